"""The training loop: a model from models/ trained under a layout on a mesh, with metrics, checkpoints and resume.

README's main command (`starscream train` with no arguments) on a machine without GPUs trains the tiny Llama on
tinyshakespeare (byte-level tokens) on a simulated MI300X QPX mesh of 2 GPUs x 4 partitions (8 CPU devices) under
`starscream_tp`, then prints the losses beside the corpus' unigram entropy and a summary of the compiled training step
(memory per device, collectives by scope). Where JAX finds GPUs it trains on them, on the detected topology.

The step (`steps.train_step`): AdamW (warm-up then cosine decay, no weight decay on norm scales and biases) after
global-norm clipping; parameters and optimizer state in float32 and placed by the layout's `params` rules; compute in
the model's dtype (`--dtype bfloat16` casts each weight as it is used). The batch of step s is a pure function of (seed,
s), and each process builds only its own devices' shards of it. Checkpoints (orbax) hold parameters, optimizer state and
the run's description; resuming continues from the latest one exactly as if the run had never stopped.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from ..analysis.memory import gpu_memory, held_bytes
from ..checks import created_directory, of_type, writable_directory
from ..compiled_memory import MemoryReport
from ..errors import CheckpointError, RunStopped, StarscreamError
from ..hardware.distributed import is_main_process
from ..model.config import ModelConfig
from ..model.decoder import create_sharded_model
from ..model.hf_checkpoint import load_hf_model
from ..sharding.apply import Placement, batch_sharding
from ..sharding.layouts import Layout, fit_batch
from ..text.corpus import DataFingerprint, load_token_stream
from ..text.tokenizer import tokenizer_for_model
from . import data
from .checkpoint import CheckpointStore, MisnamedCheckpointError, abstract_model_state, all_finite
from .config import TrainConfig, flag
from .lock import RunLock
from .metrics import MetricsLog, format_loss, plot_losses, read_metrics
from .steps import eval_step, load_balance_step, make_optimizer, train_step

METRICS_FILE, PLOT_FILE, CHECKPOINTS = "metrics.jsonl", "loss.png", "checkpoints"
"""What a run writes into its --run-dir (beside the lock): two files and a directory."""
EVAL_SEED = 0  # validation windows do not depend on --seed, so runs with different seeds compare
FREE_TO_CHANGE = ("layout", "remat", "grad_accum", "eval_every", "eval_batches", "checkpoint_every", "log_every",
                  "run_dir", "token_cache")
"""TrainConfig fields a resumed run may change without saying so: they change no number the run computes (micro-batches
sum to the same gradients; the token cache only stores what the data files give)."""
CHANGEABLE = tuple(field.name for field in dataclasses.fields(TrainConfig)
                   if field.name not in FREE_TO_CHANGE + ("model", "dtype"))
"""TrainConfig fields a resume changes only with --allow-change (and then records)."""


@dataclass(kw_only=True)
class TrainResult:
    """What a run leaves behind: per-step losses (nats), the final state (global arrays), the compiled training
    step it ran (for `starscream_jax.analysis.report.inspect_compiled`) and the layout that placed it (the one asked
    for, fitted to the batch: `fit_batch`)."""

    losses: list[tuple[int, float]]
    eval_losses: list[tuple[int, float]]
    params: object
    opt_state: object
    unigram_entropy_nats: float
    compiled_step: object
    profiled_steps: int = 0
    layout: str = ""


def initial_state(config: TrainConfig, model_config, layout, mesh):
    """(graphdef, params, rest, optimizer, opt_state) of a fresh run, created already sharded by the layout (or
    loaded so from the Hugging Face checkpoint `config.init`).

    params: the model's nnx.Param state (float32); rest: its other state; opt_state: sharded like the params (its
    init compiled on `mesh`: no layout or mesh need be active where this is called).
    """
    if config.init:
        model = load_hf_model(config.init, layout, mesh, config=model_config)
    else:
        model = create_sharded_model(model_config, layout, mesh, config.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = make_optimizer(config, params)
    with jax.set_mesh(mesh):
        return graphdef, params, rest, optimizer, jax.jit(optimizer.init)(params)


def training_tokens(config: TrainConfig, model_config) -> tuple[np.ndarray, list[DataFingerprint], str]:
    """(the packed tokens of the run's data files, each file's content fingerprint, the tokenizer's): the bytes of
    text files for the byte-level tokenizer (the demo), else tokenized once into `config.token_cache` (`corpus`).
    The tokenizer must fit the model (`tokenizer_for_model`)."""
    tokenizer = tokenizer_for_model(config.tokenizer_dir(), model_config, trained_weights=bool(config.init))
    data.require_readable(config.data_files())
    return *load_token_stream(config.data_files(), tokenizer, config.token_cache), tokenizer.fingerprint


def run_description(config: TrainConfig, model_config, mesh, step: int, changes: list[dict] = (),
                    data_files: list[DataFingerprint] = (), tokenizer: str | None = None, *, layout: str) -> dict:
    """The JSON saved with each checkpoint: enough for `starscream generate` to rebuild the model, the layout that
    ran (`layout`: fitted to the batch, `fitted_layout`; the one asked for stays in the train_config), the content
    fingerprints of each data file and of the tokenizer, and the changes resumes made to the run's TrainConfig
    ({"step", "field", "from", "to"}, oldest first)."""
    return {"step": step, "model_config": dataclasses.asdict(model_config), "layout": layout,
            "mesh_shape": dict(mesh.shape), "train_config": dataclasses.asdict(config), "changes": list(changes),
            "data_files": [fingerprint.to_dict() for fingerprint in data_files], "tokenizer_sha256": tokenizer}


def check_resumable(saved: dict, model_config) -> None:
    """The checkpoint must hold the model being trained (rematerialization and the layer loop's unrolling may change:
    they compute the same; a checkpoint saved when scan_unroll defaulted to 1 resumes under today's 0; fp8 matmuls,
    a TrainConfig field that a resume changes only with --allow-change, train the same float32 weights). Fields a
    checkpoint from an older version lacks take their defaults, which are the model it trained. A refusal names
    each differing field."""
    known = {field.name for field in dataclasses.fields(ModelConfig)}
    saved_model = ModelConfig(**{name: value for name, value in saved["model_config"].items() if name in known})
    same_model = ("remat", "scan_unroll", "name", "matmul_format", "fp8_logits")  # leave the weights' model as is
    ours, theirs = ({name: value for name, value in dataclasses.asdict(config).items() if name not in same_model}
                    for config in (model_config, saved_model))
    differing = [f"{name} {ours[name]!r} (the checkpoint's {theirs[name]!r})" for name in ours
                 if ours[name] != theirs[name]]
    if differing:
        raise CheckpointError(f"the checkpoint holds another model than this run builds: {', '.join(differing)}; "
                              "resume with the run's --model (or --init) and --dtype, or pick another --run-dir")


def resume_changes(saved: dict, config: TrainConfig, start_step: int, allow_changes=(),
                   data_files: list[DataFingerprint] = (), tokenizer: str | None = None) -> list[dict]:
    """The run's recorded changes plus this resume's: each TrainConfig field (other than FREE_TO_CHANGE and the
    model, checked by `check_resumable`) that differs from the checkpoint's, as {"step", "field", "from", "to"}.
    The data and the tokenizer are compared by content where the checkpoint holds their fingerprints (a file
    moved is the same data, a file changed in place is not), else by path.

    A difference whose field is not in `allow_changes` is refused, naming each; so are fewer --steps than the
    checkpoint has done, which no flag allows.
    """
    if config.steps < start_step:
        raise CheckpointError(f"--steps {config.steps} is below step {start_step} of the checkpoint in "
                              f"{config.run_dir}; pass --steps {saved['train_config']['steps']} (the run's) or more")
    saved_config = {**dataclasses.asdict(TrainConfig()), **saved["train_config"]}  # an older run lacks new fields
    differences = {name: (saved_config[name], value) for name, value in dataclasses.asdict(config).items()
                   if name in CHANGEABLE and name not in ("data", "tokenizer") and saved_config[name] != value}
    for name, change in (("data", _data_difference(saved, config, data_files)),
                         ("tokenizer", _tokenizer_difference(saved, config, tokenizer))):
        if change is not None:
            differences[name] = change
    refused = [name for name in differences if name not in allow_changes]
    if refused:
        listed = ", ".join(f"{flag(name)} {_shown(differences[name][1])} (the run has {_shown(differences[name][0])})"
                           for name in refused)
        raise CheckpointError(f"--resume contradicts the run in {config.run_dir}: {listed}; pass the run's values, "
                              f"or --allow-change {','.join(refused)} to change it (recorded with the checkpoints)")
    new = [{"step": start_step, "field": name, "from": old, "to": value} for name, (old, value) in differences.items()]
    return list(saved.get("changes", [])) + new


def _shown(value) -> str:
    """A setting as a message shows it: an empty one (no fp8, no tokenizer) as "none"."""
    return "none" if value in ("", None) else str(value)


def _data_difference(saved: dict, config: TrainConfig, data_files: list[DataFingerprint]) -> tuple | None:
    """(the run's data, this resume's) when they differ: by content when the checkpoint holds the data files'
    fingerprints, else by path."""
    if not saved.get("data_files") or not data_files:
        before = saved["train_config"].get("data")
        return None if before == config.data else (before, config.data)
    before = [DataFingerprint(**entry) for entry in saved["data_files"]]
    if len(before) == len(data_files) and all(old.same_content(new) for old, new in zip(before, data_files)):
        return None
    return _describe(before), _describe(data_files)


def _tokenizer_difference(saved: dict, config: TrainConfig, tokenizer: str | None) -> tuple | None:
    """(the run's tokenizer, this resume's) when they differ: by content when the checkpoint holds the tokenizer's
    fingerprint, else by path."""
    before = saved["train_config"].get("tokenizer")
    if not saved.get("tokenizer_sha256") or tokenizer is None:
        return None if before == config.tokenizer else (before, config.tokenizer)
    if saved["tokenizer_sha256"] == tokenizer:
        return None
    return (f"{before or 'its tokenizer'} (sha256 {saved['tokenizer_sha256'][:12]})",
            f"{config.tokenizer or config.init or 'bytes'} (sha256 {tokenizer[:12]})")


def _describe(files: list[DataFingerprint]) -> str:
    return ",".join(f"{entry.path} ({entry.size} bytes, sha256 {entry.sha256[:12]})" for entry in files)


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


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What a run computes, settled and checked before anything is compiled or written: the model, the layout,
    the batches (rows of seq_len + 1 tokens: the model reads the first seq_len and predicts the last seq_len),
    where tokens are placed, the steps to run and the data files' fingerprints."""

    config: TrainConfig
    model_config: ModelConfig
    layout: Layout
    mesh: object
    token_sharding: NamedSharding
    train_batches: data.TokenBatches
    eval_batches: data.TokenBatches
    unigram_nats: float
    data_files: list[DataFingerprint]
    tokenizer: str
    last_step: int

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    def description(self, step: int, changes: list[dict]) -> dict:
        return run_description(self.config, self.model_config, self.mesh, step, changes, self.data_files,
                               self.tokenizer, layout=self.layout.name)

    @property
    def layout_label(self) -> str:
        """The layout that runs, with the one asked for where they differ (`layout_label`)."""
        return layout_label(self.layout.name, self.config.layout)


@dataclass(kw_only=True)
class RunState:
    """Where the run is: the last step done and its state (params and opt_state as the compiled step takes them,
    rest: the model's other state), the newest step saved, and the changes resumes recorded."""

    step: int
    params: object
    opt_state: object
    rest: object
    saved_step: int
    changes: list[dict]


@dataclass(frozen=True)
class ProfileWindow:
    """The steps a profiled run traces into `directory`: from `steps.start` to `steps[-1]`."""

    directory: Path
    steps: range

    def before_step(self, step: int, state: RunState) -> None:
        if step == self.steps.start:
            jax.block_until_ready(state.params)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)

    def after_step(self, step: int, outputs) -> None:
        if step == self.steps[-1]:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()


def train(config: TrainConfig, mesh, *, resume: bool = False, allow_changes=(), stop_at_step: int | None = None,
          device_memory_bytes: float | None = None, show_progress: bool = True, echo=print,
          profile_dir: str | Path | None = None, overwrite: bool = False) -> TrainResult:
    """Train on `mesh` as `config` says; every process of a multi-process run calls this together.

    resume: continue from the newest intact checkpoint in `run_dir/checkpoints` (start fresh in an empty run
    directory); the run's settings must match the checkpoint's, except the TrainConfig fields named in
    `allow_changes`. A run directory holding an earlier run's metrics or plot but no checkpoint (it stopped before
    its first) is refused, fresh or resumed, unless `overwrite` (--overwrite), which starts afresh there and replaces
    them; it never deletes checkpoints (`check_checkpoints`).
    stop_at_step: stop after this many steps (saving a checkpoint there), as an interrupted run would; the schedule
    still spans `config.steps`. device_memory_bytes: refuse, before allocating, a step that needs more per device.
    Process 0 alone prints, writes metrics and plots, and holds the run directory's lock. A non-finite loss, or
    Ctrl-C or SIGTERM before the last step (`StopRequests`), raises `RunStopped` once the checkpoints are safe (none
    holds non-finite weights).
    profile_dir: write a JAX profiler trace (perfetto_trace.json.gz, for `analysis.profile.time_breakdown`) of up to
    PROFILED_STEPS steps there, from the run's second step on.

    The outline: plan (validate, read the data) -> check the run directory's checkpoints -> compile from shaped
    inputs -> the starting state (fresh or resumed) -> run the steps -> report.
    """
    main_process = is_main_process()
    say = echo if main_process else (lambda *_: None)
    if overwrite and resume:
        raise StarscreamError("--overwrite starts the run afresh and --resume continues it; pass one of them")
    plan = plan_run(config, mesh, allow_changes, stop_at_step, resume)
    if not resume:  # a resumed run's window is known once its checkpoint is read
        profile_window(profile_dir, 0, plan.last_step)
    if main_process:
        created_directory(plan.run_dir, "--run-dir")
    with StopRequests(alone=jax.process_count() == 1) as stop, RunLock(plan.run_dir, say, enabled=main_process), \
            CheckpointStore(plan.run_dir / CHECKPOINTS, save_every=config.checkpoint_every) as store:
        plan = check_checkpoints(store, plan, resume, allow_changes, overwrite)
        if overwrite and main_process:  # the earlier run's plot goes with its metrics (MetricsLog starts afresh)
            (plan.run_dir / PLOT_FILE).unlink(missing_ok=True)
        say(f"unigram entropy of the training tokens: {format_loss(plan.unigram_nats)}")
        program = compile_train_step(config, plan.model_config, plan.layout, mesh, plan.token_sharding,
                                     device_memory_bytes)
        state = starting_state(store, plan, program, resume, allow_changes, say)
        profile = profile_window(profile_dir, state.step, plan.last_step)
        progress = tqdm(total=config.steps, initial=state.step, unit="step", desc=f"train {plan.layout_label}",
                        disable=not (show_progress and main_process), file=sys.stderr, dynamic_ncols=True)
        with MetricsLog(plan.run_dir / METRICS_FILE, enabled=main_process, keep_through=state.step) as metrics:
            log = LossLog(metrics, progress, config.batch_size * config.seq_len)
            run_steps(plan, program, state, store, log, stop, profile, say)
            progress.close()
        if state.saved_step != state.step:
            save_checkpoint(store, plan, state, force=True)
    if stop.requested and state.step < plan.last_step:
        raise RunStopped(stop.stopped_at(state.step), stop.exit_status)
    if log.losses:
        report_run(config, log.losses, plan.unigram_nats, store.directory, say, plan.layout_label)
    return TrainResult(losses=log.losses, eval_losses=log.eval_losses, params=state.params,
                       opt_state=state.opt_state, unigram_entropy_nats=plan.unigram_nats,
                       compiled_step=program.compiled, profiled_steps=len(profile.steps) if profile else 0,
                       layout=plan.layout.name)


def plan_run(config: TrainConfig, mesh, allow_changes, stop_at_step: int | None, resume: bool) -> RunPlan:
    """The run's RunPlan, every flag and file checked (nothing is compiled or written yet)."""
    of_type(mesh, Mesh, "mesh", "a jax.sharding.Mesh, as starscream_jax.build_mesh gives")
    model_config = config.model_config()
    check_run_entries(writable_directory(config.run_dir, "--run-dir"))
    unknown = sorted(set(allow_changes) - set(CHANGEABLE))
    if unknown:
        raise StarscreamError(f"--allow-change {','.join(unknown)}: expected some of {', '.join(CHANGEABLE)}")
    if allow_changes and not resume:
        raise StarscreamError(f"--allow-change {','.join(allow_changes)} changes a resumed run; it needs --resume "
                              "(a fresh run takes its settings from the flags)")
    layout = fitted_layout(config, mesh)
    token_sharding = batch_sharding(layout, mesh, config.batch_size)
    tokens, data_files, tokenizer = training_tokens(config, model_config)
    train_tokens, validation_tokens = data.split_corpus(tokens)
    rows, of_all = config.seq_len + 1, f"of the data's {len(tokens)} tokens"

    def batches(split: np.ndarray, seed: int, source: str) -> data.TokenBatches:
        return data.TokenBatches(tokens=split, batch_size=config.batch_size, seq_len=rows, seed=seed, source=source)

    return RunPlan(config=config, model_config=model_config, layout=layout, mesh=mesh, token_sharding=token_sharding,
                   train_batches=batches(train_tokens, config.seed, f"the training split (the first 90% {of_all})"),
                   eval_batches=batches(validation_tokens, EVAL_SEED, f"the validation split (the last 10% {of_all})"),
                   unigram_nats=data.unigram_entropy_nats(train_tokens), data_files=data_files, tokenizer=tokenizer,
                   last_step=config.steps if stop_at_step is None else min(stop_at_step, config.steps))


def check_run_entries(run_dir: Path) -> None:
    """Refuses a run directory holding a directory where the run writes a file (METRICS_FILE, PLOT_FILE), or a file
    where it keeps its CHECKPOINTS: the run would fail on it only after compiling, or read it as no checkpoint."""
    for name, kind in ((METRICS_FILE, "file"), (PLOT_FILE, "file"), (CHECKPOINTS, "directory")):
        path = run_dir / name
        if path.exists() and path.is_dir() != (kind == "directory"):
            found = "a directory" if path.is_dir() else "a file"
            raise StarscreamError(f"{path} is {found}, where the run keeps its {name} {kind}; move it away, or "
                                  "choose another --run-dir")


def fitted_layout(config: TrainConfig, mesh) -> Layout:
    """The layout a run of `config` trains under on `mesh`: the one asked for, fitted to a micro-batch (`fit_batch`:
    fewer sequences per micro-batch than the layout's batch split, each sequence split over the partitions)."""
    return fit_batch(config.layout, mesh, config.batch_size // config.grad_accum, config.seq_len)


def layout_label(ran: str, asked: str) -> str:
    """The layout that ran as a run prints it: its name, and the one asked for where fitting the batch changed it
    ("starscream_tp+seq (asked: starscream_tp)")."""
    return ran if ran == asked else f"{ran} (asked: {asked})"


def check_checkpoints(store: CheckpointStore, plan: RunPlan, resume: bool, allow_changes,
                      overwrite: bool = False) -> RunPlan:
    """Refuses, before anything is compiled: a fresh run over a run's checkpoints; unless `overwrite`, a run
    directory whose every checkpoint was set aside as damaged, or that holds an earlier run's metrics or plot and no
    checkpoint (resuming would silently start afresh over them, and so would a fresh run); a newest checkpoint whose
    description records another step than its name; and a resume that contradicts the newest checkpoint's
    description (when it reads; damage is dealt with when restoring). Returns `plan`, whose compute dtype, when no
    --dtype was given, is the resumed run's recorded one (so a run started before the default followed --init's
    checkpoint keeps computing as it did)."""
    latest = store.latest_step()
    if latest and not resume:
        raise StarscreamError(f"{plan.run_dir} already holds checkpoints up to step {latest}; pass --resume to "
                              "continue that run, or choose another --run-dir")
    damaged = store.damaged()
    if latest is None and damaged and not overwrite:
        raise CheckpointError(f"{store.directory} holds only damaged checkpoints ({', '.join(damaged)}): nothing "
                              "to resume, and starting afresh would replace the run's metrics; choose another "
                              "--run-dir, or pass --overwrite to start this run afresh there (the damaged "
                              "checkpoints are kept)")
    outputs = run_outputs(plan.run_dir)
    if latest is None and outputs and not overwrite:
        held = " and ".join(outputs)
        if resume:
            raise CheckpointError(f"--resume: {plan.run_dir} holds {held} but no checkpoint to resume (the run "
                                  "stopped before its first); start it over with --overwrite instead of --resume "
                                  f"(replacing its {held}), or choose another --run-dir")
        raise StarscreamError(f"{plan.run_dir} holds {held} of an earlier run (no checkpoint); pass --overwrite to "
                              "start afresh there, replacing them, or choose another --run-dir")
    if not (resume and latest):
        return plan
    try:
        with store.reporting_damage(latest):
            saved = store.restore_meta(latest)
    except MisnamedCheckpointError:
        raise
    except CheckpointError:
        return plan
    plan = dataclasses.replace(plan, model_config=resumed_model(plan.config, plan.model_config, saved))
    check_resumable(saved, plan.model_config)
    resume_changes(saved, plan.config, latest, allow_changes, plan.data_files, plan.tokenizer)
    return plan


def run_outputs(run_dir: Path) -> list[str]:
    """The names of what an earlier run wrote into `run_dir` beside its checkpoints: a metrics.jsonl holding
    anything, and a loss.png."""
    metrics, plot = run_dir / METRICS_FILE, run_dir / PLOT_FILE
    return ([METRICS_FILE] if metrics.is_file() and metrics.stat().st_size else []) + \
        ([PLOT_FILE] if plot.exists() else [])


def resumed_model(config: TrainConfig, model_config: ModelConfig, saved: dict) -> ModelConfig:
    """`model_config` computing in the saved run's dtype (its description's model_config) when `config` names no
    dtype; an explicit --dtype is kept (`check_resumable` refuses it when it differs from the run's)."""
    recorded = saved.get("model_config", {}).get("dtype")
    return model_config if config.dtype or not recorded else model_config.replace(dtype=recorded)


def starting_state(store: CheckpointStore, plan: RunPlan, program: TrainProgram, resume: bool, allow_changes,
                   say) -> RunState:
    """Step 0's state (created already sharded, or loaded from --init), or with `resume` the newest intact
    checkpoint's, checked against the run; placed as the compiled step takes it."""
    _, params, rest, _, opt_state = initial_state(plan.config, plan.model_config, plan.layout, plan.mesh)
    params, opt_state, rest = program.adopt(params, opt_state, rest)
    restored = store.restore_newest_intact(params, opt_state, say) if resume else None
    if restored is None:
        return RunState(step=0, params=params, opt_state=opt_state, rest=rest, saved_step=0, changes=[])
    step, saved, params, opt_state = restored
    check_resumable(saved, plan.model_config)
    changes = resume_changes(saved, plan.config, step, allow_changes, plan.data_files, plan.tokenizer)
    say(f"resumed from {store.directory} at step {step} of {plan.config.steps}")
    params, opt_state, rest = program.adopt(params, opt_state, rest)
    return RunState(step=step, params=params, opt_state=opt_state, rest=rest, saved_step=step, changes=changes)


def profile_window(profile_dir: str | Path | None, start_step: int, last_step: int) -> ProfileWindow | None:
    """The steps to trace (None without --profile): PROFILED_STEPS from the run's second step."""
    if profile_dir is None:
        return None
    steps = range(start_step + 2, min(start_step + 2 + PROFILED_STEPS, last_step + 1))
    if not steps:
        raise StarscreamError(f"--profile traces from the run's second step on, and this run goes from step "
                              f"{start_step} to {last_step}; pass --steps {start_step + 2} or more")
    return ProfileWindow(Path(profile_dir), steps)


def run_steps(plan: RunPlan, program: TrainProgram, state: RunState, store: CheckpointStore, log: LossLog,
              stop: StopRequests, profile: ProfileWindow | None, say) -> None:
    """Steps from state.step + 1 to plan.last_step (or a stop request), updating `state`: each step's loss
    logged, checkpoints saved when due, validation every eval_every steps and at the end."""
    config = plan.config
    evaluate = Evaluation.of(plan, program)
    while state.step < plan.last_step and not stop.requested:
        state.step += 1
        tokens = plan.train_batches.global_batch(state.step - 1, plan.token_sharding)
        if profile:
            profile.before_step(state.step, state)
        state.params, state.opt_state, loss = program.compiled(state.params, state.opt_state, state.rest, tokens)
        if profile:
            profile.after_step(state.step, (state.params, loss))
        log.add(state.step, loss)
        due_to_save = store.should_save(state.step)
        if due_to_save or state.step % config.log_every == 0 or state.step == plan.last_step:
            stop_if_not_finite(log.flush(), state)
        if due_to_save and save_checkpoint(store, plan, state):
            state.saved_step = state.step
        if state.step % config.eval_every == 0 or state.step == plan.last_step:
            loss, balance = evaluate(state)
            stop_if_not_finite(log.add_eval(state.step, loss, say, balance), state)
            log.restart_clock()
    stop_if_not_finite(log.flush(), state)


@dataclass(frozen=True)
class Evaluation:
    """The validation loss (and a mixture of experts' load-balancing loss) over eval_batches batches."""

    plan: RunPlan
    loss_step: object
    balance_step: object | None

    @classmethod
    def of(cls, plan: RunPlan, program: TrainProgram) -> Evaluation:
        graphdef, under = program.graphdef, Placement(plan.layout, plan.mesh)
        balance = load_balance_step(graphdef, under=under) if plan.model_config.load_balance_weight else None
        return cls(plan, eval_step(graphdef, under=under), balance)

    def __call__(self, state: RunState) -> tuple[float, float | None]:
        balance = None if self.balance_step is None else self.mean(self.balance_step, state)
        return self.mean(self.loss_step, state), balance

    def mean(self, step, state: RunState) -> float:
        batches = self.plan.eval_batches
        values = [step(state.params, state.rest, batches.global_batch(index, self.plan.token_sharding))
                  for index in range(self.plan.config.eval_batches)]
        return float(sum(jax.device_get(values)) / len(values))


def save_checkpoint(store: CheckpointStore, plan: RunPlan, state: RunState, force: bool = False) -> bool:
    """Save state.step when due (or forced), after checking that its parameters are finite; whether it saved."""
    if not (force or store.should_save(state.step)):
        return False
    if not all_finite(state.params):
        raise RunStopped(f"the parameters after step {state.step} are not finite; nothing was saved there, and "
                         f"{resume_advice(state.saved_step)}")
    return store.save(state.step, state.params, state.opt_state, plan.description(state.step, state.changes),
                      force=force)


def stop_if_not_finite(nonfinite: tuple[int, str, float] | None, state: RunState) -> None:
    """RunStopped for a (step, what, value) that LossLog found not finite."""
    if nonfinite is not None:
        step, what, value = nonfinite
        raise RunStopped(f"{what} is {value} at step {step}; the run stopped without saving it, and "
                         f"{resume_advice(state.saved_step)}")


def resume_advice(saved_step: int) -> str:
    """Where a stopped run can continue from."""
    if not saved_step:
        return "no checkpoint was saved: lower --learning-rate and start again (--overwrite replaces its metrics)"
    return (f"its newest checkpoint is step {saved_step}: rerun with --resume and a lower --learning-rate "
            "(--allow-change learning_rate)")


def as_compiled(tree, like):
    """`tree`'s arrays, placed as the abstract arrays of `like` (the same arrays in the same order) and in its tree
    structure."""
    targets, treedef = jax.tree.flatten(like)
    return jax.tree.unflatten(treedef, [leaf if getattr(target, "sharding", None) is None
                                        else jax.device_put(leaf, target.sharding)
                                        for leaf, target in zip(jax.tree.leaves(tree), targets, strict=True)])


@dataclass
class TrainProgram:
    """The training step compiled for the run's shapes and shardings, the abstract (params, opt_state, rest) it
    was compiled for (jax.ShapeDtypeStruct placed as the step wants them) and the model's graphdef."""

    compiled: object
    arguments: tuple
    graphdef: object

    def adopt(self, params, opt_state, rest) -> tuple:
        """The run's state placed as the step was compiled for (the optimizer state as `eval_shape` of its init
        placed it, which a fresh init need not match), in the compiled arguments' tree structure."""
        return tuple(as_compiled(tree, like) for tree, like in zip((params, opt_state, rest), self.arguments))


def compile_train_step(config: TrainConfig, model_config, layout, mesh, token_sharding,
                       device_memory_bytes: float | None = None) -> TrainProgram:
    """Compile `steps.train_step` from abstract arguments, before any array is allocated; with
    `device_memory_bytes`, refuse a step that needs more per device (`step_bytes_per_device`). The step is bound
    to its placement (`steps.train_step`), so no layout need be active where this is called."""
    graphdef, params, rest = abstract_model_state(model_config, layout, mesh)
    optimizer = make_optimizer(config, params)
    opt_state = jax.tree.map(  # eval_shape places on the abstract mesh (scalars nowhere): the same specs on `mesh`
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(
            mesh, leaf.sharding.spec if leaf.sharding is not None else PartitionSpec())),
        jax.eval_shape(optimizer.init, params))
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32, sharding=token_sharding)
    compiled = train_step(graphdef, optimizer, config.grad_accum, under=Placement.of(layout, mesh)).lower(
        params, opt_state, rest, tokens).compile()
    program = TrainProgram(compiled, (params, opt_state, rest), graphdef)
    needed = step_bytes_per_device(compiled)
    if device_memory_bytes is not None and needed is not None and needed > device_memory_bytes:
        options = fitting_options(config, model_config, layout, mesh, token_sharding, device_memory_bytes,
                                  program.arguments)
        raise StarscreamError(f"the training step needs {needed / 2**30:.2f} GiB per device, more than the "
                              f"{device_memory_bytes / 2**30:.2f} GiB each device has; {options}")
    return program


def step_bytes_per_device(compiled) -> int | None:
    """Bytes one device holds while the compiled step runs: its arguments, its outputs not aliased to them, and
    its temporaries (the planner's persistent + temporary figure, here exact at full depth); None when the
    backend gives no memory analysis."""
    memory = MemoryReport.of(compiled)
    return None if memory is None else memory.working_set_bytes


def fitting_options(config: TrainConfig, model_config, layout, mesh, token_sharding, device_memory_bytes,
                    arguments) -> str:
    """What would fit, measured where it can be: the step with --remat-policy full (`full_remat_bytes`), then the
    other levers. `arguments`: the step's (params, optimizer state, rest) as compiled."""
    options = []
    if model_config.remat != "full":
        needed, how = full_remat_bytes(config, model_config, layout, mesh, token_sharding, arguments)
        verdict = "fits" if needed <= device_memory_bytes else "does not fit either"
        options.append(f"--remat-policy full needs {needed / 2**30:.2f} GiB{how} ({verdict})")
    options.append("a smaller --batch-size or --seq-len, more --gpus, or the layout `starscream plan --phases train` "
                   "picks")
    return "options: " + "; ".join(options)


def full_remat_bytes(config: TrainConfig, model_config, layout, mesh, token_sharding, arguments) -> tuple[float, str]:
    """(bytes per device, how they were found) of the step under --remat-policy full: compiled and sized, or on CPU
    devices the planner's estimate (`analysis.memory.gpu_memory`, its persistent state the step's own): XLA:CPU
    merges the recomputed forward pass with the first one, so its compile saves nothing (Llama 3.2 1B, 4 layers on 2
    x 4: 3,324 MiB of temporaries against 3,336 without recomputation), and a simulated 70B step read larger with it."""
    full = model_config.replace(remat="full")
    if mesh.devices.flat[0].platform != "cpu":
        remat = compile_train_step(dataclasses.replace(config, remat="full"), full, layout, mesh, token_sharding)
        return step_bytes_per_device(remat.compiled), ""
    params, opt_state = arguments[:2]
    persistent = {"params": held_bytes(params), "optimizer_state": held_bytes(opt_state), "kv_cache": 0.0}
    estimate = gpu_memory(full, layout, mesh, "train", config.batch_size, config.seq_len, persistent,
                          config.grad_accum)
    return estimate["total"], " by the planner's estimate (a CPU compile recomputes nothing)"


STOP_SIGNALS = {signal.SIGINT: ("interrupted", "Ctrl-C again exits at once"),
                signal.SIGTERM: ("terminated (SIGTERM)", "a second SIGTERM or Ctrl-C exits at once")}
"""The signals that stop a run after its step in progress: (what the run says it was, how to exit at once)."""


class StopRequests:
    """Within it, the first Ctrl-C (SIGINT) or SIGTERM (a scheduler ending the job) asks the loop to stop after the
    current step (`requested`: the signal's number), which then saves a checkpoint; a second one exits at once
    (status 128 + the signal's number). The handler raises nothing: a KeyboardInterrupt raised inside XLA's compile
    aborts it and leaves the process to crash as it exits, and one raised inside a garbage-collection callback is
    dropped; so it is in place from before the compile, and a signal that arrives there stops the run before its
    first step. Outside the main thread, or for a signal that is ignored (a job started in the background by a
    script), it changes nothing. SIGTERM is taken only by a run of one process (`alone`): the processes of a larger
    run would each stop after the step it had reached and wait on each other's checkpoint save, so there SIGTERM
    ends the process, as a kill does (a resume continues from the newest complete checkpoint)."""

    def __init__(self, alone: bool = True):
        self.requested = 0
        self._signals = tuple(STOP_SIGNALS) if alone else (signal.SIGINT,)
        self._previous_handlers = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:
                if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored (nohup &): keep so
                    self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)

    @property
    def exit_status(self) -> int:
        """The status a shell reports for a process the requesting signal ended: 130 after Ctrl-C, 143 after
        SIGTERM."""
        return 128 + self.requested

    def stopped_at(self, step: int) -> str:
        """What the run says when it stops at `step` (done and saved) on request."""
        what = STOP_SIGNALS[self.requested][0]
        if not step:
            return f"{what} before the first step (nothing to save); rerun the same command to start the run"
        return f"{what} at step {step} (checkpoint saved); rerun with --resume to continue"

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            print("stopped again: exiting at once; --resume continues from the newest checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.requested = signum
        what, again = STOP_SIGNALS[signum]
        print(f"{what}: finishing this step and saving a checkpoint ({again})", file=sys.stderr, flush=True)


def report_run(config: TrainConfig, losses, unigram_nats: float, checkpoint_dir, say, layout: str) -> None:
    """Print the final losses beside the unigram entropy (same units) and write the loss plot."""
    run_dir = Path(config.run_dir)
    final_step, final_loss = losses[-1]
    say(f"step {final_step}: train loss {format_loss(final_loss)}; unigram entropy {format_loss(unigram_nats)}")
    metrics_path = run_dir / METRICS_FILE
    if metrics_path.is_file():
        plot_path = plot_losses(read_metrics(metrics_path), run_dir / PLOT_FILE, reference_nats=unigram_nats,
                                title=f"{config.init or config.model} under {layout}")
        say(f"metrics {metrics_path}, plot {plot_path}, checkpoints {checkpoint_dir}")
