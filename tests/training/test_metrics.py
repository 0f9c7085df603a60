"""JSON lines metrics, the loss plot and loss formatting."""
import math

import pytest

from starscream_jax.analysis.format import format_bytes
from starscream_jax.errors import StarscreamError
from starscream_jax.training import metrics


def test_records_round_trip_through_json_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with metrics.MetricsLog(path) as log:
        log.write({"step": 1, "loss": 3.5})
        log.write({"step": 2, "loss": 3.0, "tokens_per_s": 100.0})
    with metrics.MetricsLog(path) as log:
        log.write({"step": 2, "eval_loss": 3.1})
    assert metrics.read_metrics(path) == [
        {"step": 1, "loss": 3.5},
        {"step": 2, "loss": 3.0, "tokens_per_s": 100.0},
        {"step": 2, "eval_loss": 3.1},
    ]


def test_disabled_log_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with metrics.MetricsLog(path, enabled=False) as log:
        log.write({"step": 1, "loss": 3.5})
    assert not path.exists()


def test_replayed_steps_keep_their_last_value():
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "loss": 2.4},
               {"step": 2, "eval_loss": 2.6}]
    assert metrics.last_records_by_step(records, "loss") == [(1, 3.0), (2, 2.4)]
    assert metrics.last_records_by_step(records, "eval_loss") == [(2, 2.6)]


def test_loss_is_printed_in_nats_and_bits():
    assert metrics.format_loss(math.log(2.0) * 3) == "2.079 nats (3.000 bits)"


def test_plot_is_a_png(tmp_path):
    records = [{"step": step, "loss": 4.0 / step} for step in range(1, 20)] + [{"step": 10, "eval_loss": 0.5}]
    path = metrics.plot_losses(records, tmp_path / "plots" / "loss.png", reference_nats=3.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


def test_byte_counts_use_binary_units():
    assert [format_bytes(count) for count in (512, 1536, 3.5 * 2**20, 2**31)] == [
        "512 B", "1.5 KiB", "3.5 MiB", "2.0 GiB"]


def test_a_partial_last_line_is_skipped_when_read_and_cut_before_appending(tmp_path):
    """A process killed mid-write leaves half a record; the plot reads past it and a resumed run appends cleanly."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.5}\n{"step": 2, "lo')
    assert metrics.read_metrics(path) == [{"step": 1, "loss": 3.5}]
    metrics.plot_losses(metrics.read_metrics(path), tmp_path / "loss.png")
    with metrics.MetricsLog(path) as log:
        log.write({"step": 2, "loss": 3.0})
    assert metrics.read_metrics(path) == [{"step": 1, "loss": 3.5}, {"step": 2, "loss": 3.0}]


def test_a_damaged_line_inside_the_file_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.5}\ngarbage\n{"step": 2, "loss": 3.0}\n')
    with pytest.raises(StarscreamError, match=r"metrics.jsonl, line 2: not a JSON record \('garbage'\)"):
        metrics.read_metrics(path)


def test_a_resumed_log_keeps_the_steps_up_to_its_checkpoint_and_writes_replayed_ones_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {step}, "loss": 3.0}}\n' for step in range(1, 7)) + '{"step": 7, "lo')
    with metrics.MetricsLog(path, keep_through=4) as log:
        log.write({"step": 5, "loss": 2.0})
    assert [(record["step"], record["loss"]) for record in metrics.read_metrics(path)] == [
        (1, 3.0), (2, 3.0), (3, 3.0), (4, 3.0), (5, 2.0)]
    with metrics.MetricsLog(path, keep_through=0) as log:
        log.write({"step": 1, "loss": 1.0})
    assert metrics.read_metrics(path) == [{"step": 1, "loss": 1.0}]


def test_values_that_are_not_finite_are_written_as_json_null_and_left_out_of_the_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with metrics.MetricsLog(path) as log:
        log.write({"step": 1, "loss": 2.0})
        log.write({"step": 2, "loss": float("nan"), "tokens_per_s": float("inf")})
    assert path.read_text().splitlines()[1] == '{"step": 2, "loss": null, "tokens_per_s": null}'
    assert metrics.last_records_by_step(metrics.read_metrics(path), "loss") == [(1, 2.0)]
