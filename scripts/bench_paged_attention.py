"""Paged decode attention, one layer, on one GPU: the ways the serving engine can read a row's pages, side by side
with attention over a contiguous cache (the dense decode step's), at several rows, context lengths and page sizes.

Forms (one query per row [B, 1, H, E], GQA: H query heads over K kv heads; bfloat16):
  dense    cuDNN's attention over a contiguous cache [B, T, K, E] (`jax.nn.dot_product_attention`, the row's
           visible length passed), what the dense decode step runs;
  gather   each row's pages gathered from the pool [P, page, K, E] into [B, T, K, E], then the dense form
           (`model.paged`'s "gather" path);
  cudnn    cuDNN's paged attention over the pool in place, the block tables [B, M] and visible lengths beside it
           (`model.paged`'s "cudnn" path, `jax_private.cudnn_paged_decode`), with a pool of more pages than the rows
           name, as a server's is.
  int8 dense / int8 paged (`--eight-bit int8`, or float8_e4m3fn): the same keys and values quantized, attended by
           the 8-bit cache's kernel over the contiguous cache (`eight_bit_decode.decode_attention`) and over the pool
           in place (`eight_bit_decode.paged_decode_attention`), once per `--tilings` entry (positions a loop step,
           warps, pipeline stages; `:apart`, the paged form's pages loaded as tiles of their own), so a sweep of
           the kernel's tilings runs beside cuDNN's bfloat16 reads.
Each form's TB/s counts the keys and values (and 8-bit scales) of the visible positions it must read; `max_error` is the
largest difference of the cudnn form from the gather form, `eight_bit_error` of any 8-bit form from the first. Rows
whose lengths are below the table's width show what the paged kernel skips (a server's tables are padded to a bucket).

    python scripts/bench_paged_attention.py --out benchmarks/results/h200_paged_attention.json
    python scripts/bench_paged_attention.py --quick        # CPU: the gather and dense forms only, tiny shapes
    python scripts/bench_paged_attention.py --eight-bit int8 --tilings 64:4:2 128:4:3 --shapes 64:4096:16:4096
"""
from __future__ import annotations

import argparse
import functools
import sys

from starscream_jax.benchmarks import harness

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
"""Llama 3 8B's attention."""
SHAPES = ((1, 4096, 16, 4096), (64, 4096, 16, 4096), (64, 4096, 64, 4096), (256, 640, 16, 640),
          (64, 4096, 16, 1000), (256, 4096, 16, 600))
"""(rows, table positions, page size, visible positions per row)."""
QUICK_SHAPES = ((2, 64, 16, 64), (2, 64, 16, 20))


def forms(rows: int, table_positions: int, page: int, visible: int, gpu: bool, eight_bit: str = "",
          tilings: tuple = ()) -> dict:
    """The jitted forms of one shape and their arguments: the query, the dense caches, the key and value pools
    (each with 37 pages no row names), the block tables (a random permutation of the pool) and the visible
    lengths; with `eight_bit`, the 8-bit kernel's dense and paged forms at each of `tilings`."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.jax_private import cudnn_paged_decode

    width = table_positions // page
    pool_pages = rows * width + 37
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (rows, 1, HEADS, HEAD_DIM), jnp.bfloat16)
    pool_k, pool_v = (jax.random.normal(key, (pool_pages, page, KV_HEADS, HEAD_DIM), jnp.bfloat16)
                      for key in keys[1:3])
    table = jax.random.permutation(keys[3], pool_pages)[:rows * width].reshape(rows, width).astype(jnp.int32)
    lengths = jnp.full((rows,), visible, jnp.int32)
    dense_k, dense_v = (pool[:rows * width].reshape(rows, table_positions, KV_HEADS, HEAD_DIM)
                        for pool in (pool_k, pool_v))
    implementation = "cudnn" if gpu else None

    def attend(q, k, v, lengths):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation=implementation)

    def rows_of(pool, table):
        return pool[table].reshape(rows, table_positions, KV_HEADS, HEAD_DIM)

    def gathered(q, pool_k, pool_v, table, lengths):
        return attend(q, rows_of(pool_k, table), rows_of(pool_v, table), lengths)

    programs = {"dense": (jax.jit(attend), (q, dense_k, dense_v, lengths)),
                "gather": (jax.jit(gathered), (q, pool_k, pool_v, table, lengths))}
    if gpu:
        paged = jax.jit(lambda q, k, v, table, lengths: cudnn_paged_decode(q, k, v, table, lengths, HEAD_DIM ** -0.5))
        programs["cudnn"] = (paged, (q, pool_k, pool_v, table, lengths))
    if eight_bit:
        programs.update(eight_bit_forms(q, pool_k, pool_v, table, lengths, eight_bit, tilings, gpu))
    return programs


def eight_bit_forms(q, pool_k, pool_v, table, lengths, format_name: str, tilings: tuple, gpu: bool) -> dict:
    """The 8-bit kernel over the pools quantized to `format_name`: "<format> dense <tiling>" over the rows' pages laid
    out in order, "<format> paged <tiling>" over the pool in place (interpreted off a GPU)."""
    import jax

    from starscream_jax.hardware.backend import policy_of
    from starscream_jax.model import eight_bit_decode
    from starscream_jax.model.quantize import quantize_cache_entry

    (k8, k_scale), (v8, v_scale) = (quantize_cache_entry(pool, format_name) for pool in (pool_k, pool_v))
    rows, width = table.shape

    def rows_of(pool):
        return pool[table].reshape(rows, width * pool.shape[1], *pool.shape[2:])

    dense_args = (q, *(rows_of(pool) for pool in (k8, v8, k_scale, v_scale)), lengths)
    options = {"ptx": policy_of(jax.devices()[0]).inline_ptx} if gpu else {"interpret": True}
    programs = {}
    for tiling in tilings:
        name = f"{format_name} {{}} " + (":".join(map(str, tiling[:3])) + (":apart" if tiling.pages_apart else "")
                                         if tiling else "by shape")
        programs[name.format("dense")] = (jax.jit(functools.partial(
            eight_bit_decode.decode_attention, tiling=tiling, **options)), dense_args)
        programs[name.format("paged")] = (jax.jit(functools.partial(
            eight_bit_decode.paged_decode_attention, tiling=tiling, **options)),
            (q, k8, v8, k_scale, v_scale, table, lengths))
    return programs


def measure(shape: tuple[int, int, int, int], gpu: bool, calls: int, eight_bit: str = "",
            tilings: tuple = ()) -> dict:
    """Milliseconds and TB/s of each form at one shape, the cudnn form's largest difference from gather's and the
    8-bit forms' largest difference from the first of them."""
    import jax.numpy as jnp

    rows, table_positions, page, visible = shape
    programs = forms(*shape, gpu, eight_bit, tilings)
    moved = 2 * rows * visible * KV_HEADS * HEAD_DIM * 2  # keys and values of the visible positions, bfloat16
    moved_8_bit = 2 * rows * visible * KV_HEADS * (HEAD_DIM + 4)  # 8-bit values and float32 scales
    eight_bit_names = [name for name in programs if eight_bit and name.startswith(f"{eight_bit} ")]
    row = {"rows": rows, "table_positions": table_positions, "page_size": page, "visible": visible}
    for name, (program, args) in programs.items():
        seconds = harness.seconds_per_call(program, args, warmup=2, calls=calls)
        row[f"{name}_ms"] = 1e3 * seconds
        row[f"{name}_tb_per_s"] = (moved_8_bit if name in eight_bit_names else moved) / seconds / 1e12
    if "cudnn" in programs:
        difference = programs["cudnn"][0](*programs["cudnn"][1]) - programs["gather"][0](*programs["gather"][1])
        row["max_error"] = float(jnp.max(jnp.abs(difference.astype(jnp.float32))))
    eight_bit_outputs = [programs[name][0](*programs[name][1]).astype(jnp.float32) for name in eight_bit_names]
    if eight_bit_outputs:
        row["eight_bit_error"] = max(float(jnp.max(jnp.abs(out - eight_bit_outputs[0]))) for out in eight_bit_outputs)
    return row


def tiling(text: str):
    """`block:warps:stages[:apart]` (e.g. 64:4:2, or 64:4:2:apart for the paged form's pages loaded apart) as an
    `eight_bit_decode.Tiling`."""
    from starscream_jax.model.eight_bit_decode import Tiling

    parts = text.split(":")
    apart = parts[3:] == ["apart"]
    try:
        block, warps, stages = (int(part) for part in (parts[:3] if apart else parts))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tiling {text!r}: want block:warps:stages[:apart], e.g. 64:4:2") from None
    if block < 16 or block & (block - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise argparse.ArgumentTypeError(f"tiling {text!r}: block a power of two of at least 16, warps 1-16 (a power "
                                         "of two), at least one stage")
    return Tiling(block, warps, stages, apart)


def shape(text: str) -> tuple[int, int, int, int]:
    """`rows:table_positions:page:visible` (e.g. 64:4096:16:4096)."""
    try:
        rows, positions, page, visible = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: want rows:table_positions:page:visible") from None
    if positions % page or visible > positions:
        raise argparse.ArgumentTypeError(f"shape {text!r}: the table holds whole pages and the visible positions")
    return rows, positions, page, visible


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_run_arguments(parser, warmup=None, steps=30, steps_flag="--calls", steps_help="timed calls per form",
                              quick="tiny shapes on the CPU, dense and gather forms only")
    parser.add_argument("--shapes", type=shape, nargs="+", metavar="R:T:P:V",
                        help="rows:table_positions:page:visible (default: a decode server's spread; --quick: tiny)")
    parser.add_argument("--eight-bit", default="", choices=["", "int8", "float8_e4m3fn"],
                        help="also the 8-bit cache's kernel (dense and paged) over the keys and values in this format")
    parser.add_argument("--tilings", type=tiling, nargs="+", metavar="B:W:S[:apart]",
                        help="the 8-bit kernel's tilings, block:warps:stages, and :apart for the paged form's pages "
                             "loaded as tiles of their own (default: the kernel's choice by shape)")
    args = parser.parse_args(argv)
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    result = {"meta": harness.run_info(__file__, argv).as_dict(), "rows": []}
    for shape_ in args.shapes or (QUICK_SHAPES if args.quick else SHAPES):
        row = measure(shape_, gpu and not args.quick, 2 if args.quick else args.calls, args.eight_bit,
                      tuple(args.tilings or [None]))
        result["rows"].append(row)
        harness.write_json(args.out, result)
        forms_line = "\n  ".join(f"{name[:-3]:<26} {row[name]:8.3f} ms ({row[name[:-3] + '_tb_per_s']:.2f} TB/s)"
                                 for name in row if name.endswith("_ms"))
        print(f"rows {shape_[0]:>4} table {shape_[1]:>5} page {shape_[2]:>3} visible {shape_[3]:>5}:\n  {forms_line}",
              flush=True)
        errors = [f"{name} {row[name]:.2e}" for name in ("max_error", "eight_bit_error") if name in row]
        if errors:
            print("  " + ", ".join(errors), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
