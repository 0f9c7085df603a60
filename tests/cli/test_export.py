"""Fine-tuning a Hugging Face checkpoint end to end through the commands: `train --init` on a JSON Lines file,
`export`, then the exported directory loads back with the trained parameters (the same logits) and `generate
--model-dir` decodes with its tokenizer."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from starscream_jax.cli import main as cli
from starscream_jax.cli.export import source_config
from starscream_jax.errors import CheckpointError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.hf_checkpoint import load_hf_model
from starscream_jax.sharding.apply import use_layout
from starscream_jax.training.checkpoint import restore_model

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "qwen2"
MESH = ["--topology", "2x4", "--simulate"]


def logits(model, mesh, tokens) -> np.ndarray:
    with use_layout("starscream_tp", mesh):
        return np.asarray(jax.jit(lambda m, t: m(t).logits)(model, tokens))


def test_fine_tune_export_reload_and_generate(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Line {i}?"},
                                                     {"role": "assistant", "content": "ROMEO: I will."}]}) + "\n"
                            for i in range(40)))
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    assert cli.main(["train", *MESH, "--init", str(FIXTURE), "--data", str(data), "--steps", "3", "--batch-size", "8",
                     "--seq-len", "16", "--eval-every", "3", "--run-dir", str(run_dir), "--no-progress",
                     "--token-cache", str(tmp_path / "cache")]) == 0
    assert cli.main(["export", *MESH, "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 0  # the source's other fields kept

    mesh = build_mesh("2x4")
    trained, _ = restore_model(run_dir / "checkpoints", "starscream_tp", mesh)
    reloaded = load_hf_model(out, "starscream_tp", mesh)
    tokens = load_file(FIXTURE / "reference.safetensors")["input_ids"]
    after = logits(reloaded, mesh, tokens)
    np.testing.assert_array_equal(after, logits(trained, mesh, tokens))
    assert np.max(np.abs(after - load_file(FIXTURE / "reference.safetensors")["logits"])) > 1e-3  # it trained

    capsys.readouterr()
    assert cli.main(["generate", *MESH, "--model-dir", str(out), "--prompt", "ROMEO:", "--greedy",
                     "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "exported from" in printed and "--- sample 0\nROMEO:" in printed


def test_a_run_whose_init_directory_is_gone_names_it():
    """The export keeps the fields of the model directory a run was fine-tuned from: one moved away since is named,
    with the fix (put it back), not a request for a flag export does not take."""
    assert source_config("") is None
    assert source_config(str(FIXTURE))["model_type"] == "qwen2"
    with pytest.raises(CheckpointError, match=r"fine-tuned from /nowhere/qwen2, whose config.json is gone; .* put that "
                                              r"model directory back at /nowhere/qwen2"):
        source_config("/nowhere/qwen2")
