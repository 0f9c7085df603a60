"""`starscream inspect`: compile layouts side by side on a simulated mesh and judge them by the three principles.

For one model, phase and mesh, each layout's step is lowered from abstract inputs (`jax.ShapeDtypeStruct`s carrying
the layout's shardings; no array is ever allocated, so a 70B model costs nothing) and compiled on simulated CPU
devices; `starscream_jax.inspector` reads the compiled program. gpu_tp is always compiled as well, as the reference
for kernel shapes, and shown only when asked for.

Phases (B = --batch, S = --seq):
  train    value_and_grad of next_token_loss on [B, S + 1] tokens, then an AdamW update (optax). Parameters and
           optimizer state are float32 (as `starscream train` keeps them), both placed by the layout's params rules.
  prefill  the forward pass over [B, S] tokens filling an empty KV cache of length S; returns the last position's
           logits and the cache. Parameters are held in the model's dtype.
  decode   one new token per sequence ([B, 1]) against a KV cache of length S; the token's position in the cache
           is an input of the step.

Depth: the model is compiled with --layers L (default 2) in place of its n_layers N. The layers run as one loop
(`jax.lax.scan`) whose body is the same for every layer, so per-layer figures are what the loop body does in one trip,
and full-depth figures are (everything outside the loop: embedding, head, loss, optimizer) + N x (per layer). XLA
removes a loop of one trip, so L must be at least 2. Parameter, optimizer-state and KV-cache bytes per device are
exact at full depth: they come from the shardings of the N-layer model.

Principles: `inspector.check_principles` against the gpu_tp program of the same phase. Norm scales (the layout's
`replicated_ok` logical names) and their optimizer moments may be replicated over xcd. For decode, principle 1 is
judged by bytes read instead of kernel shapes (`inspector.reads_once_per_gpu`). The table shows the first violations
of each failed principle; --json holds them all.

Bytes per device per step are the inspector's ring-formula bytes. "inter_gpu" counts every byte that crosses the
inter-GPU links: collectives over one partition of each GPU (of one node or of several) and flat collectives, whose
rings run through partitions of several GPUs at once, so each of their inter-GPU links carries the full per-device
volume and sets their pace. "flat" is that flat part alone.

The CPU backend computes and moves bfloat16 values as float32, and runs a reduce-scatter as an all-reduce followed by a
slice (which the inspector counts as an all-reduce), so collective bytes and compiled memory are up to twice what a
bfloat16 program moves on a GPU, and gradient reduce-scatters up to four times; layouts are compared like for like.
Kernel intensity is taken from each local matmul's shape at the model's compute dtype: 2MKN / (bytes per element x
(MK + KN + MN)) FLOP per byte, compared with the preset's ridge point (peak FLOP/s over HBM bytes/s of one partition).

This module imports jax only inside functions: the command line sets up the simulated devices before jax starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from starscream_jax.config import ModelConfig
from starscream_jax.errors import StarscreamError
from starscream_jax.mesh import add_mesh_arguments, mesh_from_args, prepare_simulation

if TYPE_CHECKING:
    from starscream_jax.layouts import Layout

PHASES = ("train", "prefill", "decode")
DEFAULT_LAYOUTS = {"train": "flat_tp,starscream_tp", "prefill": "flat_tp,starscream_tp",
                   "decode": "flat_tp,starscream_decode"}
# (batch, seq) per phase: the token counts of reference/h200_kernel_shapes.md.
DEFAULT_SHAPES = {"train": (8, 2048), "prefill": (8, 4096), "decode": (64, 8192)}
DEFAULT_MODEL = "llama3-70b"
DEFAULT_PRESET = "mi300x-cpx-nps1"
DEFAULT_GPUS = 8
DEFAULT_LAYERS = 2
REFERENCE = "gpu_tp"
LEARNING_RATE = 1e-4  # changes no shape, sharding or collective of the compiled step
PRINCIPLES = ("shape_preservation", "no_redundancy", "hierarchical_collectives")
KV_NAMES = ("layers", "attn_batch", "seq", "kv_heads", "head_dim")
SHOWN_VIOLATIONS = 3
LINE_WIDTH = 160
# The programs are never run: skipping LLVM's optimisation of the CPU code halves compile time and leaves the
# compiled HLO and its memory analysis unchanged.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to compile: `config` has the compiled depth (`layers`), `full_layers` is the model's own depth."""

    config: ModelConfig
    full_layers: int
    phase: str
    batch: int
    seq: int
    layouts: tuple[str, ...]
    dump_hlo: Path | None

    @property
    def layers(self) -> int:
        return self.config.n_layers


class TrainArgs(NamedTuple):
    params: Any
    opt_state: Any
    tokens: Any


class PrefillArgs(NamedTuple):
    params: Any
    tokens: Any
    cache: Any


class DecodeArgs(NamedTuple):
    params: Any
    tokens: Any
    cache: Any
    cache_index: Any


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One layout's compiled step, the abstract arguments it was lowered from, its layer-loop instructions and the
    lowered program's text (with locations: the activations' names)."""

    layout: Layout
    args: NamedTuple
    compiled: Any
    loop_ops: frozenset[str]
    lowered_text: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream inspect`: the (simulated) mesh, model, layouts, phase, shapes, output."""
    add_mesh_arguments(parser, default_preset=DEFAULT_PRESET, default_gpus=DEFAULT_GPUS, default_simulate=True)
    group = parser.add_argument_group("inspection")
    group.add_argument("--model", default=DEFAULT_MODEL, help="model configuration: a name in models/ or a TOML path")
    group.add_argument("--layout", default=None,
                       help="comma-separated layouts (default: flat_tp,starscream_tp; flat_tp,starscream_decode "
                            "for decode)")
    group.add_argument("--phase", default="train", choices=PHASES, help="which step to compile")
    group.add_argument("--batch", type=int, default=None,
                       help="sequences per step (default: 8 for train and prefill, 64 for decode)")
    group.add_argument("--seq", type=int, default=None,
                       help="tokens per sequence; the KV cache length for prefill and decode (default: 2048 train, "
                            "4096 prefill, 8192 decode)")
    group.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                       help="layers to compile (at least 2); figures are scaled to the model's full depth")
    group.add_argument("--json", action="store_true", help="print one JSON object with a key per layout")
    group.add_argument("--dump-hlo", type=Path, default=None, metavar="DIR",
                       help="write each compiled program's HLO text to DIR")


def run(args: argparse.Namespace) -> int:
    """`starscream inspect`: compile, inspect and print a side-by-side table (or JSON). Returns 0."""
    if not args.simulate:
        raise StarscreamError("--no-simulate given, but inspect always compiles on simulated CPU devices; drop "
                              "--no-simulate (the preset supplies the hardware figures)")
    prepare_simulation(args)
    settings = settings_from_args(args)
    topology, mesh = mesh_from_args(args)
    results = inspect_layouts(settings, topology, mesh)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The checked Settings of the parsed arguments."""
    return make_settings(args.model, args.phase, args.batch, args.seq, args.layout or DEFAULT_LAYOUTS[args.phase],
                         args.layers, args.dump_hlo)


def make_settings(model: str, phase: str, batch: int | None, seq: int | None, layouts: str, layers: int,
                  dump_hlo: Path | None = None) -> Settings:
    """Checked Settings: `model` a name in models/ or a TOML path, `batch` / `seq` None for the phase's defaults,
    `layouts` comma-separated names, `layers` the compiled depth (at least 2). The default sequence length is
    capped at the model's max_seq_len."""
    from starscream_jax.config import load_model_config
    from starscream_jax.layouts import get_layout

    if layers < 2:
        raise StarscreamError(f"--layers {layers}: per-layer figures are read from the compiled layer loop, "
                              "which XLA removes at one layer; pass --layers 2 or more")
    full = load_model_config(model)
    default_batch, default_seq = DEFAULT_SHAPES[phase]
    batch = default_batch if batch is None else batch
    seq = min(default_seq, full.max_seq_len) if seq is None else seq
    if batch < 1 or seq < 2:
        raise StarscreamError(f"--batch {batch} --seq {seq}: need at least 1 sequence of at least 2 tokens")
    if seq > full.max_seq_len:
        raise StarscreamError(f"--seq {seq} exceeds model {full.name}'s max_seq_len {full.max_seq_len}; pass "
                              f"--seq {full.max_seq_len} or less")
    names = tuple(name.strip() for name in layouts.split(",") if name.strip())
    if not names:
        raise StarscreamError(f"--layout {layouts!r} names no layout; give names separated by commas")
    for name in names:
        get_layout(name)
    return Settings(full.replace(n_layers=layers), full.n_layers, phase, batch, seq, tuple(dict.fromkeys(names)),
                    dump_hlo)


def inspect_layouts(settings: Settings, topology, mesh, refused: dict[str, str] | None = None) -> dict[str, dict]:
    """Compile every layout of `settings` and gpu_tp on `mesh`; {layout name: result} (see `layout_result`).

    A layout that cannot place the model on the mesh raises its ShardingRuleError, unless `refused` is given: then
    the error's message is recorded there under the layout's name and the layout left out (never gpu_tp, the
    reference every verdict needs)."""
    from starscream_jax.errors import ShardingRuleError
    from starscream_jax.inspector import inspect_compiled

    steps = {}
    for name in dict.fromkeys((*settings.layouts, REFERENCE)):
        try:
            steps[name] = compile_step(settings, name, mesh)
        except ShardingRuleError as err:
            if refused is None or name == REFERENCE:
                raise
            refused[name] = str(err)
    if settings.dump_hlo is not None:
        settings.dump_hlo.mkdir(parents=True, exist_ok=True)
        for name, step in steps.items():
            (settings.dump_hlo / f"{name}_{settings.phase}.hlo.txt").write_text(step.compiled.as_text())
    token_dims = (settings.batch, 1 if settings.phase == "decode" else settings.seq)
    reports = {name: inspect_compiled(step.compiled, mesh, args=step.args, gpus_per_node=topology.gpus_per_node,
                                      lowered_text=step.lowered_text, token_dims=token_dims)
               for name, step in steps.items()}
    return {name: layout_result(settings, topology, mesh, steps[name], reports[name], reports[REFERENCE])
            for name in settings.layouts if name in steps}


def compile_step(settings: Settings, layout_name: str, mesh) -> CompiledStep:
    """Lower the phase's step under the layout from abstract inputs and compile it (nothing is allocated)."""
    import jax

    from starscream_jax.layouts import get_layout
    from starscream_jax.sharding import use_layout

    layout = get_layout(layout_name)
    with use_layout(layout, mesh):
        graphdef, args = abstract_args(settings.config, layout, mesh, settings.phase, settings.batch, settings.seq)
        step, donated = _step_function(settings.phase, graphdef)
        lowered = jax.jit(step, donate_argnums=donated).lower(*args)
        compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    return CompiledStep(layout, args, compiled, layer_loop_ops(compiled.as_text(), settings.layers),
                        lowered.as_text(debug_info=True))


def abstract_args(config: ModelConfig, layout: Layout, mesh, phase: str, batch: int,
                  seq: int) -> tuple[Any, NamedTuple]:
    """(graphdef, the step's arguments as ShapeDtypeStructs with the layout's shardings) for a model of `config`.

    Call inside `use_layout(layout, mesh)`. Tokens: [B, S + 1] (train), [B, S] (prefill), [B, 1] (decode), batch
    placed like the layout's `batch`. KV cache {"k", "v"}: [L, B, S, K, E] each, placed by the activation rules.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from starscream_jax.model import Transformer, batch_sharding
    from starscream_jax.sharding import activation_spec

    abstract_model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract_model, nnx.Param)
    params = place(params, layout, mesh, None if phase == "train" else jnp.dtype(config.dtype))
    token_length = {"train": seq + 1, "prefill": seq, "decode": 1}[phase]
    tokens = jax.ShapeDtypeStruct((batch, token_length), jnp.int32,
                                  sharding=batch_sharding(layout, mesh, batch))
    if phase == "train":
        opt_state = jax.eval_shape(_optimizer().init, params)
        return graphdef, TrainArgs(params, place(opt_state, layout, mesh), tokens)
    shape = (config.n_layers, batch, seq, config.n_kv_heads, config.head_dim)
    kv_sharding = jax.sharding.NamedSharding(mesh, activation_spec(KV_NAMES, shape, "kv cache"))
    kv = jax.ShapeDtypeStruct(shape, jnp.dtype(config.dtype), sharding=kv_sharding)
    cache = {"k": kv, "v": kv}
    if phase == "prefill":
        return graphdef, PrefillArgs(params, tokens, cache)
    index = jax.ShapeDtypeStruct((), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return graphdef, DecodeArgs(params, tokens, cache, index)


def place(state, layout, mesh, dtype=None):
    """`state` (parameters or optimizer state) with each array a ShapeDtypeStruct carrying the layout's params
    sharding, cast to `dtype` when given; nnx Variables keep their metadata."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    from starscream_jax.sharding import param_shardings

    def placed(sharding, node):
        if isinstance(node, nnx.Variable):
            return node.replace(placed(sharding, node.get_value()))
        return jax.ShapeDtypeStruct(node.shape, dtype or node.dtype, sharding=sharding)

    return jax.tree.map(placed, param_shardings(state, layout, mesh), state,
                        is_leaf=lambda node: isinstance(node, NamedSharding))


def _optimizer():
    import optax

    return optax.adamw(LEARNING_RATE)


def _step_function(phase: str, graphdef):
    """(step, donated argument positions) of a phase; see the module docstring."""
    import jax
    import optax
    from flax import nnx

    from starscream_jax.model import next_token_loss

    if phase == "train":
        optimizer = _optimizer()

        def train_step(params, opt_state, tokens_BxS1):
            loss, grads = jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens_BxS1))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return train_step, (0, 1)

    if phase == "prefill":
        def prefill_step(params, tokens_BxS, cache):
            logits_BxSxV, cache = nnx.merge(graphdef, params)(tokens_BxS, cache=cache, cache_index=0)
            return logits_BxSxV[:, -1], cache

        return prefill_step, (2,)

    def decode_step(params, tokens_Bx1, cache, cache_index):
        logits_Bx1xV, cache = nnx.merge(graphdef, params)(tokens_Bx1, cache=cache, cache_index=cache_index)
        return logits_Bx1xV[:, 0], cache

    return decode_step, (2,)


def layer_loop_ops(hlo_text: str, layers: int) -> frozenset[str]:
    """Names of the instructions that run inside the layer loop (the forward scan, and the backward one when
    training): those under a `while` whose known trip count is `layers`."""
    from starscream_jax.hlo import instructions_in_loops

    found = instructions_in_loops(hlo_text, layers)
    if not found:
        raise StarscreamError(f"the compiled program has no loop of {layers} trips, so per-layer figures cannot be "
                              "told apart; the model must run its layers with jax.lax.scan")
    return found


@dataclasses.dataclass(frozen=True)
class Depth:
    """Scales the compiled program to the full depth: an op in the layer loop runs `compiled` times per compiled
    step and `full` times per full-depth step."""

    compiled: int
    full: int
    loop_ops: frozenset[str]

    def per_layer(self, name: str, runs: float) -> float:
        """The share of `runs` (a per-step total of one op) that one layer does; 0 for an op outside the loop."""
        return runs / self.compiled if name in self.loop_ops else 0.0

    def full_depth(self, name: str, runs: float) -> float:
        """`runs` of one op in the compiled step, scaled to the full-depth step."""
        return runs * self.full / self.compiled if name in self.loop_ops else runs


def layout_result(settings: Settings, topology, mesh, step: CompiledStep, report, reference) -> dict[str, Any]:
    """The JSON-ready result of one layout: settings, mesh, principles, bytes, memory, collectives, matmuls, inputs,
    activations, and the cost model's estimate of the full-depth step (`costmodel.estimate_step`)."""
    import numpy as np

    from starscream_jax.costmodel import estimate_step

    itemsize = np.dtype(settings.config.dtype).itemsize
    depth = Depth(settings.layers, settings.full_layers, step.loop_ops)
    matmuls = [matmul_entry(m, depth, itemsize, topology.ridge_point) for m in report.matmuls]
    result = {
        "layout": step.layout.name,
        "description": step.layout.description,
        "model": settings.config.name,
        "preset": topology.preset.name,
        "phase": settings.phase,
        "batch": settings.batch,
        "seq": settings.seq,
        "layers": {"compiled": settings.layers, "full": settings.full_layers},
        "mesh": {"axes": list(mesh.axis_names), "shape": list(mesh.devices.shape)},
        "principles": principles(settings, step, report, reference, mesh.shape["xcd"]),
        "bytes_per_device": bytes_per_device(report.collectives, depth),
        "collectives_per_layer": collectives_per_layer(report.collectives, depth),
        "memory_per_device": memory_per_device(settings, step.layout, mesh, report.memory, topology.hbm_bytes),
        "kernel_intensity": kernel_intensity(matmuls, topology.ridge_point, settings.config.dtype),
        "collectives": [{**dataclasses.asdict(c), "in_layer_loop": c.name in step.loop_ops}
                        for c in report.collectives],
        "matmuls": matmuls,
        "inputs": [dataclasses.asdict(entry) for entry in report.inputs],
        "activations": [dataclasses.asdict(entry) for entry in report.activations],
    }
    result["estimate"] = estimate_step(result, topology, itemsize).to_dict()
    return result


def _link_totals(by_scope: dict[str, float]) -> dict[str, float]:
    """inter_gpu (every byte over inter-GPU links, flat included), intra_gpu and flat, from bytes by scope."""
    return {"inter_gpu": by_scope["inter_gpu"] + by_scope["inter_node"] + by_scope["flat"],
            "intra_gpu": by_scope["intra_gpu"], "flat": by_scope["flat"]}


def bytes_per_device(collectives, depth: Depth) -> dict[str, Any]:
    """Bytes one device sends per step, at full depth (inter_gpu, intra_gpu, flat, by_scope), per layer and outside
    the layer loop."""
    from starscream_jax.inspector import SCOPES

    full, per_layer = dict.fromkeys(SCOPES, 0.0), dict.fromkeys(SCOPES, 0.0)
    for collective in collectives:
        sent = collective.bytes_per_device * collective.count
        full[collective.scope] += depth.full_depth(collective.name, sent)
        per_layer[collective.scope] += depth.per_layer(collective.name, sent)
    outside = {scope: full[scope] - depth.full * per_layer[scope] for scope in SCOPES}
    return {**_link_totals(full), "by_scope": full, "per_layer": _link_totals(per_layer),
            "outside_layers": _link_totals(outside)}


def collectives_per_layer(collectives, depth: Depth) -> dict[str, float]:
    """How many collectives of each scope one layer runs (per step)."""
    from starscream_jax.inspector import SCOPES

    counts = dict.fromkeys(SCOPES, 0.0)
    for collective in collectives:
        counts[collective.scope] += depth.per_layer(collective.name, collective.count)
    return counts


def memory_per_device(settings: Settings, layout, mesh, compiled_memory, hbm_bytes: float) -> dict[str, Any]:
    """Persistent bytes per device at full depth (params, optimizer state, KV cache, from the shardings of the
    full-depth model) and the compiled program's memory analysis at the compiled depth."""
    import jax

    from starscream_jax.sharding import use_layout

    with use_layout(layout, mesh):
        full_model = settings.config.replace(n_layers=settings.full_layers)
        _, args = abstract_args(full_model, layout, mesh, settings.phase, settings.batch, settings.seq)
    groups = {"params": args.params, "optimizer_state": getattr(args, "opt_state", None),
              "kv_cache": getattr(args, "cache", None)}
    persistent = {name: sum(_shard_bytes(leaf) for leaf in jax.tree.leaves(tree)) for name, tree in groups.items()}
    compiled = None if compiled_memory is None else {"layers": settings.layers,
                                                      **dataclasses.asdict(compiled_memory)}
    return {**persistent, "persistent": sum(persistent.values()), "hbm": hbm_bytes, "compiled": compiled}


def _shard_bytes(leaf) -> int:
    import numpy as np

    return math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def matmul_entry(matmul, depth: Depth, itemsize: int, ridge_point: float) -> dict[str, Any]:
    """One local matmul for the JSON: shape, runs, FLOPs, intensity at the compute dtype, below the ridge or not."""
    m, k, n = matmul.m, matmul.k, matmul.n
    intensity = 2 * m * k * n / (itemsize * (m * k + k * n + m * n))
    return {"name": matmul.name, "op_name": matmul.op_name, "batch": matmul.batch, "m": m, "k": k, "n": n,
            "count": matmul.count, "flops": matmul.flops, "intensity": intensity,
            "below_ridge": intensity < ridge_point, "in_layer_loop": matmul.name in depth.loop_ops,
            "full_depth_runs": depth.full_depth(matmul.name, matmul.count)}


def kernel_intensity(matmuls: list[dict], ridge_point: float, dtype: str) -> dict[str, Any]:
    """Smallest and FLOP-weighted intensity of the local matmuls and the share of their FLOPs below the ridge point,
    each matmul weighted by its runs in the full-depth step."""
    weights = [m["flops"] * m["full_depth_runs"] for m in matmuls]
    total = sum(weights)
    return {
        "dtype": dtype,
        "ridge_point": ridge_point,
        "smallest": min((m["intensity"] for m in matmuls), default=None),
        "flop_weighted": sum(w * m["intensity"] for w, m in zip(weights, matmuls)) / total if total else None,
        "below_ridge_flop_share": sum(w for w, m in zip(weights, matmuls) if m["below_ridge"]) / total
        if total else None,
    }


def principles(settings: Settings, step: CompiledStep, report, reference, partitions: int) -> dict[str, dict]:
    """The three verdicts. Replicated inputs are allowed for parameters (and their optimizer state) whose logical
    names include one of the layout's `replicated_ok` names. Decode judges principle 1 by bytes read
    (`reads_once_per_gpu`) instead of kernel shapes."""
    from starscream_jax.inspector import check_principles, reads_once_per_gpu

    allowed = replicated_ok_names(step.args, step.layout.replicated_ok)
    verdicts = check_principles(report, reference, replicated_ok=allowed)
    if settings.phase == "decode":
        verdicts["shape_preservation"] = reads_once_per_gpu(report.matmuls, reference.matmuls, partitions)
    return verdicts


def replicated_ok_names(args, logical_names: frozenset[str]) -> set[str]:
    """Input names (as the inspector writes them) of the arrays of every nnx Variable in `args` whose logical axes
    include one of `logical_names` (norm scales, and the optimizer's moments of them)."""
    import jax
    from flax import nnx

    from starscream_jax.sharding import LOGICAL_AXES

    def is_variable(node) -> bool:
        return isinstance(node, nnx.Variable)

    allowed = set()
    for path, node in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_variable)[0]:
        if is_variable(node) and logical_names & set(node.get_metadata(LOGICAL_AXES, ())):
            for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
                allowed.add(jax.tree_util.keystr((*path, *inner), simple=True, separator="/"))
    return allowed


def _clip(line: str) -> str:
    return line if len(line) <= LINE_WIDTH else line[: LINE_WIDTH - 3] + "..."


def _figure(value: float | None, form: str) -> str:
    """`value` in `form` ("{:.0f}"), or "-" when there is none (a program without matmuls)."""
    return "-" if value is None else form.format(value)


def _verdict(verdict: dict) -> str:
    return "ok" if verdict["ok"] else f"FAIL ({len(verdict['violations'])})"


def _rows(result: dict) -> list[tuple[str, str]]:
    """(label, cell) rows of one layout's column."""
    from starscream_jax.metrics import format_bytes, format_seconds

    full, compiled_layers = result["layers"]["full"], result["layers"]["compiled"]
    memory, sent = result["memory_per_device"], result["bytes_per_device"]
    intensity, estimate = result["kernel_intensity"], result["estimate"]
    counts = {**result["collectives_per_layer"]}
    counts["inter_gpu"] += counts["inter_node"]
    phase = result["phase"]
    rows = [("memory per device", "")]
    rows.append((f"  params{' + optimizer' if phase == 'train' else ''} ({full} layers)",
                 format_bytes(memory["params"] + memory["optimizer_state"])))
    if phase != "train":
        rows.append((f"  KV cache ({full} layers)", format_bytes(memory["kv_cache"])))
    if memory["compiled"] is not None:
        rows.append((f"  compiled temp ({compiled_layers} layers)", format_bytes(memory["compiled"]["temp_bytes"])))
    copied = [entry["shard_bytes"] for entry in result["activations"] if entry["replication_xcd"] > 1]
    rows.append(("  largest activation copied over xcd", format_bytes(max(copied)) if copied else "none"))
    rows += [
        ("bytes per device per step", ""),
        ("  inter-GPU per layer", format_bytes(sent["per_layer"]["inter_gpu"])),
        ("    of which flat", format_bytes(sent["per_layer"]["flat"])),
        ("  intra-GPU per layer", format_bytes(sent["per_layer"]["intra_gpu"])),
        (f"  inter-GPU, {full} layers", format_bytes(sent["inter_gpu"])),
        (f"  intra-GPU, {full} layers", format_bytes(sent["intra_gpu"])),
        ("collectives per layer", " / ".join(f"{counts[scope]:g}" for scope in ("intra_gpu", "inter_gpu", "flat"))),
        (f"kernel intensity ({intensity['dtype']}, FLOP/B)", ""),
        ("  smallest", _figure(intensity["smallest"], "{:.0f}")),
        ("  FLOP-weighted", _figure(intensity["flop_weighted"], "{:.0f}")),
        (f"  FLOPs below ridge ({intensity['ridge_point']:.0f})",
         _figure(intensity["below_ridge_flop_share"], "{:.1%}")),
        ("estimated step, full depth", ""),
        ("  matmuls (roofline)", format_seconds(estimate["compute_s"])),
        ("  collectives", format_seconds(estimate["total_communication_s"])),
        ("  serial / overlapped",
         f"{format_seconds(estimate['serial_s'])} / {format_seconds(estimate['overlapped_s'])}"),
        ("  tokens/s (serial)", f"{estimate['tokens_per_s']:,.0f}"),
        ("principles", ""),
        ("  1 kernel shapes" + (" (bytes read)" if phase == "decode" else ""),
         _verdict(result["principles"]["shape_preservation"])),
        ("  2 no redundancy over xcd", _verdict(result["principles"]["no_redundancy"])),
        ("  3 hierarchical collectives", _verdict(result["principles"]["hierarchical_collectives"])),
    ]
    return rows


def _header(result: dict) -> list[str]:
    """What was compiled: model, preset, mesh, phase and shapes, per-partition figures, depth."""
    from starscream_jax.metrics import format_bytes

    mesh = " x ".join(f"{axis} {size}" for axis, size in zip(result["mesh"]["axes"], result["mesh"]["shape"]))
    full, compiled = result["layers"]["full"], result["layers"]["compiled"]
    hbm, ridge = result["memory_per_device"]["hbm"], result["kernel_intensity"]["ridge_point"]
    shapes = f"batch {result['batch']} x seq {result['seq']}"
    return [
        f"{result['model']} on {result['preset']}, mesh {mesh}: {result['phase']}, {shapes}",
        f"per partition: {format_bytes(hbm)} HBM, ridge point {ridge:.0f} FLOP/B",
        f"compiled with {compiled} of {full} layers; {full} layers = outside the layer loop + {full} x per layer",
    ]


def format_table(results: dict[str, dict]) -> str:
    """The side-by-side table of `inspect_layouts`' results (one column per layout), then the notes and the first
    violations of each failed principle."""
    first = next(iter(results.values()))
    lines = [*_header(first), ""]
    columns = {name: _rows(result) for name, result in results.items()}
    labels = [label for label, _ in next(iter(columns.values()))]
    label_width = max(len(label) for label in labels)
    widths = {name: max(len(name), *(len(cell) for _, cell in rows)) for name, rows in columns.items()}
    lines.append(" " * label_width + "".join(f"  {name:>{widths[name]}}" for name in columns))
    for index, label in enumerate(labels):
        cells = "".join(f"  {columns[name][index][1]:>{widths[name]}}" for name in columns)
        lines.append(f"{label:<{label_width}}{cells}".rstrip())
    lines += [
        "",
        "collectives per layer: intra-GPU / inter-GPU / flat. Inter-GPU bytes include the flat collectives' (their",
        "rings pass every byte over inter-GPU links). On the CPU backend bfloat16 moves as float32 and a",
        "reduce-scatter runs as all-reduce + slice, so bytes and compiled memory are up to 2x a GPU's (gradient",
        "reduce-scatters 4x); intensity is computed from each matmul's shape at the model's dtype. The estimate is the",
        "cost model's (starscream_jax.costmodel): matmul rooflines and collective latency + bytes / bus bandwidth.",
    ]
    for name, result in results.items():
        for principle in PRINCIPLES:
            violations = result["principles"][principle]["violations"]
            if violations:
                lines.append(f"{name} {principle}: {len(violations)} violation(s), e.g.")
                lines += [_clip(f"  {line}") for line in violations[:SHOWN_VIOLATIONS]]
    return "\n".join(lines)
