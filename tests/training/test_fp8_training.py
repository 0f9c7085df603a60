"""fp8 training: e4m3 operands and e5m2 gradients with current per-tensor scales track the compute dtype's loss, and
under starscream_tp the step gathers its weights in 8 bits with every collective hierarchical."""
import argparse
import contextlib
import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.analysis.principles import check_principles
from starscream_jax.analysis.report import inspect_compiled
from starscream_jax.cli import inspect as inspect_command
from starscream_jax.cli.arguments import check_fp8_training
from starscream_jax.cli.train import add_arguments, config_from_args
from starscream_jax.errors import CheckpointError, PresetError, StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.hardware.presets import load_chip
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, create_sharded_model, next_token_loss
from starscream_jax.model.quantize import fp8_einsum, fp8_weight, largest
from starscream_jax.sharding.apply import UNPLACED, Placement, batch_sharding, use_layout
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.loop import check_resumable, resume_changes
from starscream_jax.training.steps import make_optimizer, train_step

CORPUS = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt"
CONFIG = load_model_config("tiny").replace(n_layers=1, dtype="bfloat16")
STEPS = 32
"""Enough steps for the loss to fall from ln 256 = 5.5 to below 3 (the formats' rounding has shaped the weights);
the steps cost little beside the two compiles (bfloat16 unsharded, fp8 under starscream_tp)."""
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _batches(steps: int, rows: int = 8, length: int = 32) -> list[jax.Array]:
    data = np.frombuffer(CORPUS.read_bytes()[:200_000], np.uint8)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(data) - length - 1, (steps, rows))
    return [jnp.asarray(np.stack([data[s:s + length + 1] for s in row]).astype(np.int32)) for row in starts]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    losses: list[float]
    params: object
    lowered: object
    compiled: object
    mesh: object


def _train(config, batches, layout: str | None = None, mesh=None) -> Run:
    """The real train step of `config` over `batches`, unsharded or under `layout` on `mesh`, compiled once."""
    with contextlib.nullcontext() if layout is None else use_layout(layout, mesh):
        model = Transformer(config, rngs=nnx.Rngs(0)) if layout is None else create_sharded_model(config, layout, mesh)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        optimizer = make_optimizer(TrainConfig(steps=len(batches), warmup_steps=4), params)
        opt_state = jax.jit(optimizer.init)(params)
        place = (lambda tokens: tokens) if layout is None else functools.partial(
            jax.device_put, device=batch_sharding(layout, mesh, batches[0].shape[0]))
        under = None if layout is None else Placement.of(layout, mesh)
        lowered = train_step(graphdef, optimizer, under=under).lower(params, opt_state, rest, place(batches[0]))
    step, losses = lowered.compile(FAST_COMPILE), []
    for tokens in batches:
        params, opt_state, loss = step(params, opt_state, rest, place(tokens))
        losses.append(float(loss))
    return Run(losses=losses, params=params, lowered=lowered, compiled=step, mesh=mesh)


@pytest.fixture(scope="module")
def fp8_run() -> Run:
    """The fp8 step (FNUZ, as on MI300X) under starscream_tp on 2 GPUs x 4 partitions, trained STEPS steps."""
    return _train(CONFIG.replace(matmul_format="float8_e4m3fnuz"), _batches(STEPS), "starscream_tp", build_mesh("2x4"))


def test_fp8_training_reaches_the_bfloat16_loss_within_one_percent(fp8_run):
    """The same steps, seed and batches unsharded in bfloat16 and with fp8 matmuls under starscream_tp: the final
    losses agree within 1% but are not equal (the 8-bit rounding is applied), every loss and parameter is finite
    and the master weights stay float32."""
    plain = _train(CONFIG, _batches(STEPS)).losses
    fp8 = fp8_run.losses
    assert plain[-1] < plain[0] - 2  # it learned
    assert abs(fp8[-1] - plain[-1]) <= 0.01 * plain[-1]
    assert fp8[-1] != plain[-1]
    assert np.all(np.isfinite(fp8))
    for leaf in jax.tree.leaves(fp8_run.params):
        assert leaf.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(leaf)))


def _rounded(value: jax.Array, format_name: str) -> jax.Array:
    """value on `format_name`'s grid with its current per-tensor scale, in float32."""
    scale = jnp.max(jnp.abs(value)) / largest(format_name)
    return (value / scale).astype(format_name).astype(jnp.float32) * scale


def test_an_fp8_einsum_reads_8_bit_operands_forward_and_backward():
    """Forward: x in e4m3 (its current scale) times the weight's e4m3 values; backward: the gradient in e5m2 times
    each forward operand, as the exact products of those rounded operands; the lowered program's three dots take
    the 8-bit values themselves (a dot of dequantized operands would not run as an fp8 GEMM)."""
    x = jax.random.normal(jax.random.key(0), (16, 64)) * 3
    w = jax.random.normal(jax.random.key(1), (64, 32))
    g = jax.random.normal(jax.random.key(2), (16, 32)) * 1e-3

    def project(x, w):
        weight = fp8_weight(UNPLACED, w, ("embed", "mlp"), "float8_e4m3fn", "float32", "w")
        return fp8_einsum(UNPLACED, "bd,dn->bn", x, weight, ("batch", "mlp"), "w")

    y, pullback = jax.vjp(project, x, w)
    x8, w8, g8 = _rounded(x, "float8_e4m3fn"), _rounded(w, "float8_e4m3fn"), _rounded(g, "float8_e5m2")
    assert float(jnp.max(jnp.abs(x8 - x))) > 0 and float(jnp.max(jnp.abs(g8 - g))) > 0
    dx, dw = pullback(g)
    np.testing.assert_allclose(y, x8 @ w8, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, g8 @ w8.T, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dw, x8.T @ g8, rtol=1e-5, atol=1e-7)
    def forward_and_backward(x, w, g):
        y, pullback = jax.vjp(project, x, w)
        return y, pullback(g)

    lowered = jax.jit(forward_and_backward).lower(x, w, g).as_text()
    dots = re.findall(r"stablehlo.dot_general %\S+, %\S+, .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", lowered)
    assert len(dots) == 3 and all("f8E" in lhs and "f8E" in rhs for lhs, rhs in dots), dots


@pytest.mark.parametrize("layout, mesh", [("starscream_tp", "2x2x2"), ("starscream_fsdp", "2x4"),
                                          ("starscream_tp", "1x1"), ("flat_tp", "2x4")])
def test_sharded_fp8_gradients_equal_the_unsharded_ones(layout, mesh):
    """The fp8 matmuls' hand-written backward placed by the layout: the gradient of every parameter equals the
    unsharded fp8 model's (one scale per tensor, so every device rounds alike), with the tokens split over GPUs and
    their partitions (the weight gradients' two-stage sum) or the weights split where stored; flat_tp, which copies
    the 4 kv heads over 8 devices and so runs q, k and v as three GEMMs, gives the fused q|k|v GEMM's numbers (one
    scale for the three weights and one for their gradients)."""
    config = CONFIG.replace(dtype="float32", matmul_format="float8_e4m3fn")
    tokens = _batches(1)[0]
    expected = _gradients(Transformer(config, rngs=nnx.Rngs(0)), tokens)
    mesh = build_mesh(mesh)
    with use_layout(layout, mesh):
        got = _gradients(create_sharded_model(config, layout, mesh),
                         jax.device_put(tokens, batch_sharding(layout, mesh, tokens.shape[0])))
    for (path, want), have in zip(jax.tree.leaves_with_path(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=2e-3, atol=1e-6, err_msg=str(path))


def test_fp8_numbers_do_not_depend_on_joining_the_projections():
    """q, k, v and gate, up as separate fp8 GEMMs (fuse_projections off) give the joined GEMMs' loss and gradients:
    the weights sharing an input share one scale, and so do their gradients (`quantize.fp8_einsums`)."""
    config = CONFIG.replace(dtype="float32", matmul_format="float8_e4m3fn")
    tokens = _batches(1)[0]
    joined = _gradients(Transformer(config, rngs=nnx.Rngs(0)), tokens)
    apart = _gradients(Transformer(config.replace(fuse_projections=False), rngs=nnx.Rngs(0)), tokens)
    for (path, want), have in zip(jax.tree.leaves_with_path(joined), jax.tree.leaves(apart)):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-3, atol=1e-7, err_msg=str(path))


@pytest.mark.parametrize("tied", [True, False])
def test_fp8_logits_run_the_vocabulary_projection_on_8_bit_operands(tied):
    """With fp8_logits the vocabulary projection is three more fp8 dots (forward, input and weight gradients), and
    its loss is rounded apart from the compute dtype's head's."""
    config = CONFIG.replace(dtype="float32", matmul_format="float8_e4m3fn", tie_embeddings=tied)
    tokens = _batches(1)[0]

    def fp8_dots_and_loss(config) -> tuple[int, float]:
        graphdef, params, rest = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
        loss = lambda params: next_token_loss(nnx.merge(graphdef, params, rest), tokens)  # noqa: E731
        lowered = jax.jit(jax.value_and_grad(loss)).lower(params)
        dots = re.findall(r"stablehlo.dot_general %\S+, %\S+, .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)",
                          lowered.as_text())
        return sum("f8E" in lhs and "f8E" in rhs for lhs, rhs in dots), float(lowered.compile()(params)[0])

    (plain_dots, plain_loss), (dots, loss) = (fp8_dots_and_loss(config.replace(fp8_logits=on)) for on in (False, True))
    assert dots == plain_dots + 3
    assert loss != plain_loss and abs(loss - plain_loss) < 0.01


def test_fp8_logits_of_a_tied_table_give_the_unsharded_gradients_under_starscream_tp():
    """The tied table quantized for the vocabulary projection apart from the lookup's copy: under starscream_tp on 2
    GPUs x 2 partitions x 2 data groups every gradient, the table's two summed, equals the unsharded model's."""
    config = CONFIG.replace(dtype="float32", matmul_format="float8_e4m3fn", tie_embeddings=True, fp8_logits=True)
    tokens = _batches(1)[0]
    expected = _gradients(Transformer(config, rngs=nnx.Rngs(0)), tokens)
    mesh = build_mesh("2x2x2")
    with use_layout("starscream_tp", mesh):
        got = _gradients(create_sharded_model(config, "starscream_tp", mesh),
                         jax.device_put(tokens, batch_sharding("starscream_tp", mesh, tokens.shape[0])))
    for (path, want), have in zip(jax.tree.leaves_with_path(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=2e-3, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("layout, mesh, moved", [(None, None, 4), ("starscream_tp", "2x2x2", 4),
                                                 ("starscream_fsdp", "2x4", 0)])
def test_the_forward_gemm_reads_weights_the_byte_transpose_moved_where_the_policy_asks(monkeypatch, layout, mesh,
                                                                                       moved):
    """Where the backend moves fp8 weights by the byte transpose kernel (CUDA; here interpreted), each forward GEMM
    reads its weight with the contracted dimensions last, moved on each device's shard (q/k/v, o, gate/up and down
    of the one layer; FSDP's weights at use are typed reduced over the token axes and keep XLA's transpose), and
    every gradient equals the one of XLA's own transposes."""
    from starscream_jax.model import quantize

    config = CONFIG.replace(dtype="float32", matmul_format="float8_e4m3fn")
    tokens = _batches(1)[0]

    def gradients():
        """(every parameter's gradient, the kernels the gradient's program calls)."""
        placed_mesh = None if layout is None else build_mesh(mesh)
        with contextlib.nullcontext() if layout is None else use_layout(layout, placed_mesh):
            if layout is None:
                model, placed = Transformer(config, rngs=nnx.Rngs(0)), tokens
            else:
                model = create_sharded_model(config, layout, placed_mesh)
                placed = jax.device_put(tokens, batch_sharding(layout, placed_mesh, tokens.shape[0]))
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            loss = lambda params, rest, tokens: next_token_loss(nnx.merge(graphdef, params, rest), tokens)  # noqa: E731
            text = str(jax.make_jaxpr(jax.grad(loss))(params, rest, placed))
            return _gradients(model, placed), text.count("byte_transpose")

    expected, kernels = gradients()
    assert kernels == 0
    monkeypatch.setattr(quantize, "_byte_transpose_kind", lambda placement: "interpret")
    got, kernels = gradients()
    assert kernels == moved
    for (path, want), have in zip(jax.tree.leaves_with_path(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-6, atol=1e-9, err_msg=str(path))


def _gradients(model, tokens):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda params, rest, tokens: next_token_loss(nnx.merge(graphdef, params, rest), tokens)  # noqa: E731
    return jax.jit(jax.grad(loss))(params, rest, tokens)


def test_the_fp8_step_under_starscream_tp_gathers_8_bit_weights_hierarchically(fp8_run):
    """The fp8 step's weights are gathered inside the GPU in 8 bits (the lowered program's reshards of e4m3fnuz
    values that drop xcd), the compiled program converts to both 8-bit formats, and every collective, the weights'
    scale maxima included, stays inside a GPU or across GPUs."""
    assert len(_gathered_inside_gpu(fp8_run.lowered.as_text(), "f8E4M3FNUZ")) >= 4  # qkv, o, gate_up, down
    text = fp8_run.compiled.as_text()
    assert re.search(r"f8e4m3fnuz\[[\d,]+\]\S* convert", text) and re.search(r"f8e5m2fnuz\[[\d,]+\]\S* convert", text)
    verdict = check_principles(inspect_compiled(fp8_run.compiled, fp8_run.mesh), None).hierarchical_collectives
    assert verdict.ok, verdict.violations


def _gathered_inside_gpu(lowered_text: str, dtype: str) -> list[str]:
    """The reshards of the lowered program that gather a `dtype` tensor over xcd (its operand placed with xcd, the
    result without), as "shape: from -> to"."""
    constraints = re.findall(r"(%\S+) = sdy.sharding_constraint (%\S+) <@mesh, \[(.*?)\]> : tensor<(.*?)>",
                             lowered_text)
    placed = {result: spec for result, _, spec, _ in constraints}
    return [f"{shape}: {placed[operand]} -> {spec}" for result, operand, spec, shape in constraints
            if shape.endswith(dtype) and '"xcd"' in placed.get(operand, "") and '"xcd"' not in spec]


@pytest.mark.parametrize("changes, message", [
    ({"matmul_format": "float8_e5m2"}, "matmul_format 'float8_e5m2'; use '' (the compute dtype) or one of"),
    ({"matmul_format": "float8_e4m3fn", "weight_format": "int8"}, "train from float weights"),
    ({"fp8_logits": True}, "fp8_logits without matmul_format: the vocabulary projection takes fp8 training's formats"),
    ({"matmul_format": "float8_e4m3fn", "fp8_logits": 1}, "fp8_logits 1; use true or false"),
])
def test_a_matmul_format_the_model_cannot_train_in_is_refused(changes, message):
    with pytest.raises(PresetError, match=re.escape(message)):
        CONFIG.replace(**changes)


def _train_config(*argv: str, chip=None) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), chip)


@pytest.mark.parametrize("chip, e4m3", [("h200", "float8_e4m3fn"), ("mi355x", "float8_e4m3fn"),
                                        ("mi300x", "float8_e4m3fnuz")])
def test_fp8_trains_in_each_chips_own_formats(chip, e4m3):
    config = _train_config("--fp8", chip=load_chip(chip))
    assert config.matmul_format == e4m3 and config.model_config().matmul_format == e4m3
    assert _train_config(chip=load_chip(chip)).model_config().matmul_format == ""


def test_fp8_logits_come_with_fp8_training_only():
    config = _train_config("--fp8", "--fp8-logits", chip=load_chip("h200"))
    assert config.model_config().fp8_logits and not _train_config("--fp8").model_config().fp8_logits
    with pytest.raises(StarscreamError, match=r"^--fp8-logits computes the vocabulary projection in fp8 training's "
                                              r"formats; pass it with --fp8$"):
        _train_config("--fp8-logits")


def test_a_chip_without_the_format_is_refused_in_one_line():
    int8_only = dataclasses.replace(load_chip("h200"), formats=("int8",))
    with pytest.raises(PresetError, match=r"^--fp8: NVIDIA H200 SXM \(h200\) has no fp8 formats \(its 8-bit formats: "
                                          r"int8\); train without --fp8$"):
        _train_config("--fp8", chip=int8_only)
    with pytest.raises(PresetError, match="MI300X .* does not compute in float8_e4m3fn; its 8-bit formats: int8"):
        check_fp8_training("float8_e4m3fn", load_chip("mi300x"))
    with pytest.raises(StarscreamError, match="matmul_format 'float8_e5m2': use '' "):
        TrainConfig(matmul_format="float8_e5m2")


def test_a_resume_switches_fp8_only_when_allowed():
    """The checkpoint's weights are the same float32 ones with or without fp8 (`check_resumable` lets it pass), but
    the run's numbers change, so a resume needs --allow-change matmul_format."""
    plain, fp8 = TrainConfig(), TrainConfig(matmul_format="float8_e4m3fn")
    saved = {"model_config": dataclasses.asdict(plain.model_config()), "train_config": dataclasses.asdict(plain)}
    check_resumable(saved, fp8.model_config())
    with pytest.raises(CheckpointError, match=r"--fp8 float8_e4m3fn \(the run has none\)"):
        resume_changes(saved, fp8, 10)
    assert resume_changes(saved, fp8, 10, ["matmul_format"])[-1]["to"] == "float8_e4m3fn"
    older = {**saved, "train_config": {name: value for name, value in saved["train_config"].items()
                                       if name != "fp8_logits"}}  # saved before the field existed: its default
    assert resume_changes(older, plain, 10) == []
    with pytest.raises(CheckpointError, match=r"--fp8-logits True \(the run has False\)"):
        resume_changes(saved, dataclasses.replace(fp8, fp8_logits=True), 10, ["matmul_format"])


def test_inspect_compiles_the_fp8_training_step_in_the_chips_format_and_refuses_fp8_for_inference():
    parser = argparse.ArgumentParser()
    inspect_command.add_arguments(parser)
    settings = inspect_command.settings_from_args(parser.parse_args(["--fp8"]), load_chip("mi300x"))
    assert settings.config.matmul_format == "float8_e4m3fnuz"
    with pytest.raises(StarscreamError, match="--fp8 is fp8 training; inspect it with --phase train"):
        inspect_command.settings_from_args(parser.parse_args(["--fp8", "--phase", "decode"]), load_chip("h200"))
