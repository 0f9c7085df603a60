"""The model's vocabulary: shape letters and the logical names of its activations.

Shape suffixes. Every array name in this package ends in its dimensions, one capital letter each (`x_BSD`,
`cache_LBTKE`):
  B batch (sequences)            S positions of the step's tokens   T key positions (KV cache length)
  P prompt positions             N new (generated) tokens           D d_model (the residual stream)
  H query heads                  K kv heads                         G query heads per kv head (H / K)
  E head_dim                     F d_ff (MLP width)                 X experts
  V vocabulary                   L layers

Logical names (what a layout's rule tables map to mesh axes) of the activations the model and its per-device ops
share; the weights' names are given where each weight is created.
"""
RESIDUAL = ("batch", "seq", "embed")
"""The residual stream [B, S, D]."""
ATTN_Q = ("attn_batch", "seq", "heads", "head_dim")
"""Queries and the attention output [B, S, H, E] inside attention."""
ATTN_KV = ("attn_batch", "seq", "kv_heads", "head_dim")
"""Keys and values [B, S, K, E] (one layer of the KV cache: [B, T, K, E])."""
POSITIONS = ("attn_batch", "seq")
"""Token positions [B, S] as attention sees them."""
CACHE = ("attn_batch", "cache_seq", "kv_heads", "head_dim")
"""One layer's KV cache [B, T, K, E]. Where `cache_seq` splits T over n devices, the slots are in strided order
(`model.dense_cache.write_cache`): device i holds positions i, i + n, i + 2n, ..., so that every device holds an equal
share of any prefix (split-K decode attends to its own) and the slots of a device are a prefix of its positions."""
KV_CACHE = ("layers", *CACHE)
"""The KV cache of every layer, [L, B, T, K, E] for keys and for values."""
CACHE_SCALE = CACHE[:3]
"""The scales of one layer's 8-bit keys or values [B, T, K], one per position and kv head."""
KV_CACHE_SCALE = ("layers", *CACHE_SCALE)
"""The scales of an 8-bit KV cache of every layer, [L, B, T, K] for keys and for values."""
TOKENS = ("batch", "seq")
"""Token ids, targets and per-token losses [B, S]."""
LOGITS = ("batch", "seq", "vocab")
"""Logits [B, S, V]."""
