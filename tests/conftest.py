"""Test configuration.

The default run is the CPU suite: 64 simulated CPU devices (enough for an 8 x 8 mesh), set before jax is imported.
Runs that select accelerator tests (`-m gpu`, `-m rocm`) keep the real platform instead.
"""
import os
import sys

ACCELERATOR_RUN = any(word in arg for arg in sys.argv for word in ("gpu", "rocm"))

if not ACCELERATOR_RUN:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
    ).strip()
