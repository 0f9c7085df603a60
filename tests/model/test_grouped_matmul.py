"""The grouped matmul (its Pallas kernels in interpret mode, and the batched-matmul path) against one matmul per
group, forward and gradients, with uneven and empty groups and tiles past the live rows; and the routed block run
through the kernels against the dense reference. (Pallas interpret mode cannot run inside a shard map whose
manual axes are typed: the layouts' equivalence tests run the batched-matmul path.)"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.errors import PresetError, StarscreamError
from starscream_jax.model import grouped_matmul as kernels
from starscream_jax.model import moe
from starscream_jax.model.grouped_matmul import Blocks, grouped_matmul
from tests.model.test_moe import block_inputs, config, dense_block, loss_and_grads, max_errors

pytestmark = pytest.mark.filterwarnings(  # a Pallas API on its way out fails here first; the Triton backend's own
    "error:(?!The Pallas Triton backend is deprecated):DeprecationWarning")  # notice (JAX 0.11): docs/layouts.md

TILE, K, F = 16, 32, 48
SIZES = (32, 0, 16, 48)
"""Rows of each group, whole tiles: group 1 is empty; 2 tiles past the 96 live rows."""
SMALL_BLOCKS = Blocks(cols=16, depth=16, weight_block=16, group=2)
"""Blocks smaller than the dimensions, so that the kernels loop over columns and depth and order their programs."""


def per_group(x_RK, w_GKF):
    """The reference: one matmul per group on its rows, zeros past the live rows."""
    starts = np.cumsum((0, *SIZES))
    outs = [x_RK[start:end] @ w_GKF[g] for g, (start, end) in enumerate(zip(starts[:-1], starts[1:]))]
    return jnp.concatenate([*outs, jnp.zeros((x_RK.shape[0] - starts[-1], w_GKF.shape[2]))])


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    x_RK = rng.normal(size=(sum(SIZES) + 2 * TILE, K)).astype(np.float32)
    return x_RK, rng.normal(size=(len(SIZES), K, F)).astype(np.float32), rng.normal(size=(len(x_RK), F))


def output_and_grads(matmul, x_RK, w_GKF, cotangent_RF):
    """(out, d<out, cotangent>/d(x, w)): the forward and both gradients."""
    out, pullback = jax.vjp(matmul, x_RK, w_GKF)
    return out, pullback(cotangent_RF.astype(out.dtype))


@pytest.mark.parametrize("implementation", ["interpret", "xla"])
def test_grouped_matmul_equals_one_matmul_per_group(implementation):
    x_RK, w_GKF, cotangent_RF = inputs()
    sizes = jnp.asarray(SIZES, jnp.int32)
    matmul = functools.partial(lambda x, w: grouped_matmul(x, w, sizes, TILE, implementation, SMALL_BLOCKS))
    expected = output_and_grads(per_group, x_RK, w_GKF, cotangent_RF)
    poisoned = x_RK.copy()
    poisoned[sum(SIZES):] = np.nan  # rows past the live ones: skipped, nothing of them reaches any result
    got = jax.jit(functools.partial(output_and_grads, matmul))(poisoned, w_GKF, cotangent_RF)
    errors = max_errors(got, expected)
    assert max(errors) <= 1e-4, errors
    assert not np.any(np.asarray(got[1][1][1]))  # the empty group's weight gradient is 0
    assert np.all(np.asarray(got[0][sum(SIZES):]) == 0) and np.all(np.asarray(got[1][0][sum(SIZES):]) == 0)


def test_grouped_matmul_refuses_rows_that_are_not_whole_tiles():
    x_RK, w_GKF, _ = inputs()
    with pytest.raises(StarscreamError, match="whole tiles of 16"):
        grouped_matmul(x_RK[:-1], w_GKF, jnp.asarray(SIZES, jnp.int32), TILE, "xla")


def test_routed_block_through_the_kernels_equals_the_dense_reference(monkeypatch):
    """Every expert gets tokens but expert 3, which gets none (an empty group)."""
    monkeypatch.setattr(moe, "default_implementation", lambda: "interpret")
    c = config()
    h, w = block_inputs(tokens=(2, 8))
    h[..., 0] = 4.0
    w.router[0, 3] = -10.0  # no token picks expert 3
    _, experts, _ = moe.route(h.reshape(-1, h.shape[-1]), w.router, 2, True)
    assert 3 not in np.unique(experts) and len(np.unique(experts)) == 3
    expected = jax.jit(functools.partial(loss_and_grads, dense_block, c))(h, w)
    got = jax.jit(functools.partial(loss_and_grads, lambda c, h, w: moe.routed_mlp(c, h, w)[0], c))(h, w)
    assert max(max_errors(got, expected)) <= 2e-5



def test_the_kernel_refuses_a_width_that_is_not_a_multiple_of_16():
    x_RK, w_GKF, _ = inputs()
    with pytest.raises(PresetError, match="dimension 24 is not a multiple of 16"):
        grouped_matmul(x_RK[:, :24], w_GKF[:, :24], jnp.asarray(SIZES, jnp.int32), TILE, "interpret")


class Device:
    """A device as JAX describes it: its compute capability (CUDA) or architecture (ROCm)."""

    def __init__(self, compute_capability):
        self.compute_capability = compute_capability


@pytest.mark.parametrize(("capability", "expected"), [("9.0", 232448), ("gfx942:sramecc+:xnack-", 65536),
                                                      ("gfx950", 163840), ("7.5", 49152)])
def test_shared_memory_is_read_from_the_devices_architecture(capability, expected):
    assert kernels.shared_memory_bytes(Device(capability)) == expected


def weight_step_bytes(tile, itemsize):
    return lambda depth_block, col_block: tile * (depth_block + col_block) * itemsize


@pytest.mark.parametrize(("capability", "itemsize", "wanted", "expected"), [
    ("9.0", 2, 3, (128, 128, 3)),   # bf16 on an H200: 3 x 64 KiB fit its 227 KiB
    ("9.0", 2, 4, (128, 128, 3)),   # 4 x 64 KiB asked for 256 KiB there: Triton refused it
    ("9.0", 4, 3, (128, 128, 1)),   # float32: 2 x 128 KiB would be the 256 KiB Triton refused
    ("gfx942", 4, 3, (64, 64, 1)),  # float32 on an MI300X's 64 KiB: one stage of 64-wide blocks
])
def test_kernel_blocks_are_cut_to_the_devices_shared_memory(capability, itemsize, wanted, expected):
    available = kernels.shared_memory_bytes(Device(capability))
    got = kernels._fitted(Blocks(stages=wanted, shared_memory=available), 128, 128, weight_step_bytes(128, itemsize),
                          interpret=False)
    assert got == expected
    assert weight_step_bytes(128, itemsize)(*got[:2]) * got[2] <= kernels.shared_memory_bytes(Device(capability))


def test_blocks_that_cannot_fit_any_device_are_a_clear_error():
    available = kernels.shared_memory_bytes(Device("gfx942"))
    with pytest.raises(StarscreamError, match="smallest blocks need 524288 bytes of shared memory, more than the 65536"):
        kernels._fitted(Blocks(shared_memory=available), 128, 128, weight_step_bytes(4096, 4), interpret=False)


@pytest.mark.gpu
def test_the_kernel_on_a_gpu_equals_one_float32_matmul_per_group():
    """The compiled Triton kernels (bfloat16 in, float32 sums): relative error of the output and both gradients."""
    x_RK, w_GKF, cotangent_RF = inputs(seed=1)
    sizes = jnp.asarray(SIZES, jnp.int32)
    matmul = functools.partial(lambda x, w: grouped_matmul(x, w, sizes, TILE, "pallas", SMALL_BLOCKS))
    got = jax.jit(functools.partial(output_and_grads, matmul))(
        *(jnp.asarray(a, jnp.bfloat16) for a in (x_RK, w_GKF, cotangent_RF)))
    rounded = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (x_RK, w_GKF, cotangent_RF)]
    expected = output_and_grads(per_group, *rounded)
    for actual, reference in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        actual, reference = np.asarray(actual, np.float32), np.asarray(reference)
        assert np.linalg.norm(actual - reference) <= 1e-2 * np.linalg.norm(reference)


@pytest.mark.parametrize("blocks", [{"cols": 0}, {"depth": 24}, {"weight_block": 8}, {"stages": 0}, {"warps": 2.5},
                                    {"warps": 0}, {"shared_memory": 0}, {"shared_memory": "227 KiB"}])
def test_bad_block_sizes_are_one_clear_error(blocks):
    with pytest.raises(StarscreamError, match="grouped-matmul Blocks .*powers of two of at least 16"):
        Blocks(**blocks)


def test_operands_of_two_dtypes_are_promoted_as_a_matmul_promotes_them():
    """float32 rows against bfloat16 weights (the kernels multiply blocks of one dtype): the result is the float32
    matmul of the bfloat16 weights' values, and each gradient comes back in its operand's dtype."""
    x_RK, w_GKF, cotangent_RF = inputs()
    sizes = jnp.asarray(SIZES, jnp.int32)
    w_bf16 = jnp.asarray(w_GKF, jnp.bfloat16)
    matmul = functools.partial(lambda x, w: grouped_matmul(x, w, sizes, TILE, "interpret", SMALL_BLOCKS))
    out, (dx, dw) = jax.jit(functools.partial(output_and_grads, matmul))(x_RK, w_bf16, cotangent_RF)
    assert out.dtype == dx.dtype == jnp.float32 and dw.dtype == jnp.bfloat16
    expected = output_and_grads(per_group, x_RK, np.asarray(w_bf16, np.float32), cotangent_RF)
    assert max(max_errors((out, dx), expected[:1] + (expected[1][0],))) <= 1e-4


def test_columns_and_warps_follow_the_tile_unless_given():
    assert kernels.cols_and_warps(Blocks(), 128) == (128, 8) and kernels.cols_and_warps(Blocks(), 32) == (256, 4)
    assert kernels.cols_and_warps(Blocks(cols=64, warps=2), 128) == (64, 2)
