"""Split-K attention: parts of the key positions attended apart and merged equal attention over all of them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.analysis.hlo import parse_hlo
from starscream_jax.analysis.report import classify_scope
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.split_k import PartialAttention, combine_partials, merge_partials, partial_attention

B, S, H, K, E, T = 2, 3, 4, 2, 8, 24


def inputs():
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (B, S, H, E))
    k, v = (jax.random.normal(key, (B, T, K, E)) * 3 for key in keys[1:])  # peaked scores: the max matters
    return q, k, v


def visible(lengths_B):
    """Each row's queries see the keys at positions below its length [B] (a cache prefix)."""
    return jnp.broadcast_to(jnp.arange(T)[None, None, :] < lengths_B[:, None, None], (B, S, T))


def reference(q, k, v, visible_BST):
    return jax.nn.dot_product_attention(q, k, v, mask=visible_BST[:, None])


def stacked(parts: list[PartialAttention]) -> PartialAttention:
    return jax.tree.map(lambda *fields: jnp.stack(fields), *parts)


SPLITS = [(0, 24), (0, 5, 24), (0, 1, 9, 16, 24), (0, 12, 20, 24)]
"""Bounds of the parts of the T key positions: one part, ragged parts, and parts that hold no visible key."""


@jax.jit
def merged_splits(q, k, v, mask):
    """combine_partials of the parts of each of SPLITS: [(out, max, sum)] per split."""
    merged = []
    for bounds in SPLITS:
        parts = [partial_attention(q, k[:, a:b], v[:, a:b], mask[:, :, a:b]) for a, b in zip(bounds, bounds[1:])]
        merged.append(combine_partials(stacked(parts)))
    return merged


def test_combined_parts_equal_attention_over_every_key():
    """Row lengths 7 and 11: the parts past them hold no visible key and weigh nothing."""
    q, k, v = inputs()
    mask = visible(jnp.array([7, 11]))
    whole = partial_attention(q, k, v, mask)
    for merged in merged_splits(q, k, v, mask):
        np.testing.assert_allclose(merged.out, reference(q, k, v, mask), atol=1e-5)
        np.testing.assert_allclose(merged.max, whole.max, atol=1e-6)
        np.testing.assert_allclose(merged.sum, whole.sum, rtol=1e-5)


def test_no_visible_key_anywhere_gives_zeros_not_nan():
    q, k, v = inputs()
    for merged in merged_splits(q, k, v, jnp.zeros((B, S, T), bool)):
        np.testing.assert_array_equal(merged.out, 0.0)


@pytest.fixture(scope="module")
def mesh():
    return build_mesh("2x4")


@pytest.mark.parametrize("key_axes", [("xcd",), ("gpu", "xcd")])
def test_merge_across_devices_equals_attention_and_stays_hierarchical(mesh, key_axes):
    """Keys split over the partitions of each GPU (and over the GPUs too): one collective per axis, each inside one
    GPU or taking one partition from each GPU."""
    q, k, v = inputs()
    mask = visible(jnp.array([5, 19]))

    def local(q, k, v, mask):
        return merge_partials(partial_attention(q, k, v, mask), key_axes).out

    specs = (P(), P(None, key_axes), P(None, key_axes), P(None, None, key_axes))
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip((q, k, v, mask), specs)]
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P()))
    np.testing.assert_allclose(step(*args), reference(q, k, v, mask), atol=1e-5)
    program = parse_hlo(step.lower(*args).compile().as_text())
    scopes = {classify_scope(group, mesh) for c in program.collectives for group in c.groups}
    assert len(program.collectives) == len(key_axes)
    assert scopes == ({"intra_gpu"} if key_axes == ("xcd",) else {"intra_gpu", "inter_gpu"})
