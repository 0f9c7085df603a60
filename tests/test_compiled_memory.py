"""The working set of a compiled program: arguments, outputs not aliased to them, temporaries."""
from types import SimpleNamespace

from starscream_jax.compiled_memory import MemoryReport


class FakeCompiled:
    def __init__(self, stats):
        self.stats = stats

    def memory_analysis(self):
        return self.stats


def test_donated_outputs_count_once_and_no_analysis_is_none():
    stats = SimpleNamespace(argument_size_in_bytes=100, output_size_in_bytes=60, alias_size_in_bytes=40,
                            temp_size_in_bytes=7, generated_code_size_in_bytes=3)
    assert MemoryReport.of(FakeCompiled(stats)).working_set_bytes == 100 + 60 - 40 + 7
    assert MemoryReport.of(FakeCompiled(None)) is None
