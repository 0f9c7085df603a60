"""scripts/render_tables.py: README's speed tables from stored results, each library row against its baseline."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "render_tables.py"
META = {"command": "python scripts/bench_mfu.py", "date": "2026-11-30", "devices": 2, "device_kind": "H200",
        "jax": "0.11.2", "model": "llama3.2-1b", "batch_size": 8, "seq_len": 2048}


@pytest.fixture(scope="module")
def render():
    spec = importlib.util.spec_from_file_location("render_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(name, tokens_per_s, **ratios):
    return {"name": name, "mesh": "1x2x1", "step_s": 16.384 / tokens_per_s, "tokens_per_s": tokens_per_s, "mfu": 0.4,
            "vs_plain_by_name": ratios}


def test_each_layout_is_judged_against_the_plain_baseline_of_its_parallelism(render, tmp_path):
    rows = [row("plain JAX", 100.0), row("plain JAX TP", 90.0, **{"plain JAX": 0.9}),
            row("starscream_tp", 88.2, **{"plain JAX": 0.882, "plain JAX TP": 0.98}),
            row("starscream_fsdp", 99.0, **{"plain JAX": 0.99, "plain JAX TP": 1.1})]
    (tmp_path / "mfu.json").write_text(json.dumps({"meta": META, "rows": rows}))
    text = render.render(tmp_path)
    assert "| starscream_tp | 1x2x1 | 185.8 | 88 | 40.0% | 0.980 vs plain JAX TP |" in text
    assert "| starscream_fsdp | 1x2x1 | 165.5 | 99 | 40.0% | 0.990 vs plain JAX |" in text
    assert "| plain JAX | 1x2x1 | 163.8 | 100 | 40.0% |  |" in text


def test_the_readme_block_is_replaced_between_its_markers(render):
    readme = f"intro\n{render.START}\nold table\n{render.END}\nrest\n"
    assert render.replace_block(readme, "new") == f"intro\n{render.START}\nnew\n{render.END}\nrest\n"
    with pytest.raises(SystemExit, match="markers"):
        render.replace_block("no markers", "new")
