#!/usr/bin/env python
"""Generate text from a training checkpoint: the same as `starscream generate` (see starscream_jax/cli/generate.py).

    python scripts/generate.py --prompt "ROMEO:" --max-new-tokens 200
    python scripts/generate.py --greedy --prefill-layout starscream_tp --decode-layout starscream_decode
"""
import sys

from starscream_jax.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
