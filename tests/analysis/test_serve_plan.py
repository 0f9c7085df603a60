"""The planner's price of a serving workload (`analysis.serve_plan`, `starscream plan --phases serve`) on the tiny
model over one simulated 4-partition GPU: the chosen batch meets the TPOT target by the cost model's own estimate
and has the most output tokens/s among those that do, a tighter target never chooses a larger batch, and a target
below every batch's TPOT is refused naming the fastest possible."""
import argparse
import io
import json
from contextlib import redirect_stdout

import pytest

from starscream_jax.analysis.serve_plan import ServePoint, ServeWorkload, choose_serving, serve_batches
from starscream_jax.cli import plan as plan_command
from starscream_jax.errors import StarscreamError

ARGS = ("--preset", "mi300x-qpx-nps1", "--gpus", "1", "--model", "tiny", "--phases", "serve", "--layout",
        "starscream_decode", "--batch", "8", "--prompt", "32", "--output", "16")
WORKLOAD = ServeWorkload(32, 16, 1000.0)


def plan(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert plan_command.run(parser.parse_args([*ARGS, *argv])) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def served():
    """The JSON plan at a loose target (every batch that places meets it); later calls read the compiled results
    kept by this one."""
    return json.loads(plan("--tpot-ms", "1000", "--json"))["serve"]


@pytest.fixture(scope="module")
def points(served):
    return tuple(ServePoint(**point) for point in served["points"])


def test_every_batch_is_priced_or_says_why(served, points):
    assert [point.batch for point in points] == [1, 2, 4, 8]
    assert [point.priced for point in points] == [False, False, True, True]  # 4 partitions split the batch
    assert "divisible" in points[0].reason and points[0].tpot_s is None  # JSON null, not NaN
    for point in points[2:]:
        assert point.tpot_s == pytest.approx(point.decode_s + point.batch * point.prefill_s / 16)
        assert point.output_tokens_per_s == pytest.approx(point.batch / point.tpot_s)
        assert point.requests_per_s == pytest.approx(point.output_tokens_per_s / 16)
    assert served["chosen"]["batch"] == 8


def test_the_chosen_batch_meets_the_target_and_is_the_fastest_that_does(points):
    priced = [point for point in points if point.priced]
    for target_s in sorted(point.tpot_s for point in priced):
        workload = ServeWorkload(32, 16, target_s * 1e3 * (1 + 1e-9))
        chosen = choose_serving(points, workload, "tiny", "starscream_tp").chosen
        meeting = [point for point in priced if point.tpot_s <= workload.tpot_ms / 1e3]
        assert chosen.tpot_s <= workload.tpot_ms / 1e3
        assert chosen.output_tokens_per_s == max(point.output_tokens_per_s for point in meeting)


def test_a_tighter_target_chooses_no_larger_batch(points):
    targets = sorted((point.tpot_s * 1e3 * (1 + 1e-9) for point in points if point.priced), reverse=True)
    batches = [choose_serving(points, ServeWorkload(32, 16, target), "tiny", "starscream_tp").chosen.batch
               for target in [1000.0, *targets]]
    assert batches == sorted(batches, reverse=True)


def test_an_impossible_target_names_the_fastest_tpot(points):
    fastest = min(point.tpot_s for point in points if point.priced)
    with pytest.raises(StarscreamError, match=f"fastest the cost model gives, {fastest * 1e3:.3g} ms") as err:
        plan("--tpot-ms", f"{fastest * 1e3 / 2}")
    assert "\n" not in str(err.value) and "raise --tpot-ms" in str(err.value)


def test_the_table_marks_the_choice(served):
    text = plan("--tpot-ms", "1000")
    assert "* 8" in text and f"plan: serve batch 8 under {served['chosen']['candidate']}" in text
    assert "requests/s" in text


@pytest.mark.parametrize("prompt, output, tpot", [(0, 4, 10.0), (4, 4, 0.0), (4, 0, 1.0)])
def test_a_workload_without_tokens_or_time_is_refused(prompt, output, tpot):
    with pytest.raises(StarscreamError, match="at least 1 token each and a TPOT above 0 ms"):
        ServeWorkload(prompt, output, tpot)


def test_batches_are_powers_of_two_up_to_the_largest():
    assert serve_batches(12) == (1, 2, 4, 8, 12) and serve_batches(1) == (1,)
    assert WORKLOAD.context == 48
