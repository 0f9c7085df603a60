"""The model: configurations as data (`config`), the Llama-family decoder in Flax NNX (`decoder`), the per-device
ops it runs inside `jax.shard_map` (`ops`: attention, embedding lookup, cross entropy) and its vocabulary of shape
letters and logical names (`names`)."""
