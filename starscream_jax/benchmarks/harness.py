"""The one way a benchmark times a program, describes its run and stores its figures.

Timing (`timed_steps`, `seconds_per_call`, `alternating_rounds`): programs are compiled before the clock, run
`warmup` times, then timed back to back; the clock starts once the warm-up's outputs are ready and stops once the last
timed output is, so it measures device time per step and not dispatch. `sync` makes "ready" mean what it must for the
framework: `jax.block_until_ready` by default; a PyTorch peer passes `torch.cuda.synchronize`.

Run metadata (`run_info`): the command as it was given (the argv `main` received, never the interpreter's own), the
UTC date, the JAX version, the device kind, platform and count, and XLA_FLAGS. Common arguments
(`add_run_arguments`): --warmup, the timed-steps flag, --out and --quick. Output (`write_json`): the result object as
indented JSON, rewritten whole after each row so that a run cut short keeps the rows before.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

import jax

from ..model.config import ModelConfig

from ..model.catalog import load_model_config

State = TypeVar("State")
Output = TypeVar("Output")

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunInfo:
    """Where and how a benchmark ran; `as_dict` gives the keys every result's metadata carries."""

    command: str
    date: str
    jax: str
    device_kind: str
    platform: str
    device_count: int
    xla_flags: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def command_line(script: str | Path, argv: Sequence[str] | None) -> str:
    """`python <script> <arguments>`: the script's path from the repository root where it lies inside it, and the
    arguments `main` was given (`argv`; the process's own when None), quoted as a shell would need them."""
    path = Path(script).resolve()
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    arguments = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", str(shown), *arguments])


def run_info(script: str | Path, argv: Sequence[str] | None) -> RunInfo:
    """The metadata of a run of `script` with arguments `argv` (see `command_line`), on JAX's default devices.
    Call it after the script has chosen its devices: it starts the JAX backend."""
    devices = jax.devices()
    return RunInfo(command=command_line(script, argv),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   jax=jax.__version__, device_kind=devices[0].device_kind, platform=devices[0].platform,
                   device_count=len(devices), xla_flags=os.environ.get("XLA_FLAGS", ""))


@dataclasses.dataclass(frozen=True)
class Timed(Generic[State, Output]):
    """What `timed_steps` returns: the state after the last step, every step's output (warm-up steps first) and
    the mean seconds of one timed step."""

    state: State
    outputs: list[Output]
    seconds_per_step: float


def block(value: Any) -> None:
    """Waits until every JAX array in `value` is computed."""
    jax.block_until_ready(value)


def timed_steps(step: Callable[[State], tuple[State, Output]], state: State, *, warmup: int, steps: int,
                sync: Callable[[Any], None] = block) -> Timed[State, Output]:
    """Runs `state, output = step(state)` warmup + steps times, the state threaded through (a step that donates
    its inputs returns the buffers the next one reads). The clock starts once the warm-up's state is ready and
    stops once the last state and output are: seconds per step = that time / steps."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be at least 1 and warmup at least 0 (got steps={steps}, warmup={warmup})")
    outputs: list[Output] = []
    for _ in range(warmup):
        state, output = step(state)
        outputs.append(output)
    sync(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, output = step(state)
        outputs.append(output)
    sync((state, outputs[-1]))
    return Timed(state, outputs, (time.perf_counter() - start) / steps)


def seconds_per_call(function: Callable[..., Any], args: Sequence[Any], *, warmup: int, calls: int,
                     sync: Callable[[Any], None] = block) -> float:
    """Mean seconds of one call of `function(*args)` (no state: the same arguments each call), `calls` calls
    queued back to back after `warmup` (at least one, so that the clock never includes a first call's work)."""
    return timed_steps(lambda _: (None, function(*args)), None, warmup=max(1, warmup), steps=calls,
                       sync=sync).seconds_per_step


@dataclasses.dataclass(frozen=True)
class Rounds:
    """One program's mean seconds per call in each round of `alternating_rounds`, and their median."""

    means: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.means)


def alternating_rounds(programs: dict[str, tuple[Callable[..., Any], Sequence[Any]]], *, rounds: int, warmup: int,
                       calls: int) -> dict[str, Rounds]:
    """Each program's `seconds_per_call` in each of `rounds` rounds, the programs taking turns within a round, so
    that a slow spell of the machine (clocks, a neighbour) falls on every candidate alike."""
    means: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(rounds):
        for name, (function, args) in programs.items():
            means[name].append(seconds_per_call(function, args, warmup=warmup, calls=calls))
    return {name: Rounds(tuple(values)) for name, values in means.items()}


def traced_breakdown(step: Callable[[State], tuple[State, Output]], state: State, *, steps: int, directory: Path,
                     hlo_text: str) -> tuple[State, dict]:
    """Runs `steps` more steps (as `timed_steps` runs them) under the JAX profiler, the trace written to
    `directory`: (the state after them, their device time per step by category with the host's events and what held
    the device idle, `analysis.profile.time_breakdown`). Raises StarscreamError when the trace cannot be read (it
    stays on disk)."""
    from ..analysis.profile import time_breakdown

    jax.profiler.start_trace(str(directory), create_perfetto_trace=True)
    output = None
    for _ in range(steps):
        state, output = step(state)
    block((state, output))
    jax.profiler.stop_trace()
    return state, time_breakdown(directory, steps, hlo_text)


TORCH_PEERS = REPO_ROOT / "scripts" / "torch_peers.py"
"""The PyTorch peers of the training and decode benchmarks: the one place torch is imported."""


def torch_peers(device: str = "cuda") -> tuple[ModuleType | None, str]:
    """(scripts/torch_peers.py as a module, "") where torch is installed and can use `device`; else (None, the line
    a benchmark prints to say why its PyTorch peer is skipped). torch is imported only here, when a benchmark asks
    for its peer, so that nothing else needs it. Call it before JAX starts its backend: on a GPU it turns off JAX's
    preallocation of most of the GPU's memory, which would leave torch too little."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch peer skipped: torch is not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return None, "PyTorch peer skipped: torch sees no CUDA GPU"
    if device == "cuda":  # JAX allocates as it goes, not 75% of the GPU up front, so that torch finds memory
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    spec = importlib.util.spec_from_file_location("torch_peers", TORCH_PEERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, ""


def add_run_arguments(parser: argparse.ArgumentParser, *, warmup: int | None, steps: int, quick: str,
                      steps_flag: str = "--steps", steps_help: str = "timed steps") -> None:
    """The arguments every benchmark takes: --warmup (untimed runs after compiling; left out where `warmup` is
    None, for a benchmark whose first call is its warm-up), the number of timed runs (`steps_flag`), --out (the
    JSON file) and --quick (a CPU smoke run, described by `quick`)."""
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup,
                            help=f"runs after compiling, before the clock starts (default {warmup})")
    parser.add_argument(steps_flag, type=int, default=steps, help=f"{steps_help} (default {steps})")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (rewritten after every row)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")


def add_model_arguments(parser: argparse.ArgumentParser, *, model: str) -> None:
    """--model (a configuration in models/ or a path; default `model`) and --layers (its depth, default the
    model's own: fewer layers compile and run sooner, for a smoke run or a compile-time curve)."""
    parser.add_argument("--model", default=model, help=f"model configuration in models/ (or a path; default {model})")
    parser.add_argument("--layers", type=int, help="layers of the model to build (default: all of them)")


def model_config(args: argparse.Namespace, **overrides: Any) -> ModelConfig:
    """The configuration --model and --layers name, with `overrides` (ModelConfig fields)."""
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    return load_model_config(args.model, **overrides)


def write_json(path: Path | None, result: Any) -> None:
    """Writes `result` (dicts, lists, numbers, strings and frozen dataclasses) to `path` as indented JSON, through a
    temporary file so that a reader never sees half a file; nothing when `path` is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
    partial.replace(path)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
