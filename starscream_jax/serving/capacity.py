"""How many KV-cache pages a server holds: the device memory left after the weights and the steps' working memory,
as vLLM sizes its cache (`--gpu-memory-utilization`).

Per device the budget is `memory_utilization` of its memory (JAX's allocator is told to take that fraction at
start, `XLA_PYTHON_CLIENT_MEM_FRACTION`), less what the placed weights hold, less a reserve for the largest
step's temporaries (`step_reserve_bytes`, compared with the compiled programs' after warm-up,
`check_reserve`). What remains holds pages: each page of a cache shard costs every device its part of a
`[shards, page_size, kv_heads, head_dim]` key and value pool per layer (and an 8-bit cache's scales), as the decode
layout splits them. Devices that report no memory (the CPU) get pages for every row at the full context.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..errors import StarscreamError


@dataclass(frozen=True, kw_only=True)
class CacheSize:
    """pages_per_shard: pages of each cache shard (one is its null page); why: how it was chosen, for the start
    line; pool_bytes_per_device: what those pages hold on each device; reserve_bytes: what was kept for the steps'
    temporaries when sized from memory (0 otherwise)."""

    pages_per_shard: int
    why: str
    pool_bytes_per_device: int
    reserve_bytes: int


def page_bytes_per_device(page_shardings, page_shapes, dtypes) -> int:
    """Bytes each device holds for one page per cache shard, over every pool (`page_shapes` for one page per shard,
    placed by `page_shardings` (None: on one device), stored in `dtypes`; one entry per pool kind, each for every
    layer)."""
    return max(sum(math.prod(sharding.shard_shape(shape) if sharding is not None else shape) *
                   np.dtype(dtype).itemsize * layers
                   for sharding, (layers, shape), dtype in zip(page_shardings, page_shapes, dtypes)), 1)


def step_reserve_bytes(tokens: int, rows: int, table_positions: int, d_model: int, d_ff: int, vocab: int,
                       kv_width: int, itemsize: int, scored: bool = False, mixed_tokens: int = 0) -> int:
    """A bound on one step's temporaries per device: a prefill of `tokens` tokens (the residual stream in float32,
    the MLP's three hidden arrays, q/k/v; where `scored`, a scored prefill's float32 logits of every token over the
    whole vocabulary, their log-softmax and a comparison's copy) and the decode of `rows` rows gathering
    `table_positions` positions of one layer's keys and values (`kv_width` = kv heads x head_dim on the device),
    with the float32 logits and the sampler's sorted copy of each row, doubled for what XLA keeps alive at once;
    the larger of the two, and of a mixed step's decode beside a prefill of `mixed_tokens` tokens."""
    def prefill(tokens: int) -> int:
        return tokens * (4 * d_model * 4 + 3 * d_ff * itemsize + 3 * d_model * itemsize + scored * 3 * vocab * 4)

    decode = rows * table_positions * kv_width * 2 * itemsize + rows * vocab * 4 * 3
    return 2 * max(prefill(tokens), decode + (prefill(mixed_tokens) if mixed_tokens else 0))


def memory_stats(devices) -> list[dict] | None:
    """Each device's allocator statistics (`bytes_limit`, `bytes_in_use`), or None where any device reports no
    memory size (the CPU)."""
    stats = [device.memory_stats() for device in devices]
    if not stats or any(not stat or "bytes_limit" not in stat for stat in stats):
        return None
    return stats


def size_from_memory(devices, page_bytes: int, reserve: int, utilization: float, floor_pages: int) -> CacheSize:
    """Pages per cache shard from the devices' free memory (see the module docstring); the pages for every row
    at the full context (`floor_pages`) where the devices report no memory. StarscreamError when not one row's
    worth fits."""
    stats = memory_stats(devices)
    if stats is None:
        return CacheSize(pages_per_shard=floor_pages,
                         why="every row at the full context (the devices report no memory size)",
                         pool_bytes_per_device=floor_pages * page_bytes, reserve_bytes=0)
    free = min(stat["bytes_limit"] - stat.get("bytes_in_use", 0) for stat in stats) - reserve
    pages = free // page_bytes
    limit = min(stat["bytes_limit"] for stat in stats)
    if pages < 2:
        raise StarscreamError(f"no KV-cache pages fit: each device holds {limit / 2 ** 30:.2f} GiB at "
                              f"--gpu-memory-utilization {utilization}, of which the weights and {reserve / 2 ** 30:.2f}"
                              " GiB of step memory leave none; raise --gpu-memory-utilization, lower "
                              "--max-num-batched-tokens or --max-num-seqs, or spread the model over more devices")
    why = (f"{utilization:.2f} of device memory ({limit / 2 ** 30:.1f} GiB per device) less the weights and "
           f"{reserve / 2 ** 30:.2f} GiB for the steps")
    return CacheSize(pages_per_shard=int(pages), why=why, pool_bytes_per_device=int(pages) * page_bytes,
                     reserve_bytes=reserve)


def check_reserve(programs, reserve: int) -> None:
    """Warns (one line on stderr) when a compiled program's temporaries exceed the reserve the cache was sized
    with: the step may then run out of memory, and the line says what to lower."""
    for key, program in programs.items():
        analysis = program.memory_analysis()
        temp = getattr(analysis, "temp_size_in_bytes", 0) if analysis is not None else 0
        if temp > reserve:
            print(f"warning: the {key[0]} program of {key[1]} rows x {key[2]} positions x {key[3]} pages needs "
                  f"{temp / 2 ** 30:.2f} GiB of temporaries, more than the {reserve / 2 ** 30:.2f} GiB kept beside "
                  "the KV cache; if a step runs out of memory, lower --gpu-memory-utilization or "
                  "--max-num-batched-tokens", file=sys.stderr)
            return


def check_room(devices, size: CacheSize) -> None:
    """StarscreamError, before the pools are allocated, when the devices no longer have room for them: what the
    compiled programs and the runtime took since the cache was sized came out of the pools' share. The error gives
    the pages that fit now (keeping `size.reserve_bytes` for the steps)."""
    stats = memory_stats(devices)
    if stats is None:
        return
    free = min(stat["bytes_limit"] - stat.get("bytes_in_use", 0) for stat in stats)
    if size.pool_bytes_per_device <= free:
        return
    page_bytes = size.pool_bytes_per_device // size.pages_per_shard
    fits = max(0, (free - size.reserve_bytes) // page_bytes)
    raise StarscreamError(f"the KV cache of {size.pages_per_shard} pages per shard needs "
                          f"{size.pool_bytes_per_device / 2 ** 30:.2f} GiB per device, but only {free / 2 ** 30:.2f} "
                          f"GiB are free once the programs compiled; pass --cache-pages {fits} (what fits now, "
                          f"{size.reserve_bytes / 2 ** 30:.2f} GiB kept for the steps) or lower "
                          "--gpu-memory-utilization")


LARGE_GPU_BYTES = 70 * 2 ** 30
"""Memory from which a GPU (its partitions together) gets the larger step by default (`default_token_budget`)."""


def default_token_budget(devices, utilization: float, partitions_per_gpu: int = 1) -> int:
    """Most tokens of one step where --max-num-batched-tokens is not given, as vLLM's server picks it: 8192 on GPUs
    of LARGE_GPU_BYTES or more (H100, H200, MI300X), 2048 on smaller ones and where devices report no memory (the
    CPU). A device's memory is its allocator's limit over `utilization` (the fraction it was given), a partition's
    counted `partitions_per_gpu` times. Why: a larger step prefills more prompts per read of the weights (workload A
    on one H200, Llama 3 8B shape: 5,803 output tokens/s at 8192 against 4,720 at 2048, benchmarks/NOTES.md run
    54), at the cost of a longer step while prompts arrive."""
    stats = memory_stats(devices)
    if stats is None:
        return 2048
    per_gpu = min(stat["bytes_limit"] for stat in stats) / utilization * partitions_per_gpu
    return 8192 if per_gpu >= LARGE_GPU_BYTES else 2048


def local_devices_of(mesh) -> list:
    """The devices of `mesh` this process drives (the default device without a mesh): the ones whose memory it
    can read."""
    if mesh is None:
        return [jax.devices()[0]]
    return [device for device in mesh.devices.flat if device.process_index == jax.process_index()]


def agreed(size: CacheSize) -> CacheSize:
    """`size` with the fewest pages any process of the run found room for: every process must build pools of one
    shape. One process: `size` itself."""
    if jax.process_count() == 1:
        return size
    fewest = int(np.min(multihost_utils.process_allgather(np.array([size.pages_per_shard]))))
    if fewest == size.pages_per_shard:
        return size
    return CacheSize(pages_per_shard=fewest, why=size.why + f" (another process had room for {fewest})",
                     pool_bytes_per_device=size.pool_bytes_per_device * fewest // size.pages_per_shard,
                     reserve_bytes=size.reserve_bytes)
