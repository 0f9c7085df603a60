"""`starscream train`: train a model from models/ under a layout, on a mesh built from the topology.

The default run (no arguments) on a machine without GPUs trains the tiny Llama on tinyshakespeare (byte-level
tokens) on a simulated MI300X QPX mesh of 2 GPUs x 4 partitions (8 CPU devices) under `starscream_tp`, then prints
the losses beside the corpus' unigram entropy and a summary of the compiled training step (memory per device,
collectives by scope). Where JAX finds GPUs it trains on them, on the detected topology.

The step: AdamW (warm-up then cosine decay, no weight decay on norm scales) after global-norm clipping; parameters and
optimizer state in float32 and placed by the layout's `params` rules; compute in the model's dtype (`--dtype
bfloat16` casts each weight as it is used). The batch of step s is a pure function of (seed, s), and each process
builds only its own devices' shards of it. Checkpoints (orbax) hold parameters, optimizer state and the run's
description; `--resume` continues from the latest one exactly as if the run had never stopped.

This module imports jax only inside functions: the command line sets up simulated devices before jax starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from starscream_jax.data import DEFAULT_CORPUS
from starscream_jax.distributed import add_distributed_arguments, initialize_from_args, is_main_process
from starscream_jax.errors import StarscreamError
from starscream_jax.mesh import add_mesh_arguments

DEFAULT_PRESET = "mi300x-qpx-nps1"
DEFAULT_GPUS = 2
EVAL_SEED = 0  # validation windows do not depend on --seed, so runs with different seeds compare


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a run's numbers. The defaults are the README's main command."""

    model: str = "tiny"
    layout: str = "starscream_tp"
    dtype: str = "float32"
    remat: bool = False
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    final_learning_rate_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100
    log_every: int = 10
    run_dir: str = "runs/train"
    data: str = str(DEFAULT_CORPUS)


@dataclass
class TrainResult:
    """What a run leaves behind: per-step losses (nats), the final state (global arrays) and the layout summary."""

    losses: list[tuple[int, float]]
    eval_losses: list[tuple[int, float]]
    params: object
    opt_state: object
    unigram_entropy_nats: float
    layout_summary: dict | None


def make_optimizer(config: TrainConfig, params):
    """Global-norm clipping, then AdamW on a warm-up + cosine schedule; norm scales get no weight decay."""
    import jax
    import optax
    from flax import nnx

    from starscream_jax.sharding import LOGICAL_AXES

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.final_learning_rate_fraction,
    )
    decay_mask = jax.tree.map(lambda variable: "norm" not in variable.get_metadata(LOGICAL_AXES), params,
                              is_leaf=lambda node: isinstance(node, nnx.Variable))
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay, mask=decay_mask),
    )


def initial_state(config: TrainConfig, model_config, layout, mesh):
    """(graphdef, params, rest, optimizer, opt_state) of a fresh run, created already sharded by the layout.

    params: the model's nnx.Param state (float32); rest: its other state; opt_state: sharded like the params.
    Call inside `use_layout(layout, mesh)`.
    """
    import jax
    from flax import nnx

    from starscream_jax.model import create_sharded_model

    model = create_sharded_model(model_config, layout, mesh, config.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = make_optimizer(config, params)
    return graphdef, params, rest, optimizer, jax.jit(optimizer.init)(params)


def make_steps(graphdef, optimizer):
    """(train_step, eval_step), jitted.

    train_step(params, opt_state, rest, tokens_BxS) -> (params, opt_state, loss): one AdamW update; params and
    optimizer state are donated and come back with the same shardings. eval_step(params, rest, tokens_BxS) -> loss.
    """
    import functools

    import jax
    import optax
    from flax import nnx

    from starscream_jax.model import next_token_loss

    def loss_of(params, rest, tokens_BxS):
        return next_token_loss(nnx.merge(graphdef, params, rest), tokens_BxS)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, rest, tokens_BxS):
        loss, grads = jax.value_and_grad(loss_of)(params, rest, tokens_BxS)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, jax.jit(loss_of)


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
        import jax

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
        from starscream_jax.metrics import format_loss

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


def train(config: TrainConfig, mesh, *, resume: bool = False, stop_at_step: int | None = None,
          show_progress: bool = True, summarize: bool = True, echo=print) -> TrainResult:
    """Train on `mesh` as `config` says; every process of a multi-process run calls this together.

    resume: continue from the latest checkpoint in `run_dir/checkpoints` (start fresh when there is none).
    stop_at_step: stop after this many steps (saving a checkpoint there), as an interrupted run would; the schedule
    still spans `config.steps`. Process 0 alone prints, writes metrics and plots.
    summarize: compile-time report of the training step by the inspector (`TrainResult.layout_summary`).
    """
    import jax
    from tqdm import tqdm

    from starscream_jax import data
    from starscream_jax.checkpoint import CheckpointStore
    from starscream_jax.config import load_model_config
    from starscream_jax.layouts import get_layout
    from starscream_jax.metrics import MetricsLog, format_loss
    from starscream_jax.model import batch_sharding, use_layout

    main_process = is_main_process()
    say = echo if main_process else (lambda *_: None)
    model_config = load_model_config(config.model, dtype=config.dtype)
    if config.remat:
        model_config = model_config.replace(remat=True)
    if config.seq_len > model_config.max_seq_len:
        raise StarscreamError(f"--seq-len {config.seq_len} exceeds model {model_config.name}'s max_seq_len "
                              f"{model_config.max_seq_len}; pass --seq-len {model_config.max_seq_len} or less")
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

    with use_layout(layout, mesh), store:
        token_sharding = batch_sharding(layout, mesh, config.batch_size)
        graphdef, params, rest, optimizer, opt_state = initial_state(config, model_config, layout, mesh)
        if start_step:
            check_resumable(store.restore_meta(start_step), model_config)
            params, opt_state = store.restore(start_step, params, opt_state)
            say(f"resumed from {store.directory} at step {start_step} of {config.steps}")
        train_step, eval_step = make_steps(graphdef, optimizer)
        compiled_step = train_step.lower(params, opt_state, rest,
                                         train_batches.global_batch(start_step, token_sharding)).compile()

        def evaluate(params) -> float:
            losses = [eval_step(params, rest, eval_batches.global_batch(index, token_sharding))
                      for index in range(config.eval_batches)]
            return float(sum(jax.device_get(losses)) / len(losses))

        progress = tqdm(total=config.steps, initial=start_step, unit="step", desc=f"train {layout.name}",
                        disable=not (show_progress and main_process), file=sys.stderr, dynamic_ncols=True)
        with MetricsLog(run_dir / "metrics.jsonl", enabled=main_process, append=bool(start_step)) as metrics_log:
            log = LossLog(metrics_log, progress, config.batch_size * config.seq_len)
            saved_step = start_step
            for step in range(start_step + 1, last_step + 1):
                tokens = train_batches.global_batch(step - 1, token_sharding)
                params, opt_state, loss = compiled_step(params, opt_state, rest, tokens)
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
        layout_summary = summarize_layout(compiled_step, mesh) if summarize else None

    if log.losses:
        report_run(config, log.losses, unigram_nats, store.directory, say)
    return TrainResult(log.losses, log.eval_losses, params, opt_state, unigram_nats, layout_summary)


def summarize_layout(compiled, mesh) -> dict:
    """The inspector's report of the compiled training step (memory per device, collectives by scope)."""
    from starscream_jax.inspector import inspect_compiled

    return inspect_compiled(compiled, mesh).to_dict()


def report_run(config: TrainConfig, losses, unigram_nats: float, checkpoint_dir, say) -> None:
    """Print the final losses beside the unigram entropy (same units) and write the loss plot."""
    from starscream_jax.metrics import format_loss, plot_losses, read_metrics

    run_dir = Path(config.run_dir)
    final_step, final_loss = losses[-1]
    say(f"step {final_step}: train loss {format_loss(final_loss)}; unigram entropy {format_loss(unigram_nats)}")
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        plot_path = plot_losses(read_metrics(metrics_path), run_dir / "loss.png", reference_nats=unigram_nats,
                                title=f"{config.model} under {config.layout}")
        say(f"metrics {metrics_path}, plot {plot_path}, checkpoints {checkpoint_dir}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream train` (mesh, multi-process, model, optimizer, data, run directory)."""
    defaults = TrainConfig()
    add_mesh_arguments(parser, default_preset=DEFAULT_PRESET, default_gpus=DEFAULT_GPUS, default_simulate=None)
    add_distributed_arguments(parser)
    group = parser.add_argument_group("training")
    group.add_argument("--model", default=defaults.model, help="model configuration: a name in models/ or a path")
    group.add_argument("--layout", default=defaults.layout, help="layout by name (see starscream_jax.layouts)")
    group.add_argument("--dtype", default=defaults.dtype, choices=("float32", "bfloat16"),
                       help="compute dtype; parameters and optimizer state stay float32")
    group.add_argument("--remat", action="store_true",
                       help="recompute each layer's activations in the backward pass instead of keeping them")
    group.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps in the whole run")
    group.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step (global)")
    group.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens (bytes) per sequence")
    group.add_argument("--learning-rate", type=float, default=defaults.learning_rate, help="peak learning rate")
    group.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="linear warm-up steps")
    group.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW weight decay")
    group.add_argument("--clip-norm", type=float, default=defaults.clip_norm, help="global gradient norm limit")
    group.add_argument("--seed", type=int, default=defaults.seed, help="parameters and data order")
    group.add_argument("--eval-every", type=int, default=defaults.eval_every, help="steps between validations")
    group.add_argument("--eval-batches", type=int, default=defaults.eval_batches, help="batches per validation")
    group.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                       help="steps between checkpoints (one is always saved at the end)")
    group.add_argument("--log-every", type=int, default=defaults.log_every, help="steps between metric records")
    group.add_argument("--run-dir", default=defaults.run_dir, help="metrics, plot and checkpoints go here")
    group.add_argument("--data", default=defaults.data, help="training text (byte-level tokens)")
    group.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in --run-dir (start fresh when there is none)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig that the parsed arguments describe."""
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{name: value for name, value in vars(args).items() if name in fields})


def run(args: argparse.Namespace) -> int:
    """`starscream train`: join the processes, build the mesh, train, print the summary. Returns 0."""
    initialize_from_args(args)
    from starscream_jax.mesh import mesh_from_args

    topology, mesh = mesh_from_args(args)
    config = config_from_args(args)
    echo = print if is_main_process() else (lambda *_: None)
    echo(f"{config.model} on mesh {dict(mesh.shape)} ({topology.preset.name}), layout {config.layout}, "
         f"{config.steps} steps of {config.batch_size} x {config.seq_len} tokens")
    result = train(config, mesh, resume=args.resume, show_progress=not args.no_progress)
    print_layout_summary(result.layout_summary, config.layout, echo)
    return 0


def print_layout_summary(summary: dict, layout_name: str, echo) -> None:
    """Memory per device and collectives by scope (count and bytes sent per device) of the compiled step."""
    from starscream_jax.inspector import SCOPES
    from starscream_jax.metrics import format_bytes

    echo(f"compiled training step under {layout_name}, per device:")
    memory = summary["memory"]
    if memory is not None:
        echo(f"  memory: arguments {format_bytes(memory['argument_bytes'])}, outputs "
             f"{format_bytes(memory['output_bytes'])} ({format_bytes(memory['alias_bytes'])} aliased to inputs), "
             f"temporaries {format_bytes(memory['temp_bytes'])}")
    counts = dict.fromkeys(SCOPES, 0)
    for collective in summary["collectives"]:
        counts[collective["scope"]] += collective["count"]
    sent = summary["bytes_by_scope"]
    echo("  collectives by scope: " + ", ".join(
        f"{scope} {counts[scope]} ({format_bytes(sent[scope])} sent)" for scope in SCOPES))
