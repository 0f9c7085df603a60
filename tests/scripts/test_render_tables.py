"""scripts/render_tables.py: the docs' speed tables from stored results, each library row against its baseline, each
kind of table written into the page that holds its markers."""
import json

import pytest

META = {"command": "python scripts/bench_mfu.py", "date": "2026-11-30", "devices": 2, "device_kind": "H200",
        "jax": "0.11.2", "model": "llama3.2-1b", "batch_size": 8, "seq_len": 2048, "flops_per_token": 8.2e9}


@pytest.fixture(scope="module")
def render(script):
    return script("render_tables")


def row(name, tokens_per_s, **ratios):
    return {"name": name, "mesh": "1x2x1", "step_s": 16.384 / tokens_per_s, "tokens_per_s": tokens_per_s, "mfu": 0.4,
            "vs_plain_by_name": ratios, "compile_s": 3.0}


def test_each_layout_is_judged_against_the_plain_baseline_of_its_parallelism(render, tmp_path):
    rows = [row("plain JAX", 100.0), row("plain JAX TP", 90.0, **{"plain JAX": 0.9}),
            row("starscream_tp", 88.2, **{"plain JAX": 0.882, "plain JAX TP": 0.98}),
            row("starscream_fsdp", 99.0, **{"plain JAX": 0.99, "plain JAX TP": 1.1})]
    (tmp_path / "mfu.json").write_text(json.dumps({"meta": META, "rows": rows}))
    text = render.render(tmp_path)["training"]
    assert "| starscream_tp | 1x2x1 | 185.8 | 88 | 40.0% | 0.980 vs plain JAX TP |  | 3.0 |" in text
    assert "| starscream_fsdp | 1x2x1 | 165.5 | 99 | 40.0% | 0.990 vs plain JAX |  | 3.0 |" in text
    assert "| plain JAX | 1x2x1 | 163.8 | 100 | 40.0% |  |  | 3.0 |" in text


def test_peer_ratios_compile_only_files_and_other_results(render, tmp_path):
    rows = [row("plain JAX", 100.0), {**row("starscream_tp", 110.0, **{"plain JAX": 1.1}), "vs_torch": 1.05}]
    (tmp_path / "a_mfu.json").write_text(json.dumps({"meta": META, "rows": rows}))
    compiled = [{"name": "starscream_tp", "mesh": "1x1x1", "compile_s": 19.04}]
    (tmp_path / "b_compile.json").write_text(json.dumps({"meta": {**META, "compile_only": True}, "rows": compiled}))
    (tmp_path / "c_serve.json").write_text(json.dumps({"meta": {"command": "python scripts/bench_serve.py"},
                                                       "rows": [{"requests": 4}]}))
    text = render.render(tmp_path)["training"]
    assert "| starscream_tp | 1x2x1 | 148.9 | 110 | 40.0% | 1.100 vs plain JAX | 1.050x | 3.0 |" in text
    assert "| implementation | mesh | compile s |\n|---|---|---|\n| starscream_tp | 1x1x1 | 19.0 |" in text
    assert "bench_serve" not in text


def test_decode_tables_show_each_variant_over_bf16_plain_jax_and_the_peer(render, tmp_path):
    meta = {**META, "layout": "starscream_decode", "copy_bandwidth_bytes_per_s": 3e12}
    common = {"batch": 1, "cache_length": 4096, "bytes_per_step": {"weights": 15e9}, "fraction_of_peak": 0.6}
    rows = [{**common, "variant": "bf16", "step_s": 0.005, "tokens_per_s": 200.0, "bandwidth_bytes_per_s": 3e12,
             "speedup_over_bf16": 1.0, "vs_torch": 1.4},
            {**common, "variant": "w-int8", "step_s": 0.01, "tokens_per_s": 100.0, "bandwidth_bytes_per_s": 1.5e12,
             "speedup_over_bf16": 0.5}]
    peer = [{**common, "name": "PyTorch (gpt-fast-style)", "step_s": 0.007, "tokens_per_s": 142.9,
             "bandwidth_bytes_per_s": 2.1e12}]
    plain = [{**common, "name": "plain JAX", "step_s": 0.008, "tokens_per_s": 125.0, "bandwidth_bytes_per_s": 1.9e12}]
    (tmp_path / "decode.json").write_text(json.dumps({"meta": meta, "rows": rows, "plain_rows": plain,
                                                      "peer_rows": peer}))
    text = render.render(tmp_path)["decode"]
    assert "| plain JAX | 1 | 4096 | 8.00 | 125 | 15.0 | 1.90 | 60.0% |  |  |  |  |" in text
    assert "| starscream_decode bf16 | 1 | 4096 | 5.00 | 200 | 15.0 | 3.00 | 60.0% |  |  |  | 1.400x |" in text
    assert "| starscream_decode w-int8 | 1 | 4096 | 10.00 | 100 | 15.0 | 1.50 | 60.0% |  |  | 0.50x |  |" in text
    assert "| PyTorch (gpt-fast-style) | 1 | 4096 | 7.00 | 143 | 15.0 | 2.10 | 60.0% |  |  |  |  |" in text


def test_each_kind_of_table_replaces_the_block_between_its_own_markers(render):
    training, decode = (f"{render.start_marker(kind)}\nold\n{render.end_marker(kind)}"
                        for kind in ("training", "decode"))
    text, held = render.replace_blocks(f"intro\n{training}\nmiddle\n{decode}\nrest\n",
                                       {"training": "new training", "decode": "new decode"})
    assert held == {"training", "decode"}
    assert text == (f"intro\n{render.start_marker('training')}\nnew training\n{render.end_marker('training')}\n"
                    f"middle\n{render.start_marker('decode')}\nnew decode\n{render.end_marker('decode')}\nrest\n")
    with pytest.raises(SystemExit, match="end marker"):
        render.replace_blocks(f"{render.start_marker('decode')}\nno end", {"decode": "new"})


def test_tables_that_no_page_holds_are_an_error_naming_the_markers(render, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"{render.start_marker('training')}\n{render.end_marker('training')}\n")
    render.write_pages([page], {"training": "new", "decode": ""})  # no decode tables: no page needs the markers
    assert "new" in page.read_text()
    with pytest.raises(SystemExit, match="speed-tables:start decode"):
        render.write_pages([page], {"training": "new", "decode": "decode table"})


def test_the_docs_show_the_stored_results_as_rendered_now(render):
    pages = [render.ROOT / "README.md", *sorted((render.ROOT / "docs").glob("*.md"))]
    tables = render.render(render.RESULTS)
    stale = [page.name for page in pages if render.replace_blocks(page.read_text(), tables)[0] != page.read_text()]
    assert not stale, f"{', '.join(stale)}: speed tables out of date; run python scripts/render_tables.py --write"
