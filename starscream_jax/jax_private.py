"""The private JAX APIs the library leans on, each with the reason no public one serves, so that a JAX upgrade has
one module to check. The tested JAX and Flax versions are pinned as upper bounds in pyproject.toml.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax._src import distributed as _distributed
from jax._src import xla_bridge as _xla_bridge


def backends_started() -> bool:
    """Whether JAX's backend has started. Every public API that could tell (`jax.devices`, `jax.device_count`)
    starts it, after which the CPU device count of a simulated mesh can no longer be chosen."""
    return _xla_bridge.backends_are_initialized()


def joined_processes() -> int:
    """How many processes `jax.distributed.initialize` joined (1 before or without it). `jax.process_count()` would
    start the backend, so the mesh builder could not then size the simulated devices of each process."""
    return _distributed.global_state.num_processes


def cudnn_paged_decode(q_B1HE, pages_k_PAKE, pages_v_PAKE, table_BM, lengths_B, scale: float):
    """cuDNN's paged attention of one query per row [B, 1, H, E] over the pages [P, A, K, E] its block table [B, M]
    names, each row seeing its first `lengths_B` positions (int32); [B, 1, H, E] out. Query heads h read kv head
    h // (H / K). The public `jax.nn.dot_product_attention` takes no page table, and JAX's private
    `fused_attention_stablehlo.paged_attention` refuses a pool of any size but B * M pages, which the cuDNN kernel
    does not need: its pages are a shared pool (checked against the gathered form on an H200, run 38). So the
    primitive is called under that check, with a padding mask and no bias, dropout or residual."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    rows = q_B1HE.shape[0]
    table = table_BM[:, None, :, None]
    unused = jnp.zeros(0, q_B1HE.dtype)
    return cudnn._dot_product_attention(
        q_B1HE, pages_k_PAKE, pages_v_PAKE, unused, jnp.ones((rows,), jnp.int32), lengths_B, unused, unused,
        table, table, scale, 0, 0.0, (False, False), cudnn.MaskType.PADDING, cudnn.AttentionLayout.BTNH.value, None,
        cudnn.check_cudnn_version(), False)
