"""Every benchmark script's --quick run on CPU: it exits 0 and stores its figures as JSON with the run's metadata,
the command recorded as it was given."""
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SLOW = {"bench_serve", "bench_mfu"}
"""Quick runs left to -m slow: bench_serve's takes over a minute on two cores (it compiles its twelve serving programs,
then serves twice over HTTP); bench_mfu's figures are checked by tests/scripts/test_bench_mfu.py."""
BENCHMARKS = ("bench_decode", "bench_grouped_matmul", "bench_kernels", "bench_mfu", "bench_moe", "bench_paged_attention",
              "bench_sampler", "bench_serve", "bench_train_step")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def metadata(result: dict) -> dict:
    """The run metadata of a result: under "meta" where the script keeps its rows beside it, else at the top."""
    return result.get("meta", result)


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                  for name in BENCHMARKS])
def test_quick_run_stores_its_figures_and_the_command_it_was_given(name, tmp_path):
    out = tmp_path / f"{name}.json"
    argv = ["--quick", "--out", str(out)]
    assert load(name).main(argv) == 0
    result = json.loads(out.read_text())
    meta = metadata(result)
    assert meta["command"] == shlex.join(["python", f"scripts/{name}.py", *argv])
    assert meta["platform"] == "cpu" and meta["jax"] and meta["date"].startswith("20")
    assert len(result) > 1  # figures beside the metadata
    assert "peer_rows" not in result and "PyTorch" not in json.dumps(result.get("rows", []))  # --quick skips them


def test_bench_serve_refuses_a_static_batch_below_one_before_it_starts(capsys):
    with pytest.raises(SystemExit):
        load("bench_serve").parse_args(["--static-generate", "-4"])
    assert "--static-generate -4: give the rows of each static batch" in capsys.readouterr().err


def test_the_serving_roofline_counts_a_decode_step_at_the_slower_of_its_weight_reads_and_its_flops():
    bench = load("bench_serve")
    from starscream_jax.model.catalog import load_model_config
    config = load_model_config("llama3-8b")
    multiplied = config.n_layers * (config.d_model * (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
                                    + config.n_heads * config.head_dim * config.d_model
                                    + 3 * config.d_model * config.d_ff) + config.d_model * config.vocab_size
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 2
    read, peak, efficiency = 4e12, 1e15, 0.8

    def decode_seconds(rows):
        workload = bench.Workload(name="t", requests=rows, prompt=16, output=2, rate=float("inf"))
        line = bench.roofline(config, workload, [[1] * 16] * rows, [2] * rows, efficiency, peak, read)
        return line["decode_seconds"]

    # one row reads every multiplied weight once (the embedding only by its gathered row); 256 rows are bound by FLOPs
    assert decode_seconds(1) == pytest.approx(2 * (multiplied * 2 / read) + kv * (16 + 17) / read)
    flops = 2 * multiplied * 256 / (peak * efficiency)
    assert flops > multiplied * 2 / read
    assert decode_seconds(256) == pytest.approx(2 * flops + kv * 256 * (16 + 17) / read)


@pytest.mark.slow
def test_the_static_generate_baseline_keeps_the_faster_of_its_passes(tmp_path):
    """bench_serve --static-generate: the static `generate` runs every prompt twice, each pass's rate stored, and
    the baseline is the faster pass (what the engine's ratio is taken against); --quick also runs the workload with
    mixed steps off on the same engine (two programs a step where chunks and decode rows meet)."""
    out = tmp_path / "serve.json"
    assert load("bench_serve").main(["--quick", "--workload", "A", "--static-generate", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (static,) = result["static_generate"]
    assert len(static["passes_output_tokens_per_s"]) == 2
    assert static["output_tokens_per_s"] == max(static["passes_output_tokens_per_s"]) > 0
    mixed = {row["mixed_steps"]: row["steps"]["both"]["programs"] for row in result["runs"]}  # --quick compares
    assert mixed == {True: 1, False: 2} and result["ratios"]["A_mixed_steps_over_two_programs"] > 0


def test_bench_paged_attention_times_the_8_bit_kernel_at_each_tiling_beside_the_bf16_forms(tmp_path):
    """--eight-bit adds the 8-bit kernel's dense and paged forms once per --tilings entry (interpreted on the CPU),
    each with its TB/s over the 8-bit bytes, and their largest difference from one another; a bad tiling is refused
    in one line."""
    out = tmp_path / "paged.json"
    argv = ["--quick", "--eight-bit", "float8_e4m3fn", "--tilings", "64:4:2", "16:2:3", "--shapes", "2:64:16:40",
            "--out", str(out)]
    assert load("bench_paged_attention").main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    forms = [f"float8_e4m3fn {layout} {tiling}" for tiling in ("64:4:2", "16:2:3") for layout in ("dense", "paged")]
    assert all(row[f"{form}_ms"] > 0 and row[f"{form}_tb_per_s"] > 0 for form in forms)
    assert 0 <= row["eight_bit_error"] < 2e-2  # the same attention, each tiling summing in its own order
    with pytest.raises(SystemExit):
        load("bench_paged_attention").main(["--tilings", "24:4:2"])
