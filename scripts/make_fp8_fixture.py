"""Builds tests/fixtures/hf/mistral_fp8/: the mistral fixture's weights quantized to float8_e4m3fn per output channel
in the compressed-tensors format the hub's FP8 checkpoints use ("float-quantized": each layer projection's `weight`
in fp8 with a float32 `weight_scale` [out, 1]; the output head left in float, `ignore: ["lm_head"]`; weights only,
no activation scheme), and the reference implementation's float32 logits and greedy continuation of that checkpoint
as Hugging Face transformers loads it (compressed-tensors decompresses the weights).

Needs torch, transformers, compressed-tensors, safetensors and tokenizers in a virtual environment of its own:

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install torch transformers compressed-tensors safetensors
    /tmp/tfvenv/bin/python scripts/make_fp8_fixture.py
"""
import json
import shutil
from pathlib import Path

import compressed_tensors
import numpy as np
import torch
import transformers
from safetensors import numpy as safetensors_numpy
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "fixtures" / "hf" / "mistral"
OUT = ROOT / "tests" / "fixtures" / "hf" / "mistral_fp8"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 20
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel",
                    "group_size": None, "block_structure": None, "observer": "minmax", "actorder": None}}},
}


def quantized_tensors(state: dict) -> dict:
    """The state dict with every layer projection's weight [out, in] as float8_e4m3fn values and a float32
    weight_scale [out, 1] = max |row| / 448."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            scale = tensor.abs().amax(dim=1, keepdim=True).float() / torch.finfo(torch.float8_e4m3fn).max
            out[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            out[name.removesuffix(".weight") + ".weight_scale"] = scale
        else:
            out[name] = tensor.contiguous()
    return out


def main() -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    save_file(quantized_tensors(model.state_dict()), OUT / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((SOURCE / "config.json").read_text())
    (OUT / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}, indent=2)
                                     + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(SOURCE / name, OUT / name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
    source = safetensors_numpy.load_file(SOURCE / "reference.safetensors")
    with torch.no_grad():
        logits = reference(torch.tensor(source["input_ids"], dtype=torch.long)).logits.float().numpy()
        ids = torch.tensor(source["prompt_ids"][None], dtype=torch.long)
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, reference(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    generated = ids[0, len(source["prompt_ids"]):].numpy().astype(np.int32)
    safetensors_numpy.save_file(
        {"input_ids": source["input_ids"], "logits": logits, "prompt_ids": source["prompt_ids"],
         "generated_ids": generated}, OUT / "reference.safetensors")
    facts = {"family": "mistral", "quantization": "compressed-tensors float8_e4m3fn per channel",
             "transformers": transformers.__version__, "torch": torch.__version__,
             "compressed_tensors": compressed_tensors.__version__, "logits_abs_max": float(np.abs(logits).max())}
    (OUT / "reference.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
