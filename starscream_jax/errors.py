"""Errors raised for bad input. Each message says what was found, what was expected and how to fix it."""


class StarscreamError(ValueError):
    """Base class of every error this library raises on bad input."""


class TopologyError(StarscreamError):
    """The devices, the preset or an override do not describe a consistent gpu x xcd topology."""


class PresetError(StarscreamError):
    """A hardware preset or model configuration file is unknown or malformed."""


class ShardingRuleError(StarscreamError):
    """A layout cannot place a tensor: unknown logical name, missing mesh axis, axis reused, or indivisible dimension."""


class CheckpointError(StarscreamError):
    """A model directory (config.json, safetensors files and their index, tokenizer files) is missing, corrupt or
    describes a model this library does not implement."""
