"""scripts/bench_weight_only.py: the quick run times every candidate of every shape (the kernel interpreted) and
its sums per layer; the shapes are the layer's projections."""
import json

import pytest

from starscream_jax.model import weight_only_mosaic
from starscream_jax.model.catalog import load_model_config
from tests.model.test_weight_only_mosaic import xla_partials


@pytest.fixture(scope="module")
def bench(script):
    return script("bench_weight_only")


def test_llama3_8b_projection_shapes_and_copies_past_the_l2(bench):
    shapes = bench.projections(load_model_config("llama3-8b"))
    assert shapes == [("q", 4096, 4096), ("k,v", 4096, 1024), ("o", 4096, 4096), ("gate,up", 4096, 14336),
                      ("down", 14336, 4096)]
    assert bench.copies_for(4096 * 1024, 0.15) == bench.MAX_COPIES and bench.copies_for(4096 * 14336, 0.15) == 3
    assert list(bench.candidates(1, "pallas", quick=False)) == ["kernel", "kernel reduce=sum,depth=64",
                                                                "kernel cols=64,depth=128",
                                                                "kernel cols=256,depth=32,warps=8", "kernel splits=1"]
    assert "kernel reduce=sum,depth=64" not in bench.candidates(64, "pallas", quick=False)


@pytest.mark.slow  # about 30 s on two cores; the grouped layer's quick run below runs by default
def test_quick_run_times_each_implementation_and_sums_a_layer(bench, tmp_path):
    out = tmp_path / "weight_only.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["implementation"] == "interpret" and result["meta"]["platform"] == "cpu"
    rows = result["rows"]
    assert {row["implementation"] for row in rows} == {"kernel", "xla", "bf16"} and len(rows) == 2 * 5 * 3
    assert all(row["seconds"] > 0 and row["relative_error_vs_xla"] < 1e-2 for row in rows)
    layer = {total["rows"]: total for total in result["layer"]}
    assert set(layer) == {1, 3} and all(total["complete"] for total in layer.values())
    one = [row for row in rows if row["rows"] == 1]
    by = {(row["projection"], row["implementation"]): row["seconds"] for row in one}
    assert layer[1]["xla_s"] == pytest.approx(by["q", "xla"] + 2 * by["k,v", "xla"] + by["o", "xla"]
                                              + 2 * by["gate,up", "xla"] + by["down", "xla"])


def test_quick_run_times_a_layer_grouped_against_each_projection_alone(bench, tmp_path, monkeypatch):
    """--layer-only: one layer's 7 projections per implementation (quick: at the first row count), the grouped
    kernel in 4 launches per layer (q, k, v; o; gate, up; down) where the single-projection kernel takes 7, every
    product XLA's to rounding; the Mosaic row (where a Hopper GPU runs it: here its kernel's partials computed by
    XLA) splits each group's joined product back into its projections; --layer-alternatives: the grouped kernel at
    each conversion too (the quick run's alternatives)."""
    monkeypatch.setattr(weight_only_mosaic, "available", lambda device=None: True)
    monkeypatch.setattr(weight_only_mosaic, "_kernel", xla_partials)
    out = tmp_path / "layer.json"
    assert bench.main(["--quick", "--layer-only", "--layer-alternatives", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == [] and [(layer["rows"], layer["format"]) for layer in result["grouped_layer"]] == [
        (1, "int8")]
    for layer in result["grouped_layer"]:
        assert all(layer[f"{name}_s"] > 0 for name in bench.LAYER_IMPLEMENTATIONS)
        assert all(layer[f"{name}_error_vs_xla"] < 1e-2 for name in ("grouped", "kernel", "mosaic"))
        assert layer["grouped_launches"] == 4 * bench.LAYER_COPIES
        assert layer["kernel_launches"] == 7 * bench.LAYER_COPIES
        assert layer["xla_launches"] is None and layer["grouped_over_bf16"] > 0
        tilings = [key[:-2] for key in layer if key.startswith("grouped ") and key.endswith("_s")
                   and not key.endswith("per_s")]
        assert tilings == ["grouped convert=cast", "grouped convert=half"]  # --quick: the two conversions
        assert layer["best_grouped"] in tilings + ["grouped"]
        assert all(layer[f"{name}_error_vs_xla"] < 1e-2 for name in tilings)


@pytest.mark.parametrize("argv", [["--quick", "--layer-only"], []])
def test_profile_dir_is_refused_where_no_gpu_kernel_of_a_layer_would_be_traced(bench, argv, tmp_path, capsys):
    """--profile-dir traces the layer programs' GPU kernels: refused before anything runs with --quick (the kernel
    interpreted on the CPU) and without --layer-only (the per-shape runs are not traced)."""
    with pytest.raises(SystemExit):
        bench.parse_args([*argv, "--profile-dir", str(tmp_path)])
    assert "--profile-dir traces the layer's kernels on a GPU" in capsys.readouterr().err
