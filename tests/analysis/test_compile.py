"""The programs `inspect` and `plan` judge are the programs `train` and `generate` run: each step compiled from abstract
arguments (analysis.compile) prints the same HLO as the one the training loop and generation compiled and ran."""
import dataclasses
import re

import numpy as np
import pytest

from starscream_jax.analysis.compile import Settings, compile_step, fitted_layout, make_settings
from starscream_jax.analysis.json_form import to_json
from starscream_jax.analysis.layout_report import inspect_layouts
from starscream_jax.errors import ShardingRuleError, StarscreamError
from starscream_jax.hardware.mesh import build_mesh, build_topology_mesh
from starscream_jax.inference.generate import generate
from starscream_jax.model.decoder import create_sharded_model
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.loop import train
from starscream_jax.training.steps import Sampling


def program_text(compiled) -> str:
    """The compiled HLO without what says where in Python it was traced from (the file and stack-frame tables, and
    each op's metadata): the program itself, instruction by instruction."""
    text = re.sub(r"\n\nFileNames\n.*?\nStackFrames\n.*?\n\n", "\n\n", compiled.as_text(), flags=re.S)
    return re.sub(r", metadata=\{[^}]*\}", "", text)


@pytest.fixture(scope="module")
def mesh():
    return build_mesh("1x2x4")


@pytest.mark.parametrize("layout", ["starscream_tp", pytest.param("flat_fsdp", marks=pytest.mark.slow)])
def test_inspect_compiles_the_training_step_that_train_ran(tmp_path, mesh, layout):
    config = TrainConfig(layout=layout, steps=2, batch_size=8, seq_len=32, learning_rate=1e-3, warmup_steps=1,
                         clip_norm=0.5, weight_decay=0.2, eval_every=2, eval_batches=1, checkpoint_every=2,
                         run_dir=str(tmp_path / "run"), dtype="bfloat16")
    ran = train(config, mesh, show_progress=False, echo=lambda *_: None).compiled_step
    model_config = config.model_config()
    settings = Settings(config=model_config, full_layers=model_config.n_layers, phase="train", batch=config.batch_size,
                        seq=config.seq_len, layouts=(layout,), training=config)
    judged = compile_step(settings, layout, mesh).compiled
    assert program_text(judged) == program_text(ran)


@pytest.mark.slow  # two more compiles of the training step (20 s on two cores)
def test_a_different_optimizer_is_a_different_program(mesh):
    """The comparison above can fail: the clipping norm is a constant of the compiled step."""
    settings = make_settings("tiny", "train", 8, 32, "starscream_tp", 4)
    other = dataclasses.replace(settings, training=TrainConfig(clip_norm=0.25))
    assert program_text(compile_step(settings, "starscream_tp", mesh).compiled) != program_text(
        compile_step(other, "starscream_tp", mesh).compiled)


@pytest.mark.parametrize("sampling, scan_unroll", [(Sampling(), 0), pytest.param(
    Sampling(top_p=0.9, temperature=0.8, seed=3), 1, marks=pytest.mark.slow)])
def test_inspect_compiles_the_prefill_and_decode_steps_that_generate_ran(mesh, sampling, scan_unroll):
    """scan_unroll 0 (the default): decode runs no layer loop and takes the KV cache as one array per layer, as
    generation holds it after prefill; scan_unroll 1: the rolled loop over the stacked cache."""
    settings = make_settings("tiny", "prefill", 8, 6, "starscream_tp", 4)
    config = settings.config.replace(dtype="bfloat16", scan_unroll=scan_unroll)
    model = create_sharded_model(config, "starscream_tp", mesh)
    prompt_BP = np.arange(8 * 6).reshape(8, 6) % 256
    ran = generate(model, prompt_BP, 5, sampling, mesh, "starscream_tp", "starscream_decode")
    settings = dataclasses.replace(settings, config=model.config, sampling=sampling, cache_length=11)
    prefill = compile_step(settings, "starscream_tp", mesh).compiled
    decode = compile_step(dataclasses.replace(settings, phase="decode", seq=11, cache_length=None),
                          "starscream_decode", mesh)
    assert decode.args.cache.held_per_layer == (scan_unroll == 0)
    assert (" while(" in program_text(decode.compiled)) == (scan_unroll == 1)
    assert program_text(prefill) == program_text(ran.prefill_program)
    assert program_text(decode.compiled) == program_text(ran.decode_program)


def test_a_cache_shorter_than_the_prompt_is_refused_before_compiling(mesh):
    settings = dataclasses.replace(make_settings("tiny", "prefill", 8, 16, "starscream_tp", 4), cache_length=8)
    with pytest.raises(StarscreamError, match="a KV cache of 8 positions cannot hold 16 tokens"):
        compile_step(settings, "starscream_tp", mesh)


@pytest.mark.parametrize("unroll, per_layer_cache", [(0, True), pytest.param(2, False, marks=pytest.mark.slow)])
def test_decode_without_a_layer_loop_gives_the_rolled_loops_per_layer_bytes_and_verdicts(unroll, per_layer_cache):
    """Decode as generation runs it (scan_unroll 0: no layer loop, the KV cache one array per layer, each layer
    under the layer scope) and with the scan unrolled over a stacked cache: the layers' ops are read from the layer
    scope. Per-layer and full-depth bytes, the three verdicts and attention's ratio equal the rolled program's
    (scan_unroll 1, stacked cache). (Training compiles too slowly for this suite; there XLA combines the
    optimizer's sums with layer gradients, which `test_hlo`'s scope-share test covers.)"""
    topology, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    settings = make_settings("tiny", "decode", 8, 32, "flat_tp,starscream_decode", layers=2)
    assert settings.config.scan_unroll == 0 and settings.holds_cache_per_layer  # what inspect compiles by default
    rolled = inspect_layouts(dataclasses.replace(settings, config=settings.config.replace(scan_unroll=1)),
                             topology, mesh)
    unrolled_settings = dataclasses.replace(settings, config=settings.config.replace(scan_unroll=unroll))
    assert unrolled_settings.holds_cache_per_layer == per_layer_cache
    unrolled = inspect_layouts(unrolled_settings, topology, mesh)
    for name in rolled:
        for figure in ("per_layer", "outside_layers", "by_scope"):
            assert (to_json(getattr(unrolled[name].bytes_per_device, figure))
                    == pytest.approx(to_json(getattr(rolled[name].bytes_per_device, figure))))
        assert ([verdict.ok for _, verdict in unrolled[name].principles.verdicts()]
                == [verdict.ok for _, verdict in rolled[name].principles.verdicts()])
        assert unrolled[name].collectives_per_layer == rolled[name].collectives_per_layer
        assert (dataclasses.asdict(unrolled[name].principles.shape_preservation.attention)
                == pytest.approx(dataclasses.asdict(rolled[name].principles.shape_preservation.attention)))
        assert any(m.in_layer_loop for m in unrolled[name].matmuls)


def test_the_settings_say_whether_a_layer_loop_runs_not_a_loop_of_the_right_trip_count():
    """A program without a layer loop may hold a loop of L trips of its own (an MoE block looping over its 2 local
    experts, compiled at L = 2): its layers are then read from the layer scope, never from that loop."""
    from starscream_jax.analysis.compile import layer_loop_ops, runs_layer_loop
    from tests.analysis.test_hlo import loop_module

    text = loop_module(', backend_config={"known_trip_count":{"n":"4"}}')  # an inner loop of 3 trips
    assert "ar" in layer_loop_ops(text, 3, rolled=True)
    with pytest.raises(StarscreamError, match="no op in the layer scope"):
        layer_loop_ops(text, 3, rolled=False)
    settings = make_settings("tiny", "train", 8, 32, "gpu_tp", 2)
    rolled = dataclasses.replace(settings, config=settings.config.replace(scan_unroll=1))
    decode = make_settings("tiny", "decode", 8, 32, "gpu_tp", 2)
    assert not runs_layer_loop(settings) and runs_layer_loop(rolled) and not runs_layer_loop(decode)


def test_the_serve_phase_refuses_a_layout_that_splits_the_sequence_as_the_server_does(mesh):
    """The server refuses the _cp layouts (`serving.steps.check_same_cache_placement`); `inspect --phase serve` lists
    them as unplaceable with that reason, not with the resolver's complaint about a sequence of one token."""
    settings = make_settings("tiny", "serve", 16, 64, "starscream_cp,starscream_decode", layers=2)
    for name in ("starscream_cp", "flat_cp"):
        with pytest.raises(ShardingRuleError, match=f"layout {name} splits the sequence and cannot decode from a "
                                                    "paged KV cache; serve with a decode layout"):
            fitted_layout(settings, name, mesh)
    assert fitted_layout(settings, "starscream_decode", mesh).name == "starscream_decode"
