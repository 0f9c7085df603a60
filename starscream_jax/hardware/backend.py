"""Backend-specific choices of the model and its steps, in one named policy per backend.

Each choice is applied only on the backend where it was measured to help (benchmarks/NOTES.md); elsewhere the
model runs JAX's and XLA's defaults. The model reads the policy of the device it compiles for (`policy_of`), the
cost model the policy of the chip it estimates (`policy_of_vendor`), so both make the same decision.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

SMALL_DOT_ELEMENTS = 10_000_000
"""XLA:GPU's algebraic simplifier rewrites a matmul whose left side is a single row (once size-1 dimensions are
dropped) into a multiply and a reduction when its two sides together hold fewer elements than this per device (its
dot strength reduction; the threshold is fixed in XLA's GPU algebraic simplifier). In decode at batch 1 that is the
k and v projections of grouped-query attention, which then read their weights at a quarter of the rate of a GEMM."""


@dataclass(frozen=True, kw_only=True)
class BackendPolicy:
    """What the model does differently on one backend.

    fused_attention_dtypes: the input dtypes for which attention calls the vendor's fused kernel
        (`jax.nn.dot_product_attention(implementation="cudnn")`), where JAX would pick XLA's unfused form.
    padded_rows: the rows a projection with one row per device is padded to behind an optimization barrier, so
        that XLA runs a GEMM where its simplifier would run a multiply and a reduction (0: never padded).
    small_dot_elements: below this many elements per device (both sides) such a projection is padded.
    decode_compiler_options: XLA options of the decode step, as (name, value) pairs.
    eight_bit_matmul: how a projection of a few rows by 8-bit weights runs (`model.weight_only` implementations):
        "pallas", the library's weight-only kernel, or "xla", XLA's matmul of the converted weights.
    eight_bit_groups: whether decode's 8-bit projections that share an input (q, k, v; gate, up) run in one launch
        (`model.weight_only_group`) where they run on the weight-only kernel.
    eight_bit_attention: decode attention over an 8-bit cache: "pallas" (`model.eight_bit_decode`'s kernel; for a
        shape it does not take, the reductions), "reductions" (XLA reductions in the cache's own order,
        `ops._decode_over_8_bit_cache`) or "dot" (XLA's batched dots of the converted cache, as a prefill chunk runs).
    paged_attention: the serving engine's paged decode attention (`model.paged.KERNELS`) where the engine is not
        told: "cudnn" (cuDNN's paged attention, the pages read in place) or "gather" (every backend).
    inline_ptx: whether the library's Pallas kernels may carry inline PTX (NVIDIA's assembly: int8 into float16
        by a byte permute, `model.weight_only.widened`).
    byte_transpose: whether fp8 training moves each e4m3 weight into the layout its forward GEMM reads by the
        library's byte transpose kernel (`model.byte_transpose`) rather than XLA's transpose, which ran some at
        0.3 TB/s (benchmarks/NOTES.md run 92).
    """

    name: str
    fused_attention_dtypes: frozenset[str] = frozenset()
    padded_rows: int = 0
    small_dot_elements: int = 0
    decode_compiler_options: tuple[tuple[str, bool | int], ...] = ()
    eight_bit_matmul: str = "xla"
    eight_bit_groups: bool = False
    eight_bit_attention: str = "dot"
    paged_attention: str = "gather"
    inline_ptx: bool = False
    byte_transpose: bool = False

    def fuses_attention(self, dtype) -> bool:
        """Whether attention on inputs of `dtype` runs the vendor's fused kernel."""
        return str(np.dtype(dtype)) in self.fused_attention_dtypes

    def pads(self, x_elements: int, w_elements: int) -> bool:
        """Whether a projection of one row per device, its sides `x_elements` and `w_elements` per device, is
        padded to `padded_rows` rows."""
        return self.padded_rows > 1 and x_elements + w_elements < self.small_dot_elements


CUDA = BackendPolicy(
    name="cuda",
    fused_attention_dtypes=frozenset({"bfloat16", "float16"}),
    padded_rows=8,
    small_dot_elements=SMALL_DOT_ELEMENTS,
    decode_compiler_options=(("xla_gpu_enable_triton_gemm", False), ("xla_gpu_dot_merger_threshold_mb", 0)),
    eight_bit_matmul="pallas",
    eight_bit_groups=True,
    eight_bit_attention="pallas",
    paged_attention="cudnn",
    inline_ptx=True,
    byte_transpose=True,
)
"""NVIDIA GPUs (measured on an H200): cuDNN's fused attention for 16-bit inputs (flash attention in training and
prefill; in decode it reads the KV cache with its strides, no transposed copy); one-row projections padded to 8 rows,
the multiple XLA pads a GEMM's rows to for the tensor cores itself, so one kernel does both; decode's GEMMs as cuBLAS
calls rather than XLA's Triton GEMM fusions (which read the weights more slowly and copy each layer's o weight out of
the stacked array first), and no merging of GEMMs that share an input (q, k and v), which would concatenate their
weights in every step; 8-bit weights of decode's few-row projections read by the library's weight-only kernel
(`model.weight_only`), where XLA's converting GEMM fusions read them at half the HBM rate (benchmarks/NOTES.md run
24; the kernel compiled and matched on an H200 in run 31), the projections that share an input in one launch
(one layer 1.21x bf16 for int8 and 1.15x for fp8 at one row, 1.25x and 1.18x the single-projection kernel at 64 rows:
run 32); decode attention over an 8-bit cache by the library's kernel, which reads the cache in place (XLA's
reductions read it at 0.59 TB/s at batch 64 in run 32; the kernel compiled and matched there); the paged decode
attention by cuDNN's paged kernel, which reads each row's pages in place at 3.5-4.0 TB/s where gathering them into
rows first reads 1.25 TB/s (run 38); fp8 training's e4m3 weights moved into their forward GEMMs' layout by the
library's byte transpose kernel, where XLA moved some at 0.3 TB/s (run 92)."""
PORTABLE = BackendPolicy(name="portable")
"""Every other backend (CPU, ROCm): JAX's and XLA's defaults (the weight-only kernel lowers on ROCm's Triton too,
but has not been measured there: `ModelConfig.eight_bit_matmul` "pallas" asks for it). Decode over an 8-bit cache
runs XLA's batched dots: XLA:CPU (jaxlib 0.10) miscompiles the reductions' form for some shapes (scores off by
about 1,000 for one row, 8 query heads over 4 kv heads of 16 and 32 positions, `tests/model/test_ops.py`)."""


def policy_of(device: jax.Device) -> BackendPolicy:
    """The policy of the backend `device` belongs to."""
    version = getattr(device.client, "platform_version", "").lower()
    return CUDA if device.platform == "gpu" and "cuda" in version else PORTABLE


def policy_of_vendor(vendor: str) -> BackendPolicy:
    """The policy the model applies on a chip of `vendor` (a chip file's `vendor`: "nvidia", "amd" or "")."""
    return CUDA if vendor == "nvidia" else PORTABLE
