"""The private JAX APIs the library leans on, each with the reason no public one serves, so that a JAX upgrade has
one module to check. The tested JAX and Flax versions are pinned as upper bounds in pyproject.toml.
"""
from __future__ import annotations

from jax._src import distributed as _distributed
from jax._src import xla_bridge as _xla_bridge


def backends_started() -> bool:
    """Whether JAX's backend has started. Every public API that could tell (`jax.devices`, `jax.device_count`)
    starts it, after which the CPU device count of a simulated mesh can no longer be chosen."""
    return _xla_bridge.backends_are_initialized()


def joined_processes() -> int:
    """How many processes `jax.distributed.initialize` joined (1 before or without it). `jax.process_count()` would
    start the backend, so the mesh builder could not then size the simulated devices of each process."""
    return _distributed.global_state.num_processes
