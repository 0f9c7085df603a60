"""Tokenizers: a checkpoint's tokenizer.json with its BOS, EOS and chat template, and the byte-level demo tokenizer."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from starscream_jax.errors import CheckpointError, StarscreamError
from starscream_jax.model.config import load_model_config
from starscream_jax.model.hf_config import model_config_from_hf
from starscream_jax.training.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    model_dir_tokenizer,
    tokenizer_for_model,
)

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


def test_a_tokenizer_meets_a_model_only_when_its_ids_fit_and_bytes_only_where_made_for_them():
    tiny, llama = load_model_config("tiny"), model_config_from_hf(FIXTURE)
    assert isinstance(tokenizer_for_model(None, tiny, trained_weights=True), ByteTokenizer)
    assert isinstance(tokenizer_for_model(None, llama, trained_weights=False), ByteTokenizer)  # random weights
    assert tokenizer_for_model(FIXTURE, llama, trained_weights=True).vocab_size == 384
    with pytest.raises(StarscreamError, match="has 384 tokens but model tiny only 256"):
        tokenizer_for_model(FIXTURE, tiny, trained_weights=False)
    with pytest.raises(StarscreamError, match=r"comes without a tokenizer.json, and the byte-level tokenizer is only"):
        tokenizer_for_model(None, llama, trained_weights=True)


def test_a_model_directory_without_its_tokenizer_is_refused(tmp_path):
    shutil.copy(FIXTURE / "config.json", tmp_path)
    with pytest.raises(StarscreamError, match="vocabulary 384\\) comes without a tokenizer.json"):
        model_dir_tokenizer(tmp_path, model_config_from_hf(tmp_path))
    shutil.copy(FIXTURE / "tokenizer.json", tmp_path)
    assert model_dir_tokenizer(tmp_path, model_config_from_hf(tmp_path)).vocab_size == 384


@pytest.mark.parametrize("content, message", [(b"[1]", "holds a JSON list, not an object"),
                                              (b'{"eos_token": "\xe9"}', "byte 15 is not UTF-8")])
def test_a_tokenizer_config_that_is_not_an_object_is_named(tmp_path, content, message):
    shutil.copy(FIXTURE / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        HFTokenizer(tmp_path)


def test_the_fingerprint_follows_what_decides_the_ids_not_the_path(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "moved")
    assert HFTokenizer(tmp_path / "moved").fingerprint == HFTokenizer(FIXTURE).fingerprint != ByteTokenizer.fingerprint
    settings = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    (tmp_path / "moved" / "tokenizer_config.json").write_text(json.dumps({**settings, "add_eos_token": True}))
    assert HFTokenizer(tmp_path / "moved").fingerprint != HFTokenizer(FIXTURE).fingerprint
