"""The training loop: a model from models/ trained under a layout on a mesh, with metrics, checkpoints and resume.

README's main command (`starscream train` with no arguments) on a machine without GPUs trains the tiny Llama on tinyshakespeare (byte-level
tokens) on a simulated MI300X QPX mesh of 2 GPUs x 4 partitions (8 CPU devices) under `starscream_tp`, then prints
the losses beside the corpus' unigram entropy and a summary of the compiled training step (memory per device,
collectives by scope). Where JAX finds GPUs it trains on them, on the detected topology.

The step (`steps.train_step`): AdamW (warm-up then cosine decay, no weight decay on norm scales and biases) after
global-norm clipping; parameters and optimizer state in float32 and placed by the layout's `params` rules; compute in the model's dtype (`--dtype
bfloat16` casts each weight as it is used). The batch of step s is a pure function of (seed, s), and each process
builds only its own devices' shards of it. Checkpoints (orbax) hold parameters, optimizer state and the run's
description; resuming continues from the latest one exactly as if the run had never stopped.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from ..checks import writable_directory
from ..errors import CheckpointError, RunStopped, StarscreamError
from ..hardware.distributed import is_main_process
from ..model.config import ModelConfig
from ..model.decoder import create_sharded_model
from ..model.hf_checkpoint import load_hf_model
from ..sharding.apply import batch_sharding, use_layout
from ..sharding.layouts import get_layout
from . import data
from .checkpoint import CheckpointStore, abstract_model_state
from .config import TrainConfig, flag
from .corpus import load_token_stream
from .lock import RunLock
from .metrics import MetricsLog, format_loss, plot_losses, read_metrics
from .steps import eval_step, load_balance_step, make_optimizer, train_step
from .tokenizer import ByteTokenizer, tokenizer_for_model

EVAL_SEED = 0  # validation windows do not depend on --seed, so runs with different seeds compare
FREE_TO_CHANGE = ("layout", "remat", "grad_accum", "eval_every", "eval_batches", "checkpoint_every", "log_every",
                  "run_dir", "token_cache")
"""TrainConfig fields a resumed run may change without saying so: they change no number the run computes (micro-batches
sum to the same gradients; the token cache only stores what the data files give)."""
CHANGEABLE = tuple(field.name for field in dataclasses.fields(TrainConfig)
                   if field.name not in FREE_TO_CHANGE + ("model", "dtype"))
"""TrainConfig fields a resume changes only with --allow-change (and then records)."""


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
    """(graphdef, params, rest, optimizer, opt_state) of a fresh run, created already sharded by the layout (or
    loaded so from the Hugging Face checkpoint `config.init`).

    params: the model's nnx.Param state (float32); rest: its other state; opt_state: sharded like the params.
    Call inside `use_layout(layout, mesh)`.
    """
    if config.init:
        model = load_hf_model(config.init, layout, mesh, config=model_config)
    else:
        model = create_sharded_model(model_config, layout, mesh, config.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = make_optimizer(config, params)
    return graphdef, params, rest, optimizer, jax.jit(optimizer.init)(params)


def training_tokens(config: TrainConfig, model_config) -> np.ndarray:
    """The packed tokens of the run's data files: bytes of text files for the byte-level tokenizer (the demo), else
    tokenized once into `config.token_cache` (`corpus`). The tokenizer must fit the model's vocabulary."""
    tokenizer = tokenizer_for_model(config.tokenizer_dir(), model_config, trained_weights=bool(config.init))
    files = config.data_files()
    if isinstance(tokenizer, ByteTokenizer) and all(Path(path).suffix != ".jsonl" for path in files):
        return np.concatenate([data.load_corpus(path) for path in files])
    return load_token_stream(files, tokenizer, config.token_cache)


def run_description(config: TrainConfig, model_config, mesh, step: int, changes: list[dict] = ()) -> dict:
    """The JSON saved with each checkpoint: enough for `starscream generate` to rebuild the model, and the changes
    resumes made to the run's TrainConfig ({"step", "field", "from", "to"}, oldest first)."""
    return {"step": step, "model_config": dataclasses.asdict(model_config), "layout": config.layout,
            "mesh_shape": dict(mesh.shape), "train_config": dataclasses.asdict(config), "changes": list(changes)}


def check_resumable(saved: dict, model_config) -> None:
    """The checkpoint must hold the model being trained (rematerialization and the layer loop's unrolling may change:
    they compute the same; a checkpoint saved when scan_unroll defaulted to 1 resumes under today's 0). Fields a
    checkpoint from an older version lacks take their defaults, which are the model it trained."""
    known = {field.name for field in dataclasses.fields(ModelConfig)}
    saved_model = ModelConfig(**{name: value for name, value in saved["model_config"].items() if name in known})
    if saved_model.replace(remat="none", scan_unroll=0) != model_config.replace(remat="none", scan_unroll=0):
        raise CheckpointError(
            f"the checkpoint holds model {saved['model_config']}, but this run builds "
            f"{dataclasses.asdict(model_config)}; resume with the same --model and --dtype, or pick another --run-dir"
        )


def resume_changes(saved: dict, config: TrainConfig, start_step: int, allow_changes=()) -> list[dict]:
    """The run's recorded changes plus this resume's: each TrainConfig field (other than FREE_TO_CHANGE and the
    model, checked by `check_resumable`) that differs from the checkpoint's, as {"step", "field", "from", "to"}.

    A difference whose field is not in `allow_changes` is refused, naming each; so are fewer --steps than the
    checkpoint has done, which no flag allows.
    """
    if config.steps < start_step:
        raise CheckpointError(f"--steps {config.steps} is below step {start_step} of the checkpoint in "
                              f"{config.run_dir}; pass --steps {saved['train_config']['steps']} (the run's) or more")
    saved_config = saved["train_config"]
    differences = {name: (saved_config.get(name), value) for name, value in dataclasses.asdict(config).items()
                   if name in CHANGEABLE and saved_config.get(name) != value}
    refused = [name for name in differences if name not in allow_changes]
    if refused:
        listed = ", ".join(f"{flag(name)} {differences[name][1]} (the run has {differences[name][0]})"
                           for name in refused)
        raise CheckpointError(f"--resume contradicts the run in {config.run_dir}: {listed}; pass the run's values, "
                              f"or --allow-change {','.join(refused)} to change it (recorded with the checkpoints)")
    new = [{"step": start_step, "field": name, "from": old, "to": value} for name, (old, value) in differences.items()]
    return list(saved.get("changes", [])) + new


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

    def flush(self) -> tuple[int, str, float] | None:
        """Fetch the pending losses and record them with the tokens/s since the last flush. Returns the first
        non-finite one as (step, "loss", value), else None."""
        if not self._pending:
            return None
        values = [float(value) for value in jax.device_get([loss for _, loss in self._pending])]
        tokens_per_s = self.tokens_per_step * len(values) / (time.perf_counter() - self._interval_start)
        for (step, _), value in zip(self._pending, values):
            self.losses.append((step, value))
            self.metrics_log.write({"step": step, "loss": value, "tokens_per_s": tokens_per_s})
        self.progress.set_postfix(loss=f"{values[-1]:.3f}", tokens_per_s=f"{tokens_per_s:,.0f}")
        self.progress.update(len(values))
        self._pending.clear()
        self.restart_clock()
        return next(((step, "loss", value) for step, value in self.losses[-len(values):]
                     if not math.isfinite(value)), None)

    def add_eval(self, step: int, loss: float, say,
                 load_balance: float | None = None) -> tuple[int, str, float] | None:
        """Record and print a validation loss (and a mixture of experts' load-balancing loss); returns (step,
        "validation loss", loss) when it is not finite."""
        self.eval_losses.append((step, loss))
        balance = {} if load_balance is None else {"load_balance": load_balance}
        self.metrics_log.write({"step": step, "eval_loss": loss, **balance})
        message = f"step {step}: validation loss {format_loss(loss)}"
        if self.progress.disable:
            say(message)
        else:
            self.progress.write(message, file=sys.stderr)
        return None if math.isfinite(loss) else (step, "validation loss", loss)

    def restart_clock(self) -> None:
        """Time from now on (evaluation and checkpoint pauses do not count against tokens/s)."""
        self._interval_start = time.perf_counter()


PROFILED_STEPS = 3
"""Steps a profiled run traces, from its second step on (the first may still wait on autotuning and transfers)."""


def train(config: TrainConfig, mesh, *, resume: bool = False, allow_changes=(), stop_at_step: int | None = None,
          device_memory_bytes: float | None = None, show_progress: bool = True, echo=print,
          profile_dir: str | Path | None = None) -> TrainResult:
    """Train on `mesh` as `config` says; every process of a multi-process run calls this together.

    resume: continue from the newest intact checkpoint in `run_dir/checkpoints` (start fresh when there is none);
    the run's settings must match the checkpoint's, except the TrainConfig fields named in `allow_changes`.
    stop_at_step: stop after this many steps (saving a checkpoint there), as an interrupted run would; the schedule
    still spans `config.steps`. device_memory_bytes: refuse, before allocating, a step that needs more per device.
    Process 0 alone prints, writes metrics and plots, and holds the run directory's lock. A non-finite loss or
    Ctrl-C raises `RunStopped` once the checkpoints are safe (none holds non-finite weights).
    profile_dir: write a JAX profiler trace (perfetto_trace.json.gz, for `analysis.profile.time_breakdown`) of up to
    PROFILED_STEPS steps there, from the run's second step on.
    """
    main_process = is_main_process()
    say = echo if main_process else (lambda *_: None)
    model_config = config.model_config()
    writable_directory(config.run_dir, "--run-dir")
    unknown = sorted(set(allow_changes) - set(CHANGEABLE))
    if unknown:
        raise StarscreamError(f"--allow-change {','.join(unknown)}: expected some of {', '.join(CHANGEABLE)}")
    layout = get_layout(config.layout)
    train_tokens, validation_tokens = data.split_corpus(training_tokens(config, model_config))
    # Rows hold seq_len + 1 tokens: the model reads the first seq_len and predicts the last seq_len.
    train_batches = data.TokenBatches(train_tokens, config.batch_size, config.seq_len + 1, config.seed)
    eval_batches = data.TokenBatches(validation_tokens, config.batch_size, config.seq_len + 1, EVAL_SEED)
    unigram_nats = data.unigram_entropy_nats(train_tokens)
    run_dir = Path(config.run_dir)
    last_step = config.steps if stop_at_step is None else min(stop_at_step, config.steps)

    with RunLock(run_dir, say, enabled=main_process), use_layout(layout, mesh), \
            CheckpointStore(run_dir / "checkpoints", save_every=config.checkpoint_every) as store:
        if store.latest_step() and not resume:
            raise StarscreamError(f"{run_dir} already holds checkpoints up to step {store.latest_step()}; pass "
                                  "--resume to continue that run, or choose another --run-dir")
        if resume and store.latest_step():
            check_resume_early(store, config, model_config, allow_changes)
        say(f"unigram entropy of the training tokens: {format_loss(unigram_nats)}")
        token_sharding = batch_sharding(layout, mesh, config.batch_size)
        program = compile_train_step(config, model_config, layout, mesh, token_sharding, device_memory_bytes)
        graphdef, params, rest, _, opt_state = initial_state(config, model_config, layout, mesh)
        params, opt_state, rest = program.adopt(params, opt_state, rest)
        start_step, changes = 0, []
        if resume:
            start_step, params, opt_state, changes = resumed_state(store, config, model_config, params, opt_state,
                                                                   allow_changes, say)
            params, opt_state, rest = program.adopt(params, opt_state, rest)
        profiled = range(start_step + 2, min(start_step + 2 + PROFILED_STEPS, last_step + 1) if profile_dir else 0)
        if profile_dir and not profiled:
            raise StarscreamError(f"--profile traces from the run's second step on, and this run goes from step "
                                  f"{start_step} to {last_step}; pass --steps {start_step + 2} or more")
        evaluate_batch = eval_step(graphdef)

        balance_batch = load_balance_step(graphdef) if model_config.load_balance_weight else None

        def evaluate(params, step=evaluate_batch) -> float:
            losses = [step(params, rest, eval_batches.global_batch(index, token_sharding))
                      for index in range(config.eval_batches)]
            return float(sum(jax.device_get(losses)) / len(losses))

        def save(step: int, force: bool = False) -> bool:
            """Save `step` when due (or forced), after checking that its parameters are finite."""
            if not (force or store.should_save(step)):
                return False
            if not bool(all_finite(params)):
                raise RunStopped(f"the parameters after step {step} are not finite; nothing was saved there, and "
                                 f"{resume_advice(saved_step)}")
            return store.save(step, params, opt_state, run_description(config, model_config, mesh, step, changes),
                              force=force)

        def require_finite(nonfinite) -> None:
            if nonfinite is not None:
                step, what, value = nonfinite
                raise RunStopped(f"{what} is {value} at step {step}; the run stopped without saving it, and "
                                 f"{resume_advice(saved_step)}")

        progress = tqdm(total=config.steps, initial=start_step, unit="step", desc=f"train {layout.name}",
                        disable=not (show_progress and main_process), file=sys.stderr, dynamic_ncols=True)
        with MetricsLog(run_dir / "metrics.jsonl", enabled=main_process, append=bool(start_step)) as metrics_log, \
                StopRequests() as stop:
            log = LossLog(metrics_log, progress, config.batch_size * config.seq_len)
            step = saved_step = start_step
            while step < last_step and not stop.requested:
                step += 1
                tokens = train_batches.global_batch(step - 1, token_sharding)
                if profiled and step == profiled.start:
                    jax.block_until_ready(params)
                    jax.profiler.start_trace(str(profile_dir), create_perfetto_trace=True)
                params, opt_state, loss = program.compiled(params, opt_state, rest, tokens)
                if profiled and step == profiled[-1]:
                    jax.block_until_ready((params, loss))
                    jax.profiler.stop_trace()
                log.add(step, loss)
                due_to_save = store.should_save(step)
                if due_to_save or step % config.log_every == 0 or step == last_step:
                    require_finite(log.flush())
                if due_to_save and save(step):
                    saved_step = step
                if step % config.eval_every == 0 or step == last_step:
                    balance = None if balance_batch is None else evaluate(params, balance_batch)
                    require_finite(log.add_eval(step, evaluate(params), say, balance))
                    log.restart_clock()
            require_finite(log.flush())
            progress.close()
        if saved_step != step:
            save(step, force=True)
    if stop.requested:
        raise RunStopped(f"interrupted at step {step} (checkpoint saved); rerun with --resume to continue", 130)
    if log.losses:
        report_run(config, log.losses, unigram_nats, store.directory, say)
    return TrainResult(log.losses, log.eval_losses, params, opt_state, unigram_nats, program.compiled,
                       len(profiled))


def resumed_state(store: CheckpointStore, config: TrainConfig, model_config, params, opt_state, allow_changes,
                  say) -> tuple[int, object, object, list[dict]]:
    """(step, params, opt_state, changes) of the newest intact checkpoint, checked against the run; the given fresh
    `params` and `opt_state` (also the restore targets) at step 0 when there is no checkpoint."""
    restored = store.restore_newest_intact(params, opt_state, say)
    if restored is None:
        return 0, params, opt_state, []
    step, saved, params, opt_state = restored
    check_resumable(saved, model_config)
    changes = resume_changes(saved, config, step, allow_changes)
    say(f"resumed from {store.directory} at step {step} of {config.steps}")
    return step, params, opt_state, changes


def check_resume_early(store: CheckpointStore, config: TrainConfig, model_config, allow_changes) -> None:
    """Refuses a contradicting resume before anything is compiled, from the newest checkpoint's description when
    it reads (a damaged checkpoint is dealt with when restoring)."""
    step = store.latest_step()
    try:
        with store.reporting_damage(step):
            saved = store.restore_meta(step)
    except CheckpointError:
        return
    check_resumable(saved, model_config)
    resume_changes(saved, config, step, allow_changes)


def resume_advice(saved_step: int) -> str:
    """Where a stopped run can continue from."""
    if not saved_step:
        return "no checkpoint was saved: lower --learning-rate and start again"
    return (f"its newest checkpoint is step {saved_step}: rerun with --resume and a lower --learning-rate "
            "(--allow-change learning_rate)")


def as_compiled(tree, like):
    """`tree`'s arrays, placed as the abstract arrays of `like` (the same arrays in the same order) and in its tree
    structure."""
    targets, treedef = jax.tree.flatten(like)
    return jax.tree.unflatten(treedef, [leaf if getattr(target, "sharding", None) is None
                                        else jax.device_put(leaf, target.sharding)
                                        for leaf, target in zip(jax.tree.leaves(tree), targets, strict=True)])


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every element of every array of `tree` is finite (a boolean scalar)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


@dataclass
class TrainProgram:
    """The training step compiled for the run's shapes and shardings, and the abstract (params, opt_state, rest) it
    was compiled for (jax.ShapeDtypeStruct placed as the step wants them)."""

    compiled: object
    arguments: tuple

    def adopt(self, params, opt_state, rest) -> tuple:
        """The run's state placed as the step was compiled for (the optimizer state as `eval_shape` of its init
        placed it, which a fresh init need not match), in the compiled arguments' tree structure."""
        return tuple(as_compiled(tree, like) for tree, like in zip((params, opt_state, rest), self.arguments))


def compile_train_step(config: TrainConfig, model_config, layout, mesh, token_sharding,
                       device_memory_bytes: float | None = None) -> TrainProgram:
    """Compile `steps.train_step` from abstract arguments, before any array is allocated; with
    `device_memory_bytes`, refuse a step that needs more per device (`step_bytes_per_device`). Call inside
    `use_layout(layout, mesh)`."""
    graphdef, params, rest = abstract_model_state(model_config, layout, mesh)
    optimizer = make_optimizer(config, params)
    opt_state = jax.tree.map(  # eval_shape places on the abstract mesh (scalars nowhere): the same specs on `mesh`
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(
            mesh, leaf.sharding.spec if leaf.sharding is not None else PartitionSpec())),
        jax.eval_shape(optimizer.init, params))
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32, sharding=token_sharding)
    compiled = train_step(graphdef, optimizer, config.grad_accum).lower(params, opt_state, rest, tokens).compile()
    program = TrainProgram(compiled, (params, opt_state, rest))
    needed = step_bytes_per_device(compiled)
    if device_memory_bytes is not None and needed is not None and needed > device_memory_bytes:
        options = fitting_options(config, model_config, layout, mesh, token_sharding, device_memory_bytes)
        raise StarscreamError(f"the training step needs {needed / 2**30:.2f} GiB per device, more than the "
                              f"{device_memory_bytes / 2**30:.2f} GiB each device has; {options}")
    return program


def step_bytes_per_device(compiled) -> int | None:
    """Bytes one device holds while the compiled step runs: its arguments, its outputs not aliased to them, and
    its temporaries (the planner's persistent + temporary figure, here exact at full depth); None when the
    backend gives no memory analysis."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


def fitting_options(config: TrainConfig, model_config, layout, mesh, token_sharding, device_memory_bytes) -> str:
    """What would fit, measured where it can be: the step with --remat compiled and sized, then the other levers."""
    options = []
    if model_config.remat != "full":
        remat = compile_train_step(dataclasses.replace(config, remat="full"), model_config.replace(remat="full"),
                                   layout, mesh, token_sharding)
        needed = step_bytes_per_device(remat.compiled)
        verdict = "fits" if needed <= device_memory_bytes else "does not fit either"
        options.append(f"--remat-policy full needs {needed / 2**30:.2f} GiB ({verdict})")
    options.append("a smaller --batch-size or --seq-len, more --gpus, or the layout `starscream plan --phases train` "
                   "picks")
    return "options: " + "; ".join(options)


class StopRequests:
    """Within it, the first Ctrl-C (SIGINT) asks the loop to stop after the current step (`requested`), which then
    saves a checkpoint; a second one exits at once (status 130). Outside the main thread, or where SIGINT is ignored
    (a job started in the background by a script), it changes nothing."""

    def __init__(self):
        self.requested = False
        self._previous_handler = None

    def __enter__(self):
        in_main_thread = threading.current_thread() is threading.main_thread()
        if in_main_thread and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored (nohup &): keep so
            self._previous_handler = signal.signal(signal.SIGINT, self._on_interrupt)
        return self

    def __exit__(self, *exc_info):
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)

    def _on_interrupt(self, signum, frame) -> None:
        if self.requested:
            print("interrupted again: exiting at once; --resume continues from the newest checkpoint",
                  file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        print("interrupted: finishing this step and saving a checkpoint (Ctrl-C again exits at once)",
              file=sys.stderr, flush=True)


def report_run(config: TrainConfig, losses, unigram_nats: float, checkpoint_dir, say) -> None:
    """Print the final losses beside the unigram entropy (same units) and write the loss plot."""
    run_dir = Path(config.run_dir)
    final_step, final_loss = losses[-1]
    say(f"step {final_step}: train loss {format_loss(final_loss)}; unigram entropy {format_loss(unigram_nats)}")
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        plot_path = plot_losses(read_metrics(metrics_path), run_dir / "loss.png", reference_nats=unigram_nats,
                                title=f"{config.init or config.model} under {config.layout}")
        say(f"metrics {metrics_path}, plot {plot_path}, checkpoints {checkpoint_dir}")
