"""Compiled results more than one analysis test file reads, compiled once per session."""
import pytest

from starscream_jax.analysis.compile import make_settings
from starscream_jax.analysis.layout_report import inspect_layouts
from starscream_jax.hardware.mesh import build_topology_mesh


@pytest.fixture(scope="session")
def tiny_decode():
    """(settings, topology, mesh, {layout: LayoutResult}) of flat_tp and starscream_decode, decode (the quickest
    step to compile), tiny model, 2 GPUs x 4 partitions."""
    topology, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    settings = make_settings("tiny", "decode", 8, 16, "flat_tp,starscream_decode", layers=2)
    return settings, topology, mesh, inspect_layouts(settings, topology, mesh)
