"""The training loop: a model from models/ trained under a layout on a mesh, with metrics, checkpoints and resume.

README's main command (`starscream train` with no arguments) on a machine without GPUs trains the tiny Llama on tinyshakespeare (byte-level
tokens) on a simulated MI300X QPX mesh of 2 GPUs x 4 partitions (8 CPU devices) under `starscream_tp`, then prints
the losses beside the corpus' unigram entropy and a summary of the compiled training step (memory per device,
collectives by scope). Where JAX finds GPUs it trains on them, on the detected topology.

The step (`steps.train_step`): AdamW (warm-up then cosine decay, no weight decay on norm scales) after global-norm
clipping; parameters and optimizer state in float32 and placed by the layout's `params` rules; compute in the model's dtype (`--dtype
bfloat16` casts each weight as it is used). The batch of step s is a pure function of (seed, s), and each process
builds only its own devices' shards of it. Checkpoints (orbax) hold parameters, optimizer state and the run's
description; resuming continues from the latest one exactly as if the run had never stopped.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from flax import nnx
from tqdm import tqdm

from ..errors import StarscreamError
from ..hardware.distributed import is_main_process
from ..model.decoder import create_sharded_model
from ..sharding.apply import batch_sharding, use_layout
from ..sharding.layouts import get_layout
from . import data
from .checkpoint import CheckpointStore
from .config import TrainConfig
from .metrics import MetricsLog, format_loss, plot_losses, read_metrics
from .steps import eval_step, make_optimizer, train_step

EVAL_SEED = 0  # validation windows do not depend on --seed, so runs with different seeds compare


@dataclass
class TrainResult:
    """What a run leaves behind: per-step losses (nats), the final state (global arrays) and the compiled training
    step it ran (for `starscream_jax.analysis.report.inspect_compiled`)."""

    losses: list[tuple[int, float]]
    eval_losses: list[tuple[int, float]]
    params: object
    opt_state: object
    unigram_entropy_nats: float
    compiled_step: object
    profiled_steps: int = 0


def initial_state(config: TrainConfig, model_config, layout, mesh):
    """(graphdef, params, rest, optimizer, opt_state) of a fresh run, created already sharded by the layout.

    params: the model's nnx.Param state (float32); rest: its other state; opt_state: sharded like the params.
    Call inside `use_layout(layout, mesh)`.
    """
    model = create_sharded_model(model_config, layout, mesh, config.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = make_optimizer(config, params)
    return graphdef, params, rest, optimizer, jax.jit(optimizer.init)(params)


def run_description(config: TrainConfig, model_config, mesh, step: int) -> dict:
    """The JSON saved with each checkpoint: enough for `starscream generate` to rebuild the model."""
    return {"step": step, "model_config": dataclasses.asdict(model_config), "layout": config.layout,
            "mesh_shape": dict(mesh.shape), "train_config": dataclasses.asdict(config)}


def check_resumable(saved: dict, model_config) -> None:
    """The checkpoint must hold the model being trained."""
    if saved["model_config"] != dataclasses.asdict(model_config):
        raise StarscreamError(
            f"the checkpoint holds model {saved['model_config']}, but this run builds "
            f"{dataclasses.asdict(model_config)}; resume with the same --model and --dtype, or pick another --run-dir"
        )


class LossLog:
    """Collects each step's loss (a device scalar), and every `flush` turns them into numbers: metric records,
    the progress bar's loss and tokens/s, and `losses` [(step, nats)]. Fetching in batches keeps dispatch async."""

    def __init__(self, metrics_log, progress, tokens_per_step: int):
        self.metrics_log = metrics_log
        self.progress = progress
        self.tokens_per_step = tokens_per_step
        self.losses: list[tuple[int, float]] = []
        self.eval_losses: list[tuple[int, float]] = []
        self._pending: list[tuple[int, object]] = []
        self._interval_start = time.perf_counter()

    def add(self, step: int, loss) -> None:
        self._pending.append((step, loss))

    def flush(self) -> None:
        """Fetch the pending losses and record them with the tokens/s since the last flush."""
        if not self._pending:
            return
        values = [float(value) for value in jax.device_get([loss for _, loss in self._pending])]
        tokens_per_s = self.tokens_per_step * len(values) / (time.perf_counter() - self._interval_start)
        for (step, _), value in zip(self._pending, values):
            self.losses.append((step, value))
            self.metrics_log.write({"step": step, "loss": value, "tokens_per_s": tokens_per_s})
        self.progress.set_postfix(loss=f"{values[-1]:.3f}", tokens_per_s=f"{tokens_per_s:,.0f}")
        self.progress.update(len(values))
        self._pending.clear()
        self.restart_clock()

    def add_eval(self, step: int, loss: float, say) -> None:
        self.eval_losses.append((step, loss))
        self.metrics_log.write({"step": step, "eval_loss": loss})
        message = f"step {step}: validation loss {format_loss(loss)}"
        if self.progress.disable:
            say(message)
        else:
            self.progress.write(message, file=sys.stderr)

    def restart_clock(self) -> None:
        """Time from now on (evaluation and checkpoint pauses do not count against tokens/s)."""
        self._interval_start = time.perf_counter()


PROFILED_STEPS = 3
"""Steps a profiled run traces, from its second step on (the first may still wait on autotuning and transfers)."""


def train(config: TrainConfig, mesh, *, resume: bool = False, stop_at_step: int | None = None,
          show_progress: bool = True, echo=print, profile_dir: str | Path | None = None) -> TrainResult:
    """Train on `mesh` as `config` says; every process of a multi-process run calls this together.

    resume: continue from the latest checkpoint in `run_dir/checkpoints` (start fresh when there is none).
    stop_at_step: stop after this many steps (saving a checkpoint there), as an interrupted run would; the schedule
    still spans `config.steps`. Process 0 alone prints, writes metrics and plots.
    profile_dir: write a JAX profiler trace (perfetto_trace.json.gz, for `analysis.profile.time_breakdown`) of up to
    PROFILED_STEPS steps there, from the run's second step on.
    """
    main_process = is_main_process()
    say = echo if main_process else (lambda *_: None)
    model_config = config.model_config()
    layout = get_layout(config.layout)
    train_tokens, validation_tokens = data.split_corpus(data.load_corpus(config.data))
    # Rows hold seq_len + 1 tokens: the model reads the first seq_len and predicts the last seq_len.
    train_batches = data.TokenBatches(train_tokens, config.batch_size, config.seq_len + 1, config.seed)
    eval_batches = data.TokenBatches(validation_tokens, config.batch_size, config.seq_len + 1, EVAL_SEED)
    unigram_nats = data.unigram_entropy_nats(train_tokens)
    run_dir = Path(config.run_dir)
    store = CheckpointStore(run_dir / "checkpoints", save_every=config.checkpoint_every)
    start_step = store.latest_step() or 0
    if start_step and not resume:
        store.close()
        raise StarscreamError(f"{run_dir} already holds checkpoints up to step {start_step}; pass --resume to "
                              "continue that run, or choose another --run-dir")
    say(f"unigram entropy of the training bytes: {format_loss(unigram_nats)}")
    last_step = config.steps if stop_at_step is None else min(stop_at_step, config.steps)
    profiled = range(start_step + 2, min(start_step + 2 + PROFILED_STEPS, last_step + 1)) if profile_dir else range(0)

    with use_layout(layout, mesh), store:
        token_sharding = batch_sharding(layout, mesh, config.batch_size)
        graphdef, params, rest, optimizer, opt_state = initial_state(config, model_config, layout, mesh)
        if start_step:
            check_resumable(store.restore_meta(start_step), model_config)
            params, opt_state = store.restore(start_step, params, opt_state)
            say(f"resumed from {store.directory} at step {start_step} of {config.steps}")
        evaluate_batch = eval_step(graphdef)
        compiled_step = train_step(graphdef, optimizer).lower(
            params, opt_state, rest, train_batches.global_batch(start_step, token_sharding)).compile()

        def evaluate(params) -> float:
            losses = [evaluate_batch(params, rest, eval_batches.global_batch(index, token_sharding))
                      for index in range(config.eval_batches)]
            return float(sum(jax.device_get(losses)) / len(losses))

        progress = tqdm(total=config.steps, initial=start_step, unit="step", desc=f"train {layout.name}",
                        disable=not (show_progress and main_process), file=sys.stderr, dynamic_ncols=True)
        with MetricsLog(run_dir / "metrics.jsonl", enabled=main_process, append=bool(start_step)) as metrics_log:
            log = LossLog(metrics_log, progress, config.batch_size * config.seq_len)
            saved_step = start_step
            for step in range(start_step + 1, last_step + 1):
                tokens = train_batches.global_batch(step - 1, token_sharding)
                if profiled and step == profiled.start:
                    jax.block_until_ready(params)
                    jax.profiler.start_trace(str(profile_dir), create_perfetto_trace=True)
                params, opt_state, loss = compiled_step(params, opt_state, rest, tokens)
                if profiled and step == profiled[-1]:
                    jax.block_until_ready((params, loss))
                    jax.profiler.stop_trace()
                log.add(step, loss)
                if store.save(step, params, opt_state, run_description(config, model_config, mesh, step)):
                    saved_step = step
                if step % config.log_every == 0 or step == last_step:
                    log.flush()
                if step % config.eval_every == 0 or step == last_step:
                    log.add_eval(step, evaluate(params), say)
                    log.restart_clock()
            progress.close()
        if saved_step != last_step:
            store.save(last_step, params, opt_state, run_description(config, model_config, mesh, last_step),
                       force=True)

    if log.losses:
        report_run(config, log.losses, unigram_nats, store.directory, say)
    return TrainResult(log.losses, log.eval_losses, params, opt_state, unigram_nats, compiled_step, len(profiled))


def report_run(config: TrainConfig, losses, unigram_nats: float, checkpoint_dir, say) -> None:
    """Print the final losses beside the unigram entropy (same units) and write the loss plot."""
    run_dir = Path(config.run_dir)
    final_step, final_loss = losses[-1]
    say(f"step {final_step}: train loss {format_loss(final_loss)}; unigram entropy {format_loss(unigram_nats)}")
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        plot_path = plot_losses(read_metrics(metrics_path), run_dir / "loss.png", reference_nats=unigram_nats,
                                title=f"{config.model} under {config.layout}")
        say(f"metrics {metrics_path}, plot {plot_path}, checkpoints {checkpoint_dir}")
