"""scripts/bench_mfu.py: rates, ratios and the step-0 check (its --quick run: test_benchmarks.py, under -m slow; the
plain JAX Llama it runs: tests/benchmarks/test_plain_llama.py)."""

import pytest



@pytest.fixture(scope="module")
def bench(script):
    return script("bench_mfu")


def test_rates_count_model_flops_against_every_device(bench):
    plain = [{"name": "plain JAX", "tokens_per_s": 4000.0, "losses": [2.5]},
             {"name": "plain JAX TP", "tokens_per_s": 2500.0, "losses": [2.5]}]
    row = bench.add_rates({"step_s": 0.5, "losses": [3.0]}, tokens_per_step=1000, flops_per_token=2e9, devices=2,
                          peak_flops=1e12, plain_rows=plain)
    assert row["tokens_per_s"] == 2000.0
    assert row["mfu"] == pytest.approx(2000.0 * 2e9 / 2e12)
    assert row["vs_plain"] == 0.5 and row["loss0_minus_plain"] == 0.5
    assert row["vs_plain_by_name"] == {"plain JAX": 0.5, "plain JAX TP": 0.8}


def test_fp8_logits_rows_come_with_fp8_and_take_its_tolerance(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--fp8-logits"])
    assert "--fp8-logits adds rows with the vocabulary projection in fp8 as well; pass it with --fp8" in \
        capsys.readouterr().err
    assert bench.parse_args(["--fp8", "--fp8-logits"]).fp8_logits
    assert bench.step0_tolerance("starscream_tp fp8 logits") == bench.FP8_STEP0_LOSS_TOLERANCE
    assert bench.step0_tolerance("starscream_tp") == bench.STEP0_LOSS_TOLERANCE
