"""`check_compiled`, the public one-call check: any compiled program and its gpu_tp twin -> the three verdicts."""
import pytest

import starscream_jax as ss
from starscream_jax.analysis.compile import compile_step, make_settings
from starscream_jax.analysis.principles import check_principles
from starscream_jax.analysis.report import ActivationReport, MemoryReport, Report


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


def test_a_copy_is_large_against_the_steps_working_set_not_a_fixed_size():
    """The MLP hidden that starscream_decode copies over 8 partitions at decode batch 256 (1.75 MiB per device) is
    0.1% of a 1.6 GiB working set: small, as the same copy at batch 64 (448 KiB) is; weighed against a 100 MiB
    working set it is large. Either way the verdict states the threshold and the copies' bytes."""
    hidden = ActivationReport(name="down", shape=[256, 1, 28672], dtype="bf16", spec=[[], [], ["gpu"]],
                              unreduced=[], bytes=256 * 28672 * 2, shard_bytes=1792 << 10, replication_xcd=8, count=1)

    def verdict(working_set: int) -> dict:
        memory = MemoryReport(argument_bytes=working_set, output_bytes=0, temp_bytes=0, generated_code_bytes=0,
                              alias_bytes=0)
        report = Report({"data": 1, "gpu": 8, "xcd": 8}, [], [], [], [], memory, activations=[hidden])
        return check_principles(report, None)["no_redundancy"]

    small, large = verdict(1600 << 20), verdict(100 << 20)
    assert small["ok"] and not large["ok"]
    assert small["threshold_bytes"] == pytest.approx(0.01 * (1600 << 20))
    assert small["copied_bytes"]["activations"] == large["copied_bytes"]["activations"] == (1792 << 10) * 7 / 8
