"""Trains examples/gspmd_gpt.py, a model written for Flax's GSPMD guide, under a starscream layout, unchanged.

The model file imports nothing of this library. What placing it takes is here, from the public API only: a mesh with
Auto axes (`auto_axes`), the layout in the model's names (`in_vocabulary`: its `hidden` is the library's `mlp`, its
`length` the `seq`, its fused `qkv` dimension never split), the model created already sharded (`create_sharded`,
which on Auto axes makes Flax's layers read each parameter as the layout uses it), each token batch placed as the
layout places tokens (`batch_sharding`), and the step jitted inside `use_layout`, which installs the layout as
Flax's logical-axis rules. `check` then judges what XLA's sharding propagation made of it: under starscream_tp all
three principles hold, with the model's activation constraints or without any (`--unconstrained`).

    python examples/flax_gspmd_train.py                  # trains a few steps on 2 simulated GPUs x 4 partitions
    python examples/flax_gspmd_train.py --unconstrained  # the same model with no activation constraint
    python examples/flax_gspmd_train.py --fixed          # the lookup through embed_lookup instead of nnx.Embed's
"""
from __future__ import annotations

import sys

import jax
import optax
from flax import nnx

import gspmd_gpt
from starscream_jax import (
    auto_axes,
    batch_sharding,
    build_mesh,
    check,
    create_sharded,
    embed_lookup,
    in_vocabulary,
    simulate_cpu_devices,
    use_layout,
)

VOCABULARY = {"hidden": "mlp", "length": "seq", "qkv": None}
"""The model's logical names that are not the library's ({its name: the library's}; None: never split)."""


class WithVocabularyParallelLookup(gspmd_gpt.GPT):
    """The model with its token lookup through `embed_lookup`: each partition looks its tokens up in its GPU's
    rows of the table and one all-reduce across GPUs completes them (hierarchical, and the same rows)."""

    def embed_tokens(self, tokens_BS: jax.Array) -> jax.Array:
        return embed_lookup(self.embed.embedding[...], tokens_BS)


def main(layout: str = "starscream_tp", steps: int = 6, config: gspmd_gpt.Config = gspmd_gpt.Config(),
         fixed: bool = False, topology: str = "2x4", data: int = 1, place_batch: bool = True):
    """Trains the model (`fixed`: with the lookup through `embed_lookup`) under `layout` on simulated GPUs x
    partitions (`topology`, `data` of them in data-parallel groups), each batch placed by the layout
    (`place_batch`; False: passed as made, whole on every device); returns the losses and `check`'s verdict on the
    train step."""
    simulate_cpu_devices(8)
    mesh = auto_axes(build_mesh(topology, data=data))
    placed = in_vocabulary(layout, VOCABULARY)
    model_type = WithVocabularyParallelLookup if fixed else gspmd_gpt.GPT
    model = create_sharded(lambda: model_type(config, nnx.Rngs(0)), placed, mesh)

    def tokens(step: int) -> jax.Array:
        made = gspmd_gpt.batch(step)
        return jax.device_put(made, batch_sharding(placed, mesh)) if place_batch else made

    with use_layout(placed, mesh):
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
        step = nnx.jit(gspmd_gpt.train_step)
        losses = [float(step(model, optimizer, tokens(i))) for i in range(steps)]
        verdict = check(step, model, optimizer, tokens(0), mesh=mesh, vocabulary=VOCABULARY)
    return losses, verdict


if __name__ == "__main__":
    losses, verdict = main(config=gspmd_gpt.Config(constraints="--unconstrained" not in sys.argv),
                           fixed="--fixed" in sys.argv)
    print("losses", " ".join(f"{loss:.3f}" for loss in losses))
    print(verdict.table())
