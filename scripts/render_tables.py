"""The docs' speed tables, rendered from the stored benchmark results (benchmarks/results/*.json).

Reads what scripts/bench_mfu.py and scripts/bench_decode.py wrote (each file holds its command, date, JAX version and
device) and prints markdown: training throughput per file (with each library row's ratio to the plain baseline of the
same parallelism) and where a step's time goes (rows traced with --profile-dir), and decode bandwidth. Each kind of
table lives in the docs page that holds its markers, `<!-- speed-tables:start KIND -->` and
`<!-- speed-tables:end KIND -->` (KIND: training or decode); with --write the tables replace what lies between them
in every page of --pages that holds them.

    python scripts/render_tables.py           # print
    python scripts/render_tables.py --write   # rewrite the tables in README.md and docs/*.md
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from starscream_jax.analysis.profile import breakdown_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WIDTH = 120
"""The docs' line width: each table's caption is wrapped to it (table rows are not)."""
KINDS = ("training", "decode")
"""The kinds of table, each kept between its own pair of markers."""
BASELINE = {"starscream_tp": "plain JAX TP", "gpu_tp": "plain JAX TP", "flat_tp": "plain JAX TP",
            "starscream_fsdp": "plain JAX FSDP", "flat_fsdp": "plain JAX FSDP"}
"""The plain baseline each layout is judged against when the file has it (else the first plain row)."""


def _source(meta: dict, path: Path) -> str:
    return (f"`{meta['command']}` ({meta['date']}, {meta['devices']} x {meta['device_kind']}, jax {meta['jax']}"
            + (f", XLA_FLAGS `{meta['xla_flags']}`" if meta.get("xla_flags") else "") + f"; {path.name})"
            + (f". Note: {meta['note']}" if meta.get("note") else ""))


def _caption(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def _ratio(row: dict) -> str:
    by_name = row.get("vs_plain_by_name") or {}
    layout = row["name"].split()[0]
    baseline = BASELINE.get(layout) if BASELINE.get(layout) in by_name else next(iter(by_name), None)
    if baseline is None or row["name"] == baseline:
        return ""
    return f"{by_name[baseline]:.3f} vs {baseline}"


def mfu_table(result: dict, path: Path) -> str:
    """One training-throughput table (a --compile-only file: each row's compile time)."""
    meta = result["meta"]
    caption = _caption(f"{meta['model']}, {meta['batch_size']} x {meta['seq_len']} tokens per step"
                       + (", remat" if meta.get("remat") else "") + f": {_source(meta, path)}")
    if meta.get("compile_only"):
        return "\n".join([caption, "", "| implementation | mesh | compile s |", "|---|---|---|"]
                         + [f"| {row['name']} | {row['mesh']} | {row['compile_s']:.1f} |" for row in result["rows"]])
    lines = [caption, "", "| implementation | mesh | ms/step | tokens/s | MFU | ratio | vs PyTorch | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row['name']} | {row['mesh']} | {1e3 * row['step_s']:.1f} | {row['tokens_per_s']:,.0f} | "
              f"{100 * row['mfu']:.1f}% | {_ratio(row)} | {_vs_torch(row)} | {row['compile_s']:.1f} |"
              for row in result["rows"]]
    return "\n".join(lines)


def _vs_torch(row: dict) -> str:
    return f"{row['vs_torch']:.3f}x" if "vs_torch" in row else ""


def decode_table(result: dict, path: Path) -> str:
    """One decode table: the library's rows (each precision variant, with its speed-up over bfloat16 at its batch),
    the plain JAX decoder's and the PyTorch peer's, where the file has them."""
    meta = result["meta"]
    read = meta.get("read_bandwidth_bytes_per_s")
    lines = [_caption(f"{meta['model']} decode under {meta['layout']}, measured copy bandwidth "
                      f"{meta['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s"
                      + ("" if read is None else f", read {read / 1e12:.2f} TB/s") + f": {_source(meta, path)}"), "",
             "| implementation | batch | cache | ms/step | tokens/s | GB read/step | TB/s | of 4.8 TB/s | of copy | "
             "of read | over bf16 | vs PyTorch |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"] + result.get("plain_rows", []) + result.get("peer_rows", []):
        name = row.get("name") or f"{meta['layout']} {row.get('variant', 'bf16')}"
        gigabytes = sum(row["bytes_per_step"].values()) / 1e9
        of_copy = f"{100 * row['fraction_of_copy']:.1f}%" if "fraction_of_copy" in row else ""
        of_read = f"{100 * row['fraction_of_read']:.1f}%" if "fraction_of_read" in row else ""
        over = row.get("speedup_over_bf16")
        lines.append(f"| {name} | {row['batch']} | {row['cache_length']} | {1e3 * row['step_s']:.2f} | "
                     f"{row['tokens_per_s']:,.0f} | {gigabytes:.1f} | {row['bandwidth_bytes_per_s'] / 1e12:.2f} | "
                     f"{100 * row['fraction_of_peak']:.1f}% | {of_copy} | {of_read} | "
                     f"{'' if over is None or row.get('variant') == 'bf16' else f'{over:.2f}x'} | {_vs_torch(row)} |")
    return "\n".join(lines)


def start_marker(kind: str) -> str:
    return f"<!-- speed-tables:start {kind} -->"


def end_marker(kind: str) -> str:
    return f"<!-- speed-tables:end {kind} -->"


def render(directory: Path) -> dict[str, str]:
    """Every table from the JSON files in `directory` that bench_mfu.py or bench_decode.py wrote (a "meta" and
    "rows"; other measurements stored beside them are left out), in file-name order, by kind."""
    blocks: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for path in sorted(directory.glob("*.json")):
        result = json.loads(path.read_text())
        if not isinstance(result, dict) or "meta" not in result:
            continue
        rows = result.get("rows", [])
        if rows and "bytes_per_step" in rows[0]:
            blocks["decode"].append(decode_table(result, path))
            continue
        if "flops_per_token" not in result["meta"]:
            continue
        blocks["training"].append(mfu_table(result, path))
        profiled = {row["name"]: row["time_breakdown"] for row in rows if "time_breakdown" in row}
        if profiled:
            blocks["training"].append(f"Device time per step by category ({path.name}, 3 traced steps):\n\n"
                                      + breakdown_table(profiled))
    return {kind: "\n\n".join(found) for kind, found in blocks.items()}


def replace_blocks(text: str, tables: dict[str, str]) -> tuple[str, set[str]]:
    """`text` with the part between each kind's markers replaced by its tables, and the kinds it held."""
    held = set()
    for kind, table in tables.items():
        start, end = start_marker(kind), end_marker(kind)
        if start not in text:
            continue
        head, rest = text.split(start, 1)
        if end not in rest:
            raise SystemExit(f"{start} has no {end} after it; add the end marker")
        text = f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}"
        held.add(kind)
    return text, held


def write_pages(pages: list[Path], tables: dict[str, str]) -> None:
    """Rewrites the tables in each page that holds their markers; a kind with tables that no page holds is an
    error naming the markers to add."""
    held = set()
    for page in pages:
        text, found = replace_blocks(page.read_text(), tables)
        if found:
            page.write_text(text)
        held |= found
    missing = [kind for kind, table in tables.items() if table and kind not in held]
    if missing:
        raise SystemExit(f"no page holds the {', '.join(missing)} tables; add "
                         + " and ".join(f"{start_marker(kind)} ... {end_marker(kind)}" for kind in missing)
                         + " to the page that should show them")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSON files")
    parser.add_argument("--write", action="store_true", help="rewrite the tables in the pages that hold them")
    parser.add_argument("--pages", type=Path, nargs="+", help="the pages --write looks in (default: README.md and "
                        "docs/*.md)")
    args = parser.parse_args(argv)
    tables = render(args.results)
    if args.write:
        write_pages(args.pages or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], tables)
    else:
        print("\n\n".join(table for table in tables.values() if table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
