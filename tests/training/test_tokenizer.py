"""Tokenizers: a checkpoint's tokenizer.json with its BOS, EOS and chat template, and the byte-level demo tokenizer."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from starscream_jax.errors import CheckpointError, StarscreamError
from starscream_jax.training.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama"


def test_a_checkpoint_tokenizer_adds_bos_and_decodes_back():
    tokenizer = load_tokenizer(FIXTURE)
    ids = tokenizer.encode("ROMEO:\nI will.")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (0, 1, 384)
    assert ids[0] == tokenizer.bos_id and ids.dtype == np.int32 and len(ids) < len("ROMEO:\nI will.")
    assert tokenizer.decode(ids) == "ROMEO:\nI will."
    assert tokenizer.encode("ROMEO:", special_tokens=False)[0] != tokenizer.bos_id


def test_add_bos_and_eos_from_tokenizer_config(tmp_path):
    """A tokenizer whose tokenizer.json adds nothing itself: tokenizer_config.json's add_bos_token and
    add_eos_token decide."""
    shutil.copy(FIXTURE / "tokenizer.json", tmp_path)
    settings = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "add_bos_token": True,
                                                                "add_eos_token": True}))
    ids = HFTokenizer(tmp_path).encode("ROMEO:")
    assert ids[0] == 0 and ids[1] != 0 and ids[-1] == 1


def test_the_chat_template_renders_messages():
    tokenizer = load_tokenizer(FIXTURE)
    messages = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "A friend."}]
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    assert text == "<s><|user|>\nWho goes there?</s>\n<|assistant|>\nA friend.</s>\n<|assistant|>\n"
    ids = tokenizer.encode(text, special_tokens=False)
    assert list(ids).count(tokenizer.eos_id) == 2 and list(ids).count(tokenizer.bos_id) == 1


def test_the_byte_tokenizer_is_the_demo_one():
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.eos_id is None
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"
    with pytest.raises(StarscreamError, match="the byte-level tokenizer has no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_missing_or_inconsistent_tokenizer_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer.json not found"):
        HFTokenizer(tmp_path)
    shutil.copy(FIXTURE / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    with pytest.raises(CheckpointError, match=r"names special token '<\|end\|>', which tokenizer.json does not hold"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(StarscreamError, match="has no chat_template"):
        HFTokenizer(tmp_path).render_chat([{"role": "user", "content": "hi"}])
