"""Checkpoints with orbax-checkpoint: parameters, optimizer state and a JSON description of the run, per step.

A checkpoint stores global arrays, not shards: restoring takes an abstract target (shapes, dtypes and the shardings
wanted now), so a run saved under one mesh and layout restores under any other mesh and layout with every value
bit-identical. Saves are asynchronous (orbax writes in a background thread while training continues); every process
of a multi-process run must call `save` and `restore` together.
"""
from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ..errors import StarscreamError
from ..model.config import ModelConfig
from ..model.decoder import Transformer
from ..sharding.apply import param_shardings

ITEM_NAMES = ("params", "opt_state", "meta")


def abstract_arrays(tree):
    """Each array leaf of `tree` -> jax.ShapeDtypeStruct with the same shape, dtype and sharding (a restore target)."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding), tree)


class CheckpointStore:
    """The checkpoints of one run, in `directory/<step>/{params,opt_state,meta}`.

    `save_every` steps (and whenever `save(..., force=True)`), keeping the newest `max_to_keep`. With
    `must_exist` the directory is not created: opening one that is missing is an error (for restoring only).
    """

    def __init__(self, directory: str | Path, save_every: int = 100, max_to_keep: int = 2,
                 async_save: bool = True, must_exist: bool = False):
        self.directory = Path(directory).resolve()
        if must_exist and not self.directory.is_dir():
            raise StarscreamError(f"checkpoint directory {self.directory} does not exist; pass the checkpoints "
                                  "directory of a training run (RUN_DIR/checkpoints)")
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
            preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
            enable_async_checkpointing=async_save,
            create=not must_exist,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEM_NAMES)

    def save(self, step: int, params, opt_state, meta: dict, force: bool = False) -> bool:
        """Start saving `params` and `opt_state` (pytrees of jax.Array) and `meta` (JSON) at `step`.

        Returns whether a save started (every `save_every` steps, or when forced). The write finishes in the
        background; `wait()` or `close()` blocks until it is on disk.
        """
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=force,
        )

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or None when there is none."""
        return self._manager.latest_step()

    def require_step(self, step: int | None = None) -> int:
        """`step`, or the latest one when None; a clear error when the directory holds no such checkpoint."""
        available_steps = list(self._manager.all_steps())
        chosen_step = self.latest_step() if step is None else step
        if chosen_step is None or chosen_step not in available_steps:
            raise StarscreamError(
                f"no checkpoint for step {step if step is not None else '(latest)'} in {self.directory}; "
                f"found steps {sorted(available_steps)}; train first or pass a directory and step that exist"
            )
        return chosen_step

    def restore_meta(self, step: int | None = None) -> dict:
        """The JSON description saved with `step` (default: the latest)."""
        restored = self._manager.restore(
            self.require_step(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
        return dict(restored["meta"])

    def restore(self, step: int | None, params_target, opt_state_target=None):
        """(params, opt_state) of `step` (default: the latest), placed as the targets say.

        Targets are pytrees of the structure that was saved, whose leaves are jax.Array or jax.ShapeDtypeStruct
        carrying the wanted sharding (see `abstract_arrays`). With no `opt_state_target` only the parameters are
        read and the optimizer state returned is None.
        """
        items = {"params": ocp.args.StandardRestore(abstract_arrays(params_target))}
        if opt_state_target is not None:
            items["opt_state"] = ocp.args.StandardRestore(abstract_arrays(opt_state_target))
        restored = self._manager.restore(self.require_step(step), args=ocp.args.Composite(**items))
        return restored["params"], restored["opt_state"] if opt_state_target is not None else None

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager's threads."""
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def restore_model(directory: str | Path, layout, mesh, step: int | None = None, dtype: str | None = None):
    """(model, description): the Transformer saved at `step` (default: the latest) in `directory`, its parameters
    placed by `layout`'s params rules on `mesh` (whatever mesh and layout trained it), and the run's JSON description.

    `dtype` overrides the saved compute dtype ("float32" or "bfloat16"); parameters keep the dtype they were saved in.
    """
    with CheckpointStore(directory, must_exist=True) as store:
        chosen_step = store.require_step(step)
        description = store.restore_meta(chosen_step)
        config = ModelConfig(**description["model_config"])
        if dtype is not None:
            config = config.replace(dtype=dtype)
        abstract_model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
        graphdef, abstract_params, rest = nnx.split(abstract_model, nnx.Param, ...)
        shardings = param_shardings(abstract_params, layout, mesh)
        params_target = jax.tree.map(
            lambda sharding, variable: variable.replace(
                jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding)),
            shardings, abstract_params, is_leaf=lambda node: isinstance(node, nnx.Variable),
        )
        params, _ = store.restore(chosen_step, params_target)
    return nnx.merge(graphdef, params, rest), description
