#!/usr/bin/env python
"""Train a model under a layout: the same as `starscream train` (arguments and defaults in starscream_jax/train.py).

    python scripts/train.py                      # tiny Llama, simulated 2 GPUs x 4 partitions, starscream_tp
    python scripts/train.py --layout flat_tp --steps 100 --run-dir runs/flat
"""
import sys

from starscream_jax.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
