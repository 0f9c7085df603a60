"""A built model's weights in another format: 8-bit weights quantized from float ones straight into their placement
(`quantize_model`), and OCP fp8 weights held as FNUZ for a chip that computes FNUZ only (`to_fnuz`).
"""
from __future__ import annotations

import contextlib

import jax
from flax import nnx

from ..sharding.apply import logical_names, param_shardings, path_name
from ..sharding.layouts import Layout
from .decoder import Transformer, abstract_model
from .quantize import OCP_TO_FNUZ, QUANTIZED_INPUTS, SCALE_SUFFIX, Scaled, ocp_to_fnuz, quantize


def quantize_model(model: Transformer, weight_format: str, granularity: str = "channel", layout: Layout | str = None,
                   mesh=None) -> Transformer:
    """`model` with the weights of QUANTIZED_INPUTS in `weight_format` (8 bits, float32 scales per output channel
    or per layer: `quantize.quantize`), computed in one jitted program straight into `layout`'s params placement
    on `mesh` (unsharded without them); every other parameter kept as it is."""
    config = model.config.replace(weight_format=weight_format, weight_scales=granularity)
    graphdef, abstract, rest = nnx.split(abstract_model(config), nnx.Param, ...)
    stored = {path_name(path): variable for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    def convert(arrays: dict) -> dict:
        converted = {}
        for path, value in arrays.items():
            key = path.rsplit("/", 1)[-1]
            if key not in QUANTIZED_INPUTS:
                converted[path] = value
                continue
            converted[path], converted[path + SCALE_SUFFIX] = quantize(value, key, logical_names(stored[path]),
                                                                       weight_format, granularity)
        return converted

    flat = nnx.to_flat_state(abstract)
    shardings = None
    if mesh is not None:
        placed = nnx.to_flat_state(param_shardings(abstract, layout, mesh))
        shardings = {path_name(path): sharding for path, sharding in placed}
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        arrays = jax.jit(convert, out_shardings=shardings)({path: v.get_value() for path, v in stored.items()})
    state = nnx.from_flat_state([(path, variable.replace(arrays[path_name(path)])) for path, variable in flat])
    return nnx.merge(graphdef, state, rest)


def to_fnuz(model: Transformer) -> Transformer:
    """`model` with its float8_e4m3fn weights held as float8_e4m3fnuz with doubled scales (`quantize.ocp_to_fnuz`:
    exact), each array kept where it is; for a chip that computes FNUZ fp8 only (MI300X) loading an OCP checkpoint."""
    config = model.config.replace(weight_format=OCP_TO_FNUZ[model.config.weight_format])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    layers = params["layers"]

    @jax.jit
    def convert(stored: dict) -> dict:
        converted = {}
        for key in QUANTIZED_INPUTS:
            weight = ocp_to_fnuz(Scaled(stored[key], stored[key + SCALE_SUFFIX]))
            converted[key], converted[key + SCALE_SUFFIX] = weight.values, weight.scale
        return converted

    names = [name for key in QUANTIZED_INPUTS for name in (key, key + SCALE_SUFFIX)]
    converted = convert({name: layers[name].get_value() for name in names})
    for name in names:
        layers[name] = layers[name].replace(converted[name])
    model = nnx.merge(graphdef, params, rest)
    model.config = config
    return model
