"""Time `starscream inspect` as docs/proving.md runs it: Llama 3 70B on MI300X CPX, 8 GPUs x 8 partitions, simulated.

Each command runs in a fresh process, as a user would start it (jax starts, the simulated devices are set up, every
layout and the gpu_tp reference are compiled), and the script prints the command, its table and its wall-clock time.

    .venv/bin/python scripts/bench_inspect.py [--repeat N] [--out inspect.json]
    .venv/bin/python scripts/bench_inspect.py --quick       # smoke run: the tiny model, one command
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

from starscream_jax.benchmarks import harness

COMMANDS = (
    "--model llama3-70b --preset mi300x-cpx-nps1 --gpus 8 --layout flat_tp,starscream_tp --phase train --layers 2",
    "--model llama3-70b --preset mi300x-cpx-nps1 --gpus 8 --layout flat_tp,starscream_decode --phase decode --layers 2",
)
QUICK_COMMANDS = ("--model tiny --preset mi300x-cpx-nps1 --gpus 2 --layout starscream_tp --phase train --layers 2 "
                  "--batch 8 --seq 16",)


def time_command(arguments: str, repeat: int) -> tuple[str, list[float]]:
    """(the table one run printed, wall-clock seconds of each run)."""
    argv = [sys.executable, "-m", "starscream_jax.cli.main", "inspect", *shlex.split(arguments)]
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        printed = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        seconds.append(time.perf_counter() - start)
    return printed, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_run_arguments(parser, warmup=None, steps=1, steps_flag="--repeat",
                              steps_help="runs of each command; the median is reported",
                              quick="the tiny model on 2 GPUs x 8 partitions, one layout, one command")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    result = {"meta": {**harness.run_info(__file__, argv).as_dict(), "cpu_cores": cores}, "commands": []}
    print(f"{cores} CPU cores available")
    for arguments in QUICK_COMMANDS if args.quick else COMMANDS:
        printed, seconds = time_command(arguments, args.repeat)
        print(f"\n$ starscream inspect {arguments}\n{printed}")
        print(f"wall clock: {statistics.median(seconds):.1f} s (median of {len(seconds)} run(s))")
        result["commands"].append({"arguments": arguments, "seconds": seconds,
                                   "median_s": statistics.median(seconds)})
        harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
