"""Simulated devices: N CPU devices standing in for the partitions of N / X GPUs, and whether real GPUs are here.

Both work before JAX's backend starts (importing jax does not start it): `simulate_cpu_devices` sets the CPU device
count JAX will create, `accelerator_present` judges from the environment and the installed plugins alone.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import jax

from ..errors import TopologyError
from ..jax_private import backends_started

DEFAULT_SIMULATED = "cpu"
"""The preset a simulated mesh uses when none is named."""
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
SIMULATED_COLLECTIVE_TIMEOUT_S = 300
"""Seconds a simulated device waits in a collective for the others before XLA ends the process (its own default:
40). Many CPU devices share a few cores, so on a busy machine the slowest may come late without anything being stuck
(`starscream generate` aborted so, exit 134, beside other jobs on 2 cores); a real deadlock still ends, later."""
GPU_DEVICE_NODES = {"cuda": "/dev/nvidiactl", "rocm": "/dev/kfd"}
"""The device node each GPU driver creates; a JAX GPU plugin without it finds no GPU."""


def simulated_device_flag(count: int) -> str:
    """The XLA flag that makes the CPU backend expose `count` devices."""
    return f"{_DEVICE_COUNT_FLAG}={count}"


def _flag_device_count() -> int:
    """The CPU device count XLA_FLAGS asks for (0 when it does not)."""
    found = re.search(rf"{_DEVICE_COUNT_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 0


def simulate_cpu_devices(count: int) -> None:
    """Makes JAX run on the CPU with at least `count` devices (never fewer than XLA_FLAGS already asks for). Call
    before the first use of any device: until the backend starts this sets jax.config's platform and CPU device
    count, and gives collectives `SIMULATED_COLLECTIVE_TIMEOUT_S` unless XLA_FLAGS sets theirs; once it runs, it
    only checks that enough CPU devices exist."""
    if not backends_started():
        jax.config.update("jax_platforms", "cpu")
        if max(jax.config.jax_num_cpu_devices, _flag_device_count()) < count:
            jax.config.update("jax_num_cpu_devices", count)
        flags = os.environ.get("XLA_FLAGS", "")
        if _COLLECTIVE_TIMEOUT_FLAG not in flags:  # read by XLA when the backend starts
            os.environ["XLA_FLAGS"] = f"{flags} {_COLLECTIVE_TIMEOUT_FLAG}={SIMULATED_COLLECTIVE_TIMEOUT_S}".strip()
        return
    available = len(jax.devices("cpu"))
    if available < count:
        raise TopologyError(
            f"a simulated mesh needs {count} CPU devices but JAX already started with {available}; call "
            f"simulate_cpu_devices({count}) before any JAX computation, or set "
            f"XLA_FLAGS={simulated_device_flag(count)} before importing jax")


def accelerator_present() -> bool:
    """Whether JAX will run on GPUs here, judged without starting JAX: $JAX_PLATFORMS when it is set, else an
    installed JAX GPU plugin (jax[cuda13], jax[rocm7-local]) whose driver's device node exists."""
    platforms = [name.strip() for name in os.environ.get("JAX_PLATFORMS", "").split(",") if name.strip()]
    if platforms:
        return any(name != "cpu" for name in platforms)
    plugins = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    return any(kind in plugin and Path(node).exists() for kind, node in GPU_DEVICE_NODES.items() for plugin in plugins)
