"""Time `starscream inspect` as docs/proving.md runs it: Llama 3 70B on MI300X CPX, 8 GPUs x 8 partitions, simulated.

Each command runs in a fresh process, as a user would start it (jax starts, the simulated devices are set up, every
layout and the gpu_tp reference are compiled), and the script prints the command, its table and its wall-clock time.

    .venv/bin/python scripts/bench_inspect.py [--repeat N]
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

COMMANDS = (
    "--model llama3-70b --preset mi300x-cpx-nps1 --gpus 8 --layout flat_tp,starscream_tp --phase train --layers 2",
    "--model llama3-70b --preset mi300x-cpx-nps1 --gpus 8 --layout flat_tp,starscream_decode --phase decode --layers 2",
)


def time_command(arguments: str, repeat: int) -> tuple[str, list[float]]:
    """(the table one run printed, wall-clock seconds of each run)."""
    argv = [sys.executable, "-m", "starscream_jax.cli", "inspect", *shlex.split(arguments)]
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        printed = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        seconds.append(time.perf_counter() - start)
    return printed, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each command; the median is reported")
    args = parser.parse_args()
    print(f"{len(os.sched_getaffinity(0))} CPU cores available")
    for arguments in COMMANDS:
        printed, seconds = time_command(arguments, args.repeat)
        print(f"\n$ starscream inspect {arguments}\n{printed}")
        print(f"wall clock: {statistics.median(seconds):.1f} s (median of {len(seconds)} run(s))")


if __name__ == "__main__":
    main()
