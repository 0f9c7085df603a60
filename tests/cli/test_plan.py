"""`starscream plan` on the tiny model over a simulated 2 GPU x 4 partition mesh: the search over mesh shapes,
layouts, micro-batches and remat policies; every losing candidate's reason; advice when nothing fits; the result
cache; the commands; the plot."""
import argparse
import dataclasses
import io
import json
import re
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from starscream_jax.analysis import plan as planner
from starscream_jax.analysis.compile import make_settings
from starscream_jax.analysis.layout_report import ResultCache
from starscream_jax.analysis.costmodel import StepEstimate
from starscream_jax.analysis.json_form import from_json, to_json
from starscream_jax.analysis.plan import Candidate, plan_phase
from starscream_jax.analysis.plots import plan_plot_data
from starscream_jax.cli import plan as plan_command
from starscream_jax.cli.arguments import CACHE_ENV
from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.topology import Topology

MESH_ARGS = ("--preset", "mi300x-qpx-nps1", "--gpus", "2")
SHAPES = ("--batch", "4", "--seq", "16")
STATUSES = {"chosen", "runner-up", "slower", "does not fit", "cannot place", "dominated", "pruned"}


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
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def plot_path(tmp_path_factory):
    return tmp_path_factory.mktemp("plot") / "plan.png"


@pytest.fixture(scope="module")
def plans(cache_dir, plot_path):
    """train, 4 sequences, over starscream_tp and flat_fsdp: flat_fsdp splits the batch over all 8 devices and
    starscream_tp on data 2 x gpu 1 over data x xcd (8), so neither can place 4 sequences; one candidate compiles."""
    return json.loads(plan("--phases", "train", "--layout", "starscream_tp,flat_fsdp", "--json", "--cache-dir",
                           str(cache_dir), "--plot", str(plot_path)))


def test_every_candidate_is_judged_and_the_choice_is_the_fastest_compiled(plans):
    train = plans["train"]
    assert {entry["status"] for entry in train["candidates"]} <= STATUSES
    compiled = [entry for entry in train["candidates"] if entry["estimate"] is not None]
    fastest = min(compiled, key=lambda entry: entry["estimate"]["serial_s"])
    assert train["choice"] == fastest["name"] and fastest["status"] == "chosen" and fastest["fits"]
    assert train["runner_up"] in {entry["name"] for entry in compiled} - {fastest["name"]} | {None}
    for entry in train["candidates"]:
        assert entry["status"] == "chosen" or entry["reason"]
    for entry in compiled:  # the bound that prunes never exceeds what compiling gives
        assert 0 < entry["lower_bound_s"] <= entry["estimate"]["compute_s"]
        assert set(entry["copied_bytes"]) == {"inputs", "outputs", "activations"}
    meshes = {(entry["mesh"]["data"], entry["mesh"]["gpu"]) for entry in train["candidates"]}
    assert meshes == {(1, 2), (2, 1)}
    searched = {(entry["micro_batches"], entry["remat"]) for entry in train["candidates"] if entry["memory"]}
    assert {(1, "none"), (1, "dots"), (1, "full")} <= searched


def test_a_micro_batch_the_batch_split_does_not_divide_is_placed_as_train_places_it(plans):
    """flat_fsdp (8 devices) and starscream_tp on data 2 x gpu 1 (data x xcd, 8) split the batch more than 4
    sequences allow: each is priced under the layout `fit_batch` gives (`+seq`: the sequence split over what the
    batch leaves), which `train` runs and `inspect` compiles, named in the candidate."""
    fitted = {(entry["layout"], entry["mesh"]["data"]): entry for entry in plans["train"]["candidates"]
              if entry["micro_batches"] == 1 and entry["remat"] == "none"}
    for key in (("flat_fsdp", 1), ("flat_fsdp", 2), ("starscream_tp", 2)):
        assert fitted[key]["status"] != "cannot place" and fitted[key]["memory"] is not None
        assert fitted[key]["name"].endswith(f"(as {key[0]}+seq)")
    assert fitted[("starscream_tp", 1)]["name"] == "starscream_tp data 1 x gpu 2"


def test_a_layout_that_cannot_place_the_step_is_a_refused_candidate_with_the_reason():
    """18 tokens a sequence, which the 4 partitions a fitted layout splits each sequence over do not divide: every
    candidate that must split the sequence is refused, naming the length to use; starscream_tp on data 1 x gpu 2
    splits 4 sequences over xcd and places them."""
    settings = make_settings("tiny", "train", 4, 18, "starscream_tp,flat_fsdp", layers=2)
    result = plan_phase(settings, Topology.from_preset("mi300x-qpx-nps1", gpus=2))
    refused = [entry for entry in result["candidates"] if entry["status"] == "cannot place"]
    assert {(entry["layout"], entry["mesh"]["data"]) for entry in refused if entry["micro_batches"] == 1} == {
        ("flat_fsdp", 1), ("flat_fsdp", 2), ("starscream_tp", 2)}
    assert all("18 tokens do not divide; use" in entry["reason"] for entry in refused)
    assert result["choice"] == "starscream_tp data 1 x gpu 2"


def test_more_recomputation_or_more_micro_batches_is_dominated_when_less_fits(plans):
    dominated = [entry for entry in plans["train"]["candidates"] if entry["status"] == "dominated"]
    assert dominated and all(entry["remat"] != "none" or entry["micro_batches"] > 1 for entry in dominated)


def test_a_second_plan_reads_the_cache_and_compiles_nothing(plans, cache_dir, monkeypatch):
    def no_compiling(*_):
        raise AssertionError("compiled although the result was cached")

    monkeypatch.setattr("starscream_jax.analysis.layout_report.compile_step", no_compiling)
    again = json.loads(plan("--phases", "train", "--layout", "starscream_tp,flat_fsdp", "--json", "--cache-dir",
                            str(cache_dir)))
    assert again["train"]["choice"] == plans["train"]["choice"]
    assert [e["estimate"] for e in again["train"]["candidates"]] == [e["estimate"] for e in plans["train"]["candidates"]]


def test_the_commands_run_the_chosen_configuration(plans):
    chosen = next(entry for entry in plans["train"]["candidates"] if entry["status"] == "chosen")
    train_command = plans["train"]["commands"][0]
    assert train_command.startswith("starscream train --preset mi300x-qpx-nps1 --gpus 2")
    assert f"--layout {chosen['layout']}" in train_command
    assert f"--grad-accum {chosen['micro_batches']} --remat-policy {chosen['remat']}" in train_command
    assert ("--data-parallel 2" in train_command) == (chosen["mesh"]["data"] == 2)
    assert plan_command.format_plans(plans).count(train_command) == 1


def test_the_commands_name_the_model_as_the_user_gave_it(plans):
    """A model given as a path (a TOML file, a Hugging Face directory) is named by that path, quoted for the shell,
    not by its configuration's name, which no command could load."""
    path = str(Path(__file__).parents[2] / "models" / "with space" / "tiny.toml")
    args = parse(*MESH_ARGS, "--model", path, *SHAPES)
    topology = Topology.from_preset("mi300x-qpx-nps1", gpus=2)
    for command in plan_command.commands(plans["train"], args, topology):
        words = shlex.split(command)
        assert words[words.index("--model") + 1] == path


def test_the_commands_rebuild_a_topology_given_as_such(plans, monkeypatch):
    """A mesh given by --topology (or $STARSCREAM_TOPOLOGY, unless --preset overrides it) is given to the commands
    the same way: its preset name alone ("cpu": one partition a GPU) would build another mesh."""
    for argv, env, expected in ((("--topology", "2x4"), None, "--topology 2x4"),
                                ((), "2x4", "--topology 2x4"),
                                (MESH_ARGS, "2x4", "--preset mi300x-qpx-nps1 --gpus 2")):
        if env is None:
            monkeypatch.delenv("STARSCREAM_TOPOLOGY", raising=False)
        else:
            monkeypatch.setenv("STARSCREAM_TOPOLOGY", env)
        args = parse(*argv, "--model", "tiny", *SHAPES)
        topology = Topology.from_preset("mi300x-qpx-nps1", gpus=2)
        for command in plan_command.commands(plans["train"], args, topology):
            assert expected in command and command.count("--preset") + command.count("--topology") == 1, command


def test_the_plot_is_drawn_from_the_candidates(plans, plot_path):
    data = plan_plot_data(plans)["train"]
    compiled = [entry for entry in plans["train"]["candidates"] if entry["estimate"] is not None]
    assert sorted(point[2] for point in data["compiled"]) == sorted(e["estimate"]["serial_s"] * 1e3 for e in compiled)
    assert [point[0] for point in data["compiled"] if point[3]] == [plans["train"]["choice"]]
    assert plot_path.stat().st_size > 10_000


def _tiny_hbm(hbm_bytes: float) -> Topology:
    topology = Topology.from_preset("mi300x-qpx-nps1", gpus=2)
    chip = dataclasses.replace(topology.preset.chip, hbm_bytes=hbm_bytes * topology.partitions_per_gpu)
    return dataclasses.replace(topology, preset=dataclasses.replace(topology.preset, chip=chip))


def test_when_nothing_fits_the_advice_says_what_would_with_numbers(monkeypatch):
    monkeypatch.setattr(planner, "_compile", lambda *_: pytest.fail("nothing fits, so nothing is compiled"))
    settings = make_settings("tiny", "train", 8, 32, "starscream_tp", layers=2)
    sized = [e for e in plan_phase(settings, _tiny_hbm(1e5))["candidates"] if e["memory"]]
    memory = min(sized, key=lambda e: e["memory"]["total"])["memory"]
    persistent = sum(memory[key] for key in ("params", "optimizer_state", "kv_cache", "gradients"))
    result = plan_phase(settings, _tiny_hbm(memory["total"] - persistent / 2))
    assert result["choice"] is None and result["compiled"] == 0
    assert {entry["status"] for entry in result["candidates"]} <= {"does not fit", "cannot place"}
    assert "needs" in result["candidates"][0]["reason"] and "over by" in result["candidates"][0]["reason"]
    advice = "\n".join(result["advice"])
    assert "the smallest candidate" in advice and "more GPUs: about 4 GPUs" in advice


def test_a_shorter_sequence_is_advised_when_it_would_fit(monkeypatch):
    """With room for the persistent state and half the activations at 256 tokens, nothing fits at 256 and the
    advice names a shorter sequence that does (the memory estimate needs no compiling)."""
    monkeypatch.setattr(planner, "_compile", lambda *_: pytest.fail("nothing fits, so nothing is compiled"))
    settings = make_settings("tiny", "train", 8, 256, "starscream_tp", layers=2)
    sized = [e for e in plan_phase(settings, _tiny_hbm(1e5))["candidates"] if e["memory"]]
    memory = min(sized, key=lambda e: e["memory"]["total"])["memory"]
    persistent = sum(memory[key] for key in ("params", "optimizer_state", "kv_cache", "gradients"))
    result = plan_phase(settings, _tiny_hbm(persistent + (memory["total"] - persistent) / 2))
    assert result["choice"] is None
    shorter = [line for line in result["advice"] if line.startswith("a shorter sequence: --seq ")]
    assert shorter and int(shorter[0].split()[4]) < 256


def test_a_candidate_whose_bound_exceeds_the_best_found_is_pruned(monkeypatch, tmp_path):
    real = planner.lower_bound

    def bound(settings, topology, mesh, candidate, persistent):
        return 1e9 if candidate.layout == "gpu_tp" else real(settings, topology, mesh, candidate, persistent)

    monkeypatch.setattr(planner, "lower_bound", bound)
    settings = make_settings("tiny", "decode", 8, 32, "starscream_decode,gpu_tp", layers=2)
    result = plan_phase(settings, Topology.from_preset("mi300x-qpx-nps1", gpus=2), cache=ResultCache(tmp_path))
    pruned = [entry for entry in result["candidates"] if entry["status"] == "pruned"]
    assert pruned and all(entry["layout"] == "gpu_tp" and "lower bound" in entry["reason"] for entry in pruned)


def accumulated(estimate: dict, micro_batches: int) -> dict:
    return to_json(from_json(StepEstimate, estimate).accumulated(micro_batches))


def test_a_step_of_n_micro_batches_costs_n_micro_steps():
    """A micro-step's estimate as a plan writes it, read back and accumulated."""
    estimate = {"compute_s": 1.0, "memory_bound_s": 0.5, "communication_s": {"inter_gpu": 0.25},
                "total_communication_s": 0.25, "serial_s": 1.25, "overlapped_s": 1.0, "tokens": 100,
                "tokens_per_s": 80.0}
    four = accumulated(estimate, 4)
    assert four["serial_s"] == 5.0 and four["communication_s"] == {"inter_gpu": 1.0} and four["tokens"] == 400
    assert four["tokens_per_s"] == 80.0
    with_update = accumulated({**estimate, "passes_s": {"layers": 0.5, "update": 0.25}}, 4)
    assert with_update["serial_s"] == 5.0 + 4 * 0.5 + 0.25  # the optimizer update runs once


def test_domination_needs_the_same_mesh_and_layout_and_no_more_of_either_cost():
    kept = Candidate(layout="starscream_tp", data=1, gpu=2, micro_batches=2, remat="none")
    assert kept.dominates(Candidate(layout="starscream_tp", data=1, gpu=2, micro_batches=4, remat="full"))
    assert not kept.dominates(Candidate(layout="starscream_tp", data=1, gpu=2, micro_batches=1, remat="full"))
    assert not kept.dominates(Candidate(layout="starscream_tp", data=2, gpu=1, micro_batches=4, remat="full"))
    assert not kept.dominates(kept)


@pytest.mark.parametrize("argv, message", [
    (("--phases", "training"), "expected some of train, prefill, decode"),
    (("--no-simulate",), "plan always compiles on simulated CPU devices"),
    (("--layout", "starscream"), "unknown layout 'starscream'"),
    (("--data-parallel", "2"), "plan searches every data x gpu split"),
])
def test_bad_arguments_are_clear_errors(argv, message):
    with pytest.raises(StarscreamError, match=message):
        plan_command.run(parse(*MESH_ARGS, "--model", "tiny", *argv))


def test_a_serving_workload_longer_than_the_model_names_prompt_and_output_not_seq():
    with pytest.raises(StarscreamError, match=r"--prompt 200 \+ --output 100 = 300 tokens per request exceed the "
                                              r"model's max_seq_len 256; pass a --prompt and --output that sum to 256"):
        plan_command.run(parse(*MESH_ARGS, "--model", "tiny", "--phases", "serve", "--prompt", "200", "--output",
                               "100"))


@pytest.mark.parametrize("batch", ["0", "-4"])
def test_a_serving_plan_of_no_decode_batch_is_refused_not_priced_at_the_default(batch):
    with pytest.raises(StarscreamError, match=rf"--batch {batch}: give the largest decode batch to price, at least 1"):
        plan_command.run(parse(*MESH_ARGS, "--model", "tiny", "--phases", "serve", "--prompt", "100", "--output",
                               "50", "--batch", batch))


@pytest.mark.parametrize("argv, message", [
    (("--phases", "serve", "--seq", "256"), r"--seq 256 sets the sequence of train, prefill and decode, which "
                                            r"--phases serve leaves out; .*--prompt and --output: drop --seq"),
    (("--phases", "train,decode", "--prompt", "64", "--tpot-ms", "20"),
     r"--tpot-ms, --prompt describe the serving workload, which --phases train,decode leaves out; add serve"),
    (("--phases", "train", "--quantize", "int8"), r"--quantize is for inference, which --phases train leaves out; "
                                                  r"add prefill, decode or serve to --phases, or drop it"),
    (("--phases", "train", "--quantize", "fp8", "--kv-cache", "int8"), r"--quantize and --kv-cache are .* drop them"),
])
def test_flags_of_a_phase_left_out_are_refused(argv, message):
    with pytest.raises(StarscreamError, match=message):
        plan_command.run(parse(*MESH_ARGS, "--model", "tiny", *argv))


def test_a_plan_in_which_nothing_fits_exits_2(monkeypatch, capsys):
    unfit = {"phase": "train", "model": "tiny", "batch": 4, "seq": 16, "gpus": 2, "partitions_per_gpu": 4,
             "hbm_per_device": 1e6, "compiled": 0, "candidates": [], "elapsed_s": 0.0, "choice": None,
             "advice": ["more GPUs: about 4 GPUs would hold it"]}
    monkeypatch.setattr(plan_command, "plan_phase", lambda *args, **kwargs: dict(unfit))
    assert plan_command.run(parse(*MESH_ARGS, "--model", "tiny", *SHAPES, "--phases", "train")) == 2
    printed = capsys.readouterr()
    assert "nothing fits; what would:" in printed.out and "more GPUs" in printed.out
    assert "starscream plan: nothing fits for train" in printed.err


def test_plan_is_a_subcommand():
    from starscream_jax.cli.main import build_parser

    args = build_parser().parse_args(["plan", "--model", "tiny"])
    assert args.run is plan_command.run
    assert Topology.from_preset(args.default_preset).preset.name == "mi300x-cpx-nps1"


def test_the_expert_layouts_are_candidates_by_default_only_for_a_mixture_of_experts():
    assert "starscream_ep" not in plan_command.candidate_layouts("tiny", None).split(",")
    assert {"starscream_ep", "flat_ep"} <= set(plan_command.candidate_layouts("tiny-moe", None).split(","))
    assert plan_command.candidate_layouts("tiny", "flat_ep") == "flat_ep"


def test_a_mixture_of_experts_decodes_under_starscream_decode():
    """Mixtral 8x7B (2 layers) on 2 GPUs of 8 partitions: starscream_decode, which reads each expert weight once per
    GPU, is the fastest decode and keeps principles 2 and 3, ahead of flat_tp (which fails them) and of
    starscream_ep (whose partitions each gather their GPU's expert weights, 20x the step)."""
    settings = make_settings("mixtral-8x7b", "decode", 16, 1024, "flat_tp,starscream_decode,starscream_ep", 2)
    result = plan_phase(settings, Topology.from_preset("mi300x-cpx-nps1", gpus=2))
    assert result["choice"] == "starscream_decode data 1 x gpu 2"
    steps = {entry["name"]: entry["estimate"]["serial_s"] for entry in result["candidates"] if entry["estimate"]}
    assert steps["flat_tp data 1 x gpu 2"] > steps["starscream_decode data 1 x gpu 2"]
    assert steps["starscream_ep data 1 x gpu 2"] > 10 * steps["starscream_decode data 1 x gpu 2"]
    chosen = next(entry for entry in result["candidates"] if entry["status"] == "chosen")
    assert chosen["principles"] == {"no_redundancy": True, "hierarchical_collectives": True}


def test_generate_takes_the_fastest_prefill_on_the_decode_plans_mesh():
    def entry(layout, data, serial, status):
        return {"layout": layout, "mesh": {"data": data, "gpu": 8 // data}, "heads": 0, "status": status,
                "estimate": {"serial_s": serial}}

    plans = {"prefill": {"candidates": [entry("flat_tp", 8, 0.5, "chosen"), entry("starscream_tp", 1, 1.5, "slower"),
                                        entry("flat_tp", 1, 9.0, "slower")]},
             "decode": {"candidates": [entry("starscream_decode", 1, 0.02, "chosen")]}}
    args = parse("--preset", "mi300x-cpx-nps1", "--gpus", "8")
    command = plan_command.generate_command(plans, args, Topology.from_preset("mi300x-cpx-nps1", gpus=8))
    assert command.endswith("--prefill-layout starscream_tp --decode-layout starscream_decode")
    assert "--data-parallel" not in command


SHORTENING = {"train": ("--steps", "1"), "generate": ("--max-new-tokens", "2")}
"""Flags the test appends to shorten a printed command (the run's length, nothing about its placement)."""


@pytest.mark.slow  # over a minute and a half on two cores: a plan over every phase, then each printed command
def test_every_printed_command_runs_as_printed(cache_dir, tmp_path, monkeypatch):
    """plan over every phase on the tiny model, then each command it printed, in order, through the CLI, in a
    fresh directory (train writes runs/train, which generate reads); train runs 1 step and generate 2 tokens. The
    inspect commands read plan's compiled results from the shared cache, as they would on the user's machine."""
    from starscream_jax.cli import main as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CACHE_ENV, str(cache_dir))
    printed = plan("--layout", "starscream_tp,starscream_decode")
    commands = [line.strip() for line in printed.splitlines() if line.startswith("  starscream ")]
    assert [shlex.split(command)[1] for command in commands] == ["train", "inspect", "inspect", "inspect",
                                                                 "generate"]
    for command in commands:
        words = shlex.split(command)[1:]
        with redirect_stdout(io.StringIO()) as printed:
            assert cli.main(words + list(SHORTENING.get(words[0], ()))) == 0, command
        if words[0] == "inspect":  # plan skipped principle 1; the printed inspect judges every matmul of it
            kernel_row = re.search(r"^  1 kernel shapes.*$", printed.getvalue(), re.MULTILINE).group(0)
            assert kernel_row.split()[-1] == "ok" and "judged" not in kernel_row, (command, kernel_row)
    assert (tmp_path / "runs" / "train" / "checkpoints").is_dir()
