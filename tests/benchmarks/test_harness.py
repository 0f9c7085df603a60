"""starscream_jax/benchmarks/harness.py: the clock waits for the work it times, the command is the one given, and a
result file is always whole."""
import json
import shlex
import time

import jax.numpy as jnp
import pytest

from starscream_jax.benchmarks import harness


def test_timed_steps_threads_the_state_and_times_only_the_timed_steps():
    calls = []

    def step(state):
        calls.append(state)
        time.sleep(0.02 if len(calls) > 2 else 0.0)  # the 2 warm-up steps are fast, the timed ones slow
        return state + 1, state * 10

    timed = harness.timed_steps(step, 0, warmup=2, steps=3)
    assert calls == [0, 1, 2, 3, 4] and timed.state == 5 and timed.outputs == [0, 10, 20, 30, 40]
    assert 0.02 <= timed.seconds_per_step < 0.2


def test_the_clock_stops_only_once_the_last_output_is_ready():
    synced = []
    timed = harness.timed_steps(lambda s: (s, jnp.ones(3) * s), 1.0, warmup=1, steps=2, sync=synced.append)
    assert synced[0] == 1.0 and synced[-1][1] is timed.outputs[-1]


def test_bad_step_counts_are_refused():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        harness.timed_steps(lambda s: (s, s), 0, warmup=0, steps=0)


def test_the_command_is_the_argv_given_relative_to_the_repository():
    argv = ["--quick", "--out", "/tmp/a b.json"]
    line = harness.command_line(harness.REPO_ROOT / "scripts" / "bench_mfu.py", argv)
    assert shlex.split(line) == ["python", "scripts/bench_mfu.py", *argv]


def test_run_info_names_the_devices_and_versions():
    info = harness.run_info(harness.REPO_ROOT / "scripts" / "bench_mfu.py", [])
    meta = info.as_dict()
    assert meta["platform"] == "cpu" and meta["device_count"] >= 1 and meta["jax"]
    assert meta["command"] == "python scripts/bench_mfu.py"


def test_write_json_replaces_the_file_whole_and_converts_dataclasses(tmp_path):
    out = tmp_path / "deeper" / "r.json"
    harness.write_json(out, {"rows": [1]})
    harness.write_json(out, {"info": harness.RunInfo(command="c", date="d", jax="j", device_kind="k", platform="cpu", device_count=1,
                                                    xla_flags=""), "path": tmp_path})
    stored = json.loads(out.read_text())
    assert stored["info"]["command"] == "c" and stored["path"] == str(tmp_path)
    assert [path.name for path in out.parent.iterdir()] == ["r.json"]
    harness.write_json(None, {"ignored": True})


def test_peers_are_skipped_with_a_reason_where_torch_cannot_run():
    module, reason = harness.torch_peers("cuda")
    assert module is None and reason.startswith("PyTorch peer skipped: ")
