"""Generation on the serving engine: the rows of a prompt batch submitted at once to `serving.engine.Engine` (its
paged KV cache, its sampler, its prefill and decode layouts), run until every row ends, as `starscream generate`
runs them.

The engine splits its sequences over its cache shards (the partitions that split the attention batch), so a batch
of fewer rows than shards would leave partitions idle; there `inference.generate` (the static path) splits each
prompt over the partitions and decodes split-K instead (`static_reason`). The static path also stays the library's
reference: the engine's tests compare their tokens with it.

The engine is sized for the one batch it runs: one bucket of rows (the batch over the shards), one chunk (the prompt,
up to MAX_CHUNK positions a step) and one table width (the prompt and its new tokens), so it compiles two programs.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import jax
import numpy as np

from ..errors import StarscreamError
from ..serving.engine import Engine, EngineConfig
from ..serving.scheduler import SamplingParams, engine_seed, sample_seeds
from ..serving.buckets import Buckets
from ..serving.steps import cache_shards, check_same_cache_placement
from ..sharding.layouts import get_layout
from ..training.steps import Sampling
from .generate import stop_ids_of

PAGE_SIZE = 16
MAX_CHUNK = 512
"""Most prompt positions of one row per step (longer prompts prefill over several steps, as a server's do)."""
TOKEN_BUDGET = 2048
"""Most tokens of one step, as `starscream serve` computes by default (--max-num-batched-tokens)."""


@dataclass(frozen=True, kw_only=True)
class ServedGeneration:
    """Generated token ids [batch, new_tokens] (numpy int32; a row that stopped early is padded with its first stop
    id), how many tokens the rows generated, the seconds the engine took from submitting the rows to their last token
    (its programs compiled before), the programs it compiled and the paged decode attention it ran."""

    tokens: np.ndarray
    generated: int
    seconds: float
    programs: int
    kernel: str

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the seconds, prompt processing included (prefill and decode share the engine's
        steps)."""
        return self.generated / self.seconds if self.seconds else math.nan


def static_reason(batch: int, mesh, prefill_layout, decode_layout, config) -> str | None:
    """Why `starscream generate` runs a batch of `batch` rows of a model of `config` on the static path, or None
    where it runs them on the engine: every cache shard of the decode layout holds a row (else the static path's
    split-K decode keeps every partition busy), the two layouts place the page pool alike (the engine keeps one
    pool; the static path moves its cache between the phases), and one process runs (a mesh spanning processes
    runs the engine as a server's leader and followers, `serving.multihost`, which a one-shot generation does not
    set up: the static path runs alike on every process)."""
    if jax.process_count() > 1:
        return "a mesh spanning processes"
    if mesh is None:
        return None
    shards = cache_shards(decode_layout, mesh)
    if batch < shards:
        return "split-K decode: fewer samples than cache shards"
    try:
        check_same_cache_placement({"prefill": get_layout(prefill_layout), "decode": get_layout(decode_layout)},
                                   mesh, config, shards)
    except StarscreamError:
        return "the layouts place the KV cache apart: the cache moves between prefill and decode"
    return None


def generate_served(model, prompt_BP, max_new_tokens: int, sampling: Sampling, mesh, prefill_layout, decode_layout,
                    stop_token=None) -> ServedGeneration:
    """Each row of `prompt_BP` (int tokens [B, P]) continued by up to `max_new_tokens` tokens on an engine built for
    this batch; a row ends at any of `stop_token` (ids, one id or None). Sampling as `sampling` asks: greedy where
    its top_p is None, else drawn at its temperature from its nucleus, row i seeded by its seed's i-th engine seed
    (`scheduler.sample_seeds`: rows of one prompt draw apart, as the static path's rows do)."""
    prompts = [list(map(int, row)) for row in np.asarray(prompt_BP)]
    stop_ids = stop_ids_of(stop_token)
    engine = Engine(model, engine_config(len(prompts), len(prompts[0]), max_new_tokens, mesh, decode_layout),
                    mesh, prefill_layout, decode_layout)
    programs = engine.warm_up()
    params = SamplingParams(max_tokens=max_new_tokens, stop_tokens=stop_ids,
                            temperature=0.0 if sampling.top_p is None else sampling.temperature,
                            top_p=1.0 if sampling.top_p is None else sampling.top_p)
    each = [dataclasses.replace(params, seed=seed) for seed in sample_seeds(engine_seed(sampling.seed), len(prompts))]
    started = time.perf_counter()
    rows = engine.generate(prompts, each)
    seconds = time.perf_counter() - started
    pad = stop_ids[0] if stop_ids else 0
    tokens = np.array([row + [pad] * (max_new_tokens - len(row)) for row in rows], np.int32)
    return ServedGeneration(tokens=tokens, generated=sum(map(len, rows)), seconds=seconds, programs=programs,
                            kernel=engine.kernel)


def engine_config(batch: int, prompt: int, new_tokens: int, mesh, decode_layout) -> EngineConfig:
    """An engine that holds `batch` rows of `prompt + new_tokens` positions at once over the decode layout's cache
    shards, in one bucket of each kind (two programs; a third, the mixed step, where a shard's rows take more than
    one prefill step, so that some decode while others prefill)."""
    shards = cache_shards(decode_layout, mesh)
    rows = math.ceil(batch / shards)
    chunk = min(MAX_CHUNK, PAGE_SIZE * math.ceil(prompt / PAGE_SIZE))
    pages = math.ceil((prompt + new_tokens) / PAGE_SIZE)
    prefill_rows = max(1, min(rows, TOKEN_BUDGET // chunk))
    return EngineConfig(page_size=PAGE_SIZE, pages_per_shard=rows * pages + 1, rows_per_shard=rows,
                        token_budget=max(rows, prefill_rows * chunk), chunk=chunk, max_model_len=prompt + new_tokens,
                        buckets=Buckets(rows=(rows,), positions=(chunk,), pages=(pages,), prefill_rows=(prefill_rows,)),
                        prefix_caching=False,
                        mixed_chunks=1 if rows > prefill_rows else 0)
