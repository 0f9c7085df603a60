"""The backend policy: CUDA's choices on NVIDIA GPUs only, the portable defaults on CPUs and ROCm, and the same
decision for a device the model compiles for and for a chip the cost model estimates."""
from dataclasses import dataclass

import jax

from starscream_jax.hardware.backend import CUDA, PORTABLE, policy_of, policy_of_vendor
from starscream_jax.hardware.presets import load_chip


@dataclass(frozen=True)
class FakeClient:
    platform_version: str


@dataclass(frozen=True)
class FakeDevice:
    platform: str
    client: FakeClient


def test_cuda_choices_apply_on_nvidia_gpus_only():
    assert policy_of(FakeDevice("gpu", FakeClient("PJRT C API\ncuda 12080"))) is CUDA
    assert policy_of(FakeDevice("gpu", FakeClient("PJRT C API\nrocm 70000"))) is PORTABLE
    assert policy_of(jax.devices("cpu")[0]) is PORTABLE
    assert policy_of_vendor(load_chip("h200").vendor) is CUDA
    assert policy_of_vendor(load_chip("mi300x").vendor) is PORTABLE


def test_the_portable_policy_changes_nothing():
    assert not PORTABLE.fuses_attention("bfloat16") and not PORTABLE.pads(1, 1)
    assert PORTABLE.decode_compiler_options == ()


def test_cuda_fuses_16_bit_attention_and_pads_small_one_row_matmuls():
    assert CUDA.fuses_attention("bfloat16") and CUDA.fuses_attention("float16") and not CUDA.fuses_attention("float32")
    assert CUDA.pads(4096, 4096 * 1024) and not CUDA.pads(4096, 4096 * 4096)
