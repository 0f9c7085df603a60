"""Hugging Face checkpoints in and out: safetensors files (one, or shards with `model.safetensors.index.json`).

Loading is streamed and sharded: every parameter is assembled from per-device arrays
(`jax.make_array_from_single_device_arrays`); each distinct slice that this process' devices hold is read from the
safetensors file (only its byte ranges: safetensors' lazy slicing), converted to the parameter dtype, placed on the
devices that hold it and dropped. A process reads only its own devices' slices, no device holds a tensor it does not
own, and the host holds one slice at a time on top of what the devices keep.

Our parameters stack the layers (and experts) on leading axes and keep heads and head_dim apart ([L, D, H, E]); a
checkpoint holds one [H * E, D] matrix per layer. `SOURCES` says, per parameter, which tensor each layer comes from
and how its axes map onto ours; loading and export both read it, so they are each other's inverse.
"""
from __future__ import annotations

import concurrent.futures
import errno
import functools
import glob
import json
import math
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ..checks import created_directory, of_type, process_alive, whole_number, writable_directory
from ..errors import CheckpointError, StarscreamError
from ..sharding.apply import param_shardings, path_name
from .config import ModelConfig
from .decoder import Transformer, abstract_model
from .hf_config import CONFIG_FILE, family_of, hf_config_from_model, model_config_from_hf
from .quantize import QUANTIZED_INPUTS, SCALE_SUFFIX, is_scale
from .weight_formats import quantize_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
"""safetensors dtype -> numpy dtype, for the floating dtypes a parameter can be converted from."""
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}
"""safetensors dtype -> numpy dtype of the 8-bit weights a pre-quantized checkpoint stores (read as they are)."""
SCALE_TENSOR = "_scale"
"""A quantized weight `<name>.weight`'s scale is the tensor `<name>.weight_scale`."""
SAVED_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
DEFAULT_SHARD_BYTES = 5 << 30
LOAD_THREADS = min(8, os.cpu_count() or 1)
"""Parameters read at once when a checkpoint loads (each holds one block of itself on the host at a time)."""
STAGING, REPLACED = "partial", "old"
"""An export is written into `.<out>.partial-<host>-<pid>-<random>` beside `out`, and what it replaces is moved to
`.<out>.old-<host>-<pid>-<random>` until the export is in place; a later export removes those of writers gone."""
SAFETENSORS_IO = re.compile(r'I/O error: (?P<reason>.*?) \(os error (?P<errno>\d+)\)(?: at path "(?P<path>[^"]*)")?')
"""How safetensors states a failed write: 'I/O error: No space left on device (os error 28) at path "/x/y"'."""
WRITE_FIXES = {errno.ENOSPC: "free space on that file system, or pass an --out on another",
               errno.EDQUOT: "free space within your disk quota, or pass an --out on another file system",
               errno.EACCES: "pass an --out in a directory you can write to",
               errno.EPERM: "pass an --out in a directory you can write to",
               errno.EROFS: "pass an --out on a writable file system",
               errno.EBUSY: "--out cannot be replaced by a rename (a mount point?): pass a directory inside it",
               errno.EXDEV: "--out cannot be replaced by a rename (a mount point?): pass a directory inside it"}
"""errno -> the fix a failed write of an export names."""
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint tensors that are buffers recomputed from config.json, not weights (older Llama exports hold them)."""
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
"""model_type -> (the mixture-of-experts block's name, each expert's (gate, up, down) projection names)."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """Where one parameter comes from. `template` names the checkpoint tensor of one layer (and expert);
    `stacked` leading axes of ours (0, layers, or layers and experts) index those tensors. The tensor is viewed with
    dimension `split[0]` cut into (outer, split[1]) (e.g. [H * E, D] as [H, E, D]); our per-layer axes are that
    view's axes in the order `order` (ours = view.transpose(order))."""

    template: str
    stacked: int = 0
    order: tuple[int, ...] = (0,)
    split: tuple[int, int] | None = None

    def tensor_names(self, shape: tuple[int, ...]) -> list[str]:
        """Every checkpoint tensor this parameter (of `shape`) reads, layer by layer (expert by expert)."""
        return [self.name(*index) for index in np.ndindex(*shape[:self.stacked])]

    def name(self, layer: int = 0, expert: int = 0) -> str:
        return self.template.format(layer=layer, expert=expert)

    def tensor_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's shape for our parameter of `shape`."""
        view = self.view_shape(shape[self.stacked:])
        if self.split is None:
            return view
        dim = self.split[0]
        return view[:dim] + (view[dim] * view[dim + 1],) + view[dim + 2:]

    def view_shape(self, per_layer: tuple[int, ...]) -> tuple[int, ...]:
        view = [0] * len(per_layer)
        for ours, theirs in enumerate(self.order):
            view[theirs] = per_layer[ours]
        return tuple(view)

    def permutation(self) -> tuple[int, ...]:
        """The axes of a block [stacked..., *view] in our order: ours = block.transpose(permutation())."""
        return tuple(range(self.stacked)) + tuple(self.stacked + theirs for theirs in self.order)


def sources(config: ModelConfig) -> dict[str, Source]:
    """Our parameter path ("layers/wq") -> its Source, for `config`."""
    E = config.head_dim
    layer = "model.layers.{layer}."
    table = {
        "embedding": Source(template=EMBEDDING, order=(0, 1)),
        "final_norm": Source(template="model.norm.weight"),
        "layers/attn_norm": Source(template=layer + "input_layernorm.weight", stacked=1),
        "layers/wq": Source(template=layer + "self_attn.q_proj.weight", stacked=1, order=(2, 0, 1), split=(0, E)),
        "layers/wk": Source(template=layer + "self_attn.k_proj.weight", stacked=1, order=(2, 0, 1), split=(0, E)),
        "layers/wv": Source(template=layer + "self_attn.v_proj.weight", stacked=1, order=(2, 0, 1), split=(0, E)),
        "layers/wo": Source(template=layer + "self_attn.o_proj.weight", stacked=1, order=(1, 2, 0), split=(1, E)),
        "layers/mlp_norm": Source(template=layer + "post_attention_layernorm.weight", stacked=1),
    }
    if config.post_norms:  # Gemma 2: post_attention_layernorm norms the attention's output, not the MLP's input
        table["layers/mlp_norm"] = Source(template=layer + "pre_feedforward_layernorm.weight", stacked=1)
        table["layers/attn_post_norm"] = Source(template=layer + "post_attention_layernorm.weight", stacked=1)
        table["layers/mlp_post_norm"] = Source(template=layer + "post_feedforward_layernorm.weight", stacked=1)
    if not config.tie_embeddings:
        table["lm_head"] = Source(template=HEAD, order=(1, 0))
    if config.qkv_bias:
        for ours, theirs in (("bq", "q"), ("bk", "k"), ("bv", "v")):
            table[f"layers/{ours}"] = Source(template=layer + f"self_attn.{theirs}_proj.bias", stacked=1, order=(0, 1),
                                             split=(0, E))
    if config.qk_norm:
        table["layers/q_norm"] = Source(template=layer + "self_attn.q_norm.weight", stacked=1)
        table["layers/k_norm"] = Source(template=layer + "self_attn.k_norm.weight", stacked=1)
    _add_experts(config, table, layer)
    if config.weight_format:
        table.update({path + SCALE_SUFFIX: Source(template=source.template + SCALE_TENSOR, stacked=source.stacked)
                      for path, source in table.items() if path.rsplit("/", 1)[-1] in QUANTIZED_INPUTS})
    return table


def _add_experts(config: ModelConfig, table: dict[str, Source], layer: str) -> None:
    """The MLP's sources in `table`: the experts' (stacked by layer and expert) or the dense MLP's."""
    if config.n_experts:
        block, (gate, up, down) = EXPERT_NAMES[family_of(config)]
        expert = layer + block + ".experts.{expert}."
        table["layers/router"] = Source(template=layer + block + ".gate.weight", stacked=1, order=(1, 0))
        table["layers/w_gate"] = Source(template=expert + gate + ".weight", stacked=2, order=(1, 0))
        table["layers/w_up"] = Source(template=expert + up + ".weight", stacked=2, order=(1, 0))
        table["layers/w_down"] = Source(template=expert + down + ".weight", stacked=2, order=(1, 0))
    else:
        table["layers/w_gate"] = Source(template=layer + "mlp.gate_proj.weight", stacked=1, order=(1, 0))
        table["layers/w_up"] = Source(template=layer + "mlp.up_proj.weight", stacked=1, order=(1, 0))
        table["layers/w_down"] = Source(template=layer + "mlp.down_proj.weight", stacked=1, order=(1, 0))


class CheckpointReader:
    """The safetensors files of a model directory; `weight_map` says which file holds each tensor.

    The files are found as transformers' `from_pretrained` finds them in a local directory: `model.safetensors`
    when it is there, even beside a `model.safetensors.index.json` (which is then not read), else the shards the
    index names. Every shard's header is read when the reader is made (the tensors' bytes only when asked for): an
    index entry naming a file outside the directory (an absolute path, or `..`), a tensor held by two files, and an
    entry whose file does not hold its tensor are refused, naming the tensor and the files."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._handles: dict[str, object] = {}
        index_path, single_path = self.model_dir / INDEX_FILE, self.model_dir / SINGLE_FILE
        if single_path.is_file():
            self.weight_map = {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}
        elif index_path.is_file():
            self.weight_map = _read_weight_map(index_path)
            self._check_shards(index_path)
        else:
            raise CheckpointError(f"{self.model_dir} holds neither {INDEX_FILE} nor {SINGLE_FILE}; pass a Hugging "
                                  "Face model directory with its safetensors weights")

    def _check_shards(self, index_path: Path) -> None:
        """A CheckpointError unless every file the index names lies in the model directory and holds the tensors
        the index puts in it, and no tensor is held by two of them."""
        for name, file in self.weight_map.items():
            if Path(file).is_absolute() or ".." in Path(file).parts or not file:
                raise CheckpointError(f"{index_path} puts tensor {name} in {file!r}, outside {self.model_dir}; a "
                                      "shard must be a file of the model directory: fix the index")
        holders: dict[str, str] = {}
        for file in dict.fromkeys(self.weight_map.values()):
            for name in self._handle(file).keys():
                if name in holders:
                    raise CheckpointError(f"tensor {name} is in both {self.model_dir / holders[name]} and "
                                          f"{self.model_dir / file}; a checkpoint holds each tensor once: remove the "
                                          f"stale copy (the index names {self.weight_map.get(name, 'neither')})")
                holders[name] = file
        for name, file in self.weight_map.items():
            if holders.get(name) != file:
                raise CheckpointError(f"{index_path} puts tensor {name} in {self.model_dir / file}, which does not "
                                      "hold it; the index and the shards disagree: download them again")

    def _handle(self, file: str):
        """The open safetensors file `file` of the model directory (opened once)."""
        if file not in self._handles:
            self._handles[file] = self._open(file)
        return self._handles[file]

    def check_tensor_set(self, expected: set[str]) -> None:
        """A clear error unless the checkpoint holds exactly the tensors `expected` (besides rotary buffers, and a
        tied checkpoint's lm_head.weight when it equals the embedding): a config.json describing fewer layers,
        experts or projections than the weights hold would otherwise drop the rest silently."""
        held = {name for name in self.weight_map if not name.endswith(IGNORED_SUFFIXES)}
        missing, extra = sorted(expected - held), sorted(held - expected)
        if (missing, extra) in (([HEAD], []), ([], [HEAD])):
            self._check_head(tied=not missing)
            return
        if missing or extra:
            listed = "; ".join(f"{kind} {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                               for kind, names in (("missing", missing), ("unexpected", extra)) if names)
            raise CheckpointError(f"the tensors of {self.model_dir} do not match its {CONFIG_FILE}: {listed}; the "
                                  "weights and config.json come from different models: pair them again")

    def _check_head(self, tied: bool) -> None:
        """When lm_head.weight is the only tensor config.json's `tie_word_embeddings` disagrees with: fine for a tied
        checkpoint that stores the head anyway as a copy of the embedding, else a CheckpointError naming the flag
        (an untied config without the head would leave the output layer unread; a tied one whose head differs from
        the embedding would drop the stored head)."""
        config = self.model_dir / CONFIG_FILE
        if not tied:
            raise CheckpointError(f"{self.model_dir} holds no {HEAD}, but {config} has tie_word_embeddings false (or "
                                  "absent); if the output layer is the embedding, set tie_word_embeddings to true")
        if not self._head_is_the_embedding():
            raise CheckpointError(f"{config} has tie_word_embeddings true, but {HEAD} in "
                                  f"{self.model_dir / self.file_of(HEAD)} differs from {EMBEDDING}; set "
                                  "tie_word_embeddings to false to use the stored head, or remove the tensor")

    def _head_is_the_embedding(self) -> bool:
        head, embedding = self.tensor(HEAD), self.tensor(EMBEDDING)
        rows = head.get_shape()[0]
        return head.get_shape() == embedding.get_shape() and all(
            np.array_equal(head[start:min(start + 4096, rows)], embedding[start:min(start + 4096, rows)])
            for start in range(0, rows, 4096))

    def _open(self, file: str):
        path = self.model_dir / file
        if not path.is_file():
            raise CheckpointError(f"shard {path} is missing; copy the complete checkpoint (see {INDEX_FILE})")
        try:
            return safe_open(path, framework="np")
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} is not a readable safetensors file ({err}); download it again") from None

    def file_of(self, name: str) -> str:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name} is in no file of {self.model_dir}; the checkpoint is incomplete "
                                  "or is not of the model config.json describes")
        return self.weight_map[name]

    def tensor(self, name: str):
        """The lazy safetensors slice of tensor `name` (index it with slices to read those bytes only); an fp8
        tensor, which safetensors' numpy reader cannot slice, as a read-only memory map of its bytes."""
        file = self.file_of(name)
        lazy = self._handle(file).get_slice(name)
        if lazy.get_dtype() not in FP8_DTYPES:
            return lazy
        return _mapped(self.model_dir / file, name, FP8_DTYPES[lazy.get_dtype()])

    def dtype_of(self, name: str) -> str:
        """Tensor `name`'s safetensors dtype ("BF16", "F8_E4M3", ...)."""
        return self._handle(self.file_of(name)).get_slice(name).get_dtype()

    def whole(self, name: str) -> np.ndarray:
        """Tensor `name`, read whole, as stored."""
        return np.asarray(self.tensor(name)[...] if self.dtype_of(name) in FP8_DTYPES
                          else self._handle(self.file_of(name)).get_tensor(name))

    def check(self, name: str, shape: tuple[int, ...], eight_bit: bool = False) -> None:
        """A clear error when tensor `name` is missing, not of `shape`, or of a dtype the parameter cannot take
        (`eight_bit`: the parameter holds a pre-quantized checkpoint's fp8 weights as stored)."""
        where = f"tensor {name} in {self.model_dir / self.file_of(name)}"
        dtype = self.dtype_of(name)
        stored_shape = tuple(self.tensor(name).shape if dtype in FP8_DTYPES else self.tensor(name).get_shape())
        if stored_shape != tuple(shape):
            raise CheckpointError(f"{where} has shape {stored_shape}, but config.json implies "
                                  f"{tuple(shape)}; the weights do not match config.json")
        if eight_bit and dtype not in FP8_DTYPES:
            raise CheckpointError(f"{where} is stored as {dtype}, but config.json's quantization_config says fp8 "
                                  f"({', '.join(FP8_DTYPES)}); the weights do not match config.json")
        if not eight_bit and dtype in FP8_DTYPES:
            raise CheckpointError(f"{where} is stored as {dtype}, but config.json has no quantization_config; the "
                                  "weights do not match config.json")
        if not eight_bit and dtype not in DTYPES:
            raise CheckpointError(f"{where} is stored as {dtype}, which cannot be converted to a floating parameter; "
                                  f"expected one of {', '.join(DTYPES)}")

    def read(self, source: Source, index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[np.ndarray, list[str]]:
        """Our parameter's block `index` (slices of `shape`) as the checkpoint stores it: [stacked..., *view] (view:
        `source.view_shape` of our per-layer block, a split dimension cut in two) in the tensors' stored dtype
        (float32, which holds each exactly, where layers are stored in several), each layer's bytes copied in one
        straight pass; and the names of its tensors, layer by layer. Ours is its
        transpose by `source.permutation()` in the parameter's dtype, which `_load_param` takes on the device:
        numpy's transposing copies and ml_dtypes' casts run tens of times slower than a straight pass (they made
        loading an 8B checkpoint take minutes), and the stored bytes are the fewest to send."""
        bounds = [slice(*s.indices(n)) for s, n in zip(index, shape)]
        stacked, per_layer = bounds[:source.stacked], bounds[source.stacked:]
        ours = tuple(s.stop - s.start for s in bounds)
        names = [source.name(*(s.start + i for s, i in zip(stacked, at)))
                 for at in np.ndindex(*ours[:source.stacked])]
        first = self._view(source, names[0], per_layer)
        mixed = len({self.dtype_of(name) for name in names}) > 1  # layers stored in several float formats
        block = np.empty(ours[:source.stacked] + source.view_shape(ours[source.stacked:]),
                         np.float32 if mixed else first.dtype)
        layers = block.reshape((-1,) + block.shape[source.stacked:])
        for position, name in enumerate(names):
            layers[position] = first if position == 0 else self._view(source, name, per_layer)
        return block, names

    def nonfinite(self, block: np.ndarray, names: list[str]) -> CheckpointError | None:
        """The error naming the first tensor of a block read by `read` that holds a NaN or an infinity (None when
        all are finite): checked on the host only once the device found one."""
        for name, layer in zip(names, block.reshape((len(names), -1))):
            values = layer.astype(np.float32)
            if not np.isfinite(values).all():
                return CheckpointError(f"tensor {name} in {self.model_dir / self.file_of(name)} holds "
                                       f"{_nonfinite(values)}; the checkpoint is damaged: download or export it "
                                       "again")
        return None

    def _view(self, source: Source, name: str, ours: list[slice]) -> np.ndarray:
        """One tensor's bytes for our per-layer slices `ours`, in the checkpoint's axis order (a view, in the
        stored dtype): the view's slices, the split dimension read as one contiguous range of whole outer rows and
        cut after."""
        view = [slice(None)] * len(ours)
        for axis, theirs in enumerate(source.order):
            view[theirs] = ours[axis]
        if source.split is None:
            return self.tensor(name)[tuple(view)]
        dim, inner = source.split
        outer, cut = view[dim], view[dim + 1]
        read = view[:dim] + [slice(outer.start * inner, outer.stop * inner)] + view[dim + 2:]
        block = self.tensor(name)[tuple(read)]
        block = block.reshape(block.shape[:dim] + (outer.stop - outer.start, inner) + block.shape[dim + 1:])
        return block[(slice(None),) * (dim + 1) + (cut,)]


def _nonfinite(block: np.ndarray) -> str:
    """"3 NaN and 1 infinite values": what is not finite in `block`."""
    nans = int(np.isnan(block).sum())
    return f"{nans} NaN and {int((~np.isfinite(block)).sum()) - nans} infinite values"


def _read_weight_map(path: Path) -> dict[str, str]:
    """The tensor -> file map of a safetensors index, checked to be one; a tensor named twice in it (JSON keeps the
    last silently) is refused, naming its files."""
    repeated = []  # (key, first value, second value) of every key an object of the file gives twice

    def noting_repeats(pairs: list[tuple]) -> dict:
        mapping = {}
        for key, value in pairs:
            if key in mapping:
                repeated.append((key, mapping[key], value))
            mapping[key] = value
        return mapping

    try:
        weight_map = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=noting_repeats)["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is not a safetensors index ({type(err).__name__}: {err}); fix or replace "
                              "it") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: weight_map is not an object of tensor name -> file name; fix or replace it")
    for name, first, second in repeated:
        if weight_map.get(name) is second and first != second:
            raise CheckpointError(f"{path} names tensor {name} twice (in {first} and in {second}); a checkpoint "
                                  "holds each tensor once: fix the index")
    return weight_map


def load_hf_model(model_dir: str | Path, layout, mesh, dtype: str | None = None,
                  config: ModelConfig | None = None, quantize: str = "", scales: str = "channel") -> Transformer:
    """The Transformer of a Hugging Face model directory, each parameter (float32) built shard by shard straight
    into `layout`'s params placement on `mesh`. `dtype` sets the compute dtype; `config` replaces config.json's.

    Before any device is written, the checkpoint must hold exactly the tensors the configuration describes, each of
    its shape and a floating dtype; each block read is checked finite (a NaN is a CheckpointError naming the
    tensor, not a model that generates nothing).

    `quantize` (one of quantize.WEIGHT_FORMATS) stores the layers' projections in 8 bits with `scales` per output
    channel or per layer (`weight_formats.quantize_model`, on the devices). A pre-quantized fp8 checkpoint
    (config.json's `quantization_config`, `hf_config.quantization_fields`) loads its fp8 weights and their
    `weight_scale` tensors as stored."""
    of_type(mesh, Mesh, "mesh", "a jax.sharding.Mesh, as starscream_jax.build_mesh gives")
    of_type(config, (ModelConfig, type(None)), "config", "a ModelConfig or None (read config.json)")
    config = config or model_config_from_hf(model_dir)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    if quantize and config.weight_format:
        raise CheckpointError(f"{model_dir} holds weights already quantized to {config.weight_format}; drop the "
                              "quantization asked for (--quantize)")
    model = _load(CheckpointReader(model_dir), config, layout, mesh)
    return quantize_model(model, quantize, scales, layout, mesh) if quantize else model


def _load(reader: CheckpointReader, config: ModelConfig, layout, mesh) -> Transformer:
    """The Transformer `config` describes, its parameters read from `reader` into `layout`'s placement, up to
    LOAD_THREADS parameters at a time (reading the files, copying the bytes and sending them to the devices release
    Python's lock, so the parameters' reads overlap one another's transfers)."""
    table = sources(config)
    graphdef, abstract, rest = nnx.split(abstract_model(config), nnx.Param, ...)
    shardings = param_shardings(abstract, layout, mesh)
    variables = nnx.to_flat_state(abstract)
    checks = {}  # every tensor checked before any device is written: shape and whether it is stored in 8 bits
    for path, variable in variables:
        source, shape = table[path_name(path)], tuple(variable.shape)
        for name in source.tensor_names(shape):
            checks[name] = None if is_scale(path_name(path)) else (source.tensor_shape(shape),
                                                                   np.dtype(variable.dtype).itemsize == 1)
    reader.check_tensor_set(set(checks))
    for name, expected in checks.items():
        if expected is not None:
            reader.check(name, *expected)
    leaves = jax.tree.leaves(shardings, is_leaf=lambda node: isinstance(node, jax.sharding.Sharding))

    def load(item):
        (path, variable), sharding = item
        loader = _load_scale if is_scale(path_name(path)) else _load_param
        return path, loader(reader, table[path_name(path)], variable, sharding)

    with concurrent.futures.ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="starscream-load") as pool:
        loaded = list(pool.map(load, zip(variables, leaves)))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded), rest)


def _load_scale(reader: CheckpointReader, source: Source, variable: nnx.Variable, sharding) -> nnx.Variable:
    """`variable` (abstract: a quantized weight's scale [L, ...]) from each layer's `weight_scale` tensor ([out, 1]
    per output channel, [1] or [] per tensor; a few values each, read whole), in float32."""
    shape = tuple(variable.shape)
    per_layer = shape[source.stacked:]
    layers = []
    for name in source.tensor_names(shape):
        stored = reader.whole(name)
        if stored.size != math.prod(per_layer):
            raise CheckpointError(f"tensor {name} in {reader.model_dir / reader.file_of(name)} holds {stored.size} "
                                  f"scales, but its weight has {math.prod(per_layer)} output channels ("
                                  f"quantization_config strategy); the scales do not match config.json")
        layers.append(stored.astype(np.float32).reshape(per_layer))
    return variable.replace(jax.device_put(np.stack(layers).reshape(shape), sharding))


def _mapped(path: Path, name: str, dtype) -> np.ndarray:
    """Tensor `name` of the safetensors file `path` as a read-only memory map in `dtype` (the format: an 8-byte
    little-endian header length, a JSON header giving each tensor's shape and byte range, then the bytes)."""
    with open(path, "rb") as file:
        header_length = int.from_bytes(file.read(8), "little")
        entry = json.loads(file.read(header_length))[name]
    start, _ = entry["data_offsets"]
    return np.memmap(path, dtype=dtype, mode="r", offset=8 + header_length + start, shape=tuple(entry["shape"]))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _as_ours(block, permutation: tuple[int, ...], dtype):
    """A block read as stored ([stacked..., *view], its stored dtype) in our axis order and dtype, on its device."""
    return jnp.transpose(block, permutation).astype(dtype)


@jax.jit
def _all_finite(block) -> jax.Array:
    return jnp.isfinite(block).all()


def _load_param(reader: CheckpointReader, source: Source, variable: nnx.Variable, sharding) -> nnx.Variable:
    """`variable` (abstract) holding the global array read from the checkpoint: each distinct block this process'
    devices hold is read once, placed on every device that holds it, and dropped before the next is read."""
    shape = tuple(variable.shape)
    devices_of_block: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
        devices_of_block.setdefault(tuple((s.start, s.stop) for s in bounds), []).append((device, bounds))
    shards, permutation = {}, source.permutation()
    for holders in devices_of_block.values():
        block, names = reader.read(source, holders[0][1], shape)
        for device, _ in holders:
            shards[device] = _as_ours(jax.device_put(block, device), permutation, np.dtype(variable.dtype))
        if not bool(_all_finite(shards[holders[0][0]])):
            raise reader.nonfinite(block, names)
    ordered = [shards[device] for device in sharding.addressable_devices_indices_map(shape)]
    return variable.replace(jax.make_array_from_single_device_arrays(shape, sharding, ordered))


def export_hf_model(model: Transformer, out_dir: str | Path, dtype: str = "float32", *,
                    tokenizer_dir: str | Path | None = None, source_config: dict | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, replace: bool = False) -> list[Path]:
    """Write `model` as a Hugging Face model directory: safetensors shards of at most `max_shard_bytes` (one
    `model.safetensors` when it fits, else numbered shards and `model.safetensors.index.json`), `config.json`
    (keeping `source_config`'s other fields, such as token ids) and the tokenizer files of `tokenizer_dir`.

    The files are written into a fresh directory beside `out_dir` and moved into place whole, so `out_dir` holds
    either its old content or the complete export, never a mix. An `out_dir` holding anything is refused unless
    `replace`, which replaces it entirely (`check_export_target`). Tensors are gathered one layer at a time, so the
    host holds one shard's worth at most. Every process must call this; process 0 writes. Returns the files
    written (their final paths)."""
    of_type(model, Transformer, "model", "a Transformer (load_hf_model or restore_model gives one)", CheckpointError)
    if dtype not in SAVED_DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}; use one of {', '.join(SAVED_DTYPES)}")
    whole_number(max_shard_bytes, "max_shard_bytes (--shard-size)")
    if model.config.weight_format:
        raise CheckpointError(f"model {model.config.name} holds {model.config.weight_format} weights; export the "
                              "float model it was quantized from")
    if model.config.vocab_padding:
        raise CheckpointError(f"model {model.config.name} holds {model.config.vocab_padding} padding rows past its "
                              f"{model.config.vocab_tokens} tokens (placed for inference); export the model as "
                              "trained or loaded")
    out, config, writing = Path(out_dir), model.config, jax.process_index() == 0
    check_export_target(out, replace, reads=[tokenizer_dir] if tokenizer_dir else [])
    params = {path_name(path): variable.get_value()
              for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    plan = _shard_plan(config, params, np.dtype(SAVED_DTYPES[dtype]).itemsize, max_shard_bytes)
    files = [SINGLE_FILE] if len(plan) == 1 else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
                                                    for i in range(len(plan))]
    staging = _staging_directory(out) if writing else None
    try:
        for file, tensors in zip(files, plan):
            shard = {name: _gathered(params[path], source, at).astype(SAVED_DTYPES[dtype])
                     for name, path, source, at in tensors}
            if writing:
                save_file(shard, staging / file, metadata={"format": "pt"})
        if not writing:
            return []
        if len(plan) > 1:
            weight_map = {name: file for file, tensors in zip(files, plan) for name, *_ in tensors}
            total = sum(math.prod(params[path].shape) for path in params) * np.dtype(SAVED_DTYPES[dtype]).itemsize
            (staging / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                          "weight_map": weight_map}, indent=2) + "\n")
        (staging / CONFIG_FILE).write_text(json.dumps(hf_config_from_model(config, dtype, source_config),
                                                      indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if tokenizer_dir is not None and (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, staging / name)
        names = sorted(path.name for path in staging.iterdir())
        _publish(staging, out)
    except BaseException as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        failure = write_failure(out, error)
        if failure is not None:
            raise CheckpointError(failure) from None
        raise
    return [out / name for name in names]


def write_failure(out: Path, error: BaseException) -> str | None:
    """The one line a failed write of the export to `out` is (an OSError, or safetensors' I/O error: a full disk, a
    quota, a directory that cannot be written or a mount point), naming the path and the fix; None for any other
    error."""
    if isinstance(error, OSError):
        number, reason, path = error.errno, error.strerror or str(error), error.filename
    elif isinstance(error, SafetensorError) and (found := SAFETENSORS_IO.search(str(error))):
        number, reason, path = int(found["errno"]), found["reason"], found["path"]
    else:
        return None
    fix = WRITE_FIXES.get(number, "pass another --out")
    return f"writing the export to {out} failed: {path or out} ({reason}); {fix}"


def check_export_target(out: Path, replace: bool, reads=()) -> None:
    """A CheckpointError unless `out` can take an export: a directory path (or none yet) whose parent is writable,
    not a mount point, empty unless `replace`, not inside any path in `reads` (what the export reads: the
    checkpoints, the tokenizer), and, when replaced, neither the working directory, the home directory, nor a
    directory holding any path in `reads`."""
    try:
        _check_export_target(Path(out), replace, reads)
    except OSError as error:  # a directory that cannot be listed, a path that cannot be looked at
        raise CheckpointError(write_failure(Path(out), error)) from None


def _check_export_target(out: Path, replace: bool, reads) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export target {out} is a file; pass a directory path for --out")
    if out.is_dir() and os.path.ismount(out):
        raise CheckpointError(f"export target {out} is a mount point, which the finished export cannot be moved onto; "
                              f"pass a directory inside it, such as {out / 'model'}")
    try:
        writable_directory(out.parent if not out.exists() else out, "export target")
    except StarscreamError as error:
        raise CheckpointError(str(error)) from None
    held = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if held and not replace:
        listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise CheckpointError(f"export target {out} already holds {len(held)} files ({listed}); pass --replace "
                              "(replace=True) to replace it entirely, or a new or empty directory")
    resolved = out.resolve()
    source = next((Path(path) for path in reads if resolved.is_relative_to(Path(path).resolve())), None)
    if source is not None:
        raise CheckpointError(f"export target {out} lies inside {source}, which the export reads (a new folder there "
                              "reads as one of its checkpoints); choose an --out outside it")
    guarded = [Path.cwd(), Path.home(), *(Path(path) for path in reads)]
    inside = next((path for path in guarded if path.resolve().is_relative_to(resolved)), None)
    if out.exists() and inside is not None:
        raise CheckpointError(f"export target {out} holds {inside}, which replacing it would delete; choose "
                              "another --out")


def _staging_directory(out: Path) -> Path:
    """A fresh, empty directory beside `out` (same file system, so moving it into place is one rename), named for
    this host and process; those that exports killed on this host left are removed first."""
    try:
        created_directory(out.parent, "export target's parent")
    except StarscreamError as error:
        raise CheckpointError(str(error)) from None
    _remove_abandoned(out)
    return Path(tempfile.mkdtemp(prefix=_aside_prefix(out, STAGING, os.getpid()), dir=out.parent))


def _aside_prefix(out: Path, kind: str, pid: int | None = None) -> str:
    """The name of a directory beside `out` that an export of this host writes (`kind`: STAGING or REPLACED), up to
    the writer's pid (with `pid`, up to its random part)."""
    return f".{out.name}.{kind}-{socket.gethostname()}-" + ("" if pid is None else f"{pid}-")


def _remove_abandoned(out: Path) -> None:
    """Deletes the staging directories beside `out` of exports of this host whose process is gone (killed
    mid-write: each as large as the model), and what such an export was replacing once `out` is in place."""
    kinds = (STAGING, REPLACED) if out.exists() else (STAGING,)
    for kind in kinds:
        prefix = _aside_prefix(out, kind)
        for aside in out.parent.glob(f"{glob.escape(prefix)}*"):
            pid = aside.name[len(prefix):].split("-")[0]
            if pid.isdigit() and not process_alive(int(pid)):
                shutil.rmtree(aside, ignore_errors=True)


def _publish(staging: Path, out: Path) -> None:
    """Move the complete `staging` directory to `out` (whatever `out` held is deleted after), with the modes a new
    directory and its files get under the umask (mkdtemp and safetensors create them private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in staging.iterdir():
        path.chmod(0o666 & ~umask)
    staging.chmod(0o777 & ~umask)
    previous = None
    if out.exists():
        previous = Path(tempfile.mkdtemp(prefix=_aside_prefix(out, REPLACED, os.getpid()), dir=out.parent))
        out.rename(previous / out.name)
    staging.rename(out)
    if previous is not None:
        shutil.rmtree(previous)


def _shard_plan(config: ModelConfig, params: dict, itemsize: int, max_shard_bytes: int) -> list[list[tuple]]:
    """The tensors of each shard, in checkpoint order: [(name, our path, source, stacked index)], a new shard begun
    whenever the next tensor would take the current one past `max_shard_bytes`."""
    plan, size = [[]], 0
    for path, source in sources(config).items():
        shape = params[path].shape
        tensor_bytes = math.prod(source.tensor_shape(shape)) * itemsize
        for at in np.ndindex(*shape[:source.stacked]):
            if plan[-1] and size + tensor_bytes > max_shard_bytes:
                plan.append([])
                size = 0
            plan[-1].append((source.name(*at), path, source, at))
            size += tensor_bytes
    return plan


def _slice_of(array: jax.Array, at: tuple[int, ...]) -> jax.Array:
    """array[at] (a layer's, an expert's), whole on every device: the stacked axes `at` indexes may be split over
    the mesh (the expert layouts split the experts over it), where an index into an explicitly sharded axis must
    name its result's placement."""
    if not at:
        return array
    sharding = getattr(array, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return array.at[at].get(out_sharding=NamedSharding(sharding.mesh, PartitionSpec()))
    return array[at]


def _gathered(array: jax.Array, source: Source, at: tuple[int, ...]) -> np.ndarray:
    """The checkpoint tensor of layer (expert) `at` of our parameter `array`, on the host of every process, in C
    order (safetensors writes an array's buffer as it lies)."""
    block = np.asarray(multihost_utils.process_allgather(_slice_of(array, at), tiled=True))
    view = block.transpose(np.argsort(source.order))
    return np.ascontiguousarray(view.reshape(source.tensor_shape(array.shape)))
