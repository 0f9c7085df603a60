"""Joining several processes (hosts) into one JAX program with `jax.distributed.initialize`.

Call `initialize` before anything touches a device (creating an array, listing devices, building a mesh):
jax.distributed must start before the backend does. Two ways in:

- explicit: coordinator HOST:PORT, the process count and this process' id on every process (a hand launch);
- from the environment: with none of them, jax detects the cluster itself (SLURM, Open MPI, Kubernetes, Cloud TPU,
  or JAX_COORDINATOR_ADDRESS with the process count and id given explicitly).

With neither, the run stays a single process. On CPU, cross-process collectives use gloo, jax's default
(`jax_cpu_collectives_implementation`), so simulated multi-host meshes work on one machine.
"""
from __future__ import annotations

import jax

from ..errors import StarscreamError


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join the jax.distributed run (arguments left None are detected by jax); returns True."""
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise StarscreamError(
            f"process id {process_id} is outside 0..{num_processes - 1}; give each of the {num_processes} "
            "processes a distinct --process-id in that range"
        )
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    return True


def is_main_process() -> bool:
    """Whether this is process 0, the one that prints, writes metrics and plots."""
    return jax.process_index() == 0
