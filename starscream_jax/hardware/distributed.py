"""Joining several processes (hosts) into one JAX program with `jax.distributed.initialize`.

Call `initialize` before anything touches a device (creating an array, listing devices, building a mesh):
jax.distributed must start before the backend does. Two ways in:

- explicit: coordinator HOST:PORT, the process count and this process' id on every process (a hand launch);
- from the environment: with none of them, jax detects the cluster itself (SLURM, Open MPI, Kubernetes, Cloud TPU,
  or JAX_COORDINATOR_ADDRESS with the process count and id given explicitly).

With neither, the run stays a single process. On CPU, cross-process collectives use gloo, jax's default
(`jax_cpu_collectives_implementation`), so simulated multi-host meshes work on one machine.

Joining waits at most `join_timeout` seconds for every process: past it, the process says which process is
missing (from process 0: the others have not all joined; from another: whether process 0's coordinator answers)
and exits with status 2, rather than waiting with no output (jax's own limit aborts the process without a word).
"""
from __future__ import annotations

import os
import socket
import sys
import threading

import jax

from ..checks import whole_number
from ..errors import StarscreamError

DEFAULT_JOIN_TIMEOUT = 300
"""Seconds a process waits for the others to join (jax.distributed's own default)."""
JAX_GRACE = 60
"""Seconds jax's own initialization limit is set beyond ours, so that ours reports first."""


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, join_timeout: int = DEFAULT_JOIN_TIMEOUT) -> bool:
    """Join the jax.distributed run (arguments left None are detected by jax); returns True."""
    if coordinator is not None:
        coordinator_address(coordinator)
    if num_processes is not None:
        whole_number(num_processes, "--num-processes")
    whole_number(join_timeout, "--join-timeout")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise StarscreamError(
            f"process id {process_id} is outside 0..{num_processes - 1}; give each of the {num_processes} "
            "processes a distinct --process-id in that range"
        )
    if not jax.distributed.is_initialized():
        watchdog = threading.Timer(join_timeout, _report_missing, (coordinator, num_processes, process_id,
                                                                   join_timeout))
        watchdog.daemon = True
        watchdog.start()
        try:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                       process_id=process_id, initialization_timeout=join_timeout + JAX_GRACE)
        finally:
            watchdog.cancel()
    return True


def coordinator_address(text: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT (or [IPv6]:PORT) coordinator address; a StarscreamError naming the fix."""
    host, _, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StarscreamError(f"--coordinator {text}: expected HOST:PORT, such as localhost:1234 or 10.0.0.1:8476 "
                              "(the same on every process; process 0 listens on that port)")
    return host, int(port)


def missing_process(coordinator: str | None, num_processes: int | None, process_id: int | None) -> str:
    """Which process a join that timed out waits for, as far as this process can tell."""
    if coordinator is None or num_processes is None or process_id is None:
        return "the cluster jax detected did not bring every process up"
    if process_id == 0:
        others = "process 1" if num_processes == 2 else f"one or more of processes 1..{num_processes - 1}"
        return f"{others} did not join {coordinator}"
    try:
        socket.create_connection(coordinator_address(coordinator), timeout=2).close()
    except OSError:
        return f"process 0 (the coordinator at {coordinator}) does not answer"
    return f"process 0 answers at {coordinator}, but not all of the {num_processes} processes joined"


def _report_missing(coordinator, num_processes, process_id, join_timeout) -> None:
    """The watchdog's report: one line naming the missing process, then exit status 2 (jax's join cannot be
    interrupted from Python)."""
    who = "" if process_id is None else f" (this is process {process_id})"
    print(f"starscream: error: {missing_process(coordinator, num_processes, process_id)} within {join_timeout} s"
          f"{who}; start every process with the same --coordinator and --num-processes and a distinct "
          "--process-id, or raise --join-timeout", file=sys.stderr, flush=True)
    os._exit(2)


def is_main_process() -> bool:
    """Whether this is process 0, the one that prints, writes metrics and plots."""
    return jax.process_index() == 0
