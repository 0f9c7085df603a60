"""One process per run directory: a lock file `RUN_DIR/lock` holding the owner's pid and host (JSON).

Taking the lock creates the file atomically (written beside it, then hard-linked to its name, which fails when it
exists), so a second run on the same directory is refused at start instead of interleaving its metrics and
checkpoints with the first's. A lock whose owner is gone (same host, no process with that pid) is stale: it is
taken over, and the message says so. A lock from another host cannot be checked from here and is never taken over.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from ..checks import process_alive
from ..errors import StarscreamError

LOCK_NAME = "lock"


class RunLock:
    """The lock on `run_dir` while in the `with` block. `say` reports a stale lock being taken over.

    With `enabled=False` (processes other than 0 of a multi-process run) it does nothing.
    """

    def __init__(self, run_dir: str | Path, say=print, enabled: bool = True):
        self.path = Path(run_dir) / LOCK_NAME
        self.say = say
        self.enabled = enabled
        self.owner = {"pid": os.getpid(), "host": socket.gethostname()}

    def __enter__(self):
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while not self._create():
                holder = self._holder()
                if not holder and not self.path.exists():
                    continue  # released meanwhile
                if not holder:
                    raise StarscreamError(f"lock file {self.path} cannot be read; if no run uses {self.path.parent}, "
                                          "delete it, else pick another --run-dir")
                if not self._stale(holder):
                    raise StarscreamError(
                        f"{self.path.parent} is in use by process {holder.get('pid')} on {holder.get('host')} "
                        f"(lock file {self.path}); wait for that run to end or pick another --run-dir")
                self.say(f"taking over the stale lock {self.path} of process {holder['pid']}, which is gone")
                self.path.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc_info):
        if self.enabled and self._holder() == self.owner:
            self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        """Creates the lock file holding `owner`; False when one exists already."""
        draft = self.path.with_name(f".{LOCK_NAME}.{self.owner['host']}.{self.owner['pid']}")
        draft.write_text(json.dumps(self.owner))
        try:
            os.link(draft, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            draft.unlink()

    def _holder(self) -> dict:
        """The lock file's owner ({} when it cannot be read, or holds JSON other than an object)."""
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _stale(self, holder: dict) -> bool:
        """A lock is stale when its owner ran on this host and has no process any more."""
        return (holder.get("host") == self.owner["host"] and isinstance(holder.get("pid"), int)
                and not process_alive(holder["pid"]))
