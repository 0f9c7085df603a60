"""A Hugging Face model directory of random weights in a model's shape, for serving benchmarks: what `starscream
serve --model-dir` loads as it loads a real checkpoint, written without JAX touching a device.

The weights are drawn once (a 64 Mi-value buffer, normal with standard deviation 0.02) and each tensor takes a
window of that buffer at its own offset: real-looking values at the speed of a copy (an 8-billion-parameter model is
written at the disk's rate, not the random generator's). Norm scales are ones. The tokenizer is a word-level one
with a token per id ("t0", "t1", ...), so any id decodes to text.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ..model.config import ModelConfig
from ..model.decoder import abstract_model
from ..model.hf_checkpoint import INDEX_FILE, sources
from ..model.hf_config import CONFIG_FILE, hf_config_from_model
from ..sharding.apply import path_name

BUFFER_VALUES = 64 * 2 ** 20
SHARD_BYTES = 4 * 2 ** 30


def write_random_model(config: ModelConfig, out: str | Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Writes `config`'s model with random weights to `out` (created; an existing complete directory of the same
    config.json is kept as it is); returns it."""
    out = Path(out)
    hf_config = hf_config_from_model(config, dtype)
    if (out / CONFIG_FILE).is_file() and json.loads((out / CONFIG_FILE).read_text()) == hf_config and \
            (out / INDEX_FILE).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    store = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    shapes = _checkpoint_shapes(config)
    values = min(BUFFER_VALUES, sum(math.prod(shape) for shape in shapes.values()))
    buffer = (np.random.default_rng(seed).standard_normal(values, np.float32) * 0.02).astype(store)
    shards, current, size = [], {}, 0
    for index, (name, shape) in enumerate(shapes.items()):
        if size and size + math.prod(shape) * store.itemsize > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = _tensor(name, shape, buffer, index, store)
        size += current[name].nbytes
    shards.append(current)
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
    _word_tokenizer(config.vocab_size).save(str(out / "tokenizer.json"))
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")  # last: marks the directory complete
    return out


def _checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's name and shape, from the model's abstract parameters."""
    params = {path_name(path): variable.get_value()
              for path, variable in nnx.to_flat_state(nnx.state(abstract_model(config), nnx.Param))}
    shapes = {}
    for path, source in sources(config).items():
        shape = tuple(params[path].shape)
        for name in source.tensor_names(shape):
            shapes[name] = source.tensor_shape(shape)
    return shapes


def _tensor(name: str, shape: tuple[int, ...], buffer: np.ndarray, index: int, store) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, store)
    count = math.prod(shape)
    start = (index * 7919 * 4099) % max(buffer.size - count, 1)
    values = buffer[start:start + count] if count <= buffer.size else np.resize(buffer, count)
    return np.ascontiguousarray(values).reshape(shape)


def _word_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return tokenizer

