"""The serving step's sampler, on one device: each compiled sampler (`serving.steps.sample_step`, one per combination of
passes, `SamplerFeatures`) and each pass alone, at several rows over a vocabulary's logits.

Passes alone: the top log-probabilities (`lax.top_k` at k = 20, the most a request asks for, and at 16 and 8 beside
it; `sampling.top_logprobs` in rounds of several sizes), the argmax a greedy row takes, the log-softmax every row's log-probability comes from, the sort a drawing row
needs, and `serving.sampling`'s penalties, logit bias, grammar mask, bad words and the counts the step keeps. The
samplers run as the engine runs them: recent tokens and slot state donated from each call to the next; rows of the
"extras" samplers ask for penalties, a bias and 5 top log-probabilities, those of the "drawn" ones a temperature of 1.

    python scripts/bench_sampler.py --out benchmarks/results/h200_sampler_passes.json
    python scripts/bench_sampler.py --quick             # CPU: 8 rows over 512 ids
"""
from __future__ import annotations

import argparse
import sys

from starscream_jax.benchmarks import harness

ROWS = (64, 256)
"""Rows per step: a server's middle and largest decode buckets (Llama 3 8B, one H200)."""
VOCAB = 128256
"""Llama 3's vocabulary."""
ROUNDS = (None, 16, 10, 8)
"""The most ids per round of the top log-probabilities timed side by side (None: one `lax.top_k` of 20)."""


def passes(rows: int, vocab: int) -> dict:
    """Each pass alone, jitted, with its arguments: {name: (function, arguments)}."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.serving import sampling

    logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32)
    asked, state = sampler_rows(rows, extras=True, drawn=False), sampling.SlotState.empty(rows, vocab)
    slot, position = jnp.arange(rows, dtype=jnp.int32), jnp.full((rows,), 100, jnp.int32)
    found = {f"top_k {k}": (jax.jit(lambda x, k=k: jax.lax.top_k(x, k)), (logits,)) for k in (20, 16, 8)}
    found.update({f"top_logprobs rounds of {size}": (jax.jit(lambda x, size=size: sampling.top_logprobs(x, size)),
                                                      (logits,)) for size in ROUNDS})
    found.update({"argmax": (jax.jit(lambda x: jnp.argmax(x, -1)), (logits,)),
                  "log_softmax": (jax.jit(lambda x: jax.nn.log_softmax(x, -1)), (logits,)),
                  "sort": (jax.jit(lambda x: jnp.sort(x, -1)), (logits,)),
                  "penalties": (jax.jit(sampling.apply_penalties), (logits, state, slot, asked)),
                  "bias": (jax.jit(sampling.apply_bias), (logits, state, slot, asked, position)),
                  "grammar": (jax.jit(sampling.apply_grammar), (logits, state, slot, asked)),
                  "bad words": (jax.jit(sampling.apply_bad_words), (logits, state, slot, asked)),
                  "record": (jax.jit(sampling.record), (state, slot, slot, asked))})
    return found


def sampler_rows(rows: int, *, extras: bool, drawn: bool):
    """`RowSampling` [rows] on the device: neutral, with penalties, a bias and 5 top log-probabilities where
    `extras`, a temperature of 1 where `drawn`."""
    import jax.numpy as jnp

    from starscream_jax.serving.steps import RowSampling

    settings = {name: jnp.asarray(value) for name, value in vars(RowSampling.neutral(rows)).items()}
    if extras:
        settings.update(presence=jnp.full(rows, 0.5), repetition=jnp.full(rows, 1.1),
                        biased=jnp.ones(rows, jnp.int32), top_logprobs=jnp.full(rows, 5, jnp.int32))
    if drawn:
        settings.update(temperature=jnp.ones(rows, jnp.float32))
    return RowSampling(**settings)


def sampler_ms(rows: int, vocab: int, features, calls: int) -> float:
    """Milliseconds per call of the compiled sampler of `features`, its recent tokens and slot state donated from
    each call to the next as the engine donates them."""
    import time

    import jax
    import jax.numpy as jnp

    from starscream_jax.serving.sampling import SlotState
    from starscream_jax.serving.steps import SamplerRows, sample_step

    logits = jax.random.normal(jax.random.key(1), (rows, vocab), jnp.float32)
    asked = SamplerRows(sampling=sampler_rows(rows, extras=features.extras, drawn=features.drawn),
                        position=jnp.full((rows,), 100, jnp.int32), slot=jnp.arange(rows, dtype=jnp.int32))
    recent, state = jnp.zeros((rows,), jnp.int32), SlotState.empty(rows, vocab)
    program = sample_step(under=None).lower(logits, asked, recent, state, None, features=features).compile()
    for _ in range(2):  # a warm-up round, then the timed one
        start = time.perf_counter()
        for _ in range(calls):
            outputs, recent, state = program(logits, asked, recent, state, None)
        jax.block_until_ready(outputs)
    return 1e3 * (time.perf_counter() - start) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_run_arguments(parser, warmup=None, steps=20, steps_flag="--calls", steps_help="timed calls per form",
                              quick="8 rows over 512 ids on the CPU, 2 calls each")
    args = parser.parse_args(argv)
    from starscream_jax.serving.steps import SamplerFeatures

    row_counts, vocab, calls = ((8,), 512, 2) if args.quick else (ROWS, VOCAB, args.calls)
    result = {"meta": harness.run_info(__file__, argv).as_dict(), "vocab": vocab, "rows": []}
    for rows in row_counts:
        timed = {name: harness.seconds_per_call(function, arguments, warmup=2, calls=calls)
                 for name, (function, arguments) in passes(rows, vocab).items()}
        row = {"rows": rows, "passes_ms": {name: 1e3 * seconds for name, seconds in timed.items()},
               "samplers_ms": {f"drawn={features.drawn} extras={features.extras}":
                               sampler_ms(rows, vocab, features, calls) for features in SamplerFeatures.every()}}
        result["rows"].append(row)
        harness.write_json(args.out, result)
        print(f"rows {rows}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in
                                           {**row["passes_ms"], **row["samplers_ms"]}.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
