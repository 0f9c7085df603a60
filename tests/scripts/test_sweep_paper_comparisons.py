"""scripts/sweep_paper_comparisons.py: the model's predicted flat / hierarchical ratios, as stored."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
STORED = SCRIPTS.parent / "benchmarks" / "results" / "paper_comparisons_model.json"


@pytest.fixture(scope="module")
def sweep_script(monkeypatch_module):
    monkeypatch_module.syspath_prepend(str(SCRIPTS))  # the script imports bench_kernels beside it
    spec = importlib.util.spec_from_file_location("sweep_paper_comparisons", SCRIPTS / "sweep_paper_comparisons.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_sweep_of_one_preset_predicts_the_stored_ratios(sweep_script):
    preset = sweep_script.PRESETS[0]
    rows = sweep_script.sweep(preset)
    stored = [row for row in json.loads(STORED.read_text())["rows"] if row["preset"] == preset]
    assert len(rows) == len(stored) > 0
    for row, kept in zip(rows, stored):
        assert row["kernel"] == kept["kernel"] and row["batch"] == kept["batch"] and row["seq"] == kept["seq"]
        assert row["ratio_h200_efficiency"] == pytest.approx(kept["ratio_h200_efficiency"], rel=1e-9)
