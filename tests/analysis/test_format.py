"""The principles' rows and notes as `check` and `inspect` print them: a principle not judged never reads as ok."""
from starscream_jax.analysis.format import principle_rows, verdict_cell, violation_lines
from starscream_jax.analysis.principles import (
    CollectiveVerdict,
    CopiedBytes,
    KernelVerdict,
    Principles,
    RedundancyVerdict,
)


def principles(shapes: KernelVerdict) -> Principles:
    return Principles(shapes, RedundancyVerdict(True, (), 0.0, None, "large: above 0 bytes", CopiedBytes(0, 0, 0)),
                      CollectiveVerdict(True, ()))


def test_a_principle_over_unjudged_ops_alone_reads_not_judged_and_says_why():
    skipped = principles(KernelVerdict(None, (), ("dot.1", "dot.2"), not_judged="gpu_tp was not compiled"))
    assert principle_rows(skipped)[0] == ("  1 kernel shapes", "not judged (2 ops)")
    assert verdict_cell(KernelVerdict(None, (), ("dot.1",))) == "not judged (1 op)"
    lines = violation_lines("starscream_tp", skipped, 120)
    assert lines[0] == "starscream_tp shape_preservation: not judged: gpu_tp was not compiled"
    assert lines[1].startswith("starscream_tp shape_preservation: 2 op(s) unjudged") and len(lines) == 2
    reason = "gpu_tp cannot place the model: " + "x" * 200 + " pass --pad-heads 16"
    wrapped = violation_lines("starscream_tp", principles(KernelVerdict(None, (), (), not_judged=reason)), 120)
    assert wrapped[-1].endswith("pass --pad-heads 16") and all(len(line) <= 120 for line in wrapped)


def test_beside_judged_ops_the_unjudged_are_counted_apart():
    assert verdict_cell(KernelVerdict(True, (), ("dot.1",))) == "ok, 1 unjudged"
    assert verdict_cell(KernelVerdict(False, ("shrank",), ())) == "FAIL (1)"
