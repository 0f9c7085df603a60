"""Test configuration.

The default run is the CPU suite: 64 simulated CPU devices (enough for an 8 x 8 mesh), set before jax is imported.
Runs that select accelerator tests (`-m gpu`, `-m rocm`) keep the real platform instead; on a machine without that
hardware those tests are skipped with a reason that names what they need.
"""
import functools
import os
import re
import socket
import subprocess
import tempfile
import time

import pytest


def pytest_configure(config):
    """Chooses the platform from the marker expression, before any test module imports jax; compiled results that
    `inspect` and `plan` keep go to a fresh directory of this run, never the user's cache."""
    os.environ["STARSCREAM_CACHE"] = tempfile.mkdtemp(prefix="starscream-compiled-")
    accelerator_run = re.search(r"(?<!not )\b(gpu|rocm)\b", config.getoption("markexpr") or "")
    if not accelerator_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        # 64 devices share 2 cores: a collective may wait long for its slowest device without being stuck, so the
        # CPU runtime's 40 s termination timeout is raised (a real deadlock still fails, later). The tests run each
        # program a few times on tiny shapes, so LLVM's optimisation of the CPU code would cost more compile time
        # than it saves (a quarter of the compile time without it); the HLO and its memory analysis are the same.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_force_host_platform_device_count=64 --xla_cpu_collective_call_terminate_timeout_seconds=300"
            + " --xla_backend_optimization_level=0"
        ).strip()

HARDWARE = {
    "gpu": "a GPU that JAX can use (NVIDIA with jax[cuda13], or AMD Instinct with jax[rocm7-local])",
    "rocm": "AMD Instinct GPUs with ROCm: GPU nodes under /sys/class/kfd (an MI300X / MI355X node)",
}


@functools.cache
def hardware_present(marker: str) -> bool:
    """gpu: JAX shows a device that is not a CPU. rocm: KFD sysfs shows a GPU node."""
    if marker == "gpu":
        import jax

        try:
            return any(device.platform != "cpu" for device in jax.devices())
        except RuntimeError:
            return False
    from starscream_jax.hardware.detect import read_kfd_partitions

    try:
        return bool(read_kfd_partitions(render_dir=None))
    except OSError:
        return False


def pytest_runtest_setup(item):
    """Skips a `gpu` or `rocm` test where its hardware is missing, naming the hardware."""
    for marker, hardware in HARDWARE.items():
        if item.get_closest_marker(marker) is not None and not hardware_present(marker):
            pytest.skip(f"needs {hardware}; none found on this machine")


@pytest.fixture
def cpu_child_env():
    """devices -> the environment of a child Python process on that many simulated CPU devices, with the suite's
    other XLA flags (its programs then compile as this process's do: the same random draws, the same rounding)."""
    def env(devices: int) -> dict[str, str]:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
        return {**os.environ, "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])}
    return env


@pytest.fixture
def free_port():
    """() -> a TCP port free on 127.0.0.1 now (a coordinator for local processes joined by jax.distributed)."""
    def port() -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]
    return port


@pytest.fixture
def local_processes():
    """(commands, env, timeout) -> the (stdout, stderr) of each command, run at once as local processes that must
    all exit 0 within `timeout` seconds in all; any still running at the end (a failure, a timeout) is killed, so no
    process outlives its test."""
    def run(commands: list[list[str]], env: dict[str, str], timeout: float) -> list[tuple[str, str]]:
        workers = [subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for command in commands]
        deadline = time.monotonic() + timeout
        try:
            outputs = [worker.communicate(timeout=max(1.0, deadline - time.monotonic())) for worker in workers]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.communicate()
        for worker, (_, stderr) in zip(workers, outputs):
            assert worker.returncode == 0, stderr[-3000:]
        return outputs
    return run

