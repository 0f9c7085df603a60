"""Tokenizers: a model directory's `tokenizer.json` (the `tokenizers` library) with BOS, EOS and the chat template of
its `tokenizer_config.json`, or the byte-level tokenizer of the built-in demo (`data.encode` / `data.decode`).

Both give token ids as int32 arrays and text back. `render_chat` turns chat messages ([{"role", "content"}]) into
text with the checkpoint's own Jinja template, run in Jinja's sandbox; that text is encoded without adding special
tokens again (the template writes them).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..errors import CheckpointError, StarscreamError
from ..model.config import ModelConfig
from . import data

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ByteTokenizer:
    """Token ids are UTF-8 bytes (vocabulary 256); no BOS, EOS or chat template."""

    vocab_size = data.VOCAB_SIZE
    bos_id = eos_id = None
    fingerprint = "bytes"
    """What decides the ids it gives (compared on resume, part of the token cache's key)."""

    def encode(self, text: str, special_tokens: bool = True) -> np.ndarray:
        return data.encode(text).astype(np.int32)

    def decode(self, token_ids) -> str:
        return data.decode(token_ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        raise StarscreamError("the byte-level tokenizer has no chat template; pass --tokenizer DIR (or --init DIR) "
                              "with a tokenizer_config.json that holds one, or give JSON Lines with a 'text' field")


class HFTokenizer:
    """`directory/tokenizer.json`, with `bos_token`, `eos_token`, `add_bos_token`, `add_eos_token` and
    `chat_template` from `directory/tokenizer_config.json` where present."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"{path} not found; pass a directory holding a Hugging Face tokenizer.json")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises plain Exceptions on malformed files
            raise CheckpointError(f"{path} is not a tokenizer the tokenizers library can read ({err})") from None
        settings = _read_json(self.directory / TOKENIZER_CONFIG_FILE)
        self.bos_token, self.eos_token = _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
        self.bos_id, self.eos_id = self._id_of(self.bos_token), self._id_of(self.eos_token)
        self.add_bos, self.add_eos = bool(settings.get("add_bos_token")), bool(settings.get("add_eos_token"))
        self.chat_template = settings.get("chat_template")
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        identity = f"{self.add_bos}{self.add_eos}{self.chat_template}{self.bos_id}{self.eos_id}".encode()
        self.fingerprint = hashlib.sha256(path.read_bytes() + identity).hexdigest()
        """What decides the ids it gives: tokenizer.json and the settings used from tokenizer_config.json."""

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{self.directory / TOKENIZER_CONFIG_FILE} names special token {token!r}, which "
                                  f"{TOKENIZER_FILE} does not hold; fix either file")
        return token_id

    def encode(self, text: str, special_tokens: bool = True) -> np.ndarray:
        """Token ids [n] int32; with `special_tokens` the tokenizer's own post-processing (BOS where it adds one)
        and BOS / EOS where tokenizer_config.json asks for them."""
        ids = self._tokenizer.encode(text, add_special_tokens=special_tokens).ids
        if special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        if special_tokens and self.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return np.asarray(ids, np.int32)

    def decode(self, token_ids) -> str:
        return self._tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The messages as the checkpoint's chat template writes them."""
        if not self.chat_template:
            raise StarscreamError(f"{self.directory / TOKENIZER_CONFIG_FILE} has no chat_template; give JSON Lines "
                                  "with a 'text' field, or a tokenizer whose configuration holds a template")
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _template_error
        try:
            return environment.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "")
        except TemplateError as err:
            raise StarscreamError(f"the chat template of {self.directory} failed on these messages: {err}") from None


def _template_error(message: str):
    raise TemplateError(message)


def _read_json(path: Path) -> dict:
    """The JSON object in `path` ({} when there is no such file)."""
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: byte {err.start} is not UTF-8; the file must be UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); fix or replace the file") from None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path} holds a JSON {type(settings).__name__}, not an object of settings; fix or "
                              "replace the file")
    return settings


def _token_text(entry) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    return entry.get("content") if isinstance(entry, dict) else entry


def load_tokenizer(directory: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of `directory` (holding tokenizer.json), or the byte-level one when None."""
    return ByteTokenizer() if directory is None else HFTokenizer(directory)


def tokenizer_for_model(directory: str | Path | None, config: ModelConfig, *,
                        trained_weights: bool) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of `directory` (None: byte-level), checked against the model it feeds: every id it gives must
    be a row of the model's embedding, and the byte tokenizer serves trained weights (a model directory, a
    checkpoint to fine-tune) only when they were made for it (vocabulary 256); random weights take any tokenizer
    that fits. The one check wherever a tokenizer meets a model (train, generate, serving)."""
    tokenizer = load_tokenizer(directory)
    source = "the byte-level tokenizer" if directory is None else f"the tokenizer of {directory}"
    if tokenizer.vocab_size > config.vocab_size:
        raise StarscreamError(f"{source} has {tokenizer.vocab_size} tokens but model {config.name} only "
                              f"{config.vocab_size}: its ids would fall outside the embedding; pass the model's own "
                              "tokenizer (--tokenizer DIR, or a model directory holding its tokenizer.json)")
    if directory is None and trained_weights and config.vocab_size != ByteTokenizer.vocab_size:
        raise StarscreamError(f"model {config.name} (vocabulary {config.vocab_size}) comes without a "
                              f"{TOKENIZER_FILE}, and the byte-level tokenizer is only for models made for it "
                              f"(vocabulary {ByteTokenizer.vocab_size}); put the model's {TOKENIZER_FILE} and "
                              f"{TOKENIZER_CONFIG_FILE} in its directory, or pass --tokenizer DIR")
    return tokenizer


def model_dir_tokenizer(model_dir: str | Path, config: ModelConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a Hugging Face model directory holding `config`'s weights, by `tokenizer_for_model`."""
    has_tokenizer = (Path(model_dir) / TOKENIZER_FILE).is_file()
    return tokenizer_for_model(model_dir if has_tokenizer else None, config, trained_weights=True)
