"""bench_kernels' split-K rows: shapes from the layouts (one partition's part holds 1/X of the cache) and a timed
run on CPU."""


def test_split_k_rows_compare_the_whole_cache_with_one_partitions_part(script):
    bench = script("bench_kernels")
    args = bench.parse_args(["--quick"])
    config = bench.harness.model_config(args)
    (row,) = bench.split_k_kernels(config, bench.layout_mesh(args.topology), args.split_k)
    # tiny (8 heads, 4 kv heads) on 2 GPUs x 4 partitions, batch 1, cache 64: heads over the GPUs either way
    assert row.flat_shape == [[1, 1, 4, 16], [1, 64, 2, 16]]
    assert row.hier_shape == [[1, 1, 4, 16], [1, 16, 2, 16]]
    measured = bench.measure(row, warmup=1, calls=1, rounds=1)
    assert measured.flat_us > 0 and measured.hier_us > 0
