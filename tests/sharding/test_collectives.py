"""The hierarchical collectives inside shard_map on simulated (data, gpu, xcd) meshes: each equals its flat
counterpart, and the compiled program's replica groups stay inside a GPU or across GPUs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.analysis.report import inspect_compiled
from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding import collectives

MESHES = {"1x2x4": ("2x4", 1), "2x2x2": ("4x2", 2)}
ALL = ("data", "gpu", "xcd")
ROWS, COLUMNS = 8, 3


def per_device_values(mesh):
    """A [devices * ROWS, COLUMNS] array whose block on each device differs, split over all three axes."""
    values = jnp.arange(mesh.devices.size * ROWS * COLUMNS, dtype=jnp.float32).reshape(-1, COLUMNS) ** 0.5
    return jax.device_put(values, NamedSharding(mesh, P(ALL)))


def run(mesh, local, values, out_spec=P(ALL)):
    with jax.set_mesh(mesh):
        function = jax.jit(jax.shard_map(local, in_specs=P(ALL), out_specs=out_spec))
        compiled = function.lower(values).compile()
        return np.asarray(compiled(values)), inspect_compiled(compiled, mesh)


@pytest.fixture(params=list(MESHES))
def mesh(request):
    shape, data = MESHES[request.param]
    return build_mesh(shape, data=data)


def test_hierarchical_all_reduce_equals_psum_and_sends_a_slice_across_gpus(mesh):
    values = per_device_values(mesh)
    got, report = run(mesh, collectives.hierarchical_all_reduce, values)
    flat, flat_report = run(mesh, lambda x: jax.lax.psum(x, ALL), values)
    np.testing.assert_allclose(got, flat, rtol=1e-6)
    assert {(c.kind, c.scope) for c in report.collectives} == {
        ("reduce-scatter", "intra_gpu"), ("all-gather", "intra_gpu"), ("all-reduce", "inter_gpu")} or \
        {(c.kind, c.scope) for c in report.collectives} == {  # XLA:CPU prints a reduce-scatter as all-reduce + slice
        ("all-reduce", "intra_gpu"), ("all-gather", "intra_gpu"), ("all-reduce", "inter_gpu")}
    across = [c for c in report.collectives if c.scope == "inter_gpu"]
    assert [c.buffer_bytes for c in across] == [ROWS * COLUMNS * 4 // mesh.shape["xcd"]]
    assert {c.scope for c in flat_report.collectives} == {"flat"}


def test_the_pieces_equal_their_flat_forms(mesh):
    values = per_device_values(mesh)
    xcd = mesh.shape["xcd"]
    scattered, report = run(mesh, collectives.reduce_scatter_inside_gpu, values)
    summed, _ = run(mesh, lambda x: jax.lax.psum(x, "xcd"), values)
    blocks = summed.reshape(-1, xcd, ROWS, COLUMNS)  # each GPU's X identical sums
    expected = np.stack([blocks[:, i, i * ROWS // xcd:(i + 1) * ROWS // xcd] for i in range(xcd)], axis=1)
    np.testing.assert_allclose(scattered, expected.reshape(-1, COLUMNS), rtol=1e-6)
    assert {c.scope for c in report.collectives} == {"intra_gpu"}

    gathered, report = run(mesh, collectives.all_gather_inside_gpu, values)
    np.testing.assert_array_equal(gathered.reshape(-1, xcd * ROWS, COLUMNS)[::xcd].reshape(-1, xcd, ROWS, COLUMNS),
                                  np.asarray(values).reshape(-1, xcd, ROWS, COLUMNS))
    assert {c.scope for c in report.collectives} == {"intra_gpu"}

    across, report = run(mesh, collectives.all_reduce_across_gpus, values)
    np.testing.assert_allclose(across, run(mesh, lambda x: jax.lax.psum(x, ("data", "gpu")), values)[0], rtol=1e-6)
    assert {c.scope for c in report.collectives} == {"inter_gpu"}


@pytest.mark.parametrize("reduction", [jax.lax.psum, jax.lax.pmax])
def test_hierarchical_psum_reduces_one_axis_at_a_time_inside_the_gpu_first(mesh, reduction):
    values = per_device_values(mesh)
    got, report = run(mesh, lambda x: collectives.hierarchical_psum(x, ("gpu", "xcd"), reduction), values)
    flat, _ = run(mesh, lambda x: reduction(x, ("gpu", "xcd")), values)
    np.testing.assert_allclose(got, flat, rtol=1e-6)
    assert [c.scope for c in report.collectives] == ["intra_gpu", "inter_gpu"]


def test_reduce_scatter_of_rows_the_partitions_do_not_divide_is_refused():
    mesh = build_mesh("2x4")
    values = jax.device_put(jnp.ones((mesh.devices.size * 6, COLUMNS)), NamedSharding(mesh, P(ALL)))
    with pytest.raises(ShardingRuleError, match=r"6 rows, which the 4 partitions of a GPU do not divide"):
        run(mesh, collectives.reduce_scatter_inside_gpu, values)


def test_a_mesh_without_a_data_axis_reduces_across_gpus_only():
    from jax.sharding import AxisType, Mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("gpu", "xcd"), axis_types=(AxisType.Explicit,) * 2)
    values = jax.device_put(jnp.ones((8 * ROWS, COLUMNS)), NamedSharding(mesh, P(("gpu", "xcd"))))
    with jax.set_mesh(mesh):
        function = jax.shard_map(collectives.hierarchical_all_reduce, in_specs=P(("gpu", "xcd")),
                                 out_specs=P(("gpu", "xcd")))
        np.testing.assert_allclose(np.asarray(jax.jit(function)(values)), 8.0)
