"""What one device holds while a compiled program runs, read from XLA's memory analysis: the one definition that the
training loop (does the step fit?) and the analysis package (what is large against the step?) both read.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Per-device memory of a compiled program, from `compiled.memory_analysis()`, in bytes."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    alias_bytes: int

    @classmethod
    def of(cls, compiled: Any) -> MemoryReport | None:
        """The memory of `compiled` (a jax Compiled); None when the backend gives no memory analysis."""
        stats = compiled.memory_analysis()
        if stats is None:
            return None
        return cls(argument_bytes=stats.argument_size_in_bytes, output_bytes=stats.output_size_in_bytes,
                   temp_bytes=stats.temp_size_in_bytes, generated_code_bytes=stats.generated_code_size_in_bytes,
                   alias_bytes=stats.alias_size_in_bytes)

    @property
    def working_set_bytes(self) -> int:
        """Bytes one device holds while the program runs: its arguments, its outputs not aliased to them (donated
        buffers reused), and its temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
