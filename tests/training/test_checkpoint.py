"""Orbax checkpoints: save interval, retention, metadata, and restoring under another mesh and sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.errors import StarscreamError
from starscream_jax.training.checkpoint import CheckpointStore, abstract_arrays


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
