"""`starscream plan` on the tiny model over a simulated 2 GPU x 4 partition mesh: the choice follows the cost model
and the memory limit, layouts the mesh cannot place are listed with the reason, and training falls back to
rematerialization when nothing fits."""
import argparse
import dataclasses
import io
import json
from contextlib import redirect_stdout

import pytest

from starscream_jax.analysis import plan as plan_module
from starscream_jax.analysis.compile import make_settings
from starscream_jax.analysis.plan import full_depth_memory, plan_phase
from starscream_jax.cli import plan as plan_command
from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_topology_mesh
from starscream_jax.hardware.topology import Topology

MESH_ARGS = ("--preset", "mi300x-qpx-nps1", "--gpus", "2")
SHAPES = ("--batch", "8", "--seq", "32")
CANDIDATES = "flat_tp,starscream_tp,starscream_decode,flat_fsdp"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    return parser.parse_args(argv)


def plan(*argv: str) -> str:
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert plan_command.run(parse(*MESH_ARGS, "--model", "tiny", *SHAPES, *argv)) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def plans():
    return json.loads(plan("--phases", "train,decode", "--layout", CANDIDATES, "--json"))


def test_every_candidate_is_estimated_sized_and_judged(plans):
    for phase in ("train", "decode"):
        candidates = plans[phase]["candidates"]
        assert candidates[plans[phase]["choice"]]["fits"]
        for candidate in candidates.values():
            assert candidate["memory_per_device"] > 0 and candidate["estimate"]["serial_s"] > 0
            assert set(candidate["principles"]) == {"shape_preservation", "no_redundancy", "hierarchical_collectives"}
            assert set(candidate["copied_bytes"]) == {"inputs", "outputs", "activations"}


def test_the_choice_is_the_fastest_of_the_layouts_that_fit(monkeypatch):
    """Three made-up candidates: the fastest (0.5 s) does not fit, so the 1 s one is chosen over the 2 s one."""
    def candidate(seconds: float, fits: bool) -> dict:
        return {"estimate": {"serial_s": seconds}, "fits": fits}

    made_up = {"slow": candidate(2.0, True), "chosen": candidate(1.0, True), "too_big": candidate(0.5, False)}
    monkeypatch.setattr(plan_module, "_candidates", lambda *args, **kwargs: dict(made_up))
    settings = make_settings("tiny", "decode", 8, 32, "starscream_decode", layers=2)
    topology = Topology.from_preset("mi300x-qpx-nps1", gpus=2)
    assert plan_phase(settings, topology, None)["choice"] == "chosen"
    made_up["chosen"]["fits"] = False
    assert plan_phase(settings, topology, None)["choice"] == "slow"


def test_a_layout_the_mesh_cannot_place_is_listed_with_the_reason():
    """flat_fsdp splits the batch over all 8 devices: 4 sequences cannot be, and the resolver's message says why."""
    result = json.loads(plan("--phases", "decode", "--layout", "starscream_decode,flat_fsdp", "--batch", "4",
                             "--json"))["decode"]
    assert set(result["candidates"]) == {"starscream_decode"} and set(result["refused"]) == {"flat_fsdp"}
    assert "not divisible" in result["refused"]["flat_fsdp"]


def test_memory_at_full_depth_adds_the_temporaries_of_the_missing_layers():
    memory = {"persistent": 1000, "compiled": {"temp_bytes": 300}}
    assert full_depth_memory(memory, full_layers=10, compiled_layers=2, temp_per_layer=50) == 1700
    assert full_depth_memory(memory, full_layers=10, compiled_layers=2, temp_per_layer=-5) == 1300


def test_training_that_fits_nowhere_is_retried_with_remat_and_may_still_fit_nowhere():
    topology, mesh = build_topology_mesh("mi300x-qpx-nps1:2", simulate=True)
    chip = dataclasses.replace(topology.preset.chip, hbm_bytes=1.0)
    tiny_hbm = dataclasses.replace(topology, preset=dataclasses.replace(topology.preset, chip=chip))
    settings = make_settings("tiny", "train", 8, 32, "starscream_tp", layers=2)
    result = plan_phase(settings, tiny_hbm, mesh)
    assert set(result["candidates"]) == {"starscream_tp", "starscream_tp+remat"}
    recomputed, kept = result["candidates"]["starscream_tp+remat"], result["candidates"]["starscream_tp"]
    assert recomputed["estimate"]["compute_s"] > kept["estimate"]["compute_s"]
    assert result["choice"] is None


def test_table_marks_the_choice_and_gives_the_commands(plans):
    table = plan_command.format_plans(plans)
    for phase in ("train", "decode"):
        assert f"* {plans[phase]['choice']}" in table
    assert f"starscream train --layout {plans['train']['choice']}" in table
    assert "starscream generate" not in table  # no prefill was planned
    assert plan_command.format_plans({"prefill": {**plans["decode"], "phase": "prefill"}, "decode": plans["decode"]})\
        .endswith(f"starscream generate --prefill-layout {plans['decode']['choice']} "
                  f"--decode-layout {plans['decode']['choice']}")


@pytest.mark.parametrize("argv, message", [
    (("--phases", "training"), "expected some of train, prefill, decode"),
    (("--no-simulate",), "plan always compiles on simulated CPU devices"),
    (("--layout", "starscream"), "unknown layout 'starscream'"),
])
def test_bad_arguments_are_clear_errors(argv, message):
    with pytest.raises(StarscreamError, match=message):
        plan_command.run(parse(*MESH_ARGS, "--model", "tiny", *argv))


def test_plan_is_a_subcommand():
    from starscream_jax.cli.main import build_parser

    args = build_parser().parse_args(["plan", "--model", "tiny"])
    assert args.run is plan_command.run
    assert Topology.from_preset(args.default_preset).preset.name == "mi300x-cpx-nps1"
