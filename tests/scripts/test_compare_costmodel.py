"""scripts/compare_costmodel.py: the GPU memory estimate beside each stored H200 memory_analysis(), as
docs/planning.md runs it (`--parts memory`)."""

import pytest



@pytest.fixture(scope="module")
def compare(script):
    return script("compare_costmodel")


def test_the_memory_part_estimates_stored_runs_of_each_phase(compare, capsys):
    stored = compare.stored_memory()
    cases = [next(case for case in stored if case["phase"] == phase) for phase in ("train", "decode")]
    rows = compare.memory_rows(cases)
    assert [row["phase"] for row in rows] == ["train", "decode"]
    for row, case in zip(rows, cases):
        assert row["measured_bytes"] == case["peak_bytes"]
        assert 0.85 < row["ratio"] < 1.15, row
        assert row["estimate"]["params"] > 0
    assert rows[1]["estimate"]["kv_cache"] > 0
    assert capsys.readouterr().out.count("ratio") == 2
