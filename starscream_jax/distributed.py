"""Joining several processes (hosts) into one JAX program with `jax.distributed.initialize`.

Call `initialize_from_args` before anything touches a device (creating an array, listing devices, building a mesh):
jax.distributed must start before the backend does. Two ways in:

- explicit: `--coordinator HOST:PORT --num-processes N --process-id I` on every process (a hand launch);
- from the environment: `--distributed` lets jax detect the cluster itself (SLURM, Open MPI, Kubernetes, Cloud TPU,
  or JAX_COORDINATOR_ADDRESS with the process count and id given explicitly).

With neither, the run stays a single process. On CPU, cross-process collectives use gloo, jax's default
(`jax_cpu_collectives_implementation`), so simulated multi-host meshes work on one machine.
"""
from __future__ import annotations

import argparse

from starscream_jax.errors import StarscreamError


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --coordinator, --num-processes, --process-id and --distributed to `parser`."""
    group = parser.add_argument_group("multi-process (jax.distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0's coordination service, the same on every process")
    group.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process' index, 0..N-1")
    group.add_argument("--distributed", action="store_true",
                       help="join the cluster that jax detects from the environment (SLURM, Open MPI, Kubernetes)")


def initialize_from_args(args: argparse.Namespace) -> bool:
    """Start jax.distributed as the arguments say; returns whether this run has joined several processes."""
    explicit_values = (args.coordinator, args.num_processes, args.process_id)
    if all(value is None for value in explicit_values):
        if args.distributed:
            return initialize()
        return False
    if any(value is None for value in explicit_values):
        raise StarscreamError(
            f"got --coordinator {args.coordinator} --num-processes {args.num_processes} --process-id "
            f"{args.process_id}; expected all three together; pass each one, or none with --distributed"
        )
    return initialize(args.coordinator, args.num_processes, args.process_id)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join the jax.distributed run (arguments left None are detected by jax); returns True."""
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise StarscreamError(
            f"process id {process_id} is outside 0..{num_processes - 1}; give each of the {num_processes} "
            "processes a distinct --process-id in that range"
        )
    import jax

    if not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    return True


def is_main_process() -> bool:
    """Whether this is process 0, the one that prints, writes metrics and plots."""
    import jax

    return jax.process_index() == 0
