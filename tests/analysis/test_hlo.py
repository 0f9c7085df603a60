"""Reading compiled HLO text: replica groups in all three printed forms, collectives, matmuls, attention, run counts.

The expected groups of the iota and mesh-axis snippets are the members XLA itself runs those collectives over (an
all-gather of the partition id, executed on simulated CPU devices).
"""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.analysis.hlo import (
    ArrayShape,
    dtype_bits,
    instructions_in_loops,
    parse_hlo,
    parse_replica_groups,
    parse_shapes,
    scope_shares,
)
from starscream_jax.errors import StarscreamError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hlo"
REDUCER = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}
"""


def module(*lines: str, partitions: int = 8, computations: str = "") -> str:
    """An HLO module whose entry takes %p = f32[8,8] and runs `lines`, with %add and `computations` defined before."""
    body = "\n".join(f"  {line}" for line in lines)
    return (
        f"HloModule test, num_partitions={partitions}\n\n{REDUCER}\n{computations}\n"
        f"ENTRY %main (p: f32[8,8]) -> f32[8,8] {{\n  %p = f32[8,8]{{1,0}} parameter(0)\n{body}\n}}\n"
    )


def all_reduce_groups(groups_text: str, partitions: int = 8) -> list[list[int]]:
    text = module(
        f"ROOT %ar = f32[8,8]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups_text}, "
        "use_global_device_ids=true, to_apply=%add",
        partitions=partitions,
    )
    (collective,) = parse_hlo(text).collectives
    return collective.groups


@pytest.mark.parametrize(
    "groups_text, expected",
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("{{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("{}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ],
)
def test_explicit_groups(groups_text, expected):
    assert all_reduce_groups(groups_text) == expected


@pytest.mark.parametrize(
    "groups_text, expected",
    [
        ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("[1,8]<=[8]", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ],
)
def test_iota_groups(groups_text, expected):
    assert all_reduce_groups(groups_text) == expected


def test_iota_groups_with_transpose_on_sixteen_partitions():
    groups = all_reduce_groups("[4,4]<=[4,4]T(1,0)", partitions=16)
    assert groups == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize(
    "groups_text, expected",
    [
        ("mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh[a=2,b=4] {b}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("mesh['a'=2,'b'=4] {'b':(2)2,'a'}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
        ("mesh['a'=2,'b'=4] {'a','b':(2)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ("mesh['a'=2,'b'=2,'c'=2] {'c','a'}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
        ("mesh['a'=8] {'a':(4)2,'a':(1)2}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
    ],
)
def test_mesh_axis_groups(groups_text, expected):
    assert all_reduce_groups(groups_text) == expected


@pytest.mark.parametrize(
    "groups_text, expected",
    [
        # the mesh's devices, row-major, are the listed ids: [[3,1,7,5],[0,2,6,4]]
        ("mesh['a'=2,'b'=4], device_ids=(3,1,7,5,0,2,6,4) {'a'}", [[3, 0], [1, 2], [7, 6], [5, 4]]),
        ("mesh['a'=2,'b'=4], device_ids=(3,1,7,5,0,2,6,4) {'b'}", [[3, 1, 7, 5], [0, 2, 6, 4]]),
        # iota(8) shaped [2,4] and transposed: [0,4,1,5,2,6,3,7]
        ("mesh['axis_0'=1,'axis_1'=8], device_ids=([2,4]T(1,0)) {'axis_1'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
        ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_mesh_axis_groups_with_device_ids(groups_text, expected):
    assert all_reduce_groups(groups_text) == expected


def test_unknown_group_form_is_an_error():
    with pytest.raises(StarscreamError, match="no known form"):
        parse_replica_groups("<0,1>", 2)


def test_group_axis_missing_from_mesh_is_an_error():
    with pytest.raises(StarscreamError, match="not in the mesh"):
        parse_replica_groups("mesh['a'=2] {'b'}", 2)


def mesh_2x4(devices=None) -> Mesh:
    devices = jax.devices()[:8] if devices is None else devices
    return Mesh(np.array(devices).reshape(1, 2, 4), ("data", "gpu", "xcd"), axis_types=(AxisType.Explicit,) * 3)


@pytest.mark.parametrize("spec", [P(("xcd", "gpu")), P(("gpu", "xcd")), P("xcd"), P("gpu")])
def test_compiled_all_gather_groups_list_shards_in_order(spec):
    """Gathering dim 0 to replicated: each group must list the partitions holding rows 0.., in that order."""
    mesh = mesh_2x4()
    x = jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda a: jax.sharding.reshard(a, P()) * 2).lower(x).compile()
    (gather,) = [c for c in parse_hlo(compiled.as_text()).collectives if c.kind == "all-gather"]
    position = {device: i for i, device in enumerate(mesh.devices.flat)}
    holders_by_row = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        holders_by_row.setdefault(index[0].start or 0, []).append(position[device])
    rows = sorted(holders_by_row)
    for group in gather.groups:
        assert [holder for row in rows for holder in holders_by_row[row] if holder in group] == group


def test_collective_permute_reads_source_target_pairs():
    text = module(
        "ROOT %cp = f32[8,8]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
    )
    (permute,) = parse_hlo(text).collectives
    assert permute.kind == "collective-permute"
    assert permute.groups == []
    assert permute.source_target_pairs == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert permute.results == (ArrayShape("f32", (8, 8)),)


def test_async_pairs_count_once_with_their_results():
    text = module(
        "%ags = (f32[8,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%p), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true",
        "%agd = f32[32,8]{1,0} all-gather-done(%ags)",
        "%ars = f32[8,8]{1,0} all-reduce-start(%p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), "
        "use_global_device_ids=true, to_apply=%add",
        "%ard = f32[8,8]{1,0} all-reduce-done(%ars)",
        "%cps = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, "
        "source_target_pairs={{0,4},{4,0}}",
        "ROOT %cpd = f32[8,8]{1,0} collective-permute-done(%cps)",
    )
    kinds = [(c.kind, c.results, c.count) for c in parse_hlo(text).collectives]
    assert kinds == [
        ("all-gather", (ArrayShape("f32", (32, 8)),), 1),
        ("all-reduce", (ArrayShape("f32", (8, 8)),), 1),
        ("collective-permute", (ArrayShape("f32", (8, 8)),), 1),
    ]


def test_collectives_inside_async_wrappers_and_fusions_are_found_once():
    wrapped = """%wrapped_rs (a: f32[8,8]) -> f32[2,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %rs = f32[2,8]{1,0} reduce-scatter(%a), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
}

%fused_all-reduce (b: f32[8,8]) -> f32[8,8] {
  %b = f32[8,8]{1,0} parameter(0)
  ROOT %ar = f32[8,8]{1,0} all-reduce(%b), channel_id=2, replica_groups=mesh['x'=2,'y'=4] {'x'}, use_global_device_ids=true, to_apply=%add
}
"""
    text = module(
        "%rs-start = ((f32[8,8]{1,0}), f32[2,8]{1,0}) async-start(%p), calls=%wrapped_rs",
        "%rs-done = f32[2,8]{1,0} async-done(%rs-start), calls=%wrapped_rs",
        "%fs = ((f32[8,8]{1,0}), f32[8,8]{1,0}) fusion-start(%p), kind=kCustom, calls=%fused_all-reduce",
        "ROOT %fd = f32[8,8]{1,0} fusion-done(%fs), calls=%fused_all-reduce",
        computations=wrapped,
    )
    found = [(c.kind, c.groups, c.count) for c in parse_hlo(text).collectives]
    assert found == [
        ("reduce-scatter", [[0, 1, 2, 3], [4, 5, 6, 7]], 1),
        ("all-reduce", [[0, 4], [1, 5], [2, 6], [3, 7]], 1),
    ]


def loop_module(trip_count_config: str) -> str:
    loops = """%inner_body (s: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %s = (s32[], f32[8,8]{1,0}) parameter(0)
  %si = s32[] get-tuple-element(%s), index=0
  %sv = f32[8,8]{1,0} get-tuple-element(%s), index=1
  %ar = f32[8,8]{1,0} all-reduce(%sv), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %st = (s32[], f32[8,8]{1,0}) tuple(%si, %ar)
}

%cond (c: (s32[], f32[8,8])) -> pred[] {
  %c = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %true = pred[] constant(true)
}

%outer_body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %ti = s32[] get-tuple-element(%t), index=0
  %tv = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %d = f32[8,8]{1,0} dot(%tv, %tv), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %it = (s32[], f32[8,8]{1,0}) tuple(%ti, %d)
  ROOT %w = (s32[], f32[8,8]{1,0}) while(%it), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}
"""
    return module(
        "%zero = s32[] constant(0)",
        "%init = (s32[], f32[8,8]{1,0}) tuple(%zero, %p)",
        f"%loop = (s32[], f32[8,8]{{1,0}}) while(%init), condition=%cond, body=%outer_body{trip_count_config}",
        "ROOT %out = f32[8,8]{1,0} get-tuple-element(%loop), index=1",
        computations=loops,
    )


def test_loop_bodies_count_their_known_trip_counts_multiplied_through_nesting():
    program = parse_hlo(loop_module(', backend_config={"known_trip_count":{"n":"4"}}'))
    assert [c.count for c in program.collectives] == [12]
    assert [d.count for d in program.dots] == [4]


def test_loop_without_known_trip_count_counts_once():
    program = parse_hlo(loop_module(""))
    assert [c.count for c in program.collectives] == [3]
    assert [d.count for d in program.dots] == [1]


def test_instructions_in_loops_of_a_trip_count_include_what_their_bodies_call():
    """The outer loop runs 4 times and holds the inner one (3 trips): asking for 4 finds both bodies and the
    condition; asking for 3 finds only the inner loop's; a count no loop has finds nothing."""
    text = loop_module(', backend_config={"known_trip_count":{"n":"4"}}')
    assert {"d", "w", "ar", "c"} <= instructions_in_loops(text, 4)
    assert "loop" not in instructions_in_loops(text, 4)
    inner = instructions_in_loops(text, 3)
    assert "ar" in inner and "d" not in inner
    assert instructions_in_loops(text, 5) == frozenset()


def test_compiled_scan_counts_each_layer():
    mesh = mesh_2x4()
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    def layers(x, weights):
        def layer(carry, weight):
            weight = jax.sharding.reshard(weight, P(None, None))
            return jnp.einsum("bd,de->be", carry, weight, out_sharding=P("xcd", None)), None

        return jax.lax.scan(layer, x, weights)[0]

    with jax.set_mesh(mesh):
        compiled = jax.jit(layers).lower(sds((64, 32), P("xcd")), sds((5, 32, 32), P(None, "xcd"))).compile()
    program = parse_hlo(compiled.as_text())
    assert [(c.kind, c.count) for c in program.collectives] == [("all-gather", 5)]
    assert [(d.m, d.k, d.n, d.count) for d in program.dots] == [(16, 32, 32, 5)]


def dot_program(*lines: str, computations: str = ""):
    return parse_hlo(module(*lines, "ROOT %r = f32[8,8]{1,0} copy(%p)", computations=computations))


def test_dot_dimensions_with_batch_and_several_free_dims():
    program = dot_program(
        "%q = bf16[4,16,8,64]{3,2,1,0} parameter(1)",
        "%k = bf16[4,8,32,64]{3,2,1,0} parameter(2)",
        "%s = f32[4,8,16,32]{3,2,1,0} dot(%q, %k), lhs_batch_dims={0,2}, lhs_contracting_dims={3}, "
        'rhs_batch_dims={0,1}, rhs_contracting_dims={3}, metadata={op_name="jit(f)/attn/dot_general"}',
    )
    (dot,) = program.dots
    assert (dot.batch, dot.m, dot.k, dot.n, dot.split_k) == (32, 16, 64, 32, 1)
    assert dot.flops == 2 * 32 * 16 * 64 * 32
    assert dot.bytes == 4 * 16 * 8 * 64 * 2 + 4 * 8 * 32 * 64 * 2 + 4 * 8 * 16 * 32 * 4
    assert dot.op_name == "jit(f)/attn/dot_general"


def test_split_k_batch_is_folded_back_into_k():
    """XLA:GPU's split-K turns [128,512]x[512,1024] into a batch of 4 partial products of K=128."""
    fused = """%gemm_fusion (parameter_0: bf16[128,4,128], parameter_1: bf16[4,128,1024]) -> f32[4,128,1024] {
  %parameter_0 = bf16[128,4,128]{2,1,0} parameter(0)
  %parameter_1 = bf16[4,128,1024]{2,1,0} parameter(1)
  ROOT %dot.8 = f32[4,128,1024]{2,1,0} dot(%parameter_0, %parameter_1), lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, metadata={op_name="jit(loss)/jvp(bd,df->bf)/dot_general"}, backend_config={"sizes":["64"]}
}
"""
    program = dot_program(
        "%x = bf16[128,4,128]{2,1,0} parameter(1)",
        "%w = bf16[4,128,1024]{2,1,0} parameter(2)",
        "%g = f32[4,128,1024]{2,1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion",
        computations=fused,
    )
    (dot,) = program.dots
    assert (dot.batch, dot.m, dot.k, dot.n, dot.split_k) == (1, 128, 512, 1024, 4)


def test_split_k_of_a_weight_first_matmul_is_folded_back_into_k():
    """XLA:GPU's merged q/k/v projection of 256 tokens: the three weights concatenated into [128, 256] and put first,
    the contraction over their 128 rows split into a leading batch of 4 (the activations hold it behind the tokens)."""
    fused = """%gemm_fusion_dot.168_computation (parameter_0.15: f32[256,4,32], parameter_1.15: f32[128,128], parameter_2.2: f32[128,64], parameter_3.1: f32[128,64]) -> f32[4,256,256] {
  %parameter_1.15 = f32[128,128]{1,0} parameter(1)
  %parameter_2.2 = f32[128,64]{1,0} parameter(2)
  %parameter_3.1 = f32[128,64]{1,0} parameter(3)
  %concatenate.30 = f32[128,256]{1,0} concatenate(%parameter_1.15, %parameter_2.2, %parameter_3.1), dimensions={1}
  %reshape.748 = f32[4,32,256]{2,1,0} reshape(%concatenate.30)
  %parameter_0.15 = f32[256,4,32]{2,1,0} parameter(0)
  %dot.199 = f32[4,256,256]{1,2,0} dot(%reshape.748, %parameter_0.15), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={1}, rhs_contracting_dims={2}, operand_precision={highest,highest}, metadata={op_name="jit(train_step)/jvp()/while/body/eval_jaxpr/bsd,dhe->bshe/dot_general" scheduling_name="dot.199"}, backend_config={"sizes":["32"]}
  ROOT %bitcast.777 = f32[4,256,256]{2,1,0} bitcast(%dot.199)
}
"""
    program = dot_program(
        "%x = f32[256,4,32]{2,1,0} parameter(1)",
        "%wq = f32[128,128]{1,0} parameter(2)",
        "%wk = f32[128,64]{1,0} parameter(3)",
        "%wv = f32[128,64]{1,0} parameter(4)",
        "%g = f32[4,256,256]{2,1,0} fusion(%x, %wq, %wk, %wv), kind=kCustom, calls=%gemm_fusion_dot.168_computation",
        computations=fused,
    )
    (dot,) = program.dots
    assert (dot.batch, dot.m, dot.k, dot.n, dot.split_k) == (1, 256, 128, 256, 4)


def test_split_k_over_the_tokens_of_a_weight_gradient_is_folded_back_into_k():
    """The down projection's weight gradient [384, 128] over 256 tokens, split 4 x 64, the activations first."""
    program = dot_program(
        "%h = f32[4,64,384]{2,1,0} parameter(1)",
        "%dy = f32[128,4,64]{2,1,0} parameter(2)",
        "%dw = f32[4,384,128]{2,1,0} dot(%h, %dy), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={1}, "
        'rhs_contracting_dims={2}, metadata={op_name="jit(train_step)/transpose(jvp())/bsf,fd->bsd/transpose"}',
    )
    (dot,) = program.dots
    assert (dot.batch, dot.m, dot.k, dot.n, dot.split_k) == (1, 384, 256, 128, 4)


def test_leading_batch_of_attention_heads_is_not_split_k():
    """Scores x values for 32 (sequence, head) pairs: the batch leads both operands, so it stays a batch."""
    program = dot_program(
        "%s = f32[32,32,64]{2,1,0} parameter(1)",
        "%v = f32[32,16,32]{2,1,0} parameter(2)",
        "%o = f32[32,64,16]{1,2,0} dot(%s, %v), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, "
        'rhs_contracting_dims={2}, metadata={op_name="jit(train_step)/attention/dot_general"}',
    )
    (dot,) = program.dots
    assert (dot.batch, dot.m, dot.k, dot.n, dot.split_k) == (32, 64, 32, 16, 1)


def test_cublas_gemm_custom_call_is_a_matmul():
    config = (
        '{"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":'
        '{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
        '"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}'
    )
    program = dot_program(
        "%x = bf16[256,64]{1,0} parameter(1)",
        "%dy = bf16[256,512]{1,0} parameter(2)",
        f'%g = (bf16[64,512]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %dy), custom_call_target="__cublas$gemm", '
        f"backend_config={config}",
    )
    (dot,) = program.dots
    assert (dot.batch, dot.m, dot.k, dot.n) == (1, 64, 256, 512)
    assert (dot.dtype, dot.bytes) == ("bf16", 2 * (256 * 64 + 256 * 512 + 64 * 512))  # x, dy and the result


def test_convolution_used_as_matmul_is_read_and_a_real_one_is_not():
    program = dot_program(
        "%x = f32[32,16]{1,0} parameter(1)",
        "%w = f32[16,24]{1,0} parameter(2)",
        "%mm = f32[32,24]{1,0} convolution(%x, %w), dim_labels=bf_io->bf",
        "%img = f32[2,9,9,16]{3,2,1,0} parameter(3)",
        "%ker = f32[3,3,16,24]{3,2,1,0} parameter(4)",
        "%conv = f32[2,7,7,24]{3,2,1,0} convolution(%img, %ker), window={size=3x3}, dim_labels=b01f_01io->b01f",
    )
    assert [(d.name, d.m, d.k, d.n) for d in program.dots] == [("mm", 32, 16, 24)]


def test_cudnn_attention_custom_call_is_recorded():
    program = dot_program(
        "%q = bf16[4,512,8,128]{3,2,1,0} parameter(1)",
        "%k = bf16[4,512,2,128]{3,2,1,0} parameter(2)",
        "%v = bf16[4,512,2,128]{3,2,1,0} parameter(3)",
        "%fmha = (bf16[4,8,512,128]{3,1,2,0}, u8[256]{0}) custom-call(%q, %k, %v), "
        'custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/dot_product_attention_fwd"}',
    )
    (call,) = program.attention
    assert call.target == "__cudnn$fmhaSoftmax"
    assert [shape.dims for shape in call.operands] == [(4, 512, 8, 128), (4, 512, 2, 128), (4, 512, 2, 128)]
    assert program.dots == []


@pytest.mark.parametrize("target", ["__gpu$xla.gpu.triton", "triton_kernel_call_ffi", "mosaic_gpu_v2"])
def test_a_custom_kernel_is_read_as_work_the_text_does_not_show(target):
    """A Pallas kernel (the grouped matmul on a GPU): listed with its name and operands, never taken for a dot or
    dropped. (The instruction is written in the form XLA prints custom-calls in; its backend config as Pallas's
    Triton lowering fills it, with the name of the `pallas_call`.)"""
    program = dot_program(
        "%tiles = s32[40]{0} parameter(1)",
        "%x = bf16[5120,4096]{1,0} parameter(2)",
        "%w = bf16[8,4096,14336]{2,1,0} parameter(3)",
        f'%gmm = bf16[5120,14336]{{1,0}} custom-call(%tiles, %x, %w), custom_call_target="{target}", '
        'backend_config={name = "grouped_matmul", ir = "", num_stages = 3 : i32, num_warps = 8 : i32}, '
        'metadata={op_name="jit(step)/moe/gate/pallas_call"}',
    )
    (kernel,) = program.kernels
    assert (kernel.target, kernel.kernel) == (target, "grouped_matmul")
    assert kernel.op_name == "jit(step)/moe/gate/pallas_call"
    assert [shape.dims for shape in kernel.operands] == [(40,), (5120, 4096), (8, 4096, 14336)]
    assert (program.dots, program.attention, kernel.count) == ([], [], 1)


def test_shapes_and_element_sizes():
    assert parse_shapes("(bf16[2,3]{1,0}, (f32[4]{0}, s8[]), token[])") == (
        ArrayShape("bf16", (2, 3)),
        ArrayShape("f32", (4,)),
        ArrayShape("s8", ()),
    )
    assert [dtype_bits(t) for t in ("pred", "bf16", "f8e4m3fn", "s4", "c64", "f64")] == [8, 16, 8, 4, 64, 64]
    assert ArrayShape("s4", (3,)).bytes == 2


def test_text_without_computations_is_an_error():
    with pytest.raises(StarscreamError, match="no HLO computation"):
        parse_hlo("not a program")


def test_every_collective_kind_is_read_with_its_groups_and_result():
    """A ragged all-to-all's array is what it sends (its first operand), not its worst-case receive buffer."""
    text = module(
        "%a2a = f32[8,8]{1,0} all-to-all(%p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}",
        "%o = f32[16,8]{1,0} parameter(1)",
        "%s = s64[2]{0} parameter(2)",
        "%ragged = f32[16,8]{1,0} ragged-all-to-all(%p, %o, %s, %s, %s, %s), channel_id=2, "
        "replica_groups=[4,2]<=[2,4]T(1,0)",
        "%bcast = f32[8,8]{1,0} collective-broadcast(%p), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}",
        "%t = token[] after-all()",
        "%send = (f32[8,8]{1,0}, u32[], token[]) send(%p, %t), channel_id=4, "
        'frontend_attributes={_xla_send_recv_source_target_pairs="{{0,4},{4,0}}"}',
        "%send-done = token[] send-done(%send), channel_id=4",
        "%recv = (f32[8,8]{1,0}, u32[], token[]) recv(%t), channel_id=5, "
        'frontend_attributes={_xla_send_recv_source_target_pairs="{{0,4},{4,0}}"}',
        "%recv-done = (f32[8,8]{1,0}, token[]) recv-done(%recv), channel_id=5",
        "ROOT %future = f32[8,8]{1,0} all-to-all-v9(%p), channel_id=6, replica_groups={{0,1}}",
    )
    found = [(c.kind, c.known, c.grouped, c.groups or c.source_target_pairs, c.results)
             for c in parse_hlo(text).collectives]
    shape = (ArrayShape("f32", (8, 8)),)
    assert found == [
        ("all-to-all", True, True, [[0, 4], [1, 5], [2, 6], [3, 7]], shape),
        ("ragged-all-to-all", True, True, [[0, 4], [1, 5], [2, 6], [3, 7]], shape),
        ("collective-broadcast", True, True, [[0, 1, 2, 3], [4, 5, 6, 7]], shape),
        ("send", True, True, [(0, 4), (4, 0)], shape),
        ("recv", True, True, [(0, 4), (4, 0)], shape),
        ("all-to-all-v9", False, True, [[0, 1]], shape),
    ]


def test_a_collective_without_groups_says_so():
    text = module("ROOT %ar = f32[8,8]{1,0} all-reduce(%p), channel_id=1, to_apply=%add")
    (collective,) = parse_hlo(text).collectives
    assert (collective.groups, collective.grouped) == ([], False)


@pytest.mark.parametrize(
    "groups_text, message",
    [
        ("[2,4]<=[6]", "do not hold the 6 ids"),
        ("[4,4]<=[16]", "the program has 8 partitions"),
        ("[2,4]<=[2,4]T(0,2)", "not a permutation"),
        ("{{0,1},{2,9}}", "the program has 8 partitions"),
        ("{{0,0}}", "each once per group"),
        ("mesh['a'=4,'b'=4] {'a'}", "the program has 8 partitions"),
        ("mesh['a'=2,'b'=4], device_ids=(0,1,2,3) {'a'}", "list 4 device ids for a mesh of 8"),
        ("mesh['a'=8] {'a':(2)3}", "sub-axes do not divide"),
    ],
)
def test_malformed_replica_groups_are_clear_errors(groups_text, message):
    with pytest.raises(StarscreamError, match=message):
        parse_replica_groups(groups_text, 8)


def test_source_target_pairs_outside_the_program_are_an_error():
    text = module("ROOT %cp = f32[8,8]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{0,8}}")
    with pytest.raises(StarscreamError, match="source-target pairs"):
        parse_hlo(text)


def test_a_partition_may_send_to_itself():
    """A collective-permute pair {0,0} is legal (XLA emits them, in the tiny model's decode plan among others)."""
    text = module("ROOT %cp = f32[8,8]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{0,0},{1,2}}")
    (permute,) = parse_hlo(text).collectives
    assert permute.source_target_pairs == [(0, 0), (1, 2)]


def test_a_dot_xla_left_unnamed_takes_its_deepest_named_neighbours_op_name():
    """XLA drops the op name of a dot whose size-1 dimensions it rewrites (attention at one kv head per device); the
    dot's inputs and result are made and used inside attention (softmax), deeper in the scopes than the rope output."""
    program = parse_hlo(module(
        "%q = f32[8,16,1]{2,1,0} concatenate(%p, %p), dimensions={0}, metadata={op_name=\"jit(s)/body/concatenate\"}",
        "%k = f32[8,16,32]{2,1,0} copy(%p), metadata={op_name=\"jit(s)/body/attention/shard_map/dynamic_slice\"}",
        "%scores = f32[8,1,32]{2,1,0} dot(%q, %k), lhs_batch_dims={0}, lhs_contracting_dims={1}, "
        "rhs_batch_dims={0}, rhs_contracting_dims={1}",
        "%peak = f32[8,1]{1,0} reduce(%scores, %p), dimensions={2}, to_apply=%add, "
        "metadata={op_name=\"jit(s)/body/attention/shard_map/vmap()/reduce_max\"}",
        "%named = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
        "metadata={op_name=\"jit(s)/body/o/dot_general\"}",
    ))
    scores, named = program.dots
    assert scores.op_name == "jit(s)/body/attention/shard_map/vmap()/reduce_max" and scores.inferred_name
    assert named.op_name == "jit(s)/body/o/dot_general" and not named.inferred_name


def test_a_dot_fused_without_a_name_is_named_through_its_fusion():
    fused = (
        "%fused (param_0: f32[8,8], param_1: f32[8,8]) -> f32[8,8] {\n"
        "  %param_0 = f32[8,8]{1,0} parameter(0)\n  %param_1 = f32[8,8]{1,0} parameter(1)\n"
        "  ROOT %dot.1 = f32[8,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
        "}\n"
    )
    program = parse_hlo(module(
        "%x = f32[8,8]{1,0} copy(%p), metadata={op_name=\"jit(s)/transpose(jvp())/attention/vmap()/mul\"}",
        "%f = f32[8,8]{1,0} fusion(%x, %p), kind=kCustom, calls=%fused",
        computations=fused,
    ))
    (dot,) = program.dots
    assert dot.op_name == "jit(s)/transpose(jvp())/attention/vmap()/mul" and dot.inferred_name


def test_a_dot_named_by_a_transpose_of_an_elementwise_einsum_is_named_by_its_neighbours():
    """Qwen2 under starscream_fsdp: XLA folded the transpose beginning the value bias's gradient (a sum over the
    tokens of `...ab,ab->...ab`, which contracts nothing) into the value-gradient matmul of attention, which took its
    name, as did the fusion around it. That name belongs to no matmul: the dot is named by its operands, attention's,
    and paired with gpu_tp's (it was left out: "not judged (2 of 39 ops)"). A transpose of an einsum that contracts
    something keeps naming its own dot."""
    bias = "jit(s)/transpose(jvp(closed_call))/...ab,ab->...ab/transpose"
    fused = (
        "%fused (param_0: f32[8,8], param_1: f32[8,8]) -> f32[8,8] {\n"
        "  %param_0 = f32[8,8]{1,0} parameter(0)\n  %param_1 = f32[8,8]{1,0} parameter(1)\n"
        "  ROOT %dot.1 = f32[8,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
        f"metadata={{op_name=\"{bias}\"}}\n"
        "}\n"
    )
    attention = "jit(s)/transpose(jvp(closed_call))/attention/shard_map/vmap(BNTS,BSNH->BTNH)/transpose"
    program = parse_hlo(module(
        f"%x = f32[8,8]{{1,0}} copy(%p), metadata={{op_name=\"{attention}\"}}",
        f"%f = f32[8,8]{{1,0}} fusion(%x, %p), kind=kCustom, calls=%fused, metadata={{op_name=\"{bias}\"}}",
        "%down = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
        "metadata={op_name=\"jit(s)/transpose(jvp(closed_call))/down/bsf,fd->bsd/transpose\"}",
        computations=fused,
    ))
    (dot, down) = sorted(program.dots, key=lambda matmul: matmul.name)
    assert dot.op_name == attention and dot.inferred_name
    assert down.op_name.endswith("/down/bsf,fd->bsd/transpose") and not down.inferred_name


LAYER_LOOP = """%slice_layer (param_0.1: f32[2,8,8], param_1.1: s32[]) -> f32[8,8] {
  %param_0.1 = f32[2,8,8]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %ds = f32[1,8,8]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %zero.1, %zero.1), dynamic_slice_sizes={1,8,8}
  ROOT %bc = f32[8,8]{1,0} bitcast(%ds)
}

%layer_cond (c.1: (s32[], f32[8,8], f32[2,8,8], f32[8,8])) -> pred[] {
  %c.1 = (s32[], f32[8,8]{1,0}, f32[2,8,8]{2,1,0}, f32[8,8]{1,0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

%layer (l: (s32[], f32[8,8], f32[2,8,8], f32[8,8])) -> (s32[], f32[8,8], f32[2,8,8], f32[8,8]) {
  %l = (s32[], f32[8,8]{1,0}, f32[2,8,8]{2,1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%l), index=0
  %resid = f32[8,8]{1,0} get-tuple-element(%l), index=1
  %stack = f32[2,8,8]{2,1,0} get-tuple-element(%l), index=2
  %kv = f32[8,8]{1,0} get-tuple-element(%l), index=3
  %w = f32[8,8]{1,0} fusion(%stack, %i), kind=kLoop, calls=%slice_layer
  %h = f32[8,8]{1,0} multiply(%resid, %resid)
  %row = f32[1,8]{1,0} slice(%h), slice={[0:1], [0:8]}
  %kv.1 = f32[8,8]{1,0} dynamic-update-slice(%kv, %row, %i, %i)
  %proj = f32[8,8]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %first = f32[8,8]{1,0} dot(%w, %h), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %carried = f32[8,8]{1,0} dot(%resid, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %scores = f32[8,8]{1,0} dot(%h, %kv.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %both = f32[8,8]{1,0} dot(%h, %proj), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %next = f32[8,8]{1,0} add(%resid, %both)
  %one = s32[] constant(1)
  %i.1 = s32[] add(%i, %one)
  ROOT %trip = (s32[], f32[8,8]{1,0}, f32[2,8,8]{2,1,0}, f32[8,8]{1,0}) tuple(%i.1, %next, %stack, %kv.1)
}
"""


def test_a_matmuls_weight_operand_is_the_one_moved_from_the_steps_arguments():
    """A rolled layer loop: the layer's weight is sliced from the stacked weights the loop carries unchanged, the KV
    cache is written in place, the residual stream enters as an argument but each trip computes the next one. The
    operand that is an argument moved without arithmetic is the weight side, whichever operand XLA put first; a
    product of two computed values has none."""
    program = parse_hlo(module(
        "%stacked = f32[2,8,8]{2,1,0} parameter(1)",
        "%cache = f32[8,8]{1,0} parameter(2)",
        "%zero = s32[] constant(0)",
        "%init = (s32[], f32[8,8]{1,0}, f32[2,8,8]{2,1,0}, f32[8,8]{1,0}) tuple(%zero, %p, %stacked, %cache)",
        "%loop = (s32[], f32[8,8]{1,0}, f32[2,8,8]{2,1,0}, f32[8,8]{1,0}) while(%init), condition=%layer_cond, "
        'body=%layer, backend_config={"known_trip_count":{"n":"2"}}',
        "ROOT %r = f32[8,8]{1,0} get-tuple-element(%loop), index=1",
        computations=LAYER_LOOP,
    ))
    assert {dot.name: dot.weight_operand for dot in program.dots} == {
        "proj": "rhs", "first": "lhs", "carried": "rhs", "scores": "rhs", "both": ""}


@pytest.mark.parametrize("layout, batch, heads, kv_heads", [
    ("gpu_tp", 4, 8, 2), ("starscream_tp", 1, 8, 2), ("flat_tp", 4, 1, 1)])
def test_cudnn_attention_work_is_read_from_a_real_h200_program(layout, batch, heads, kv_heads):
    """Forward: scores and values, 2 x (batch x heads) x 128 queries x 64 head_dim x 128 keys each; backward: four
    such matmuls. The programs are tests/fixtures/hlo (compiled on an H200, GQA of `heads` over `kv_heads`)."""
    text = (FIXTURES / f"cudnn_attention_{layout}.hlo.txt").read_text()
    forward, backward = parse_hlo(text).attention
    one_matmul = 2 * batch * heads * 128 * 64 * 128
    assert (forward.target, forward.flops) == ("__cudnn$fmhaSoftmax", 2 * one_matmul)
    assert (backward.target, backward.flops) == ("__cudnn$fmhaSoftmaxBackward", 4 * one_matmul)
    assert forward.operands[1].dims == (batch, 128, kv_heads, 64)


def test_scope_shares_split_a_collective_xla_combined_by_its_parts_bytes():
    """An all-reduce XLA combined from the optimizer's scalar sum and two layer gradients: the layers' share is their
    bytes' share; a plain op is in the scope or not; a dot XLA left unnamed goes by its neighbour's name."""
    text = module(
        "%s = f32[] reduce(%p, %p), dimensions={0,1}, to_apply=%add",
        "%ar = (f32[], f32[8,8]{1,0}, f32[4,8]{1,0}) all-reduce(%s, %p, %p), channel_id=1, replica_groups={{0,1}}, "
        "to_apply=%add, metadata={op_name=\"jit(s)/(optimizer/reduce_sum:transpose(jvp())/closed_call/up/dot_general:"
        "transpose(jvp())/closed_call/down/dot_general)\"}",
        "%q = f32[8,8]{1,0} copy(%p), metadata={op_name=\"jit(s)/closed_call/qkv/(a/dot_general:b/dot_general)\"}",
        "%d = f32[8,8]{1,0} dot(%q, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "%o = f32[8,8]{1,0} copy(%p), metadata={op_name=\"jit(s)/logits/dot_general\"}",
    )
    shares = scope_shares(text, "closed_call")
    assert shares["ar"] == pytest.approx((256 + 128) / (4 + 256 + 128))
    assert shares["q"] == shares["d"] == 1.0 and "o" not in shares and "s" not in shares
