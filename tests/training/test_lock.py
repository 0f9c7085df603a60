"""The run directory's lock: a second run is refused, a lock whose process is gone is taken over, release."""
import json
import os
import socket
import subprocess
import sys

import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.training.lock import RunLock


def finished_process_id() -> int:
    """The pid of a process that has exited (and been reaped), so that no process has it now."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_is_released(tmp_path):
    with RunLock(tmp_path / "run") as held:
        assert json.loads(held.path.read_text()) == {"pid": os.getpid(), "host": socket.gethostname()}
        with pytest.raises(StarscreamError, match=rf"run is in use by process {os.getpid()} on "
                                                  rf"{socket.gethostname()} \(lock file .*/run/lock\)"):
            RunLock(tmp_path / "run").__enter__()
    assert not held.path.exists()
    with RunLock(tmp_path / "run"):
        pass


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    lock_file = tmp_path / "lock"
    dead_pid = finished_process_id()
    lock_file.write_text(json.dumps({"pid": dead_pid, "host": socket.gethostname()}))
    said = []
    with RunLock(tmp_path, say=said.append) as held:
        assert json.loads(held.path.read_text())["pid"] == os.getpid()
    assert said == [f"taking over the stale lock {lock_file} of process {dead_pid}, which is gone"]


@pytest.mark.parametrize("content, message", [
    ({"pid": 1, "host": "another-host"}, "in use by process 1 on another-host"),
    ("{half", "cannot be read; if no run uses"),
    ("[1]", "cannot be read; if no run uses"),
])
def test_a_lock_from_another_host_or_unreadable_is_never_taken_over(tmp_path, content, message):
    (tmp_path / "lock").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(StarscreamError, match=message):
        RunLock(tmp_path).__enter__()
    assert (tmp_path / "lock").exists()
