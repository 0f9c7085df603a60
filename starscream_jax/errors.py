"""Errors raised for bad input. Each message says what was found, what was expected and how to fix it."""


class StarscreamError(ValueError):
    """Base class of every error this library raises on bad input."""


class TopologyError(StarscreamError):
    """The devices, the preset or an override do not describe a consistent gpu x xcd topology."""


class PresetError(StarscreamError):
    """A hardware preset or model configuration file is unknown or malformed."""


class ShardingRuleError(StarscreamError):
    """A layout cannot place a tensor: unknown logical name, missing mesh axis, axis reused, or indivisible
    dimension."""


class CheckpointError(StarscreamError):
    """A checkpoint cannot be restored (damaged files), or resuming from it would contradict the run; or a model
    directory (config.json, safetensors files and their index, tokenizer files) is missing, corrupt or describes a
    model this library does not implement."""


class RunStopped(StarscreamError):
    """A training run stopped before its last step (a non-finite loss, or Ctrl-C); its checkpoints are intact.

    `exit_status` is the status the command exits with (130 after Ctrl-C, as a shell reports an interrupt)."""

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status
