"""The layouts: their tables, golden files of every parameter's spec for Llama 3 70B on an 8 x 8 mesh, and the
principles read from compiled train and decode steps.

Golden files: tests/sharding/golden/<model>_8x8_<layout>.json hold, for every parameter of models/llama3-70b.toml,
models/qwen2.5-72b.toml (q, k, v biases) and models/qwen3-32b.toml (q and k norms), its shape, logical axes and
PartitionSpec on a (data, gpu, xcd) = (1, 8, 8) mesh, computed from abstract shapes only
(`nnx.eval_shape` and `param_specs` on an AbstractMesh: nothing is allocated). After an intended change to a layout or
to the model, regenerate them from the repository root and review the diff:

    python -m tests.sharding.test_layouts --regenerate

Principles: train steps (value_and_grad of next_token_loss) and decode steps (one token through the model with a KV
cache) of Llama 3 70B cut to 2 layers are lowered from ShapeDtypeStructs and compiled, never run, and read by
`starscream_jax.analysis.report.inspect_compiled`. At these sizes every weight matrix is 32 MiB or more, the KV cache 4
MiB and the norm scales 64 KiB, so the report's 1 MiB threshold for "large" separates exactly what principle 2 is about.
"""
import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.analysis.principles import check_principles
from starscream_jax.analysis.report import inspect_compiled
from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.axes import AXES
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, next_token_loss
from starscream_jax.model.dense_cache import init_cache
from starscream_jax.sharding.apply import (
    LOGICAL_AXES,
    activation_spec,
    batch_sharding,
    param_shardings,
    param_specs,
    use_layout,
)
from starscream_jax.sharding.layouts import ACTIVATION_NAMES, LAYOUTS, WEIGHT_NAMES, fit_batch, get_layout

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_MODEL = "llama3-70b"
GOLDEN_MODELS = (GOLDEN_MODEL, "qwen2.5-72b", "qwen3-32b")
GOLDEN_MESH = (1, 8, 8)


def golden_path(layout: str, model: str = GOLDEN_MODEL) -> Path:
    return GOLDEN_DIR / f"{model}_{GOLDEN_MESH[1]}x{GOLDEN_MESH[2]}_{layout}.json"


def spec_as_json(spec: P) -> list:
    return [list(entry) if isinstance(entry, tuple) else entry for entry in spec]


def golden_specs(layout: str, model: str = GOLDEN_MODEL) -> dict:
    """{"model", "mesh", "layout", "params": {path: {"shape", "logical_axes", "spec"}}}, from abstract shapes."""
    config = load_model_config(model)
    state = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    mesh = AbstractMesh(GOLDEN_MESH, AXES)
    specs = param_specs(state, layout, mesh)
    params = {}
    for (path, variable), spec in zip(nnx.to_flat_state(state), jax.tree.leaves(specs, is_leaf=_is_spec)):
        params["/".join(map(str, path))] = {"shape": list(variable.shape),
                                            "logical_axes": list(variable.get_metadata(LOGICAL_AXES)),
                                            "spec": spec_as_json(spec)}
    return {"model": model, "mesh": dict(zip(AXES, GOLDEN_MESH)), "layout": layout, "params": params}


def _is_spec(node) -> bool:
    return isinstance(node, P)


def golden_text(golden: dict) -> str:
    """JSON with one line per parameter."""
    lines = [f"  {json.dumps(key)}: {json.dumps(golden[key])}," for key in ("model", "mesh", "layout")]
    entries = [f"    {json.dumps(path)}: {json.dumps(entry)}" for path, entry in golden["params"].items()]
    return "{\n" + "\n".join(lines) + '\n  "params": {\n' + ",\n".join(entries) + "\n  }\n}\n"


def regenerate() -> list[Path]:
    GOLDEN_DIR.mkdir(exist_ok=True)
    paths = []
    for model in GOLDEN_MODELS:
        for layout in LAYOUTS:
            paths.append(golden_path(layout, model))
            paths[-1].write_text(golden_text(golden_specs(layout, model)))
    return paths


@pytest.mark.parametrize("model", GOLDEN_MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_parameter_spec_matches_its_golden_file(layout, model):
    stored = json.loads(golden_path(layout, model).read_text())
    current = golden_specs(layout, model)
    assert stored["params"].keys() == current["params"].keys()
    changed = {path: (stored["params"][path], entry) for path, entry in current["params"].items()
               if stored["params"][path] != entry}
    assert not changed, f"specs differ from {golden_path(layout, model).name} (stored, now): {changed}; " \
                        f"run `python -m tests.sharding.test_layouts --regenerate` and review the diff"
    assert stored == current


def test_golden_files_hold_what_each_layout_promises():
    """A few entries read by eye, so the golden files are known to be right and not only unchanged."""
    specs = {layout: json.loads(golden_path(layout).read_text())["params"] for layout in LAYOUTS}
    assert specs["flat_tp"]["layers/wq"]["spec"] == [None, None, ["gpu", "xcd"], None]
    assert specs["flat_tp"]["layers/wk"]["spec"] == [None, None, "gpu", None]  # 8 kv heads: copied over xcd
    assert specs["gpu_tp"]["layers/w_gate"]["spec"] == [None, None, "gpu"]
    assert specs["starscream_tp"]["layers/w_gate"]["spec"] == [None, "xcd", "gpu"]
    assert specs["starscream_tp"]["layers/wk"]["spec"] == [None, "xcd", "gpu", None]
    assert specs["starscream_decode"] == specs["starscream_tp"] == specs["starscream_cp"]
    assert specs["flat_cp"] == specs["flat_fsdp"]
    assert specs["starscream_ep"] == specs["starscream_tp"] and specs["flat_ep"] == specs["flat_tp"]  # no experts
    assert specs["flat_fsdp"]["embedding"]["spec"] == [None, ["gpu", "xcd"]]
    assert specs["starscream_fsdp"]["lm_head"]["spec"] == ["xcd", None]
    assert specs["starscream_tp"]["layers/attn_norm"] == {"shape": [80, 8192], "logical_axes": ["layers", "norm"],
                                                          "spec": [None, None]}
    biases = json.loads(golden_path("starscream_tp", "qwen2.5-72b").read_text())["params"]
    assert biases["layers/bq"]["spec"] == [None, "gpu", None]  # heads over GPUs, like the q projection's
    assert json.loads(golden_path("flat_tp", "qwen2.5-72b").read_text())["params"]["layers/bk"]["spec"] == \
        [None, "gpu", None]  # 8 kv heads: copied over xcd, like wk
    norms = json.loads(golden_path("starscream_tp", "qwen3-32b").read_text())["params"]
    assert norms["layers/q_norm"] == {"shape": [64, 128], "logical_axes": ["layers", "norm"], "spec": [None, None]}


def test_every_layout_has_a_rule_for_every_name():
    for layout in LAYOUTS.values():
        assert layout.params.names() == layout.weights.names() == list(WEIGHT_NAMES)
        assert layout.activations.names() == list(ACTIVATION_NAMES)
        assert layout.activations.lookup("batch")[1][0] == "data"


def test_only_the_context_parallel_layouts_split_the_sequence():
    assert {name for name, layout in LAYOUTS.items() if layout.splits_sequence} == {"flat_cp", "starscream_cp"}
    assert get_layout("starscream_cp").activations.lookup("seq") == (True, ("xcd",))


def test_unknown_layout_lists_the_known_ones():
    with pytest.raises(ShardingRuleError, match="unknown layout 'tp'; choose one of flat_tp, gpu_tp, starscream_tp"):
        get_layout("tp")


def test_with_rules_changes_only_the_named_rules():
    layout = get_layout("starscream_tp").with_rules(activations={"batch": "data"})
    assert layout.activations.lookup("batch") == (True, ("data",))
    assert layout.activations.lookup("heads") == (True, ("gpu",))
    assert layout.params == get_layout("starscream_tp").params


@pytest.mark.parametrize("changes, message", [
    ({"activations": {"bacth": "data"}}, r"activations rules of layout starscream_tp have no logical name\(s\) \['bacth'\]"),
    ({"param": {"embed": "xcd"}}, r"layout starscream_tp has no rule table 'param'; change one of params, weights"),
])
def test_with_rules_refuses_a_name_or_table_the_layout_lacks(changes, message):
    """A typo would otherwise leave the layout unchanged without a word."""
    with pytest.raises(ShardingRuleError, match=message):
        get_layout("starscream_tp").with_rules(**changes)


# Principles, on compiled programs.

STRUCTURE_MESHES = {"1x2x4": "2x4", "1x8x8": "8x8"}
BATCH, SEQ, CACHE_LEN = 8, 64, 128


@functools.cache
def structure_config():
    return load_model_config(GOLDEN_MODEL, n_layers=2)


def abstract_params(config, layout: str, mesh):
    """(graphdef, parameter state of ShapeDtypeStructs carrying the layout's shardings)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    shardings = jax.tree.leaves(param_shardings(state, layout, mesh))
    leaves, treedef = jax.tree.flatten(state)
    return graphdef, jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
                                                  for leaf, sharding in zip(leaves, shardings)])


@functools.cache
def structure_report(layout: str, mesh_name: str, program: str):
    """The inspector's report of the compiled train or decode step of `layout` on `mesh_name`."""
    config = structure_config()
    mesh = build_mesh(STRUCTURE_MESHES[mesh_name])
    graphdef, params = abstract_params(config, layout, mesh)
    with use_layout(layout, mesh):
        if program == "train":
            def step(params, tokens_BS):
                return jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens_BS))(params)
            args = (params, jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=batch_sharding(layout, mesh, BATCH)))
        else:
            def step(params, tokens_B1, cache, index):
                return nnx.merge(graphdef, params)(tokens_B1, cache=cache, cache_index=index)
            cache = jax.eval_shape(lambda: init_cache(config, BATCH, CACHE_LEN))
            cache_sharding = NamedSharding(mesh, activation_spec(("layers", "attn_batch", "seq", "kv_heads",
                                                                  "head_dim"), cache.k.shape))
            cache = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=cache_sharding), cache)
            args = (params, jax.ShapeDtypeStruct((BATCH, 1), jnp.int32, sharding=batch_sharding(layout, mesh, BATCH)),
                    cache, jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))
        lowered = jax.jit(step).lower(*args)
    token_dims = (BATCH, SEQ - 1) if program == "train" else (BATCH, 1)
    return inspect_compiled(lowered.compile(), mesh, args=args,
                            lowered_text=lowered.as_text(debug_info=True), token_dims=token_dims)


STRUCTURE_CASES = [(layout, mesh, program) for mesh in STRUCTURE_MESHES
                   for layout, program in [("starscream_tp", "train"), ("starscream_tp", "decode"),
                                           ("starscream_decode", "decode")]]


@pytest.mark.parametrize("layout,mesh_name,program", STRUCTURE_CASES)
def test_starscream_layouts_keep_collectives_hierarchical_and_large_arrays_off_xcd_replication(
        layout, mesh_name, program):
    report = structure_report(layout, mesh_name, program)
    verdict = check_principles(report, None)
    assert verdict.hierarchical_collectives.ok, verdict.hierarchical_collectives.violations
    assert verdict.no_redundancy.ok, verdict.no_redundancy.violations
    assert {c.scope for c in report.collectives} >= {"intra_gpu", "inter_gpu"}
    assert sum(entry.bytes > 1 << 20 for entry in report.inputs) >= 9
    assert any(entry.shard_bytes > 1 << 20 for entry in report.activations) or program == "decode"


@pytest.mark.parametrize("mesh_name", STRUCTURE_MESHES)
def test_starscream_decode_on_many_tokens_copies_the_mlp_hidden_over_xcd(mesh_name):
    """Why starscream_decode is for decode only: its weights never move, so the activations do, and those that
    enter a matmul whose weight splits its embed side over xcd (the MLP hidden [B, S, F] into w_down, the attention
    output [B, S, H, E] into wo) are whole on each partition of a GPU. At one token per sequence that is a few hundred
    KiB; over a training batch it is the largest tensor. The fused gate/up GEMM's output [B, S, 2, F] is the MLP
    hidden before its activation, and is whole likewise, as is the gradient of each half ([B, S, 1, F])."""
    report = structure_report("starscream_decode", mesh_name, "train")
    verdict = check_principles(report, None, large_bytes=1 << 20)
    assert verdict.hierarchical_collectives.ok, verdict.hierarchical_collectives.violations
    copied = [entry for entry in report.activations if entry.replication_xcd > 1 and entry.shard_bytes > 1 << 20]
    config = structure_config()
    allowed_shapes = ([BATCH, SEQ - 1, config.d_ff], [BATCH, SEQ - 1, config.n_heads, config.head_dim],
                      [BATCH, SEQ - 1, 2, config.d_ff], [BATCH, SEQ - 1, 1, config.d_ff])
    assert any(entry.shape == allowed_shapes[0] for entry in copied)
    assert all(entry.shape in allowed_shapes for entry in copied)
    assert len(verdict.no_redundancy.violations) == len(copied)


@pytest.mark.parametrize("mesh_name,program", [(mesh, program) for mesh in STRUCTURE_MESHES
                                               for program in ("train", "decode")])
def test_flat_tp_spans_both_axes_in_one_collective(mesh_name, program):
    verdict = check_principles(structure_report("flat_tp", mesh_name, program), None, large_bytes=1 << 20)
    assert not verdict.hierarchical_collectives.ok
    if program == "train":  # the residual stream [B, S, D] is whole on every partition
        assert any(line.startswith("activation ") for line in verdict.no_redundancy.violations)


@pytest.mark.parametrize("program,replicated", [
    ("train", ["0/layers/wk/value", "0/layers/wv/value"]),
    ("decode", ["0/layers/wk/value", "0/layers/wv/value", "2/k", "2/v"]),
])
def test_flat_tp_copies_kv_weights_and_cache_over_xcd_on_8x8(program, replicated):
    """8 kv heads cannot split 64 ways, so flat_tp keeps kv heads over gpu only: 8 copies in each GPU."""
    report = structure_report("flat_tp", "1x8x8", program)
    verdict = check_principles(report, None)
    assert not verdict.no_redundancy.ok
    assert sorted(entry.name for entry in report.inputs if entry.replication_xcd == 8 and entry.bytes > 1 << 20) \
        == replicated


def test_train_kernels_keep_gpu_tp_shapes_under_starscream_tp_and_shrink_under_flat_tp():
    reference = structure_report("gpu_tp", "1x8x8", "train")
    starscream = check_principles(structure_report("starscream_tp", "1x8x8", "train"), reference)
    flat = check_principles(structure_report("flat_tp", "1x8x8", "train"), reference)
    assert starscream.shape_preservation.ok, starscream.shape_preservation.violations
    assert not starscream.shape_preservation.unjudged
    assert not flat.shape_preservation.ok


def test_decode_layout_moves_fewer_bytes_inside_the_gpu_than_gathering_weights():
    """starscream_decode keeps weights in place and moves activations; starscream_tp gathers every weight over xcd
    each step."""
    stationary = structure_report("starscream_decode", "1x8x8", "decode").bytes_by_scope()["intra_gpu"]
    gathering = structure_report("starscream_tp", "1x8x8", "decode").bytes_by_scope()["intra_gpu"]
    assert 0 < 10 * stationary < gathering


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Regenerate the golden spec files in tests/sharding/golden/.")
    parser.add_argument("--regenerate", action="store_true", required=True)
    parser.parse_args()
    for written in regenerate():
        print(f"wrote {written}")


def placed(layout) -> dict:
    return {name: layout.activations.lookup(name)[1] for name in ("batch", "attn_batch", "seq", "cache_seq")}


@pytest.mark.parametrize("layout, mesh, batch, positions, name, expected", [
    ("starscream_tp", (1, 2, 4), 8, 16, "starscream_tp",
     {"batch": ("data", "xcd"), "attn_batch": ("data", "xcd"), "seq": (), "cache_seq": ()}),
    ("starscream_tp", (1, 2, 4), 2, 16, "starscream_tp+seq",
     {"batch": ("data",), "attn_batch": ("data",), "seq": ("xcd",), "cache_seq": ("xcd",)}),
    ("starscream_tp", (1, 2, 4), 3, None, "starscream_tp+seq",  # a prefill pads its prompt to the split itself
     {"batch": ("data",), "attn_batch": ("data",), "seq": ("xcd",), "cache_seq": ("xcd",)}),
    ("starscream_decode", (2, 2, 2), 1, 1, "starscream_decode+split_k+data",
     {"batch": (), "attn_batch": (), "seq": (), "cache_seq": ("xcd",)}),
    ("starscream_decode", (1, 2, 8), 5, 16, "starscream_decode+split_k",  # embed is over xcd: the sequence stays
     {"batch": ("data",), "attn_batch": ("data",), "seq": (), "cache_seq": ("xcd",)}),
    ("starscream_fsdp", (1, 2, 4), 2, 16, "starscream_fsdp+seq",
     {"batch": ("data", "gpu"), "attn_batch": ("data", "gpu"), "seq": ("xcd",), "cache_seq": ("xcd",)}),
    ("flat_fsdp", (1, 2, 4), 1, 16, "flat_fsdp+seq",
     {"batch": ("data",), "attn_batch": ("data",), "seq": ("gpu", "xcd"), "cache_seq": ("gpu", "xcd")}),
    ("starscream_cp", (1, 2, 4), 8, 1, "starscream_cp+split_k",  # decode: one token, its cache split as prefill's
     {"batch": ("data",), "attn_batch": ("data",), "seq": (), "cache_seq": ("xcd",)}),
    ("gpu_tp", (2, 2, 2), 3, 16, "gpu_tp+data", {"batch": (), "attn_batch": (), "seq": (), "cache_seq": ()}),
])
def test_fit_batch_moves_the_axes_a_batch_cannot_fill_to_the_positions(layout, mesh, batch, positions, name,
                                                                         expected):
    fitted = fit_batch(layout, AbstractMesh(mesh, AXES), batch, positions)
    assert fitted.name == name and placed(fitted) == expected


def test_fit_batch_names_the_sequence_length_and_the_batch_that_work():
    with pytest.raises(ShardingRuleError, match=r"splitting each sequence over \('xcd',\) \(4 parts\), which 30 "
                                                r"tokens do not divide; use 32 tokens per sequence or a batch that "
                                                r"is a multiple of 4"):
        fit_batch("starscream_tp", AbstractMesh((1, 2, 4), AXES), 2, 30)
