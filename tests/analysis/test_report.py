"""Inspecting compiled programs of a two-matmul MLP on simulated (1, gpu, xcd) CPU meshes, and the three principles;
principle 1 also on the matmuls XLA:GPU writes for a transformer step (merged, weight first, split-K).

Layouts of y = relu(x @ w1) @ w2, x: [B, D], w1: [D, F], w2: [F, D]:
- flat: hidden F over ('gpu', 'xcd'), tokens replicated (64-way TP on an 8x8 mesh);
- gpu_tp: hidden F over 'gpu', everything replicated over 'xcd' (the reference);
- starscream: tokens over 'xcd', hidden over 'gpu'; weights stored with D over 'xcd' and resharded to replicated over
  'xcd' just before the matmul.
All programs are lowered from ShapeDtypeStructs and compiled, never run.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.analysis.hlo import Matmul
from starscream_jax.analysis.principles import (
    NO_COUNTERPART,
    NO_REFERENCE,
    AttentionRatio,
    KernelVerdict,
    UnjudgedOp,
    check_principles,
    reads_once_per_gpu,
    weight_side_elements,
)
from starscream_jax.analysis.report import (
    classify_scope,
    infer_tokens_per_device,
    inspect_compiled,
    inspect_text,
    matmul_key,
    replication,
    ring_bytes_per_device,
)
from starscream_jax.errors import TopologyError

B, D = 64, 32
HIDDEN = {(2, 4): 128, (8, 8): 256}
LAYOUTS = {
    # name: (tokens, hidden, w1 stored, w2 stored, w1 used, w2 used)
    "flat": (None, ("gpu", "xcd"), P(None, ("gpu", "xcd")), P(("gpu", "xcd"), None), None, None),
    "gpu_tp": (None, "gpu", P(None, "gpu"), P("gpu", None), None, None),
    "starscream": ("xcd", "gpu", P("xcd", "gpu"), P("gpu", "xcd"), P(None, "gpu"), P("gpu", None)),
}


def make_mesh(gpus: int, xcds: int, devices=None) -> Mesh:
    devices = jax.devices()[: gpus * xcds] if devices is None else devices
    return Mesh(np.array(devices).reshape(1, gpus, xcds), ("data", "gpu", "xcd"), axis_types=(AxisType.Explicit,) * 3)


def mlp_args(mesh: Mesh, layout: str) -> tuple:
    tokens, _, w1_spec, w2_spec, _, _ = LAYOUTS[layout]
    hidden = HIDDEN[(mesh.shape["gpu"], mesh.shape["xcd"])]
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
    return sds((B, D), P(tokens)), sds((D, hidden), w1_spec), sds((hidden, D), w2_spec)


def mlp_function(layout: str, train: bool):
    tokens, hidden, _, _, w1_use, w2_use = LAYOUTS[layout]

    def mlp(x, w1, w2):
        w1 = w1 if w1_use is None else jax.sharding.reshard(w1, w1_use)
        w2 = w2 if w2_use is None else jax.sharding.reshard(w2, w2_use)
        h = jnp.einsum("bd,df->bf", x, w1, out_sharding=P(tokens, hidden))
        return jnp.einsum("bf,fd->bd", jax.nn.relu(h), w2, out_sharding=P(tokens, None))

    if not train:
        return mlp
    return jax.grad(lambda x, w1, w2: (mlp(x, w1, w2) ** 2).sum(), argnums=(1, 2))


@functools.cache
def lowered_mlp(gpus: int, xcds: int, layout: str, train: bool = False):
    mesh = make_mesh(gpus, xcds)
    args = mlp_args(mesh, layout)
    with jax.set_mesh(mesh):
        return mesh, args, jax.jit(mlp_function(layout, train)).lower(*args)


@functools.cache
def compiled_mlp(gpus: int, xcds: int, layout: str, train: bool = False):
    mesh, args, lowered = lowered_mlp(gpus, xcds, layout, train)
    return mesh, args, lowered.compile()


def mlp_report_with_activations(layout: str, train: bool = False):
    mesh, args, lowered = lowered_mlp(2, 4, layout, train)
    return inspect_compiled(lowered.compile(), mesh, args=args, lowered_text=lowered.as_text(debug_info=True),
                            token_dims=(B,))


@functools.cache
def mlp_report(gpus: int, xcds: int, layout: str, train: bool = False):
    mesh, args, compiled = compiled_mlp(gpus, xcds, layout, train)
    return inspect_compiled(compiled, mesh, args=args)


def test_scopes_of_groups_on_a_2x4_mesh():
    mesh = make_mesh(2, 4)
    assert classify_scope([0, 1, 2, 3], mesh) == "intra_gpu"
    assert classify_scope([1, 5], mesh) == "inter_gpu"
    assert classify_scope([0, 5], mesh) == "flat"
    assert classify_scope(range(8), mesh) == "flat"
    assert classify_scope([6], mesh) == "local"


def test_scopes_with_a_data_axis_and_nodes():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "gpu", "xcd"))
    # partition 4 is (data 1, gpu 0, xcd 0): physical GPU 2; partition 2 is GPU 1
    assert classify_scope([0, 4], mesh) == "inter_gpu"
    assert classify_scope([0, 4], mesh, gpus_per_node=2) == "inter_node"
    assert classify_scope([0, 2], mesh, gpus_per_node=2) == "inter_gpu"
    assert classify_scope([0, 1, 4, 5], mesh, gpus_per_node=2) == "flat"


def test_mesh_without_xcd_axis_is_an_error():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "gpu"))
    with pytest.raises(TopologyError, match="lack \\['xcd'\\]"):
        classify_scope([0, 1], mesh)


def test_ring_formulas():
    assert ring_bytes_per_device("all-gather", 65536, 4) == 49152
    assert ring_bytes_per_device("reduce-scatter", 65536, 4) == 49152
    assert ring_bytes_per_device("all-reduce", 65536, 8) == 114688
    assert ring_bytes_per_device("all-to-all", 1000, 2) == 500
    assert ring_bytes_per_device("ragged-all-to-all", 1000, 4) == 750
    assert ring_bytes_per_device("collective-permute", 1000, 2) == 1000


def test_all_gather_bytes_by_hand():
    """starscream on 2x4: w1 [32,128] f32 stored P('xcd','gpu') is gathered over the 4 xcds into its [32,64] gpu shard:
    8 KiB per device, so each device receives the other 3 quarters: 3/4 x 8192 = 6144 bytes."""
    report = mlp_report(2, 4, "starscream")
    gathers = [c for c in report.collectives if c.kind == "all-gather" and c.buffer_bytes == 32 * 64 * 4]
    assert gathers, [(c.kind, c.buffer_bytes) for c in report.collectives]
    assert {(c.scope, c.group_size, c.bytes_per_device) for c in gathers} == {("intra_gpu", 4, 6144.0)}


def test_explicit_collectives_bytes_and_scopes():
    """Per device x is [16, 32] f32 = 2 KiB, on a 2x4 mesh."""
    mesh = make_mesh(2, 4)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("gpu", "xcd"), out_specs=P("gpu", "xcd"))
    def collectives(x):
        scattered = jax.lax.psum_scatter(x, "xcd", scatter_dimension=0, tiled=True)
        exchanged = jax.lax.all_to_all(x, "gpu", 0, 0, tiled=True)
        shifted = jax.lax.ppermute(x, "xcd", [(i, (i + 1) % 4) for i in range(4)])
        return jnp.tile(scattered, (4, 1)) + exchanged + shifted

    x = jax.ShapeDtypeStruct((32, 128), jnp.float32, sharding=NamedSharding(mesh, P("gpu", "xcd")))
    report = inspect_compiled(collectives.lower(x).compile(), mesh)
    found = {(c.kind, c.scope, c.group_size, c.buffer_bytes, c.bytes_per_device) for c in report.collectives}
    assert found == {
        ("reduce-scatter", "intra_gpu", 4, 2048, 1536.0),
        ("all-to-all", "inter_gpu", 2, 2048, 1024.0),
        ("collective-permute", "intra_gpu", 2, 2048, 2048.0),
    }


@pytest.mark.parametrize("gpus, xcds", [(2, 4), (8, 8)])
def test_flat_layout_has_flat_collectives_and_divides_weight_dims(gpus, xcds):
    report = mlp_report(gpus, xcds, "flat")
    assert "flat" in {c.scope for c in report.collectives}
    first, second = report.matmuls
    hidden = HIDDEN[(gpus, xcds)]
    assert (first.m, first.k, first.n) == (B, D, hidden // (gpus * xcds))
    assert (second.m, second.k, second.n) == (B, hidden // (gpus * xcds), D)
    verdicts = check_principles(report, mlp_report(gpus, xcds, "gpu_tp"), large_bytes=1024)
    assert not verdicts.shape_preservation.ok
    assert len(verdicts.shape_preservation.violations) == 2
    assert not verdicts.hierarchical_collectives.ok
    assert not verdicts.no_redundancy.ok
    assert "input 0" in verdicts.no_redundancy.violations[0]


@pytest.mark.parametrize("gpus, xcds", [(2, 4), (8, 8)])
def test_starscream_layout_is_hierarchical_and_keeps_kernel_shapes(gpus, xcds):
    report = mlp_report(gpus, xcds, "starscream")
    assert {c.scope for c in report.collectives} == {"intra_gpu", "inter_gpu"}
    first, second = report.matmuls
    hidden = HIDDEN[(gpus, xcds)]
    assert (first.m, first.k, first.n) == (B // xcds, D, hidden // gpus)
    assert (second.m, second.k, second.n) == (B // xcds, hidden // gpus, D)
    assert (report.tokens_per_device, mlp_report(gpus, xcds, "gpu_tp").tokens_per_device) == (B // xcds, B)
    verdicts = check_principles(report, mlp_report(gpus, xcds, "gpu_tp"), large_bytes=1024)
    assert verdicts.ok, verdicts
    assert verdicts.shape_preservation.unjudged == ()


def test_training_steps_judged_on_backward_matmuls_too():
    reference = mlp_report(2, 4, "gpu_tp", train=True)
    starscream = mlp_report(2, 4, "starscream", train=True)
    flat = mlp_report(2, 4, "flat", train=True)
    assert len(starscream.matmuls) == len(reference.matmuls) == 5
    weight_gradients = [c for c in starscream.collectives if "transpose(" in c.op_name]
    # weight gradients are reduced over the xcds of each GPU: a reduce-scatter, or on CPU all-reduce + dynamic-slice
    assert weight_gradients and all(c.kind in ("reduce-scatter", "all-reduce") for c in weight_gradients)
    assert {c.scope for c in weight_gradients} == {"intra_gpu"}
    starscream_verdicts = check_principles(starscream, reference, large_bytes=1024)
    assert starscream_verdicts.ok, starscream_verdicts
    flat_verdicts = check_principles(flat, reference, large_bytes=1024)
    # both layers forward, both backward (input gradient of the second, weight gradients of both)
    assert len(flat_verdicts.shape_preservation.violations) == 4
    assert not flat_verdicts.hierarchical_collectives.ok


def test_replica_group_ids_are_mesh_positions_not_device_ids():
    permutation = [5, 2, 7, 0, 3, 6, 1, 4]
    devices = [jax.devices()[i] for i in permutation]
    mesh = make_mesh(2, 4, devices)
    args = mlp_args(mesh, "starscream")
    with jax.set_mesh(mesh):
        compiled = jax.jit(mlp_function("starscream", train=False)).lower(*args).compile()
    assert list(compiled.runtime_executable().local_devices()) == list(mesh.devices.flat)
    report = inspect_compiled(compiled, mesh, args=args)
    assert {c.scope for c in report.collectives} == {"intra_gpu", "inter_gpu"}
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert all(sorted(map(sorted, c.groups)) == [[0, 1, 2, 3], [4, 5, 6, 7]] for c in gathers)
    # read as Device.id, the first gather group would hold devices of both GPUs
    assert classify_scope([permutation.index(i) for i in gathers[0].groups[0]], mesh) == "flat"


def test_inputs_report_spec_bytes_and_replication():
    starscream = {entry.name: entry for entry in mlp_report(2, 4, "starscream").inputs}
    reference = {entry.name: entry for entry in mlp_report(2, 4, "gpu_tp").inputs}
    x, w1 = starscream["0"], starscream["1"]
    assert (x.shape, x.spec, x.replication_xcd, x.replication_gpu) == ([B, D], ["xcd"], 1, 2)
    assert (w1.spec, w1.bytes, w1.shard_bytes, w1.replication_xcd, w1.replication_gpu) == (
        ["xcd", "gpu"], D * 128 * 4, D * 128 * 4 // 8, 1, 1
    )
    w1_reference = reference["1"]
    assert (w1_reference.spec, w1_reference.replication_xcd, w1_reference.replication_gpu) == ([None, "gpu"], 4, 1)
    assert reference["0"].replication_xcd == 4 and reference["0"].replication_gpu == 2


def test_inputs_without_args_are_read_from_the_compiled_program():
    mesh, args, compiled = compiled_mlp(2, 4, "starscream")
    assert inspect_compiled(compiled, mesh).inputs == inspect_compiled(compiled, mesh, args=args).inputs


def test_replication_counts_copies_along_each_axis():
    mesh = make_mesh(2, 4)
    sharding = NamedSharding(mesh, P(None, ("gpu", "xcd")))
    assert replication(sharding, (4, 8), mesh, "xcd") == 1
    assert replication(NamedSharding(mesh, P("gpu")), (4, 8), mesh, "xcd") == 4
    assert replication(NamedSharding(mesh, P("gpu")), (4, 8), mesh, "gpu") == 1


def test_replicated_inputs_can_be_allowed_by_pattern_or_callable():
    reference = mlp_report(2, 4, "gpu_tp")
    assert len(check_principles(reference, None, large_bytes=1024).no_redundancy.violations) == 3
    assert check_principles(reference, None, large_bytes=1 << 20).no_redundancy.ok
    by_pattern = check_principles(reference, None, replicated_ok={"0", "[12]"}, large_bytes=1024)
    assert by_pattern.no_redundancy.ok
    by_callable = check_principles(reference, None, replicated_ok=lambda name: name != "2", large_bytes=1024)
    assert [v.split()[1] for v in by_callable.no_redundancy.violations] == ["2"]


def test_activations_report_global_shape_placement_and_copies_over_xcd():
    """flat splits the hidden activation over (gpu, xcd) but holds x and the output [B, D] whole on every device;
    starscream splits every activation's tokens over xcd."""
    hidden = HIDDEN[(2, 4)]
    flat = {entry.name: entry for entry in mlp_report_with_activations("flat").activations}
    first, second = flat["bd,df->bf/dot_general"], flat["bf,fd->bd/dot_general"]
    assert (first.shape, first.spec, first.replication_xcd) == ([B, hidden], [[], ["gpu", "xcd"]], 1)
    assert first.shard_bytes == B * hidden * 4 // 8
    assert (second.shape, second.spec, second.replication_xcd, second.shard_bytes) == ([B, D], [[], []], 4, B * D * 4)
    starscream = mlp_report_with_activations("starscream", train=True).activations
    assert starscream and all(entry.replication_xcd == 1 for entry in starscream)
    assert all(entry.shape[0] == B for entry in starscream)  # weights and their gradients are not activations


def test_no_redundancy_judges_activations_by_bytes_per_device():
    flat = mlp_report_with_activations("flat", train=True)
    largest_copy = max(entry.shard_bytes for entry in flat.activations if entry.replication_xcd > 1)
    failing = check_principles(flat, None, replicated_ok={"*"}, large_bytes=largest_copy - 1).no_redundancy
    assert not failing.ok and all(line.startswith("activation ") for line in failing.violations)
    assert check_principles(flat, None, replicated_ok={"*"}, large_bytes=largest_copy).no_redundancy.ok
    starscream = mlp_report_with_activations("starscream", train=True)
    assert check_principles(starscream, None, large_bytes=0).no_redundancy.ok


def test_activations_need_both_the_lowered_text_and_the_token_dims():
    mesh, args, lowered = lowered_mlp(2, 4, "flat")
    with pytest.raises(TopologyError, match="need both lowered_text and token_dims"):
        inspect_compiled(lowered.compile(), mesh, lowered_text=lowered.as_text(debug_info=True))


def test_without_reference_no_matmul_is_judged():
    report = mlp_report(2, 4, "flat")
    verdict = check_principles(report, None).shape_preservation
    assert verdict == KernelVerdict(ok=None, violations=(),
                                    unjudged=tuple(UnjudgedOp(m.name, "no reference program") for m in report.matmuls),
                                    attention=AttentionRatio(None, None), not_judged=NO_REFERENCE)


def test_report_is_json_serialisable_with_memory_and_bytes_by_scope():
    report = mlp_report(2, 4, "starscream")
    as_dict = json.loads(json.dumps(report.to_dict()))
    assert as_dict["mesh_axes"] == {"data": 1, "gpu": 2, "xcd": 4}
    assert as_dict["memory"]["argument_bytes"] == sum(entry.shard_bytes for entry in report.inputs)
    expected = sum(c.bytes_per_device * c.count for c in report.collectives if c.scope == "intra_gpu")
    assert as_dict["bytes_by_scope"]["intra_gpu"] == expected > 0
    assert as_dict["bytes_by_scope"]["flat"] == 0


def test_below_ridge_compares_intensity_with_peak_over_bandwidth():
    mesh, args, compiled = compiled_mlp(2, 4, "starscream")
    (first, _) = inspect_compiled(compiled, mesh).matmuls
    assert first.intensity == pytest.approx(2 * 16 * 32 * 64 / (4 * (16 * 32 + 32 * 64 + 16 * 64)))
    assert first.below_ridge is None
    low_ridge = inspect_compiled(compiled, mesh, peak_flops=1e12, hbm_bandwidth=1e12).matmuls[0]
    high_ridge = inspect_compiled(compiled, mesh, peak_flops=1e15, hbm_bandwidth=1e12).matmuls[0]
    assert (low_ridge.below_ridge, high_ridge.below_ridge) == (False, True)


def test_program_and_mesh_of_different_sizes_is_an_error():
    mesh, _, compiled = compiled_mlp(2, 4, "starscream")
    with pytest.raises(TopologyError, match="compiled for 8 partitions"):
        inspect_compiled(compiled, make_mesh(2, 2))


def matmul(name: str, op_name: str, m: int, k: int, n: int, count: int = 1) -> Matmul:
    return Matmul(name=name, op_name=op_name, batch=1, m=m, k=k, n=n, dtype="f32", flops=2 * m * k * n, bytes=0,
                  intensity=0.0, below_ridge=None, count=count)


def test_matmul_key_unwraps_transposes_and_drops_jit_and_primitive():
    assert matmul_key("jit(step)/jvp(bd,df->bf)/dot_general") == ("jvp(bd,df->bf)", False)
    assert matmul_key("jit(other)/transpose(jvp(bd,df->bf))/transpose") == ("jvp(bd,df->bf)", True)
    assert matmul_key("") == ("", False)


def test_attention_is_one_op_whatever_direction_its_dots_were_named_for():
    forward = "jit(step)/jvp(closed_call)/attention/shard_map/vmap()/convert_element_type"
    backward = "jit(step)/transpose(jvp(closed_call))/attention/shard_map/vmap()/mul"
    assert matmul_key(forward) == matmul_key(backward) == ("jvp(closed_call)/attention", False)


def test_decode_reads_each_weight_once_per_gpu_or_is_flagged():
    """A gpu_tp device reads its GPU's share of a weight once: 4 tokens x (1024 x 256). Split over 4 partitions
    along the weight, each reads a quarter (once per GPU: ok); gathered so that each reads the whole share, the GPU
    reads it 4 times."""
    reference = [matmul("dot", "jit(d)/bsd,df->bsf/dot_general", 4, 1024, 256)]
    split = [matmul("dot", "jit(d)/bsd,df->bsf/dot_general", 4, 256, 256)]
    assert reads_once_per_gpu(split, reference, partitions=4).ok
    gathered = reads_once_per_gpu(reference, reference, partitions=4)
    assert not gathered.ok and "read 4.00x the weight-side elements" in gathered.violations[0]
    assert reads_once_per_gpu([matmul("dot", "jit(d)/other/dot_general", 4, 8, 8)], reference, 4).unjudged == (
        UnjudgedOp("other", NO_COUNTERPART),)


def test_weight_side_elements_do_not_depend_on_operand_order_or_merging():
    """16 tokens through a [32, 96] weight: forward weight first, one input gradient, the weight gradient run 4 times
    (as a layer loop would)."""
    matmuls = [
        matmul("forward, weight first", "jit(f)/jvp(up)/dot_general", 96, 32, 16),
        matmul("input gradient", "jit(f)/transpose(jvp(up))/dot_general", 16, 96, 32),
        matmul("weight gradient", "jit(f)/transpose(jvp(up))/transpose", 96, 16, 32, count=4),
    ]
    assert weight_side_elements(matmuls, 16) == {("jvp(up)", False): 32 * 96, ("jvp(up)", True): 5 * 32 * 96}


def test_tokens_per_device_is_the_free_size_most_forward_matmuls_share():
    forward = [
        matmul("weight first", "jit(f)/jvp(up)/dot_general", 96, 32, 16),
        matmul("activations first", "jit(f)/jvp(down)/dot_general", 16, 96, 32),
        matmul("backward", "jit(f)/transpose(jvp(down))/dot_general", 96, 16, 32),
    ]
    assert infer_tokens_per_device(forward) == 16
    assert infer_tokens_per_device(forward[2:]) == 96
    assert infer_tokens_per_device([matmul("tie", "jit(f)/jvp(up)/dot_general", 64, 8, 16)]) == 64
    assert infer_tokens_per_device([]) is None


# What XLA:GPU (JAX 0.11.2, two H200s as one GPU of two partitions) wrote for the tiny model's training step: q/k/v
# and gate/up merged into one matmul each, written weight first (tokens in N); contractions split into a leading
# batch (split-K), over the weight's rows forward and over the tokens for weight gradients; the merged op's backward
# matmuls in another order in each program. gpu_tp runs 256 tokens per device, starscream_tp 128 (tokens over xcd),
# flat_tp 256 with every weight halved.
QKV = "jit(train_step)/jvp()/while/body/eval_jaxpr/bsd,dhe->bshe/dot_general"
GATE_UP = "jit(train_step)/jvp()/while/body/eval_jaxpr/bsd,df->bsf/dot_general"
GATE_UP_BACK = "jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/bsd,df->bsf/"
DOWN_BACK = "jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/bsf,fd->bsd/transpose"
SPLIT_WEIGHT_FIRST = "lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={1}, rhs_contracting_dims={2}"
SPLIT_ACTIVATIONS_FIRST = "lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}"
SPLIT_BOTH_BEHIND = "lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={1}, rhs_contracting_dims={2}"
GPU_STEPS = {
    "gpu_tp": [
        ("f32[4,32,256]", "f32[256,4,32]", "f32[4,256,256]", SPLIT_WEIGHT_FIRST, QKV),
        ("f32[128,768]", "f32[256,128]", "f32[768,256]", "cublas", GATE_UP),
        ("f32[256,8,48]", "f32[128,8,48]", "f32[8,256,128]", SPLIT_BOTH_BEHIND, GATE_UP_BACK + "dot_general"),
        ("f32[256,8,48]", "f32[128,8,48]", "f32[8,256,128]", SPLIT_BOTH_BEHIND, GATE_UP_BACK + "dot_general"),
        ("f32[768,4,64]", "f32[4,64,128]", "f32[4,768,128]", SPLIT_ACTIVATIONS_FIRST, GATE_UP_BACK + "transpose"),
        ("f32[4,64,384]", "f32[128,4,64]", "f32[4,384,128]", SPLIT_WEIGHT_FIRST, DOWN_BACK),
    ],
    "starscream_tp": [
        ("f32[4,32,256]", "f32[128,4,32]", "f32[4,256,128]", SPLIT_WEIGHT_FIRST, QKV),
        ("f32[128,768]", "f32[128,128]", "f32[768,128]", "cublas", GATE_UP),
        ("f32[768,128]", "f32[128,128]", "f32[768,128]", "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
         GATE_UP_BACK + "dot_general"),
        ("f32[128,8,48]", "f32[128,8,48]", "f32[8,128,128]", SPLIT_BOTH_BEHIND, GATE_UP_BACK + "dot_general"),
        ("f32[128,8,48]", "f32[128,8,48]", "f32[8,128,128]", SPLIT_BOTH_BEHIND, GATE_UP_BACK + "dot_general"),
        ("f32[128,4,32]", "f32[4,32,384]", "f32[4,128,384]", SPLIT_ACTIVATIONS_FIRST, DOWN_BACK),
    ],
    "flat_tp": [
        ("f32[4,32,128]", "f32[256,4,32]", "f32[4,128,256]", SPLIT_WEIGHT_FIRST, QKV),
        ("f32[128,384]", "f32[256,128]", "f32[384,256]", "cublas", GATE_UP),
        ("f32[256,4,48]", "f32[128,4,48]", "f32[4,256,128]", SPLIT_BOTH_BEHIND, GATE_UP_BACK + "dot_general"),
        ("f32[256,4,48]", "f32[128,4,48]", "f32[4,256,128]", SPLIT_BOTH_BEHIND, GATE_UP_BACK + "dot_general"),
        ("f32[384,4,64]", "f32[4,64,128]", "f32[4,384,128]", SPLIT_ACTIVATIONS_FIRST, GATE_UP_BACK + "transpose"),
        ("f32[8,32,192]", "f32[128,8,32]", "f32[8,192,128]", SPLIT_WEIGHT_FIRST, DOWN_BACK),
    ],
}
CUBLAS_CONFIG = (
    '{"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["0"],'
    '"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}'
)


def gpu_step_text(layout: str) -> str:
    """The GPU_STEPS matmuls of `layout` as the text of a 2-partition program: a dot per matmul, or a cuBLAS call."""
    lines = []
    for i, (lhs, rhs, out, numbers, op_name) in enumerate(GPU_STEPS[layout]):
        lines += [f"  %lhs.{i} = {lhs} parameter({2 * i})", f"  %rhs.{i} = {rhs} parameter({2 * i + 1})"]
        metadata = f'metadata={{op_name="{op_name}"}}'
        if numbers == "cublas":
            lines.append(f'  %mm.{i} = ({out}, s8[1024]) custom-call(%lhs.{i}, %rhs.{i}), '
                         f'custom_call_target="__cublas$lt$matmul", {metadata}, backend_config={CUBLAS_CONFIG}')
        else:
            lines.append(f"  %mm.{i} = {out} dot(%lhs.{i}, %rhs.{i}), {numbers}, {metadata}")
    return "HloModule jit_train_step, num_partitions=2\n\nENTRY %main () -> f32[] {\n" + "\n".join(lines) + "\n}\n"


def gpu_step_report(layout: str, tokens_per_device: int | None = None):
    return inspect_text(gpu_step_text(layout), make_mesh(1, 2), tokens_per_device=tokens_per_device)


def test_gpu_matmuls_merged_weight_first_and_split_keep_starscream_tp_kernels():
    reference, starscream = gpu_step_report("gpu_tp"), gpu_step_report("starscream_tp")
    assert (reference.tokens_per_device, starscream.tokens_per_device) == (256, 128)
    verdict = check_principles(starscream, reference).shape_preservation
    assert (verdict.ok, verdict.violations, verdict.unjudged, verdict.attention) == (True, (), (),
                                                                                     AttentionRatio(None, None))


def test_gpu_matmuls_of_flat_tp_shrink_every_op():
    verdict = check_principles(gpu_step_report("flat_tp"), gpu_step_report("gpu_tp")).shape_preservation
    shrunk = [line.split(" (")[0] for line in verdict.violations]
    assert shrunk == [f"op {matmul_key(op)[0]}" for op in (QKV, GATE_UP, GATE_UP_BACK + "dot_general", DOWN_BACK)]
    assert "fewer than the reference's 32768 at 256 tokens" in verdict.violations[0]


def test_a_token_count_that_is_not_divided_shows_the_kernels_shrunk():
    """Read as if its 128 tokens per device were gpu_tp's 256, starscream_tp's matmuls would hold half the weight."""
    verdict = check_principles(gpu_step_report("starscream_tp", tokens_per_device=256), gpu_step_report("gpu_tp"))
    assert len(verdict.shape_preservation.violations) == 4


def test_args_that_do_not_match_the_program_are_an_error():
    mesh, args, compiled = compiled_mlp(2, 4, "starscream")
    with pytest.raises(TopologyError, match="args hold 2 arrays but the program takes 3"):
        inspect_compiled(compiled, mesh, args=args[:2])


def collective_program(line: str) -> str:
    """A 2x4-partition program whose entry runs one collective `line` on %p = f32[8,8]."""
    return ("HloModule test, num_partitions=8\n\n%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n"
            "  %y = f32[] parameter(1)\n  ROOT %sum = f32[] add(%x, %y)\n}\n\n"
            f"ENTRY %main (p: f32[8,8]) -> f32[8,8] {{\n  %p = f32[8,8]{{1,0}} parameter(0)\n  ROOT {line}\n}}\n")


@pytest.mark.parametrize("line, scope, bytes_per_device, reason", [
    # all-to-all over one partition of each GPU: 256 bytes, half of them leave the device
    ("%c = f32[8,8]{1,0} all-to-all(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
     "inter_gpu", 128.0, ""),
    ("%c = f32[8,8]{1,0} ragged-all-to-all(%p, %p, %p, %p, %p, %p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}",
     "intra_gpu", 192.0, ""),
    ("%c = f32[8,8]{1,0} all-to-all(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
     "flat", 224.0, "several partitions of one GPU"),
    ("%c = f32[8,8]{1,0} all-reduce(%p), channel_id=1, to_apply=%add", "unknown", 0.0, "no replica groups"),
    ("%c = f32[8,8]{1,0} all-to-all-v9(%p), channel_id=1, replica_groups={{0,1}}", "unknown", 256.0,
     "kind 'all-to-all-v9'"),
])
def test_every_collective_has_a_scope_and_bytes_and_the_unknown_ones_fail_principle_3(line, scope,
                                                                                     bytes_per_device, reason):
    report = inspect_text(collective_program(line), make_mesh(2, 4))
    (collective,) = report.collectives
    assert (collective.scope, collective.bytes_per_device) == (scope, bytes_per_device)
    assert reason in collective.reason
    verdict = check_principles(report, None).hierarchical_collectives
    assert verdict.ok == (scope in ("inter_gpu", "intra_gpu"))
    assert all(reason in line for line in verdict.violations)


def test_one_partition_per_gpu_at_different_indices_is_flat_and_says_why():
    """Partition 0 is xcd 0 of GPU 0 and partition 5 is xcd 1 of GPU 1: one of each GPU, on different dies."""
    mesh = make_mesh(2, 4)
    assert classify_scope([0, 5], mesh) == "flat"
    report = inspect_text(collective_program(
        "%c = f32[8,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,5},{1,4},{2,7},{3,6}}, to_apply=%add"),
        mesh)
    (collective,) = report.collectives
    assert collective.scope == "flat"
    assert "one partition from each of GPUs [0, 1] but at different partition indices" in collective.reason
    assert "at different partition indices" in check_principles(report, None).hierarchical_collectives.violations[0]
