"""One engine per mesh and layout pair for every serving test in a process, over the tiny Llama checkpoint of
tests/fixtures/hf: each compiles its programs (a decode, a prefill and a mixed bucket) once."""
import functools
from pathlib import Path

import pytest

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.hf_checkpoint import load_hf_model
from starscream_jax.serving.engine import Engine, EngineConfig
from starscream_jax.serving.scheduler import SamplingParams
from starscream_jax.serving.buckets import Buckets
from starscream_jax.serving.steps import cache_shards
from starscream_jax.text.tokenizer import load_tokenizer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "llama"
ROWS = 8
CASES = {"1x1x1": ("starscream_tp", "starscream_decode"), "1x2x4": ("starscream_tp", "starscream_decode"),
         "2x2x2": ("starscream_tp", "starscream_decode"), "1x2x4-flat": ("flat_tp", "flat_tp"),
         "1x2x4-int8": ("starscream_tp", "starscream_decode"), "1x1x1-sync": ("starscream_tp", "starscream_decode"),
         "1x2x4-logprobs": ("starscream_tp", "starscream_decode"),
         "1x1x1-logprobs": ("starscream_tp", "starscream_decode"),
         "1x2x4-apart": ("starscream_tp", "starscream_decode")}
"""mesh (-variant) -> (prefill layout, decode layout); the int8 variant holds its KV pages in int8 and decodes with
the gather path; the sync variant reads each step's tokens before it launches the next (no overlap); the logprobs
variant serves prompt log-probabilities (one more program: the scored prefill); the apart variant runs a step's
prompt chunks and decode rows as two programs (`EngineConfig.mixed_chunks` 0), every other as one mixed program."""
PAGES_PER_SHARD = {"1x1x1": 13, "1x1x1-sync": 13}
"""Pages per cache shard where fewer than the default 40: one shard of 12 usable pages cannot hold 8 requests of 12
positions (3 pages each) at once, so the engine preempts."""


PREFILL_ROWS = {"1x1x1-logprobs": (1,)}
"""Prefill rows per step where not as many as decode's: one row, a bucket every server compiles."""
MIXED_CHUNKS = {"1x1x1": (), "1x1x1-sync": (), "1x1x1-logprobs": ()}
"""Prompt chunks per shard of a mixed step where not every prefill row's: the engine's default, one (a step of more
runs as two programs); elsewhere a mixed step takes as many chunks as a prefill step."""


@functools.cache
def tokenizer():
    return load_tokenizer(FIXTURE)


@functools.cache
def _unsharded_model():
    """The checkpoint's model with its parameters on the default device, no layout (what `generate` runs)."""
    placed = load_hf_model(FIXTURE, "gpu_tp", build_mesh("1x1x1"))
    graphdef, params, rest = nnx.split(placed, nnx.Param, ...)
    return nnx.merge(graphdef, jax.tree.map(lambda array: jnp.asarray(np.asarray(array)), params), rest)


@functools.cache
def _engine(case: str) -> Engine:
    """8 rows in all, chunks of 8 positions, 16 pages of 4 positions per row (a context of 64); its programs
    compiled before any test, as a server compiles them."""
    mesh, (prefill, decode) = build_mesh(case.split("-")[0]), CASES[case]
    engine = Engine(load_case_model(case, prefill, mesh), engine_config(case, mesh), mesh, prefill, decode)
    engine.use_tokenizer(tokenizer())  # structured output
    engine.warm_up()
    return engine


def load_case_model(case: str, layout, mesh):
    """The checkpoint's model placed by `layout` on `mesh`; the int8 variant's KV cache in int8."""
    model = load_hf_model(FIXTURE, layout, mesh)
    if case.endswith("-int8"):
        model.config = model.config.replace(kv_format="int8")
    return model


def engine_config(case: str, mesh) -> EngineConfig:
    """The engine configuration of `case` on `mesh` (tests/serving/multihost_serve_worker.py builds it too)."""
    shards = cache_shards(CASES[case][1], mesh)
    return EngineConfig(page_size=4, pages_per_shard=PAGES_PER_SHARD.get(case, 40), rows_per_shard=ROWS // shards,
                        token_budget=64, chunk=8,
                        buckets=Buckets(rows=(ROWS // shards,), positions=(8,), pages=(16,),
                                        prefill_rows=PREFILL_ROWS.get(case),
                                        mixed_chunks=MIXED_CHUNKS.get(case, (ROWS // shards,))),
                        kernel="gather", overlap=not case.endswith("-sync"),
                        prompt_logprobs=case.endswith("-logprobs"), mixed_chunks=0 if case.endswith("-apart") else 1)


def staggered(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens where the first two are submitted, run two steps, then the rest arrive two at a
    time, a step after each pair: the later prompts' chunks run in steps beside the earlier ones' decode rows
    (mixed steps, where the engine runs them)."""
    outputs = {index: [] for index in range(len(prompts))}

    def step():
        for event in engine.step():
            outputs[int(event.request_id)].append(event.token)

    for index, prompt in enumerate(prompts):
        engine.submit(str(index), prompt, SamplingParams(max_tokens=new_tokens))
        if index == 1:
            step()
        if index % 2:
            step()
    while engine.busy:
        step()
    return [outputs[index] for index in range(len(prompts))]


@pytest.fixture(scope="session")
def run_staggered():
    """`staggered`, for the tests (a test module cannot import this conftest by name)."""
    return staggered


@pytest.fixture(scope="session")
def engine_for():
    """case (a key of CASES) -> its engine, built once per process."""
    return _engine


@pytest.fixture(scope="session")
def unsharded_llama():
    return _unsharded_model()


@pytest.fixture(scope="session")
def llama_tokenizer():
    return tokenizer()
