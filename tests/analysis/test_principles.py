"""`check_compiled`, the public one-call check: any compiled program and its gpu_tp twin -> the three verdicts."""
import pytest

import starscream_jax as ss
from starscream_jax.analysis.compile import compile_step, make_settings


@pytest.fixture(scope="module")
def programs():
    mesh = ss.build_mesh("2x4")
    settings = make_settings("tiny", "train", 8, 32, "flat_tp,starscream_tp,gpu_tp", 2)
    return mesh, {name: compile_step(settings, name, mesh) for name in settings.layouts}


def test_the_hierarchical_layout_passes_and_the_flat_one_fails(programs):
    mesh, steps = programs
    reference = steps["gpu_tp"].compiled
    flat = ss.check_compiled(steps["flat_tp"].compiled, mesh, reference=reference)
    hierarchical = ss.check_compiled(steps["starscream_tp"].compiled, mesh, reference=reference,
                                     replicated_ok={"*norm*"}, args=steps["starscream_tp"].args)
    assert not flat.ok and not flat.principles["hierarchical_collectives"]["ok"]
    assert hierarchical.ok, hierarchical.principles
    assert hierarchical.report.bytes_by_scope()["flat"] == 0 < flat.report.bytes_by_scope()["flat"]


def test_without_a_reference_no_kernel_is_judged(programs):
    mesh, steps = programs
    check = ss.check_compiled(steps["starscream_tp"].compiled, mesh)
    assert check.principles["shape_preservation"]["violations"] == []
    assert len(check.principles["shape_preservation"]["unpaired"]) == len(check.report.matmuls) > 0
