"""The library on real accelerators (run with `pytest -m gpu` on a GPU machine; skipped where JAX sees no GPU).

Meshes: every device its own GPU (what the machine shows: 1 x n x 1 on NVIDIA), and, with two devices or more, an
explicit grouping that treats consecutive pairs of devices as the two partitions of one GPU (1 x n/2 x 2), so the
hierarchical layouts run real intra-"GPU" collectives. The tiny model runs in float32 with matmul precision "highest"
(no TF32), so a sharded run must match the unsharded one to float32 rounding: tolerances below.
"""
import contextlib
import functools
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.analysis.principles import check_principles
from starscream_jax.analysis.report import inspect_compiled, matmul_key
from starscream_jax.errors import TopologyError
from starscream_jax.hardware.mesh import build_mesh, build_topology_mesh, device_table, resolve_topology
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import create_sharded_model, next_token_loss
from starscream_jax.model.dense_cache import init_cache
from starscream_jax.sharding.apply import Placement, batch_sharding, use_layout
from starscream_jax.sharding.layouts import LAYOUTS
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.loop import initial_state
from starscream_jax.training.steps import train_step as make_train_step

pytestmark = pytest.mark.gpu

CONFIG = load_model_config("tiny")
BATCH, SEQ = 8, 33          # 8 sequences split over up to 8 devices; the model reads 32 tokens, predicts 32
LOSS_RTOL = 1e-5            # float32 reductions in another order
LOGITS_ATOL = 1e-4          # logits are O(1)
GRAD_REL_L2 = 1e-4          # per parameter: |g - g_ref| / |g_ref|
MAX_DEVICES = 8             # the tiny model's 8 query heads and 8 sequences split over at most 8 devices


@pytest.fixture(scope="module", autouse=True)
def full_float32_matmuls():
    """Matmuls in full float32 (GPUs default to TF32 for float32 dots, which differs in the 4th digit)."""
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", previous)


def device_ids() -> list[int]:
    return sorted(d.id for d in jax.devices())


def needs_devices(count: int) -> None:
    if len(jax.devices()) < count:
        pytest.skip(f"needs {count} accelerator devices, this machine shows {len(jax.devices())}")


def needs_cuda() -> None:
    if jax.devices()[0].platform != "gpu" or "rocm" in jax.devices()[0].client.platform_version.lower():
        pytest.skip(f"needs NVIDIA GPUs (CUDA), found {jax.devices()[0].device_kind}")


def power_of_two_at_most(count: int) -> int:
    return 1 << (count.bit_length() - 1)


def pairs_grouping() -> list[list[int]]:
    """Consecutive pairs of the first devices (a power of two of them, at most MAX_DEVICES), each pair one 'GPU' of
    two partitions."""
    ids = device_ids()[:power_of_two_at_most(min(len(jax.devices()), MAX_DEVICES))]
    return [ids[i:i + 2] for i in range(0, len(ids), 2)]


@functools.cache
def mesh_named(name: str):
    """'whole': the machine's own grouping (on NVIDIA every device a GPU), at most MAX_DEVICES devices;
    'pairs': devices grouped in pairs."""
    if name == "pairs":
        needs_devices(2)
        return build_mesh(grouping=pairs_grouping())
    topology = resolve_topology()
    gpus = min(topology.gpus_per_node, max(1, MAX_DEVICES // topology.partitions_per_gpu))
    return build_mesh(topology, gpus=power_of_two_at_most(gpus))


def grouped_if_possible():
    """The 'pairs' mesh where there are two devices or more, else the machine's own."""
    return mesh_named("pairs" if len(jax.devices()) >= 2 else "whole")


def tokens_BS() -> np.ndarray:
    """A fixed batch with structure to learn: each row counts up by a row-specific stride."""
    rows = np.arange(BATCH)[:, None]
    return ((rows * 31 + np.arange(SEQ)[None, :] * (rows + 1)) % CONFIG.vocab_size).astype(np.int32)


# --- the mesh builder on real devices ---

def test_each_cuda_device_is_one_gpu():
    needs_cuda()
    topology, mesh = build_topology_mesh()
    kind = jax.devices()[0].device_kind.lower()
    assert "h200" in kind and topology.preset.name == "h200", kind
    assert topology.partitions_per_gpu == 1
    assert dict(mesh.shape) == {"data": 1, "gpu": len(jax.devices()), "xcd": 1}
    assert device_table(mesh) == [[[i] for i in device_ids()]]


def test_partitions_on_cuda_need_an_explicit_grouping():
    needs_cuda()
    needs_devices(2)
    with pytest.raises(TopologyError, match="pass grouping="):
        build_mesh("1x2")


def test_two_devices_grouped_as_one_gpu_of_two_partitions():
    needs_devices(2)
    first, second = device_ids()[:2]
    mesh = build_mesh(grouping=[[second, first]])
    assert dict(mesh.shape) == {"data": 1, "gpu": 1, "xcd": 2}
    assert device_table(mesh) == [[[second, first]]]


def test_four_devices_grouped_as_two_gpus_of_two_partitions():
    needs_devices(4)
    ids = device_ids()
    mesh = build_mesh(grouping=[ids[0:2], ids[2:4]])
    assert dict(mesh.shape) == {"data": 1, "gpu": 2, "xcd": 2}
    assert device_table(mesh) == [[ids[0:2], ids[2:4]]]
    assert dict(build_mesh(grouping=[ids[0:2], ids[2:4]], data=2).shape) == {"data": 2, "gpu": 1, "xcd": 2}


def test_grouping_with_an_unknown_device_is_an_error():
    with pytest.raises(TopologyError, match="device ids \\[9999\\] that JAX does not have"):
        build_mesh(grouping=[[device_ids()[0], 9999]])


# --- every layout computes what the unsharded model computes ---

def forward_and_gradients(graphdef, state, tokens):
    """(logits [B, S-1, V], loss, gradients of every parameter)."""
    def loss_of(state):
        return next_token_loss(nnx.merge(graphdef, state), tokens)

    logits = nnx.merge(graphdef, state)(tokens[:, :-1]).logits
    loss, grads = jax.value_and_grad(loss_of)(state)
    return logits, loss, grads


def sharded_and_plain_state(layout: str, mesh):
    """(graphdef, state created sharded by the layout, the same values as plain single-device arrays)."""
    graphdef, state = nnx.split(create_sharded_model(CONFIG, layout, mesh))
    return graphdef, state, jax.tree.map(jnp.asarray, jax.device_get(state))


def relative_l2(value, reference) -> float:
    value, reference = np.asarray(value, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(value - reference) / np.linalg.norm(reference))


@pytest.mark.parametrize("mesh_name", ["whole", "pairs"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_the_unsharded_model(layout, mesh_name):
    mesh = mesh_named(mesh_name)
    graphdef, state, plain_state = sharded_and_plain_state(layout, mesh)
    step = jax.jit(forward_and_gradients, static_argnums=0)
    with use_layout(layout, mesh):
        tokens = jax.device_put(tokens_BS(), batch_sharding(layout, mesh, BATCH))
        logits, loss, grads = step(graphdef, state, tokens)
    ref_logits, ref_loss, ref_grads = step(graphdef, plain_state, jnp.asarray(tokens_BS()))

    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=LOGITS_ATOL, rtol=0)
    for (path, grad), ref_grad in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        error = relative_l2(grad, ref_grad)
        assert error < GRAD_REL_L2, (f"{layout} on {dict(mesh.shape)}: gradient {jax.tree_util.keystr(path)} "
                                     f"differs by {error:.2e} (relative L2)")


def prefill_then_decode(graphdef, state, prompt_BS, next_B1):
    """Logits of the last prompt position and of one decoded token, through the KV cache."""
    model = nnx.merge(graphdef, state)
    cache = init_cache(CONFIG, prompt_BS.shape[0], prompt_BS.shape[1] + 1)
    prefill_logits, cache, _ = model(prompt_BS, cache=cache, cache_index=0)
    decode_logits = model(next_B1, cache=cache, cache_index=prompt_BS.shape[1]).logits
    return prefill_logits[:, -1], decode_logits[:, -1]


@pytest.mark.parametrize("layout", ["flat_tp", "starscream_tp", "starscream_decode"])
def test_cached_decoding_matches_the_unsharded_model(layout):
    mesh = grouped_if_possible()
    graphdef, state, plain_state = sharded_and_plain_state(layout, mesh)
    prompt, following = tokens_BS()[:, :16], tokens_BS()[:, 16:17]
    run = jax.jit(prefill_then_decode, static_argnums=0)
    with use_layout(layout, mesh):
        sharding = batch_sharding(layout, mesh, BATCH)
        got = run(graphdef, state, jax.device_put(prompt, sharding), jax.device_put(following, sharding))
    expected = run(graphdef, plain_state, jnp.asarray(prompt), jnp.asarray(following))
    for value, reference in zip(got, expected):
        np.testing.assert_allclose(np.asarray(value), np.asarray(reference), atol=LOGITS_ATOL, rtol=0)


# --- training ---

TRAIN = TrainConfig(learning_rate=1e-2, warmup_steps=1, steps=8, weight_decay=0.0)
TRAJECTORY_RTOL = 1e-3      # eight Adam steps amplify float32 rounding differences of the gradients


def train_losses(layout: str, mesh, sharded: bool = True) -> list[float]:
    """Losses of TRAIN.steps AdamW steps (the `starscream train` step) on the fixed batch, from the layout's initial
    state; with sharded=False the same values train as plain single-device arrays, no layout active."""
    with use_layout(layout, mesh):
        graphdef, params, rest, optimizer, opt_state = initial_state(TRAIN, CONFIG, layout, mesh)
        tokens = jax.device_put(tokens_BS(), batch_sharding(layout, mesh, BATCH))
    if not sharded:
        params, rest, opt_state, tokens = jax.tree.map(jnp.asarray, jax.device_get((params, rest, opt_state, tokens)))
    with use_layout(layout, mesh) if sharded else contextlib.nullcontext():
        train_step = make_train_step(graphdef, optimizer, under=Placement.of(layout, mesh) if sharded else None)
        losses = []
        for _ in range(TRAIN.steps):
            params, opt_state, loss = train_step(params, opt_state, rest, tokens)
            losses.append(loss)
    return [float(loss) for loss in jax.device_get(losses)]


@pytest.mark.parametrize("layout", ["flat_tp", "starscream_tp"])
def test_adamw_steps_lower_the_loss_as_unsharded_training_does(layout):
    mesh = grouped_if_possible()
    losses = train_losses(layout, mesh)
    assert losses[-1] < losses[0] - 1.0, losses
    np.testing.assert_allclose(losses, train_losses(layout, mesh, sharded=False), rtol=TRAJECTORY_RTOL)


# --- what XLA emits for the training step on a grouped mesh ---

@functools.cache
def train_step_report(layout: str):
    """The inspector's report of the compiled training step on the 'pairs' mesh."""
    mesh = mesh_named("pairs")
    with use_layout(layout, mesh):
        graphdef, params, rest, optimizer, opt_state = initial_state(TRAIN, CONFIG, layout, mesh)
        train_step = make_train_step(graphdef, optimizer, under=Placement.of(layout, mesh))
        tokens = jax.device_put(tokens_BS(), batch_sharding(layout, mesh, BATCH))
        args = (params, opt_state, rest, tokens)
        return inspect_compiled(train_step.lower(*args).compile(), mesh, args=args)


def collective_table(report) -> str:
    return "\n".join(f"{c.kind} {c.scope} {c.groups} x{c.count} {c.op_name[-90:]}" for c in report.collectives)


SMALL_BYTES = 256           # inputs judged for replication: anything larger (the token batch is 1 KiB)


def norm_scales(name: str) -> bool:
    return "norm" in name


def tokens_per_device(layout: str, mesh) -> int:
    """Tokens each device's matmuls see: the batch's local rows x the SEQ - 1 positions the model reads."""
    entry = batch_sharding(layout, mesh, BATCH).spec[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return BATCH // math.prod(mesh.shape[axis] for axis in axes) * (SEQ - 1)


def weight_side_per_op(layout: str) -> dict[tuple[str, bool], int]:
    """Weight-side elements of the layout's matmuls, summed per source op and direction (`analysis.report.matmul_key`).

    Every matmul of the step is tokens x weight (forward, input gradient and weight gradient alike), so its weight
    side holds FLOPs / 2 / tokens-per-device elements however XLA arranged it. On GPU XLA merges the q/k/v and the
    gate/up matmuls (not always the same ones in two programs), writes some weight-first (tokens in N, not M) and
    splits token contractions (split-K): the per-matmul, per-dimension reading of `check_principles` then mistakes
    the token count for a weight dimension. Summed per op, the volume does not depend on operand order, merging order
    or splitting.
    """
    mesh = mesh_named("pairs")
    tokens = tokens_per_device(layout, mesh)
    volumes = defaultdict(int)
    for matmul in train_step_report(layout).matmuls:
        volumes[matmul_key(matmul.op_name)] += matmul.flops // 2 // tokens
    return dict(volumes)


def shrunk_ops(layout: str) -> list[str]:
    """Ops whose matmuls have a smaller weight side under the layout than under gpu_tp, or have no gpu_tp twin."""
    volumes, reference = weight_side_per_op(layout), weight_side_per_op("gpu_tp")
    return [f"{key}: weight side {volumes.get(key)} elements, gpu_tp {reference.get(key)}"
            for key in sorted(volumes.keys() | reference.keys())
            if key not in reference or volumes.get(key, 0) < reference[key]]


def test_starscream_tp_step_keeps_the_three_principles_on_the_gpus():
    needs_devices(2)
    report, reference = train_step_report("starscream_tp"), train_step_report("gpu_tp")
    verdicts = check_principles(report, reference, replicated_ok=norm_scales, large_bytes=SMALL_BYTES)
    for principle in ("no_redundancy", "hierarchical_collectives"):
        verdict = getattr(verdicts, principle)
        assert verdict.ok, f"{principle}:\n" + "\n".join(verdict.violations)
    assert shrunk_ops("starscream_tp") == []


def test_weight_gradients_are_reduce_scattered_over_xcd():
    """The first stage of the hierarchical weight-gradient reduction: XLA:GPU emits a real reduce-scatter inside each
    GPU (on CPU the same reduction prints as all-reduce + dynamic-slice)."""
    needs_devices(2)
    report = train_step_report("starscream_tp")
    gradient_reductions = [c for c in report.collectives if "transpose(" in c.op_name]
    scattered = [c for c in gradient_reductions if c.kind == "reduce-scatter"]
    assert scattered, collective_table(report)
    assert {c.scope for c in scattered} == {"intra_gpu"}, collective_table(report)
    assert all(c.group_size == mesh_named("pairs").shape["xcd"] for c in scattered)


def test_flat_tp_step_visibly_breaks_the_principles():
    needs_devices(2)
    mesh = mesh_named("pairs")
    verdicts = check_principles(train_step_report("flat_tp"), train_step_report("gpu_tp"),
                                replicated_ok=norm_scales, large_bytes=SMALL_BYTES)
    assert shrunk_ops("flat_tp")
    assert not verdicts.no_redundancy.ok
    assert verdicts.hierarchical_collectives.ok == (mesh.shape["gpu"] == 1), verdicts
