"""Training: exact resume, checkpoints that move between meshes and layouts, and the command end to end."""
import dataclasses
import os
import re
import shutil
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from starscream_jax.analysis.profile import latest_trace
from starscream_jax.cli import main as cli
from starscream_jax.errors import CheckpointError, RunStopped, StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.sharding.apply import param_shardings
from starscream_jax.sharding.layouts import get_layout
from starscream_jax.text import corpus
from starscream_jax.training import data, loop
from starscream_jax.training.checkpoint import CheckpointStore, restore_model
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.lock import RunLock
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
def one_device():
    """For the fault tests that need no sharding: a single-device mesh compiles several times faster."""
    return build_mesh("1x1")


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


@pytest.mark.slow  # remat's gradients: tests/training/test_steps.py; its matmuls: tests/model/test_decoder.py
def test_rematerialized_run_follows_the_kept_activations_run(runs, tmp_path, mesh_2x4):
    """--remat recomputes each layer in the backward pass: the same losses, up to float32 rounding."""
    _, whole, _ = runs
    recomputed = quiet_train(small_run(tmp_path, "remat", remat="full"), mesh_2x4)
    np.testing.assert_allclose([loss for _, loss in recomputed.losses], [loss for _, loss in whole.losses],
                               rtol=1e-5)
    _, description = restore_model(tmp_path / "remat" / "checkpoints", "starscream_tp", mesh_2x4)
    assert description["model_config"]["remat"] == "full"


@pytest.mark.slow  # over 30 s on two cores; the trace's reading is tested on stored traces in tests/analysis
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
    assert description["step"] == 6 and description["layout"] == whole.layout == "starscream_tp"
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


def test_a_checkpoint_differing_only_in_remat_or_loop_unrolling_is_resumable():
    """remat and scan_unroll change how the model is computed, not what: a checkpoint saved with other values (as
    every one saved when scan_unroll defaulted to 1) resumes; another width does not."""
    config = load_model_config("tiny")
    saved = {"model_config": dataclasses.asdict(config.replace(remat="full", scan_unroll=1))}
    loop.check_resumable(saved, config)
    with pytest.raises(CheckpointError, match=rf"holds another model than this run builds: d_ff {config.d_ff} "
                                              rf"\(the checkpoint's {2 * config.d_ff}\); resume with"):
        loop.check_resumable({"model_config": dataclasses.asdict(config.replace(d_ff=2 * config.d_ff))}, config)


def test_existing_checkpoints_need_resume(runs, mesh_2x4):
    root, _, _ = runs
    with pytest.raises(StarscreamError, match="already holds checkpoints up to step 6; pass --resume"):
        quiet_train(small_run(root, "whole"), mesh_2x4)


def test_sequence_longer_than_the_model_allows_is_refused(tmp_path, mesh_2x4):
    with pytest.raises(StarscreamError, match="--seq-len 4096 exceeds model tiny's max_seq_len 256"):
        quiet_train(small_run(tmp_path, "long", seq_len=4096), mesh_2x4)


def test_data_too_short_for_the_held_out_split_names_the_split_and_the_whole(tmp_path, mesh_2x4):
    corpus = tmp_path / "short.txt"
    corpus.write_bytes(b"x" * 400)  # 360 tokens to train on, 40 held out: fewer than a window of 65
    with pytest.raises(StarscreamError, match=r"^the validation split \(the last 10% of the data's 400 tokens\): 40 "
                                              r"tokens cannot fill one window of 65 \(--seq-len \+ 1\)"):
        quiet_train(small_run(tmp_path, "short", data=str(corpus), seq_len=64), mesh_2x4)


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


def test_a_simulated_two_node_run_counts_the_collectives_that_cross_nodes(tmp_path, capsys, monkeypatch):
    """2 nodes x 2 GPUs x 2 partitions on one process: the GPUs' collectives that span both nodes are inter_node
    (nodes by GPUs per node, as inspect counts them), not inter_gpu."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"train": cli.SUBCOMMANDS["train"]})
    status = cli.main(["train", "--topology", "2x2x2", "--steps", "1", "--batch-size", "8", "--seq-len", "32",
                       "--eval-every", "1", "--checkpoint-every", "1", "--run-dir", str(tmp_path / "nodes"),
                       "--no-progress"])
    summary = capsys.readouterr().out
    assert status == 0 and "mesh {'data': 1, 'gpu': 4, 'xcd': 2}" in summary
    assert re.search(r"collectives by scope: .*intra_gpu [1-9]\d* .*inter_node [1-9]\d* .*flat 0 ", summary), summary


def test_an_evaluation_record_carries_the_load_balancing_loss_when_given(tmp_path):
    from tqdm import tqdm

    from starscream_jax.training.loop import LossLog
    from starscream_jax.training.metrics import MetricsLog

    with MetricsLog(tmp_path / "metrics.jsonl") as metrics_log:
        log = LossLog(metrics_log, tqdm(disable=True), tokens_per_step=1)
        log.add_eval(3, 2.5, print, load_balance=1.25)
        log.add_eval(6, 2.0, print)
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 3, "eval_loss": 2.5, "load_balance": 1.25},
                                                         {"step": 6, "eval_loss": 2.0}]


# Faults: damaged checkpoints, contradicting resumes, a held run directory, non-finite losses, Ctrl-C, no memory.

def damage_arrays(checkpoint_dir):
    """Truncates every array data file of one checkpoint to 10 bytes, as a full disk or a cut copy leaves them."""
    for data_file in checkpoint_dir.glob("*/d/*"):
        data_file.write_bytes(data_file.read_bytes()[:10])


def copied_run(root, name, tmp_path):
    shutil.copytree(root / name, tmp_path / name)
    return tmp_path / name


def test_resume_sets_a_damaged_checkpoint_aside_and_continues_exactly_from_the_data_moved(runs, tmp_path, mesh_2x4):
    """The data file moved elsewhere is the same data (compared by content): no change to allow or record."""
    root, whole, _ = runs
    run_dir = copied_run(root, "whole", tmp_path)
    damage_arrays(run_dir / "checkpoints" / "6")
    corpus_copy = tmp_path / "corpus.txt"
    shutil.copy(SMALL.data, corpus_copy)
    said = []
    resumed = train(dataclasses.replace(SMALL, run_dir=str(run_dir), data=str(corpus_copy), eval_every=100), mesh_2x4,
                    resume=True, show_progress=False, echo=said.append)

    assert resumed.losses == whole.losses[4:]
    assert re.search(r"checkpoint step 6 in .* is damaged: .*/checkpoints/6/(params|opt_state)/d/\w+ .*moved aside "
                     r"to 6\.damaged", "\n".join(said))
    assert (run_dir / "checkpoints" / "6.damaged").is_dir()
    _, description = restore_model(run_dir / "checkpoints", "starscream_tp", mesh_2x4)
    assert description["step"] == 6
    assert description["changes"] == []
    assert [entry["path"] for entry in description["data_files"]] == [str(corpus_copy)]


@pytest.mark.parametrize("changes, allowed, message", [
    ({"steps": 3}, ("steps",), r"--steps 3 is below step 6 of the checkpoint .*; pass --steps 6 \(the run's\) or more"),
    ({"learning_rate": 0.01, "batch_size": 16}, (),
     r"--resume contradicts the run .*: --batch-size 16 \(the run has 8\), --learning-rate 0.01 \(the run has 0.003\); "
     r"pass the run's values, or --allow-change batch_size,learning_rate"),
])
def test_contradicting_resume_is_refused_before_compiling_and_keeps_every_checkpoint(runs, tmp_path, mesh_2x4,
                                                                                    monkeypatch, changes, allowed,
                                                                                    message):
    root, _, _ = runs
    run_dir = copied_run(root, "whole", tmp_path)
    monkeypatch.setattr(loop, "compile_train_step", None)  # a call would fail: nothing may be compiled
    with pytest.raises(CheckpointError, match=message):
        quiet_train(dataclasses.replace(SMALL, run_dir=str(run_dir), **changes), mesh_2x4, resume=True,
                    allow_changes=allowed)
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["4", "6"]


def test_a_run_directory_in_use_is_refused(tmp_path, mesh_2x4):
    config = small_run(tmp_path, "shared")
    with RunLock(config.run_dir):
        with pytest.raises(StarscreamError, match=rf"shared is in use by process {os.getpid()} on .*pick another "
                                                  "--run-dir"):
            quiet_train(config, mesh_2x4)
    assert sorted(path.name for path in (tmp_path / "shared").iterdir()) == []


def test_a_non_finite_loss_stops_the_run_and_no_checkpoint_holds_non_finite_weights(tmp_path, one_device):
    config = small_run(tmp_path, "diverged", learning_rate=1e30, checkpoint_every=1)  # Adam steps by ~lr
    with pytest.raises(RunStopped, match=r"(loss is (nan|inf) at step \d|parameters after step \d are not finite)"):
        quiet_train(config, one_device)
    with CheckpointStore(tmp_path / "diverged" / "checkpoints") as store:
        saved_steps = store.all_steps()
    for step in saved_steps:
        model, _ = restore_model(tmp_path / "diverged" / "checkpoints", "starscream_tp", one_device, step)
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.fixture
def interactive_sigint():
    """SIGINT as a terminal delivers it (Python's default handler, not blocked), whatever an earlier test of this
    process left (once in a full suite run the first Ctrl-C below was never handled), restored afterwards."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, handler)


@pytest.mark.usefixtures("interactive_sigint")
def test_ctrl_c_saves_a_checkpoint_and_says_how_to_resume(tmp_path, one_device, monkeypatch):
    add = loop.LossLog.add

    def add_then_press_ctrl_c_at_step_3(self, step, value):
        add(self, step, value)
        if step == 3:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(loop.LossLog, "add", add_then_press_ctrl_c_at_step_3)
    with pytest.raises(RunStopped, match="interrupted at step 3 .*rerun with --resume") as stopped:
        quiet_train(small_run(tmp_path, "interrupted", checkpoint_every=5, eval_every=100), one_device)
    assert stopped.value.exit_status == 130
    with CheckpointStore(tmp_path / "interrupted" / "checkpoints") as store:
        assert store.all_steps() == [3]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("interactive_sigint")
def test_second_ctrl_c_exits_at_once(monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(loop.os, "_exit", exits.append)
    with loop.StopRequests() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and exits == []
        signal.raise_signal(signal.SIGINT)
    assert exits == [130]
    assert "Ctrl-C again exits at once" in capsys.readouterr().err


@pytest.mark.usefixtures("interactive_sigint")
def test_sigterm_stops_the_run_as_ctrl_c_does_with_status_143(monkeypatch, capsys):
    """A scheduler ending the job (SLURM, Kubernetes) sends SIGTERM, then SIGKILL after a grace period."""
    exits = []
    monkeypatch.setattr(loop.os, "_exit", exits.append)
    default = signal.getsignal(signal.SIGTERM)
    with loop.StopRequests() as stop:
        assert signal.getsignal(signal.SIGTERM) is not default  # else the signal below would end the test process
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested == signal.SIGTERM and stop.exit_status == 143 and exits == []
        assert stop.stopped_at(4) == ("terminated (SIGTERM) at step 4 (checkpoint saved); rerun with --resume to "
                                      "continue")
        signal.raise_signal(signal.SIGINT)
    assert exits == [130]
    assert signal.getsignal(signal.SIGTERM) is default
    assert "terminated (SIGTERM): finishing this step and saving a checkpoint" in capsys.readouterr().err


@pytest.mark.usefixtures("interactive_sigint")
def test_a_run_of_several_processes_takes_sigterm_as_a_kill():
    """Its processes would each stop after the step it had reached and wait on each other's save: SIGTERM keeps its
    default there (a resume continues from the newest checkpoint), Ctrl-C is still taken."""
    default = signal.getsignal(signal.SIGTERM)
    with loop.StopRequests(alone=False):
        assert signal.getsignal(signal.SIGTERM) is default
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler


@pytest.fixture
def ctrl_c_while_compiling(monkeypatch):
    """step -> the run's compile replaced by one during which Ctrl-C is pressed, and its starting state by one at
    `step` with that step saved (nothing is compiled or allocated). A KeyboardInterrupt raised inside XLA's compile
    aborts it and crashes the process as it exits: the press must only ask the run to stop."""
    def compile_while_ctrl_c_is_pressed(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C raised KeyboardInterrupt inside the compile")
        return loop.TrainProgram(compiled=None, arguments=(), graphdef=None)

    def starting_at(step: int) -> None:
        monkeypatch.setattr(loop, "compile_train_step", compile_while_ctrl_c_is_pressed)
        monkeypatch.setattr(loop, "starting_state", lambda *args: loop.RunState(
            step=step, params=None, opt_state=None, rest=None, saved_step=step, changes=[]))
    return starting_at


@pytest.mark.usefixtures("interactive_sigint")
def test_ctrl_c_while_compiling_stops_the_run_before_its_first_step(tmp_path, one_device, ctrl_c_while_compiling):
    ctrl_c_while_compiling(0)
    with pytest.raises(RunStopped, match=r"^interrupted before the first step \(nothing to save\)") as stopped:
        quiet_train(small_run(tmp_path, "early"), one_device)
    assert stopped.value.exit_status == 130
    assert read_metrics(tmp_path / "early" / "metrics.jsonl") == []
    assert not os.listdir(tmp_path / "early" / "checkpoints")


@pytest.mark.usefixtures("interactive_sigint")
def test_ctrl_c_after_the_last_step_ends_the_run_as_complete(tmp_path, one_device, ctrl_c_while_compiling):
    """A run whose every step is done is not reported as interrupted (nor exits 130)."""
    ctrl_c_while_compiling(SMALL.steps)
    assert quiet_train(small_run(tmp_path, "done"), one_device).losses == []


def test_a_step_too_big_for_the_devices_is_refused_before_allocation(tmp_path, one_device, monkeypatch):
    monkeypatch.setattr(loop, "initial_state", None)  # a call would fail: nothing may be allocated
    with pytest.raises(StarscreamError, match=r"the training step needs \d+\.\d\d GiB per device, more than the 0\.00 "
                                              r"GiB each device has; options: .*--batch-size"):
        quiet_train(small_run(tmp_path, "big", remat=True), one_device, device_memory_bytes=1)


def test_on_cpu_devices_the_full_remat_option_is_the_planners_estimate(tmp_path, one_device, monkeypatch):
    """Without recomputation the refusal offers --remat-policy full at the planner's estimate (XLA:CPU's compile of
    the recomputing step saves nothing), below the compiled step's need, with nothing compiled for it."""
    monkeypatch.setattr(loop, "initial_state", None)
    compiles = []
    real = loop.compile_train_step
    monkeypatch.setattr(loop, "compile_train_step", lambda *args, **kw: compiles.append(args) or real(*args, **kw))
    with pytest.raises(StarscreamError) as refused:
        quiet_train(small_run(tmp_path, "big"), one_device, device_memory_bytes=1)
    found = re.search(r"needs (\d+\.\d\d) GiB per device.*--remat-policy full needs (\d+\.\d\d) GiB by the "
                      r"planner's estimate \(a CPU compile recomputes nothing\) \(does not fit either\)",
                      str(refused.value))
    assert found and float(found.group(2)) <= float(found.group(1)), str(refused.value)
    assert len(compiles) == 1  # the step itself, not a recomputing one


def test_a_data_file_changed_in_place_is_refused_on_resume_and_recorded_when_allowed(tmp_path):
    """Data is compared by content: the same bytes elsewhere are no change, other bytes under the same path are."""
    path = tmp_path / "corpus.txt"
    path.write_text("to be\n")
    config = dataclasses.replace(SMALL, data=str(path), run_dir=str(tmp_path / "run"))
    before = corpus.content_fingerprint(path)
    saved = {"train_config": dataclasses.asdict(config), "data_files": [before.to_dict()]}
    path.write_text("TO BE\n")
    after = corpus.content_fingerprint(path)
    with pytest.raises(CheckpointError, match=r"--data .*corpus.txt \(6 bytes, sha256 \w{12}\) \(the run has "
                                              r".*corpus.txt \(6 bytes, sha256 \w{12}\)\); .*--allow-change data"):
        loop.resume_changes(saved, config, 4, (), [after])
    [change] = loop.resume_changes(saved, config, 4, ("data",), [after])
    assert (change["step"], change["field"]) == (4, "data") and after.sha256[:12] in change["to"]
    moved = dataclasses.replace(config, data=str(tmp_path / "elsewhere.txt"))
    assert loop.resume_changes(saved, moved, 4, (), [before]) == []


@pytest.mark.parametrize("resume", [True, False])
def test_a_run_directory_holding_only_damaged_checkpoints_is_refused(tmp_path, one_device, monkeypatch, resume):
    """Starting afresh there would replace the run's metrics without a word."""
    (tmp_path / "run" / "checkpoints" / "6.damaged").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 6, "loss": 1.0}\n')
    monkeypatch.setattr(loop, "compile_train_step", None)  # a call would fail: nothing may be compiled
    with pytest.raises(CheckpointError, match=r"holds only damaged checkpoints \(6.damaged\): nothing to resume"):
        quiet_train(small_run(tmp_path, "run"), one_device, resume=resume)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 6, "loss": 1.0}\n'


def test_a_tokenizer_changed_in_place_is_refused_on_resume_and_one_moved_is_not():
    config = dataclasses.replace(SMALL, tokenizer="/models/tok")
    saved = {"train_config": dataclasses.asdict(config), "tokenizer_sha256": "a" * 64}
    with pytest.raises(CheckpointError, match=r"--tokenizer /models/tok \(sha256 bbbbbbbbbbbb\) \(the run has "
                                              r"/models/tok \(sha256 aaaaaaaaaaaa\)\); .*--allow-change tokenizer"):
        loop.resume_changes(saved, config, 4, (), (), "b" * 64)
    assert loop.resume_changes(saved, dataclasses.replace(config, tokenizer="/moved/tok"), 4, (), (), "a" * 64) == []


@pytest.mark.parametrize("resume", [True, False])
def test_a_run_directory_with_metrics_but_no_checkpoint_is_refused_unless_overwritten(tmp_path, one_device,
                                                                                      monkeypatch, resume):
    """A run killed before its first checkpoint: resuming (or starting afresh) would replace its metrics and plot
    without a word."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n')
    (run / "loss.png").write_bytes(b"plot")
    monkeypatch.setattr(loop, "compile_train_step", None)  # a call would fail: nothing may be compiled
    refusal = (r"--resume: .*run holds metrics.jsonl and loss.png but no checkpoint to resume .*start it over with "
               r"--overwrite instead of --resume" if resume else
               r"run holds metrics.jsonl and loss.png of an earlier run \(no checkpoint\); pass --overwrite")
    with pytest.raises(StarscreamError, match=refusal):
        quiet_train(small_run(tmp_path, "run"), one_device, resume=resume)
    assert (run / "metrics.jsonl").read_text() == '{"step": 10, "loss": 1.0}\n' and (run / "loss.png").exists()


def test_overwrite_starts_afresh_over_an_earlier_runs_metrics_and_contradicts_resume(tmp_path, one_device,
                                                                                     monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n')
    (run / "loss.png").write_bytes(b"plot")

    class Compiling(Exception):
        pass

    def compiling(*args, **kwargs):
        raise Compiling

    monkeypatch.setattr(loop, "compile_train_step", compiling)
    with pytest.raises(StarscreamError, match="--overwrite starts the run afresh and --resume continues it"):
        quiet_train(small_run(tmp_path, "run"), one_device, resume=True, overwrite=True)
    with pytest.raises(Compiling):  # past every check: the run would start at step 0
        quiet_train(small_run(tmp_path, "run"), one_device, overwrite=True)
    assert not (run / "loss.png").exists()
    (run / "metrics.jsonl").write_text("")  # an empty metrics file holds nothing to lose
    with pytest.raises(Compiling):
        quiet_train(small_run(tmp_path, "run"), one_device)


@pytest.mark.parametrize("name, make, found", [
    ("metrics.jsonl", os.mkdir, "is a directory, where the run keeps its metrics.jsonl file"),
    ("loss.png", os.mkdir, "is a directory, where the run keeps its loss.png file"),
    ("checkpoints", lambda path: open(path, "w").close(), "is a file, where the run keeps its checkpoints directory"),
])
@pytest.mark.parametrize("resume", [True, False])
def test_a_run_directory_entry_of_the_wrong_kind_is_refused_before_compiling(tmp_path, one_device, monkeypatch, name,
                                                                             make, found, resume):
    """Unchecked, a directory named metrics.jsonl would fail the run with a traceback after the compile, and a file
    named checkpoints would read as a run without checkpoints (and --resume would say to start over)."""
    monkeypatch.setattr(loop, "compile_train_step", None)  # a call would fail: nothing may be compiled
    (tmp_path / "run").mkdir()
    make(tmp_path / "run" / name)
    with pytest.raises(StarscreamError, match=f"^{re.escape(str(tmp_path / 'run' / name))} {found}; move it away"):
        quiet_train(small_run(tmp_path, "run"), one_device, resume=resume)


def test_a_run_names_the_layout_fitted_to_its_batch_beside_the_one_asked_for():
    """Two sequences per step over four partitions: the run trains under starscream_tp+seq and prints both names;
    where fitting changes nothing, the one name alone."""
    config = dataclasses.replace(SMALL, batch_size=2, layout="starscream_tp")
    fitted = loop.fitted_layout(config, build_mesh("1x2x4")).name
    assert loop.layout_label(fitted, config.layout) == "starscream_tp+seq (asked: starscream_tp)"
    assert loop.layout_label("starscream_tp", "starscream_tp") == "starscream_tp"
