"""Orbax checkpoints: save interval, retention, metadata, restoring under another mesh and sharding, falling back
past damaged checkpoints, and a save killed at chosen points."""
import errno
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.path import async_path

from starscream_jax.errors import CheckpointError, StarscreamError
from starscream_jax.training.checkpoint import (
    CheckpointStore,
    _quiet_reads_left_behind,
    abstract_arrays,
    describe_storage_error,
    restore_model,
)

ROOT = Path(__file__).resolve().parents[2]


def make_mesh(shape):
    return jax.make_mesh(shape, ("data", "gpu", "xcd"), devices=jax.devices()[:8])


def place(tree, mesh, spec):
    return jax.tree.map(lambda leaf: jax.device_put(leaf, NamedSharding(mesh, spec)), tree)


def random_tree(seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": jax.random.normal(keys[0], (16, 8), jnp.float32),
        "layers": [jax.random.normal(keys[1], (8, 32), jnp.bfloat16), jax.random.normal(keys[2], (32, 8))],
    }


def assert_trees_bit_identical(left, right):
    for left_leaf, right_leaf in zip(jax.tree.leaves(left), jax.tree.leaves(right), strict=True):
        assert left_leaf.dtype == right_leaf.dtype
        assert np.asarray(left_leaf).tobytes() == np.asarray(right_leaf).tobytes()


def test_restores_bit_identical_under_another_mesh_and_sharding(tmp_path):
    saved_mesh, restored_mesh = make_mesh((1, 2, 4)), make_mesh((1, 4, 2))
    params = place(random_tree(0), saved_mesh, P("xcd", "gpu"))
    opt_state = place(random_tree(1), saved_mesh, P("gpu", None))
    with CheckpointStore(tmp_path, save_every=1) as store:
        assert store.save(3, params, opt_state, {"layout": "starscream_tp"})

    target_sharding = NamedSharding(restored_mesh, P(None, ("gpu", "xcd")))
    params_target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=target_sharding),
                                 params)
    with CheckpointStore(tmp_path) as store:
        restored_params, restored_opt_state = store.restore(3, params_target, place(random_tree(5), restored_mesh,
                                                                                    P()))
    assert_trees_bit_identical(restored_params, params)
    assert_trees_bit_identical(restored_opt_state, opt_state)
    assert all(leaf.sharding == target_sharding for leaf in jax.tree.leaves(restored_params))


def test_saves_every_n_steps_keeps_the_newest_and_stores_metadata(tmp_path):
    mesh = make_mesh((1, 2, 4))
    params = place(random_tree(0), mesh, P())
    with CheckpointStore(tmp_path, save_every=4, max_to_keep=2) as store:
        started = [store.save(step, params, params, {"step": step}) for step in range(1, 13)]
        assert store.save(13, params, params, {"step": 13}, force=True)
        store.wait()
        assert [step for step, did_save in zip(range(1, 13), started) if did_save] == [4, 8, 12]
        assert store.latest_step() == 13
        assert sorted(int(path.name) for path in tmp_path.iterdir() if path.name.isdigit()) == [12, 13]
        assert store.restore_meta() == {"step": 13}
        assert store.restore_meta(12) == {"step": 12}


def test_parameters_alone_can_be_restored(tmp_path):
    mesh = make_mesh((1, 2, 4))
    params = place(random_tree(0), mesh, P("gpu"))
    with CheckpointStore(tmp_path, save_every=1) as store:
        store.save(1, params, place(random_tree(1), mesh, P()), {})
    with CheckpointStore(tmp_path) as store:
        restored_params, restored_opt_state = store.restore(None, abstract_arrays(params))
    assert restored_opt_state is None
    assert_trees_bit_identical(restored_params, params)


def test_missing_checkpoint_lists_what_exists(tmp_path):
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(StarscreamError, match=r"no checkpoint for step \(latest\).*found steps \[\]"):
            store.restore_meta()
        with pytest.raises(StarscreamError, match="no checkpoint for step 7"):
            store.restore(7, {})


def test_opening_a_missing_directory_for_restore_is_refused(tmp_path):
    with pytest.raises(StarscreamError, match="nowhere does not exist"):
        CheckpointStore(tmp_path / "nowhere", must_exist=True)
    assert not (tmp_path / "nowhere").exists()


def saved_steps_1_and_2(directory):
    """Checkpoints of steps 1 and 2 (the same small trees) in `directory`; returns the trees."""
    params = place(random_tree(0), make_mesh((1, 2, 4)), P())
    with CheckpointStore(directory, save_every=1) as store:
        store.save(1, params, params, {"step": 1})
        store.save(2, params, params, {"step": 2})
    return params


def truncate_arrays(step_dir):
    for data_file in step_dir.glob("params/d/*"):
        data_file.write_bytes(data_file.read_bytes()[:10])


@pytest.mark.parametrize("damage, damaged_file", [
    (truncate_arrays, r"2/params/d/\w+ \(OUT_OF_RANGE"),
    (lambda step_dir: (step_dir / "meta" / "metadata").unlink(), r"2/meta/metadata"),
    (lambda step_dir: (step_dir / "params" / "_METADATA").write_text("{bad"), r"JSONDecodeError"),
    (lambda step_dir: shutil.rmtree(step_dir / "opt_state"), r'KeyError: .*Item "opt_state" was not found'),
])
def test_newest_intact_checkpoint_is_restored_past_a_damaged_one(tmp_path, damage, damaged_file):
    params = saved_steps_1_and_2(tmp_path)
    damage(tmp_path / "2")
    said = []
    with CheckpointStore(tmp_path) as store:
        step, description, restored_params, _ = store.restore_newest_intact(params, params, said.append)
        assert store.all_steps() == [1]
    assert (step, description) == (1, {"step": 1})
    assert_trees_bit_identical(restored_params, params)
    assert len(said) == 1 and re.search(rf"checkpoint step 2 in {tmp_path} is damaged: .*{damaged_file}", said[0])
    assert "moved aside to 2.damaged" in said[0] and (tmp_path / "2.damaged").is_dir()


def test_every_checkpoint_damaged_is_an_error_naming_each(tmp_path):
    params = saved_steps_1_and_2(tmp_path)
    for step in ("1", "2"):
        truncate_arrays(tmp_path / step)
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*step 2 .*step 1 .*another --run-dir"):
            store.restore_newest_intact(params, params, lambda _: None)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["1.damaged", "2.damaged"]


KILLED_SAVE = """
import os, signal, sys
from orbax.checkpoint._src.path import async_path
from tests.training.test_checkpoint import saved_steps_1_and_2
from starscream_jax.training import checkpoint

armed = False
original = getattr(async_path, sys.argv[2])

async def kill_when_armed(*args, **kwargs):
    if armed:
        os.kill(os.getpid(), signal.SIGKILL)
    return await original(*args, **kwargs)

setattr(async_path, sys.argv[2], kill_when_armed)
save = checkpoint.CheckpointStore.save

def save_armed_from_step_2(self, step, *args, **kwargs):
    global armed
    if step == 2:
        self.wait()  # step 1 is on disk
        armed = True
    return save(self, step, *args, **kwargs)

checkpoint.CheckpointStore.save = save_armed_from_step_2
saved_steps_1_and_2(sys.argv[1])
"""


@pytest.mark.parametrize("kill_point", ["write_text", "rename"])
def test_a_save_killed_midway_leaves_the_earlier_checkpoint_whole(tmp_path, kill_point, cpu_child_env):
    """SIGKILL while step 2 is written (its first file) or just before it is committed (the final rename)."""
    env = cpu_child_env(8)  # the child draws the parameters compared bit for bit below
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path), kill_point], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    params = place(random_tree(0), make_mesh((1, 2, 4)), P())
    with CheckpointStore(tmp_path, save_every=1) as store:
        assert store.all_steps() == [1]
        step, description, restored, _ = store.restore_newest_intact(params, params, print)
        assert (step, description) == (1, {"step": 1})
        assert_trees_bit_identical(restored, params)
        assert store.save(2, params, params, {"step": 2})
        store.wait()
        assert store.restore_meta() == {"step": 2}


def test_a_full_disk_is_one_error_naming_the_checkpoint_to_resume_from(tmp_path, monkeypatch, caplog):
    """...and only that line: orbax's background threads log no traceback of it."""
    params = saved_steps_1_and_2(tmp_path)

    async def disk_full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(async_path, "write_text", disk_full)
    monkeypatch.setattr(async_path, "write_bytes", disk_full)
    with pytest.raises(CheckpointError, match=r"writing a checkpoint in .* failed: .*No space left on device.*; free "
                                              r"space .* rerun with --resume, which continues from step 2"):
        with CheckpointStore(tmp_path, save_every=1) as store:
            store.save(3, params, params, {"step": 3})
            store.wait()
    assert not [record.getMessage() for record in caplog.records if record.exc_info]
    monkeypatch.undo()
    with CheckpointStore(tmp_path) as store:
        assert store.all_steps() == [1, 2] and store.restore_meta() == {"step": 2}


def test_a_checkpoint_holding_non_finite_parameters_is_damage_set_aside(tmp_path):
    """Training never saves non-finite parameters: a checkpoint holding them was damaged afterwards."""
    params = saved_steps_1_and_2(tmp_path)
    poisoned = jax.tree.map(lambda leaf: jax.device_put(np.full(leaf.shape, np.nan, leaf.dtype), leaf.sharding),
                            params)
    with CheckpointStore(tmp_path, save_every=1) as store:
        store.save(3, poisoned, params, {"step": 3})
    said = []
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(CheckpointError, match=r"step 3 in .* holds non-finite parameters \(\['embed'\], "):
            store.restore_checked(3, params, params)
        assert store.restore_newest_intact(params, params, said.append)[0] == 2
    assert "moved aside to 3.damaged" in said[0]


def test_a_checkpoint_renamed_to_another_step_is_refused_naming_both_steps(tmp_path):
    """A copy of step 2 named 30 must not resume "at step 30" on step 2's weights; it is not damage either, so it
    stays where it is."""
    params = saved_steps_1_and_2(tmp_path)
    shutil.copytree(tmp_path / "2", tmp_path / "30")
    refusal = r"checkpoint .*30 records step 2, not 30: .*rename it back to 2"
    with CheckpointStore(tmp_path) as store:
        assert store.latest_step() == 30
        with pytest.raises(CheckpointError, match=refusal):
            store.restore_meta()
        with pytest.raises(CheckpointError, match=refusal):
            store.restore_newest_intact(params, params, lambda _: None)
        assert store.restore_meta(2) == {"step": 2}
    assert (tmp_path / "30").is_dir() and not list(tmp_path.glob("*.damaged"))


def test_a_newest_checkpoint_without_its_description_names_the_step_and_the_others(tmp_path):
    """What `export` and `generate` read first: a checkpoint whose meta/ is gone is damage named in one line."""
    saved_steps_1_and_2(tmp_path)
    shutil.rmtree(tmp_path / "2" / "meta")
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 in .* is damaged: .*; pass --step with one of the "
                                              r"other checkpoints \[1\]"):
        restore_model(tmp_path, None, make_mesh((1, 2, 4)))


def test_a_model_trained_in_fp8_comes_back_computing_in_its_dtype(tmp_path):
    """fp8 training's formats are the run's, not the model's: generate and serve run its float32 weights in the
    compute dtype (and may quantize them with --quantize), as they run a run's trained without fp8."""
    import dataclasses

    from flax import nnx

    from starscream_jax.model.catalog import load_model_config
    from starscream_jax.model.decoder import create_sharded_model

    config = load_model_config("tiny").replace(n_layers=1, matmul_format="float8_e4m3fn", fp8_logits=True)
    mesh = make_mesh((1, 2, 4))
    _, params, _ = nnx.split(create_sharded_model(config, "starscream_tp", mesh), nnx.Param, ...)
    with CheckpointStore(tmp_path, save_every=1) as store:
        store.save(1, params, params, {"step": 1, "model_config": dataclasses.asdict(config),
                                       "layout": "starscream_tp"})
    model, description = restore_model(tmp_path, "starscream_tp", mesh)
    assert description["model_config"]["matmul_format"] == "float8_e4m3fn"
    assert model.config == config.replace(matmul_format="", fp8_logits=False)
    assert_trees_bit_identical(nnx.state(model, nnx.Param), params)


def test_a_wrapped_storage_error_is_told_by_the_file_it_names():
    """orbax wraps tensorstore's read error (which names the file) in one of its own (which names the array's slice
    and appends the store's whole specification): the description is the file and the reason, one short line."""
    spec = "See full TensorStore details: <bound method pybind11_detail_function_record_v1.spec of TensorStore({"
    try:
        try:
            raise ValueError('OUT_OF_RANGE: Error reading "lm_head.value/2.1" in OCDBT database at local file '
                             '"/runs/r/checkpoints/70/params/": Requested byte range [136814, 152035) is not valid')
        except ValueError as cause:
            raise Exception(f"Encountered error while reading array index: (slice(0, 128, 1),). {spec}") from cause
    except Exception as error:  # noqa: BLE001 (orbax raises a bare Exception)
        described = describe_storage_error(error)
    assert described.startswith("/runs/r/checkpoints/70/params/ (OUT_OF_RANGE") and "TensorStore(" not in described
    alone = Exception(f"Encountered error while reading array index: (slice(0, 1, 1),). {spec}")  # no file named
    assert describe_storage_error(alone) == "Exception: Encountered error while reading array index: (slice(0, 1, 1),)."


def test_reads_orbax_leaves_failing_after_a_failed_restore_are_not_printed(capsys):
    """After a restore failed (and was reported in one line), orbax's read coroutines still in flight may fail as
    they are collected: Python would print each with a traceback. Those are dropped; any other unraisable
    exception still reaches the previous hook."""
    namespace = {}
    exec(compile("async def read():\n    raise OSError('short read')\n", "/site-packages/orbax/read.py", "exec"),
         namespace)
    previous = sys.unraisablehook
    seen = []
    sys.unraisablehook = seen.append
    try:
        _quiet_reads_left_behind()
        orbax_read = namespace["read"]()
        sys.unraisablehook(types.SimpleNamespace(exc_value=OSError("short read"), object=orbax_read))
        orbax_read.close()
        sys.unraisablehook(types.SimpleNamespace(exc_value=OSError("other"), object=None))
    finally:
        sys.unraisablehook = previous
    assert [str(unraisable.exc_value) for unraisable in seen] == ["other"]


def test_a_save_the_other_processes_never_reached_says_so_and_resumes_from_a_complete_step(tmp_path):
    """A multi-process save whose barrier timed out (another process died) is not a full disk: the error says which,
    and names the newest complete checkpoint on disk as the one --resume continues from."""
    saved_steps_1_and_2(tmp_path)
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(CheckpointError, match=r"failed: the run's other processes did not reach the save .*; "
                                                  r"restart every process of the run and rerun with --resume, which "
                                                  r"continues from step 2"):
            with store.reporting_write_failure():
                raise TimeoutError("Timed out while waiting for async_write_complete barrier.")
