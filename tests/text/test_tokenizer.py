"""Tokenizers: a checkpoint's tokenizer.json with its BOS, EOS and chat template, and the byte-level demo tokenizer."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from starscream_jax.errors import CheckpointError, StarscreamError
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.hf_config import model_config_from_hf
from starscream_jax.text.tokenizer import (
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


def copied_tokenizer(tmp_path, tokenizer_change=None, **settings) -> Path:
    """The fixture's tokenizer in tmp_path/tok, tokenizer.json changed by `tokenizer_change` and
    tokenizer_config.json updated with `settings`."""
    target = tmp_path / "tok"
    target.mkdir(parents=True)
    tokenizer = json.loads((FIXTURE / "tokenizer.json").read_text())
    if tokenizer_change is not None:
        tokenizer_change(tokenizer)
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    return target


def test_ids_the_post_processor_or_an_added_token_gives_must_fit_the_model(tmp_path):
    llama = model_config_from_hf(FIXTURE)

    def beyond_the_vocabulary(tokenizer):
        tokenizer["post_processor"]["special_tokens"]["<s>"]["ids"] = [999]

    directory = copied_tokenizer(tmp_path, beyond_the_vocabulary)
    assert HFTokenizer(directory).encode("")[0] == 999 and HFTokenizer(directory).vocab_size == 384
    with pytest.raises(StarscreamError, match=r"gives id 999 \(a special id of its post-processor\) but model .* has "
                                              r"384 embeddings \(ids 0-383\)"):
        tokenizer_for_model(directory, llama, trained_weights=True)

    def sparse(tokenizer):  # 384 tokens, the last of id 600
        vocabulary = tokenizer["model"]["vocab"]
        vocabulary[max(vocabulary, key=vocabulary.get)] = 600

    directory = copied_tokenizer(tmp_path / "sparse", sparse)
    assert HFTokenizer(directory).vocab_size == 384
    with pytest.raises(StarscreamError, match=r"gives id 600 \(token 'ess' of its vocabulary\) but model .* has 512 "
                                              r"embeddings"):
        tokenizer_for_model(directory, llama.replace(vocab_size=512), trained_weights=True)
    assert ByteTokenizer.highest_id == 255


def test_every_declared_eos_id_is_kept_in_order(tmp_path):
    directory = copied_tokenizer(tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 1, 6]}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    tokenizer = HFTokenizer(directory)
    assert (tokenizer.eos_id, tokenizer.eos_ids) == (1, (1, 5, 6, 7))
    assert HFTokenizer(FIXTURE).eos_ids == (1,) and ByteTokenizer().eos_ids == ()
    (directory / "config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(CheckpointError, match=r"config.json: eos_token_id is \"</s>\"; expected a token id or a list"):
        HFTokenizer(directory)


@pytest.mark.parametrize("key", ["add_bos_token", "add_eos_token"])
def test_add_bos_and_eos_must_be_json_booleans(tmp_path, key):
    with pytest.raises(CheckpointError, match=rf"tokenizer_config.json: {key} is \"false\", not a JSON boolean; "
                                              r"write true or false"):
        HFTokenizer(copied_tokenizer(tmp_path, **{key: "false"}))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({key: False}))
    assert HFTokenizer(tmp_path / "tok").encode("ROMEO:")[-1] != 1


@pytest.mark.parametrize("field, value", [("bos_token", 5), ("eos_token", [1]), ("eos_token", {"content": 2})])
def test_a_special_token_that_is_no_text_is_named(tmp_path, field, value):
    with pytest.raises(CheckpointError, match=rf"tokenizer_config.json: {field} is .*; give the token's text"):
        HFTokenizer(copied_tokenizer(tmp_path, **{field: value}))


def test_the_default_of_a_list_of_named_chat_templates_renders(tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0].role }}"}]
    tokenizer = HFTokenizer(copied_tokenizer(tmp_path, chat_template=templates))
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "user"
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates[:1]}))
    with pytest.raises(StarscreamError, match=r"holds chat templates named tool_use but none named 'default'"):
        HFTokenizer(tmp_path / "tok").render_chat([{"role": "user", "content": "hi"}])
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default"}]}))
    with pytest.raises(CheckpointError, match=r"chat_template is .*expected a Jinja template string or a list"):
        HFTokenizer(tmp_path / "tok")


@pytest.mark.parametrize("template, failure", [
    ("{{ 1 // 0 }}", "ZeroDivisionError: integer division or modulo by zero"),
    ("{{ messages[0].content + 1 }}", "TypeError: can only concatenate str"),
    ("{% if %}", "Expected an expression"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_any_failure_inside_a_chat_template_is_one_line(tmp_path, template, failure):
    tokenizer = HFTokenizer(copied_tokenizer(tmp_path, chat_template=template))
    refusal = rf"the chat template of .*tok failed on these messages: {failure}"
    with pytest.raises(StarscreamError, match=refusal) as err:
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert "\n" not in str(err.value)


def test_text_that_is_not_valid_unicode_is_refused_naming_the_index():
    for tokenizer in (load_tokenizer(FIXTURE), ByteTokenizer()):
        with pytest.raises(StarscreamError, match=r"text to encode is not valid Unicode \(lone surrogate at index 1, "
                                                  r"U\+D800"):
            tokenizer.encode("a\ud800b")
    assert list(ByteTokenizer().encode("a\udce9")) == [97, 0xE9]  # a command line's byte that is not UTF-8


def test_tools_reach_the_chat_template_and_special_tokens_can_be_kept(tmp_path):
    template = ("{% if tools %}{{ tools | map(attribute='function.name') | join(',') }}|{% endif %}"
                "{{ messages[0].content }}")
    tokenizer = HFTokenizer(copied_tokenizer(tmp_path, chat_template=template))
    tools = [{"type": "function", "function": {"name": "weather"}}]
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=tools) == "weather|hi"
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "hi"
    ids = tokenizer.encode("ab", special_tokens=False).tolist() + [tokenizer.eos_id]
    assert tokenizer.decode(ids) == "ab" and tokenizer.decode(ids, skip_special_tokens=False) == "ab</s>"
