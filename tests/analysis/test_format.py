"""The principles' rows and notes as `check` and `inspect` print them: a principle not judged never reads as ok."""
from starscream_jax.analysis.format import principle_rows, verdict_cell, violation_lines
from starscream_jax.analysis.principles import (
    CollectiveVerdict,
    CopiedBytes,
    NO_COUNTERPART,
    KernelVerdict,
    Principles,
    RedundancyVerdict,
    UnjudgedOp,
)


def unjudged(*names: str) -> tuple[UnjudgedOp, ...]:
    return tuple(UnjudgedOp(name, NO_COUNTERPART) for name in names)


def principles(shapes: KernelVerdict) -> Principles:
    return Principles(shapes, RedundancyVerdict(ok=True, violations=(), threshold_bytes=0.0, layer_threshold_bytes=None,
                                                rule="large: above 0 bytes", copied_bytes=CopiedBytes(0, 0, 0)),
                      CollectiveVerdict(True, ()))


def test_a_principle_over_unjudged_ops_alone_reads_not_judged_and_says_why():
    skipped = principles(KernelVerdict(ok=None, violations=(), unjudged=unjudged("dot.1", "dot.2"),
                                       not_judged="gpu_tp was not compiled"))
    assert principle_rows(skipped)[0] == ("  1 kernel shapes", "not judged (2 ops)")
    assert verdict_cell(KernelVerdict(ok=None, violations=(), unjudged=unjudged("dot.1"))) == "not judged (1 op)"
    lines = violation_lines("starscream_tp", skipped, 120)
    assert lines[0] == "starscream_tp shape_preservation: not judged: gpu_tp was not compiled"
    assert lines[1].startswith("starscream_tp shape_preservation: 2 op(s) unjudged") and len(lines) == 2
    reason = "gpu_tp cannot place the model: " + "x" * 200 + " pass --pad-heads 16"
    wrapped = violation_lines("starscream_tp", principles(KernelVerdict(ok=None, violations=(), unjudged=(),
                                                                        not_judged=reason)), 120)
    assert wrapped[-1].endswith("pass --pad-heads 16") and all(len(line) <= 120 for line in wrapped)


def test_judged_ops_passing_beside_unjudged_ones_read_not_judged_and_a_failure_stands():
    """Passing the ops it judged says nothing of the others: such a verdict reads "not judged (K of N ops)", never
    ok, and names them with their reasons; a verdict with a violation reads FAIL whatever it left unjudged."""
    partly = KernelVerdict(ok=None, violations=(), unjudged=unjudged("dot.1"),
                           not_judged="1 of 5 op(s) left out: dot.1", judged_ops=4)
    assert verdict_cell(partly) == "not judged (1 of 5 ops)"
    lines = violation_lines("starscream_tp", principles(partly), 120)
    assert lines == ["starscream_tp shape_preservation: not judged: 1 of 5 op(s) left out: dot.1",
                     f"starscream_tp shape_preservation: 1 op(s) unjudged: dot.1 ({NO_COUNTERPART})"]
    assert verdict_cell(KernelVerdict(ok=False, violations=("shrank",), unjudged=unjudged("dot.1"),
                                      judged_ops=4)) == "FAIL (1), 1 unjudged"
    assert verdict_cell(KernelVerdict(ok=False, violations=("shrank",), unjudged=())) == "FAIL (1)"
    assert verdict_cell(KernelVerdict(ok=True, violations=(), unjudged=(), judged_ops=5)) == "ok"
