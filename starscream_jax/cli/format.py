"""Numbers as the commands print them: the formatters of `starscream_jax.analysis.format` (where `check` prints with
them too), under the name the commands import."""
from ..analysis.format import clip, format_bytes, format_seconds

__all__ = ["clip", "format_bytes", "format_seconds"]
