"""Checkpoints with orbax-checkpoint: parameters, optimizer state and a JSON description of the run, per step.

A checkpoint stores global arrays, not shards: restoring takes an abstract target (shapes, dtypes and the shardings
wanted now), so a run saved under one mesh and layout restores under any other mesh and layout with every value
bit-identical. Saves are asynchronous (orbax writes in a background thread while training continues); every process
of a multi-process run must call `save` and `restore` together.

A save is first written to a temporary directory and renamed when complete, so a process killed mid-save leaves the
earlier checkpoints whole. A checkpoint damaged afterwards (a truncated or missing file, bad metadata, a half-deleted
directory) fails to restore with a `CheckpointError` naming its step and file; `restore_newest_intact` moves such a
checkpoint aside to `<step>.damaged` (never deleting it) and falls back to the next older one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding

from ..errors import CheckpointError, StarscreamError
from ..hardware.distributed import is_main_process
from ..model.config import ModelConfig
from ..model.decoder import abstract_model
from ..sharding.apply import abstract_placed

ITEM_NAMES = ("params", "opt_state", "meta")
DAMAGED_SUFFIX = ".damaged"
FILE_IN_ERROR = re.compile(r'(?:local file "|File )(/[^"\s]+)')
"""The file named by a tensorstore or orbax error message ('local file "/x/y"', 'File /x/y not found')."""


def abstract_arrays(tree):
    """Each array leaf of `tree` -> jax.ShapeDtypeStruct with the same shape, dtype and sharding (a restore target)."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding), tree)


class MisnamedCheckpointError(CheckpointError):
    """A checkpoint whose directory names another step than its description records (a copy renamed). It is not
    damage, so it is never set aside: resuming from it, or past it, is refused until it is named right."""


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
        _quiet_orbax_tracebacks()
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEM_NAMES)

    def save(self, step: int, params, opt_state, meta: dict, force: bool = False) -> bool:
        """Start saving `params` and `opt_state` (pytrees of jax.Array) and `meta` (JSON) at `step`.

        Returns whether a save started (every `save_every` steps, or when forced). The write finishes in the
        background; `wait()` or `close()` blocks until it is on disk.
        """
        with self.reporting_write_failure():
            return self._manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(opt_state),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=force,
            )

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` without `force` would save."""
        return self._manager.should_save(step)

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def require_step(self, step: int | None = None) -> int:
        """`step`, or the latest one when None; a clear error when the directory holds no such checkpoint."""
        available_steps = self.all_steps()
        chosen_step = self.latest_step() if step is None else step
        if chosen_step is None or chosen_step not in available_steps:
            raise StarscreamError(
                f"no checkpoint for step {step if step is not None else '(latest)'} in {self.directory}; "
                f"found steps {sorted(available_steps)}; train first or pass a directory and step that exist"
            )
        return chosen_step

    def restore_meta(self, step: int | None = None) -> dict:
        """The JSON description saved with `step` (default: the latest). A description recording another step than
        its directory's name is a `MisnamedCheckpointError` naming both."""
        chosen_step = self.require_step(step)
        restored = self._manager.restore(chosen_step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        description = dict(restored["meta"])
        recorded = description.get("step")
        if recorded is not None and recorded != chosen_step:
            raise MisnamedCheckpointError(
                f"checkpoint {self.directory / str(chosen_step)} records step {recorded}, not {chosen_step}: it holds "
                f"step {recorded}'s weights under another name, and resuming would continue at step {chosen_step} "
                f"from them; rename it back to {recorded} (or delete it)")
        return description

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

    @contextlib.contextmanager
    def reporting_damage(self, step: int):
        """Within it, a failure to read checkpoint `step` raises `CheckpointError` naming the step and the file."""
        try:
            yield
        except StarscreamError:
            raise
        except Exception as error:  # orbax and tensorstore raise many types (KeyError, ValueError, OSError, ...)
            _quiet_reads_left_behind()
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: "
                                  f"{describe_storage_error(error)}") from error

    def restore_checked(self, step: int, params_target, opt_state_target=None):
        """(description, params, opt_state) of `step`, as `restore_meta` and `restore` give them, under
        `reporting_damage`; parameters that are not finite are damage too (training never saves them)."""
        with self.reporting_damage(step):
            restored = (self.restore_meta(step), *self.restore(step, params_target, opt_state_target))
        require_finite_checkpoint(restored[1], f"checkpoint step {step} in {self.directory}")
        return restored

    def restore_newest_intact(self, params_target, opt_state_target, say):
        """(step, description, params, opt_state) of the newest checkpoint that restores, or None when there is no
        checkpoint. Each newer damaged one is reported through `say` and moved aside to `<step>.damaged`, so that
        the run saves that step afresh; when every checkpoint is damaged, a `CheckpointError` lists them."""
        damaged = []
        for step in reversed(self.all_steps()):
            try:
                return (step, *self.restore_checked(step, params_target, opt_state_target))
            except MisnamedCheckpointError:
                raise
            except CheckpointError as error:
                damaged.append(str(error))
                say(f"{error}; moved aside to {self._set_aside(step).name}, trying the previous checkpoint")
        if damaged:
            raise CheckpointError(f"no intact checkpoint in {self.directory} ({'; '.join(damaged)}); start afresh "
                                  "with another --run-dir")
        return None

    def damaged(self) -> list[str]:
        """The names of the checkpoints set aside as damaged (`<step>.damaged`), oldest first."""
        return sorted((path.name for path in self.directory.glob(f"*{DAMAGED_SUFFIX}")),
                      key=lambda name: int(name.removesuffix(DAMAGED_SUFFIX)) if name[0].isdigit() else -1)

    def _set_aside(self, step: int) -> Path:
        """Renames checkpoint `step` to `<step>.damaged` (kept for inspection; orbax no longer lists it)."""
        aside = self.directory / f"{step}{DAMAGED_SUFFIX}"
        if is_main_process():
            (self.directory / str(step)).rename(aside)
        self._manager.reload()
        return aside

    def wait(self) -> None:
        """Block until every started save is on disk."""
        with self.reporting_write_failure():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager's threads."""
        with self.reporting_write_failure():
            self._manager.close()

    @contextlib.contextmanager
    def reporting_write_failure(self):
        """Within it, a save that failed (now, or in the background: a full disk, a directory gone) raises
        `CheckpointError` naming the file and the newest complete checkpoint, from which --resume continues."""
        try:
            yield
        except StarscreamError:
            raise
        except Exception as error:  # orbax re-raises the background writer's error, of any type
            _quiet_reads_left_behind()
            if isinstance(error, TimeoutError) or "barrier" in str(error):  # the processes save together
                why, fix = ("the run's other processes did not reach the save (one stopped or hangs)",
                            "restart every process of the run")
            else:
                why, fix = describe_storage_error(error), "free space (or fix the directory)"
            raise CheckpointError(f"writing a checkpoint in {self.directory} failed: {why}; {fix} and rerun with "
                                  f"--resume, which {resume_point(self._complete_step())}") from error

    def _complete_step(self) -> int | None:
        """The newest step whose checkpoint is complete on disk (a save that failed may still be listed)."""
        try:
            self._manager.reload()
        except Exception:  # noqa: BLE001 (a directory orbax can no longer list: what it listed before)
            pass
        return self._manager.latest_step()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def resume_point(step: int | None) -> str:
    return "starts afresh (no checkpoint is complete)" if step is None else f"continues from step {step}"


class _OrbaxTracebacks(logging.Filter):
    """Drops the tracebacks orbax logs from its background threads when a save or restore fails (a full disk
    gives hundreds of lines): orbax raises that error again in the caller, where `reporting_write_failure` and
    `reporting_damage` state it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname)


_ORBAX_TRACEBACKS = _OrbaxTracebacks()


def _quiet_orbax_tracebacks() -> None:
    """Installs `_OrbaxTracebacks` on absl's logger (which orbax logs through; once) and the closed event loop's
    message filter."""
    logging.getLogger("absl").addFilter(_ORBAX_TRACEBACKS)
    _quiet_reads_left_behind()


def _quiet_reads_left_behind() -> None:
    """After a failed restore, tensorstore may finish the reads it still had in flight and hand them to orbax's
    event loop, closed by then; Python would print that as an ignored exception with a traceback. Only that
    message is dropped; any other unraisable exception reaches the previous hook."""
    previous_hook = sys.unraisablehook
    if getattr(previous_hook, "drops_closed_loop", False):
        return

    def hook(unraisable):
        closed_loop = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == \
            "Event loop is closed"
        if not (closed_loop or _orbax_read(unraisable.object)):
            previous_hook(unraisable)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook


def _orbax_read(thing) -> bool:
    """Whether `thing` is one of orbax's read coroutines (one left failing after a restore that failed already)."""
    code = getattr(thing, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def describe_storage_error(error: Exception) -> str:
    """What a failed read or write says, shortened to the file and the reason: of the first error in its chain
    (orbax wraps tensorstore's in its own, which names the array's slice, not the file) that names a file."""
    chain = [error]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    error = next((link for link in chain if FILE_IN_ERROR.search(_first_line(link))), error)
    message = _first_line(error)
    found = FILE_IN_ERROR.findall(message)
    if not found:
        return f"{type(error).__name__}: {message[:200]}"
    status, _, rest = message.partition(": ")
    detail = rest.rpartition(f'{found[-1]}": ')[2] if f'{found[-1]}": ' in rest else ""
    return f"{found[-1]} ({status}{': ' + detail[:120] if detail else ''})"


def _first_line(error: BaseException) -> str:
    """An error's first line without the store specification tensorstore and orbax append."""
    line = (str(error).splitlines() or [""])[0]
    return line.split(" [tensorstore_spec")[0].split(" See full TensorStore details")[0]


@jax.jit
def _finite_flags(leaves: list) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])


def finite_flags(tree) -> np.ndarray:
    """Whether each array leaf of `tree` is finite, [leaves] bool on the host; computed where the arrays lie (under
    their mesh, which the scalar results need on an Explicit mesh)."""
    leaves = jax.tree.leaves(tree)
    meshes = {leaf.sharding.mesh for leaf in leaves if isinstance(getattr(leaf, "sharding", None), NamedSharding)}
    with jax.set_mesh(meshes.pop()) if len(meshes) == 1 else contextlib.nullcontext():
        return np.asarray(_finite_flags(leaves))


def all_finite(tree) -> bool:
    """Whether every element of every array of `tree` is finite."""
    return bool(finite_flags(tree).all())


def require_finite_checkpoint(params, where: str) -> None:
    """A CheckpointError naming the parameters of a restored checkpoint that are not finite."""
    flags = finite_flags(params)
    bad = [jax.tree_util.keystr(path) for (path, _), finite in zip(jax.tree_util.tree_leaves_with_path(params), flags)
           if not finite]
    if bad:
        raise CheckpointError(f"{where} holds non-finite parameters ({', '.join(bad[:3])}); it is damaged: "
                              "resume from another --run-dir or train afresh")


def abstract_model_state(config: ModelConfig, layout, mesh):
    """(graphdef, params, rest) of a Transformer of `config` with no array allocated: params are
    jax.ShapeDtypeStruct placed by `layout`'s params rules on `mesh` (a restore or compile target)."""
    graphdef, abstract_params, rest = nnx.split(abstract_model(config), nnx.Param, ...)
    return graphdef, abstract_placed(abstract_params, layout, mesh), rest


def restore_model(directory: str | Path, layout, mesh, step: int | None = None, dtype: str | None = None):
    """(model, description): the Transformer saved at `step` (default: the latest) in `directory`, its parameters
    placed by `layout`'s params rules on `mesh` (whatever mesh and layout trained it; None: the layout the run
    trained under), and the run's JSON description. A checkpoint that cannot be read (its description or its
    parameters) is a `CheckpointError` naming its step and the other steps to pass as --step.

    `dtype` overrides the saved compute dtype ("float32" or "bfloat16"); parameters keep the dtype they were saved in.
    fp8 training's formats (`matmul_format`, `fp8_logits`) are how the run trained, not the model: the model comes
    back computing in its dtype, as a float checkpoint does (8-bit inference is `--quantize`'s).
    """
    with CheckpointStore(directory, must_exist=True) as store:
        chosen_step = store.require_step(step)
        try:
            with store.reporting_damage(chosen_step):
                description = store.restore_meta(chosen_step)
                config = ModelConfig(**description["model_config"]).replace(matmul_format="", fp8_logits=False)
                if dtype is not None:
                    config = config.replace(dtype=dtype)
                graphdef, params_target, rest = abstract_model_state(config, layout or description["layout"], mesh)
                params, _ = store.restore(chosen_step, params_target)
            require_finite_checkpoint(params, f"checkpoint step {chosen_step} in {store.directory}")
        except CheckpointError as error:
            others = [other for other in store.all_steps() if other != chosen_step]
            raise CheckpointError(f"{error}; pass --step with one of the other checkpoints {others}" if others
                                  else f"{error}; no other checkpoint is there: train again") from error
    return nnx.merge(graphdef, params, rest), description
