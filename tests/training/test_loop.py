"""Training: exact resume, checkpoints that move between meshes and layouts, and the command end to end."""
import dataclasses
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from starscream_jax.analysis.profile import latest_trace
from starscream_jax.cli import main as cli
from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding.apply import param_shardings
from starscream_jax.sharding.layouts import get_layout
from starscream_jax.training import data
from starscream_jax.training.checkpoint import restore_model
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.loop import train
from starscream_jax.training.metrics import read_metrics

SMALL = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup_steps=2, eval_every=3, eval_batches=1,
                    checkpoint_every=2, log_every=2)


def small_run(tmp_path, name, **changes):
    return dataclasses.replace(SMALL, run_dir=str(tmp_path / name), **changes)


def quiet_train(config, mesh, **options):
    return train(config, mesh, show_progress=False, echo=lambda *_: None, **options)


@pytest.fixture(scope="module")
def mesh_2x4():
    return build_mesh("1x2x4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mesh_2x4):
    """An uninterrupted 6-step run and the same run stopped after step 3, checkpointed at steps 2 and 3.

    "crashed" is a copy of the stopped run without its step-3 checkpoint: resuming it starts from the periodic
    checkpoint of step 2, saved asynchronously while step 3 went on (and donated the arrays being saved).
    """
    root = tmp_path_factory.mktemp("runs")
    whole = quiet_train(small_run(root, "whole"), mesh_2x4)
    first_half = quiet_train(small_run(root, "interrupted"), mesh_2x4, stop_at_step=3)
    shutil.copytree(root / "interrupted", root / "crashed")
    shutil.rmtree(root / "crashed" / "checkpoints" / "3")
    return root, whole, first_half


def test_resumed_run_repeats_the_uninterrupted_losses_step_for_step(runs, mesh_2x4):
    root, whole, first_half = runs
    second_half = quiet_train(small_run(root, "interrupted"), mesh_2x4, resume=True)

    assert [step for step, _ in whole.losses] == list(range(1, 7))
    assert first_half.losses == whole.losses[:3]
    assert second_half.losses == whole.losses[3:]
    assert second_half.eval_losses == [(6, whole.eval_losses[-1][1])]
    replayed = read_metrics(root / "interrupted" / "metrics.jsonl")
    assert [record["step"] for record in replayed if "loss" in record] == list(range(1, 7))


def test_rematerialized_run_follows_the_kept_activations_run(runs, tmp_path, mesh_2x4):
    """--remat recomputes each layer in the backward pass: the same losses, up to float32 rounding."""
    _, whole, _ = runs
    recomputed = quiet_train(small_run(tmp_path, "remat", remat=True), mesh_2x4)
    np.testing.assert_allclose([loss for _, loss in recomputed.losses], [loss for _, loss in whole.losses],
                               rtol=1e-5)
    _, description = restore_model(tmp_path / "remat" / "checkpoints", "starscream_tp", mesh_2x4)
    assert description["model_config"]["remat"] is True


def test_profiled_run_traces_three_steps_and_trains_the_same(runs, tmp_path, mesh_2x4):
    _, whole, _ = runs
    profiled = quiet_train(small_run(tmp_path, "profiled"), mesh_2x4, profile_dir=tmp_path / "trace")
    assert profiled.losses == whole.losses
    assert profiled.profiled_steps == 3
    assert latest_trace(tmp_path / "trace").stat().st_size > 0


def test_checkpoint_moves_to_another_mesh_and_layout_bit_identical(runs):
    root, whole, _ = runs
    other_mesh = build_mesh("1x4x2")
    model, description = restore_model(root / "whole" / "checkpoints", "flat_tp", other_mesh)
    restored = nnx.state(model, nnx.Param)
    assert description["step"] == 6 and description["layout"] == "starscream_tp"
    expected_shardings = jax.tree.leaves(param_shardings(restored, get_layout("flat_tp"), other_mesh))
    for saved, loaded, sharding in zip(jax.tree.leaves(whole.params), jax.tree.leaves(restored),
                                       expected_shardings, strict=True):
        assert loaded.sharding == sharding
        assert np.asarray(loaded).tobytes() == np.asarray(saved).tobytes()


def test_resume_under_another_mesh_and_layout_continues_the_same_run(runs):
    root, whole, _ = runs
    moved = quiet_train(small_run(root, "crashed", layout="flat_tp"), build_mesh("1x4x2"), resume=True)
    assert [step for step, _ in moved.losses] == [3, 4, 5, 6]
    np.testing.assert_allclose([loss for _, loss in moved.losses], [loss for _, loss in whole.losses[2:]],
                               rtol=1e-5)


def test_existing_checkpoints_need_resume(runs, mesh_2x4):
    root, _, _ = runs
    with pytest.raises(StarscreamError, match="already holds checkpoints up to step 6; pass --resume"):
        quiet_train(small_run(root, "whole"), mesh_2x4)


def test_sequence_longer_than_the_model_allows_is_refused(tmp_path, mesh_2x4):
    with pytest.raises(StarscreamError, match="--seq-len 4096 exceeds model tiny's max_seq_len 256"):
        quiet_train(small_run(tmp_path, "long", seq_len=4096), mesh_2x4)


def test_command_learns_below_the_unigram_entropy_and_reports(tmp_path, capsys, monkeypatch):
    """The main command with fewer steps, computing in bfloat16 (parameters and optimizer state stay float32)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"train": cli.SUBCOMMANDS["train"]})
    run_dir = tmp_path / "cli"
    status = cli.main(["train", "--steps", "40", "--eval-every", "20", "--checkpoint-every", "20", "--dtype",
                       "bfloat16", "--run-dir", str(run_dir), "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    train_losses = [record["loss"] for record in records if "loss" in record]
    unigram_nats = data.unigram_entropy_nats(data.split_corpus(data.load_corpus())[0])
    assert len(train_losses) == 40
    assert np.mean(train_losses[-10:]) < unigram_nats - 0.3
    assert [record["step"] for record in records if "eval_loss" in record] == [20, 40]
    assert f"unigram entropy {unigram_nats:.3f} nats ({data.nats_to_bits(unigram_nats):.3f} bits)" in out
    assert "mesh {'data': 1, 'gpu': 2, 'xcd': 4}" in out
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir() if path.name.isdigit()) == ["20", "40"]
    summary = out[out.index("compiled training step under starscream_tp, per device:"):]
    assert re.search(r"memory: arguments [\d.]+ [KMG]?i?B", summary)
    assert re.search(r"collectives by scope: local \d+ .*intra_gpu [1-9]\d* .*inter_gpu [1-9]\d* .*flat \d+", summary)

    model, _ = restore_model(run_dir / "checkpoints", "starscream_tp", build_mesh("1x2x4"))
    assert model.config.dtype == "bfloat16"
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {"float32"}
