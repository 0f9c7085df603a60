"""What the benchmark scripts (scripts/bench_*.py) share: `harness` times a program, describes the run and stores its
figures, so every benchmark measures and records the same way."""
