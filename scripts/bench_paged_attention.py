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
Each form's TB/s counts the keys and values of the visible positions it must read; `max_error` is the largest
difference of the cudnn form from the gather form. Rows whose lengths are below the table's width show what the
paged kernel skips (a server's tables are padded to a bucket).

    python scripts/bench_paged_attention.py --out benchmarks/results/h200_paged_attention.json
    python scripts/bench_paged_attention.py --quick        # CPU: the gather and dense forms only, tiny shapes
"""
from __future__ import annotations

import argparse
import sys

from starscream_jax.benchmarks import harness

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
"""Llama 3 8B's attention."""
SHAPES = ((1, 4096, 16, 4096), (64, 4096, 16, 4096), (64, 4096, 64, 4096), (256, 640, 16, 640),
          (64, 4096, 16, 1000), (256, 4096, 16, 600))
"""(rows, table positions, page size, visible positions per row)."""
QUICK_SHAPES = ((2, 64, 16, 64), (2, 64, 16, 20))


def forms(rows: int, table_positions: int, page: int, visible: int, gpu: bool) -> dict:
    """The jitted forms of one shape and their arguments: the query, the dense caches, the key and value pools
    (each with 37 pages no row names), the block tables (a random permutation of the pool) and the visible
    lengths."""
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
    return programs


def measure(shape: tuple[int, int, int, int], gpu: bool, calls: int) -> dict:
    """Milliseconds and TB/s of each form at one shape, and the cudnn form's largest difference from gather's."""
    import jax.numpy as jnp

    rows, table_positions, page, visible = shape
    programs = forms(*shape, gpu)
    moved = 2 * rows * visible * KV_HEADS * HEAD_DIM * 2  # keys and values of the visible positions, bfloat16
    row = {"rows": rows, "table_positions": table_positions, "page_size": page, "visible": visible}
    for name, (program, args) in programs.items():
        seconds = harness.seconds_per_call(program, args, warmup=2, calls=calls)
        row[f"{name}_ms"], row[f"{name}_tb_per_s"] = 1e3 * seconds, moved / seconds / 1e12
    if "cudnn" in programs:
        difference = programs["cudnn"][0](*programs["cudnn"][1]) - programs["gather"][0](*programs["gather"][1])
        row["max_error"] = float(jnp.max(jnp.abs(difference.astype(jnp.float32))))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_run_arguments(parser, warmup=None, steps=30, steps_flag="--calls", steps_help="timed calls per form",
                              quick="tiny shapes on the CPU, dense and gather forms only")
    args = parser.parse_args(argv)
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    result = {"meta": harness.run_info(__file__, argv).as_dict(), "rows": []}
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        row = measure(shape, gpu and not args.quick, 2 if args.quick else args.calls)
        result["rows"].append(row)
        harness.write_json(args.out, result)
        forms_line = "  ".join(f"{name} {row[f'{name}_ms']:.3f} ms ({row[f'{name}_tb_per_s']:.2f} TB/s)"
                               for name in ("dense", "gather", "cudnn") if f"{name}_ms" in row)
        print(f"rows {shape[0]:>4} table {shape[1]:>5} page {shape[2]:>3} visible {shape[3]:>5}: {forms_line}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
