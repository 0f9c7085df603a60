"""`starscream topology`: the JSON report, the readable table and one-line errors.

The installed console script runs in a fresh process without the suite's XLA_FLAGS, so --simulate itself must make
the 64 devices; the other tests call `cli.main` in this process (64 simulated devices already).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from starscream_jax.cli import main as cli
from starscream_jax.cli.arguments import checkpoint_dir
from starscream_jax.hardware.topology import OVERRIDE_ENV
from starscream_jax.training import loop as train_loop

CONSOLE_SCRIPT = Path(sys.executable).with_name("starscream")
HF_FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama"


def run_console_script(*args):
    env = {name: value for name, value in os.environ.items()
           if name not in ("XLA_FLAGS", "JAX_PLATFORMS", OVERRIDE_ENV)}
    return subprocess.run([str(CONSOLE_SCRIPT), "topology", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def topology_command(monkeypatch, capsys):
    """Runs `starscream topology ARGS` in this process; returns (exit status, stdout, stderr)."""
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)

    def run(*args):
        status = cli.main(["topology", *args])
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return run


def test_console_script_reports_a_simulated_cpx_node_as_json():
    result = run_console_script("--preset", "mi300x-cpx-nps1", "--gpus", "8", "--simulate", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["mesh"] == {"axes": ["data", "gpu", "xcd"], "shape": [1, 8, 8]}
    assert report["devices"] == [list(range(8 * gpu, 8 * gpu + 8)) for gpu in range(8)]
    assert (report["preset"], report["compute_mode"], report["memory_mode"]) == ("mi300x-cpx-nps1", "CPX", "NPS1")
    assert report["per_partition"]["hbm_bytes"] == pytest.approx(24e9)


def test_readable_table(topology_command):
    status, out, _ = topology_command("--topology", "2x4", "--simulate", "--data-parallel", "2")
    assert status == 0
    assert out.splitlines() == [
        "simulated CPU devices (cpu): QPX + NPS1, 1 node(s) x 2 GPUs x 4 partitions = 8 devices",
        "per partition: 0.2 TFLOP/s bf16, 4.0 GB HBM at 25 GB/s; ridge point 10 FLOP/byte",
        "mesh axes ('data', 'gpu', 'xcd') shape (2, 1, 4); device ids:",
        "  data gpu | x0 x1 x2 x3",
        "     0   0 |  0  1  2  3",
        "     1   0 |  4  5  6  7",
    ]


def test_plot_is_written_beside_the_table(topology_command, tmp_path):
    status, out, _ = topology_command("--topology", "2x4", "--simulate", "--plot", str(tmp_path / "mesh.png"))
    assert status == 0 and out.splitlines()[-1] == f"plot: {tmp_path / 'mesh.png'}"
    assert (tmp_path / "mesh.png").stat().st_size > 10_000


def test_preview_mode_is_marked(topology_command):
    _, out, _ = topology_command("--preset", "mi355x-cpx-nps2", "--gpus", "2", "--simulate")
    assert out.startswith("AMD Instinct MI355X (mi355x-cpx-nps2): CPX + NPS2 (preview mode), 1 node(s) x 2 GPUs")


def test_environment_override_and_the_argument_that_wins_over_it(topology_command, monkeypatch):
    monkeypatch.setenv(OVERRIDE_ENV, "4x2")
    assert json.loads(topology_command("--simulate", "--json")[1])["mesh"]["shape"] == [1, 4, 2]
    assert json.loads(topology_command("--topology", "2x4", "--simulate", "--json")[1])["mesh"]["shape"] == [1, 2, 4]


def test_console_script_error_is_one_line_and_status_2():
    result = run_console_script("--topology", "mi300x-spx-nps4")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("starscream topology: error: topology override 'mi300x-spx-nps4': AMD Instinct "
                                    "MI300X cannot run SPX+NPS4; valid compute+memory pairs: SPX+NPS1, DPX+NPS1")
    assert result.stderr.count("\n") == 1


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly():
    """`starscream topology | head -1`: stdout closed before the table is written (stdout buffered, as Python
    leaves a pipe, so the write fails in the flush at the run's end); no traceback, the status a shell gives a
    command killed by a closed pipe."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("XLA_FLAGS", "JAX_PLATFORMS", OVERRIDE_ENV, "PYTHONUNBUFFERED")}
    read_end, write_end = os.pipe()
    os.close(read_end)
    run = subprocess.Popen([str(CONSOLE_SCRIPT), "topology", "--topology", "2x4", "--simulate"], env=env,
                           stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    _, err = run.communicate(timeout=120)
    assert (run.returncode, err) == (141, "")


def test_a_pipe_other_than_stdout_breaking_is_not_taken_for_a_reader_that_left(monkeypatch, capsys):
    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli.topology, "run", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["topology", "--topology", "2x4", "--simulate"])


@pytest.mark.parametrize("args, message", [
    (("--topology", "8x"), "topology override '8x': a shape is two or three integers joined by 'x'; write"),
    (("--preset", "mi300x-spx-nps4", "--simulate"), "cannot run SPX+NPS4; valid compute+memory pairs: SPX+NPS1, "),
    (("--preset", "mi400x"), "unknown preset 'mi400x'; known presets: cpu, h200, "),
    (("--topology", "8x8", "--data-parallel", "3"), "data=3 (--data-parallel) does not divide the 8 GPUs; pick a"),
    (("--topology", "2x8x8", "--simulate"), "a simulated mesh needs 128 CPU devices but JAX already started with 64"),
    (("--coordinator", "localhost:1234"), "got --coordinator localhost:1234 --num-processes None --process-id None"),
    (("--preset", "mi300x-cpx-nps1", "--gpus", "16"), "--gpus 16 exceeds the 8 GPUs per node of mi300x-cpx-nps1; "
                                                      "--gpus counts GPUs per node: to span nodes pass --nodes 2"),
])
def test_bad_input_is_one_error_line(topology_command, args, message):
    status, out, err = topology_command(*args)
    assert (status, out) == (2, "")
    assert err.startswith("starscream topology: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_importing_the_library_and_the_command_starts_no_jax_backend():
    """Every module imports JAX at the top; none may start its backend, or the command could not choose the devices
    (simulated CPU ones, or a jax.distributed launch) after reading its arguments."""
    code = ("import importlib, pkgutil, starscream_jax\n"
            "for module in pkgutil.walk_packages(starscream_jax.__path__, 'starscream_jax.'):\n"
            "    importlib.import_module(module.name)\n"
            "from starscream_jax.jax_private import backends_started\n"
            "print(len(list(pkgutil.walk_packages(starscream_jax.__path__))), backends_started())")
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(printed[0]) >= 6 and printed[1] == "False"


@pytest.mark.parametrize("args, message", [
    (("--steps", "0"), "--steps 0: must be at least 1; pass 1 or more"),
    (("--batch-size", "-4"), "--batch-size -4: must be at least 1"),
    (("--checkpoint-every", "0"), "--checkpoint-every 0: must be at least 1"),
    (("--learning-rate", "nan"), "--learning-rate nan: must be a finite number above zero"),
    (("--weight-decay", "-0.1"), "--weight-decay -0.1: must be a finite number zero or more"),
    (("--run-dir", f"{__file__}/run"), f"--run-dir {__file__}/run: {__file__} is a file, not a directory"),
    (("--allow-change", "model"), "--allow-change model: expected some of steps,"),
    (("--gpus", "9"), "--gpus 9 exceeds the 8 GPUs per node of mi300x-qpx-nps1"),
    (("--allow-change", "steps"), "--allow-change steps changes a resumed run; it needs --resume"),
    (("--init", "/nonexistent/model"), "--init /nonexistent/model is not a directory; pass a Hugging Face model"),
    (("--data", str(HF_FIXTURE / "config.json")), "config.json is a JSON file; write one JSON object per line"),
    (("--init", str(HF_FIXTURE), "--tokenizer", str(HF_FIXTURE), "--model", "tiny"),
     "--init contradicts --model (--init's config.json is the model); pass only one of them"),
    (("--remat", "--remat-policy", "none"), "--remat contradicts --remat-policy (--remat is --remat-policy full)"),
    (("--topology", "2x4", "--preset", "mi300x-cpx-nps1"), "--topology contradicts --preset"),
    (("--distributed", "--coordinator", "localhost:1234"), "--distributed contradicts --coordinator"),
    (("--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"),
     "--coordinator localhost: expected HOST:PORT, such as localhost:1234"),
    (("--coordinator", "localhost:1234", "--num-processes", "0", "--process-id", "0"),
     "--num-processes 0: must be at least 1"),
    (("--run-dir", "/proc/starscream/run"), "--run-dir /proc/starscream/run: cannot write there"),
    (("--data", ""), "--data '' names no file; pass one or more .txt or .jsonl files"),
    (("--run-dir", ""), "--run-dir '' names no directory; pass one such as runs/train"),
    (("--token-cache", ""), "--token-cache '' names no directory; pass one such as runs/token-cache"),
    (("--steps", "100", "--warmup-steps", "200"), "--warmup-steps 200 exceeds --steps 100: the run would end before"),
    (("--profile", "runs/trace", "--steps", "1"), "--profile traces from the run's second step on"),
    (("--token-cache", "/proc/starscream", "--tokenizer", str(HF_FIXTURE), "--model", str(HF_FIXTURE)),
     "--token-cache /proc/starscream: cannot write there"),
])
def test_bad_training_input_is_one_error_line_before_anything_is_compiled(monkeypatch, capsys, tmp_path, args,
                                                                           message):
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"train": cli.SUBCOMMANDS["train"]})
    monkeypatch.setattr(train_loop, "compile_train_step", None)  # a call would fail: nothing may be compiled
    status = cli.main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress", *args])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("starscream train: error: ") and err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [
    (("train", "--profile", f"{__file__}/trace"), f"argument --profile: directory {__file__}/trace: {__file__} is a file"),
    (("inspect", "--plot", f"{__file__}/x.png"), f"argument --plot: directory {__file__}: {__file__} is a file"),
    (("plan", "--cache-dir", __file__), f"argument --cache-dir: directory {__file__}: {__file__} is a file"),
    (("topology", "--plot", f"{__file__}/x.png"), f"argument --plot: directory {__file__}: {__file__} is a file"),
    (("train", "--seed", str(2 ** 64)), "argument --seed: value 18446744073709551616: a seed is a 64-bit signed"),
])
def test_output_paths_and_seeds_out_of_range_are_refused_as_the_flags_are_read(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]


def test_a_model_directory_without_its_tokenizer_is_refused_before_anything_is_compiled(monkeypatch, capsys,
                                                                                        tmp_path):
    """A 384-token model is not fine-tuned on byte ids: its tokenizer.json is missing."""
    model_dir = tmp_path / "model"
    shutil.copytree(HF_FIXTURE, model_dir)
    (model_dir / "tokenizer.json").unlink()
    monkeypatch.setattr(train_loop, "compile_train_step", None)
    status = cli.main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress", "--init", str(model_dir)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "model model (vocabulary 384) comes without a tokenizer.json" in err


@pytest.mark.parametrize("argv, message", [
    (("generate", "--model-dir", "m", "--checkpoint", "runs/x"), "--model-dir contradicts --checkpoint"),
    (("generate", "--model-dir", "m", "--step", "3"), "--model-dir contradicts --step"),
    (("generate", "--greedy", "--top-p", "0.9"), "--greedy contradicts --top-p (greedy decoding takes"),
    (("generate", "--greedy", "--temperature", "0.8"), "--greedy contradicts --temperature"),
    (("export", "--checkpoint", "runs/x", "--out", "y", "--distributed", "--process-id", "1"),
     "--distributed contradicts --process-id"),
    (("plan", "--no-cache", "--cache-dir", "runs/cache"), "--no-cache contradicts --cache-dir"),
])
def test_contradicting_flags_are_one_error_line(capsys, argv, message):
    """Each pair is refused even when one of the values given is the default (which the parser alone cannot
    tell from a flag left out)."""
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith(f"starscream {argv[0]}: error: ")


@pytest.mark.parametrize("size", ["0", "-1", "inf"])
def test_a_shard_size_that_is_not_a_positive_number_is_refused(capsys, size):
    with pytest.raises(SystemExit) as exited:
        cli.main(["export", "--checkpoint", "x", "--out", "y", "--shard-size", size])
    assert exited.value.code == 2
    assert "argument --shard-size: --shard-size" in capsys.readouterr().err.splitlines()[-1]


def test_generate_and_export_take_a_run_directory_or_its_checkpoints(tmp_path):
    """`--checkpoint` names what `train` made: the run directory (with checkpoints/ in it) or that checkpoints
    directory itself."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert checkpoint_dir(str(tmp_path / "run")) == tmp_path / "run" / "checkpoints"
    assert checkpoint_dir(str(tmp_path / "run" / "checkpoints")) == tmp_path / "run" / "checkpoints"
    assert checkpoint_dir(str(tmp_path / "missing")) == tmp_path / "missing"



@pytest.mark.parametrize("command, said", [
    ("train", "interrupted; checkpoints written before it are kept (--resume continues from the newest)"),
    ("topology", "interrupted")])
def test_ctrl_c_outside_a_runs_own_handling_exits_130_saying_what_is_kept(monkeypatch, capsys, command, said):
    """A Ctrl-C that reaches the command (training's steps stop at a checkpoint themselves, `RunStopped`): status
    130, and for train the note that the checkpoints already written stay."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.SUBCOMMANDS[command][0], "run", interrupted)
    monkeypatch.setattr(cli, "prepare_simulation", lambda args: None)
    assert cli.main([command]) == 130
    assert capsys.readouterr().err == f"starscream {command}: {said}\n"
