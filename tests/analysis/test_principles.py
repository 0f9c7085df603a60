"""`check_compiled`, the public one-call check: any compiled program and its gpu_tp twin -> the three verdicts."""
import dataclasses
from pathlib import Path

import jax
import pytest

import starscream_jax as ss
from starscream_jax.analysis.compile import compile_step, make_settings
from starscream_jax.analysis.hlo import Matmul
from starscream_jax.analysis.layout_report import tokens_per_device
from starscream_jax.analysis.principles import RedundancyVerdict, check_principles, reads_once_per_gpu
from starscream_jax.analysis.report import (
    ActivationReport,
    KernelReport,
    Report,
    inspect_compiled,
    inspect_text,
)
from starscream_jax.compiled_memory import MemoryReport

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hlo"


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
    assert not flat.ok and not flat.principles.hierarchical_collectives.ok
    assert hierarchical.ok, hierarchical.principles
    assert hierarchical.report.bytes_by_scope()["flat"] == 0 < flat.report.bytes_by_scope()["flat"]


def test_without_a_reference_no_kernel_is_judged(programs):
    mesh, steps = programs
    check = ss.check_compiled(steps["starscream_tp"].compiled, mesh)
    assert check.principles.shape_preservation.violations == ()
    assert len(check.principles.shape_preservation.unpaired) == len(check.report.matmuls) > 0
    assert check.principles.shape_preservation.ok is None and not check.ok  # not judged is never passing


def unit_matmul(op: str) -> Matmul:
    """A 4-token matmul of the op `op`, as `parse_hlo` reads one."""
    return Matmul(f"dot.{op}", f"jit(step)/{op}/dot_general", 1, 4, 64, 64, "f32", 2 * 4 * 64 * 64, 0, 0.0, None, 1)


def test_a_verdict_over_unjudged_ops_alone_is_not_judged_and_never_ok():
    """Without a reference, or against one that has none of the program's ops, principle 1 judged nothing: its `ok`
    is None with the reason, and the program's principles do not hold though 2 and 3 do. Beside an op it judged,
    unjudged ops are listed and the verdict is the judged op's."""
    def report(*ops: str) -> Report:
        return Report({"data": 1, "gpu": 2, "xcd": 4}, [], [unit_matmul(op) for op in ops], [], [], None,
                      tokens_per_device=4)

    layout, elsewhere = report("up", "down"), report("other")
    for verdict in (check_principles(layout, None).shape_preservation,
                    check_principles(layout, elsewhere).shape_preservation,
                    reads_once_per_gpu(layout.matmuls, elsewhere.matmuls, partitions=4)):
        assert verdict.ok is None and not verdict.judged and verdict.violations == ()
        assert len(verdict.unpaired) == 2 and verdict.not_judged
    assert "counterpart" in check_principles(layout, elsewhere).shape_preservation.not_judged
    unjudged = check_principles(layout, None, no_reference="gpu_tp was not compiled")
    assert unjudged.shape_preservation.not_judged == "gpu_tp was not compiled"
    assert unjudged.no_redundancy.ok and unjudged.hierarchical_collectives.ok and not unjudged.ok
    partly = check_principles(layout, report("up")).shape_preservation
    assert partly.ok is True and partly.judged and partly.unpaired == ("dot.down",)


def test_a_copy_is_large_against_the_steps_working_set_not_a_fixed_size():
    """The MLP hidden that starscream_decode copies over 8 partitions at decode batch 256 (1.75 MiB per device) is
    0.1% of a 1.6 GiB working set: small, as the same copy at batch 64 (448 KiB) is; weighed against a 100 MiB
    working set it is large. Either way the verdict states the threshold and the copies' bytes."""
    hidden = ActivationReport(name="down", shape=[256, 1, 28672], dtype="bf16", spec=[[], [], ["gpu"]],
                              unreduced=[], bytes=256 * 28672 * 2, shard_bytes=1792 << 10, replication_xcd=8, count=1)

    def verdict(working_set: int) -> RedundancyVerdict:
        memory = MemoryReport(argument_bytes=working_set, output_bytes=0, temp_bytes=0, generated_code_bytes=0,
                              alias_bytes=0)
        report = Report({"data": 1, "gpu": 8, "xcd": 8}, [], [], [], [], memory, activations=[hidden])
        return check_principles(report, None).no_redundancy

    small, large = verdict(1600 << 20), verdict(100 << 20)
    assert small.ok and not large.ok
    assert small.threshold_bytes == pytest.approx(0.01 * (1600 << 20))
    assert small.copied_bytes.activations == large.copied_bytes.activations == (1792 << 10) * 7 / 8


def test_a_custom_kernel_is_listed_as_unjudged_work_beside_judged_matmuls():
    """A Pallas kernel's work is not in the program text: the verdict cannot weigh it, so it says so by name, with
    or without a reference."""
    kernel = KernelReport(name="custom-call.3", op_name="jit(step)/moe/gate/pallas_call", target="__gpu$xla.gpu.triton",
                          kernel="grouped_matmul", operand_shapes=[[40], [5120, 4096], [8, 4096, 14336]], count=1)
    report = Report({"data": 1, "gpu": 1, "xcd": 1}, [], [], [], [], None, tokens_per_device=4096, kernels=[kernel])
    for reference in (None, dataclasses.replace(report, kernels=[])):
        verdict = check_principles(report, reference).shape_preservation
        assert verdict.unpaired == ("custom-call.3 (grouped_matmul: a custom kernel)",)


@pytest.fixture(scope="module")
def decode_programs():
    mesh = ss.build_mesh("2x4")
    settings = make_settings("tiny", "decode", 8, 32, "flat_tp,starscream_decode,gpu_tp", 2)
    return mesh, {name: compile_step(settings, name, mesh) for name in settings.layouts}


@pytest.mark.parametrize("phase, layout, ratio, ok", [
    ("train", "flat_tp", 0.25, False), ("train", "starscream_tp", 1.0, True),
    ("decode", "flat_tp", 2.0, False), ("decode", "starscream_decode", 1.0, True)])
def test_attention_is_judged_and_flat_tp_with_more_partitions_than_kv_heads_fails_it(request, phase, layout, ratio,
                                                                                      ok):
    """Tiny: 8 query heads sharing 4 kv heads on 2 GPUs x 4 partitions. In training flat_tp keeps 1 query head per
    device where gpu_tp keeps 4 per GPU (a quarter of the work per token); in decode the 4 partitions of a GPU each
    read a copy of the kv head their query heads share (2 query heads per kv head on a GPU: twice gpu_tp's reads).
    XLA leaves flat_tp's attention matmuls unnamed (one head per device); they are judged all the same."""
    mesh, steps = request.getfixturevalue("programs" if phase == "train" else "decode_programs")
    token_dims = (8, 32 if phase == "train" else 1)
    reference, report = (inspect_compiled(steps[name].compiled, mesh,
                                          tokens_per_device=tokens_per_device(steps[name].layout, mesh, token_dims))
                         for name in ("gpu_tp", layout))
    if phase == "decode":
        verdict = reads_once_per_gpu(report.matmuls, reference.matmuls, mesh.shape["xcd"])
    else:
        verdict = check_principles(report, reference).shape_preservation
    assert (verdict.attention.ratio, verdict.attention.ok) == (pytest.approx(ratio), ok)
    attention_violations = [line for line in verdict.violations if "/attention " in line or "/attention:" in line]
    assert len(attention_violations) == (0 if ok else 1)  # one op: forward and backward together
    assert not [op for op in verdict.unpaired if "attention" in op]


def test_fused_attention_kernels_are_judged_from_their_operand_shapes():
    """cuDNN's fused attention, compiled on an H200 (tests/fixtures/hlo): the batch split over 4 partitions keeps
    gpu_tp's heads per device (ok), one query head per device does not."""
    mesh = jax.make_mesh((1, 1, 1), ("data", "gpu", "xcd"), devices=jax.devices()[:1])
    tokens = {"gpu_tp": 4 * 128, "starscream_tp": 128, "flat_tp": 4 * 128}
    reports = {name: inspect_text((FIXTURES / f"cudnn_attention_{name}.hlo.txt").read_text(), mesh,
                                  tokens_per_device=count) for name, count in tokens.items()}
    for name, ok in (("starscream_tp", True), ("flat_tp", False)):
        verdict = check_principles(reports[name], reports["gpu_tp"]).shape_preservation
        assert verdict.ok is ok and verdict.attention.ok is ok and verdict.unpaired == ()
        assert verdict.attention.ratio == pytest.approx(1.0 if ok else 1 / 8)
