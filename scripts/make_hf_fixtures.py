"""Builds tests/fixtures/hf/<family>/: a tiny random checkpoint of each supported family, written by Hugging Face
transformers (the reference implementation), with a small BPE tokenizer, and the reference's float32 logits for a
fixed batch and its greedy continuation of a prompt.

Needs torch, transformers, safetensors and tokenizers, in a virtual environment of its own (the tests read the
fixtures without them):

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors tokenizers
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py

Weights are drawn at a larger scale than transformers' initialisation (and norm scales and biases are drawn too, not
left at one and zero), so every feature changes the logits and greedy decoding has clear winners: the smallest gap
between the two best logits along each greedy path is recorded, and must dwarf float32 noise.
"""
import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf"
CORPUS = ROOT / "data" / "tinyshakespeare.txt"
VOCAB = 384
BATCH, SEQ, NEW_TOKENS = 8, 16, 20
PROMPT = "ROMEO:\nI"
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                 "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(
        tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": (transformers.MistralConfig, dict(head_dim=16, sliding_window=None, rope_theta=100000.0)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1000000.0, use_sliding_window=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, attention_bias=False, rope_theta=1000000.0)),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                                 rope_theta=1000000.0)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, use_sliding_window=False)),
    # Gemma 2: a window of 6 on the even layer (the batch's 16 tokens and the greedy path's 29 run past it), an
    # attention scale other than head_dim's, and caps low enough to bend the scores and logits of this model
    "gemma2": (transformers.Gemma2Config, dict(
        head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=8.0,
        final_logit_softcapping=10.0, tie_word_embeddings=True, rope_theta=10000.0, pad_token_id=None)),
}
EMBEDDING_STD = {"gemma2": COMMON["hidden_size"] ** -0.5}
"""Families whose embeddings are drawn smaller than N(0, 1): Gemma 2 multiplies them by sqrt(hidden_size), and at
N(0, 1) its tied embedding then makes every token predict itself."""
SHARD_SIZE = {"llama": "200KB"}
"""Families saved as several shards with an index (the others as one model.safetensors)."""


def train_tokenizer(out: Path) -> Tokenizer:
    """A byte-level BPE tokenizer of VOCAB tokens (<s> and </s> first) trained on the corpus; it adds <s> in front of
    every encoded text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(CORPUS)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 0)])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 256}, indent=2) + "\n")
    return tokenizer


def randomize(model: torch.nn.Module, seed: int, embedding_std: float = 1.0) -> None:
    """Every weight drawn from N(0, 0.15^2) (embeddings N(0, embedding_std^2)), norm scales 1 + N(0, 0.1^2), biases
    N(0, 0.1^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=generator)
            if "norm" in name:
                tensor.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                tensor.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                tensor.copy_(embedding_std * noise)
            else:
                tensor.copy_(0.15 * noise)


def greedy(model, prompt_ids: list[int]) -> tuple[list[int], float]:
    """NEW_TOKENS tokens chosen by argmax, one full forward pass each, and the smallest top-2 logit gap seen."""
    ids, smallest_gap = torch.tensor([prompt_ids]), float("inf")
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            last = model(ids).logits[0, -1]
            top = torch.topk(last, 2).values
            smallest_gap = min(smallest_gap, float(top[0] - top[1]))
            ids = torch.cat([ids, last.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist(), smallest_gap


def build(family: str, tokenizer_dir: Path, tokenizer: Tokenizer, seed: int) -> dict:
    config_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed, EMBEDDING_STD.get(family, 1.0))
    out = OUT / family
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, max_shard_size=SHARD_SIZE.get(family, "50MB"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    input_ids = np.random.default_rng(seed).integers(2, VOCAB, (BATCH, SEQ))
    with torch.no_grad():
        logits = model(torch.tensor(input_ids)).logits.float().numpy()
    prompt_ids = tokenizer.encode(PROMPT).ids
    generated, gap = greedy(model, prompt_ids)
    save_file({"input_ids": input_ids.astype(np.int32), "logits": logits,
               "prompt_ids": np.array(prompt_ids, np.int32), "generated_ids": np.array(generated, np.int32)},
              out / "reference.safetensors")
    facts = {"family": family, "transformers": transformers.__version__, "torch": torch.__version__,
             "tokenizers": tokenizers.__version__, "seed": seed, "prompt": PROMPT,
             "greedy_smallest_top2_gap": gap, "logits_abs_max": float(np.abs(logits).max())}
    (out / "reference.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    tokenizer_dir = OUT / "tokenizer"
    tokenizer = train_tokenizer(tokenizer_dir)
    for family in args.families:
        print(json.dumps(build(family, tokenizer_dir, tokenizer, seed=list(FAMILIES).index(family))))
    shutil.rmtree(tokenizer_dir)


if __name__ == "__main__":
    main()
