"""Tokenizers: a model directory's `tokenizer.json` (the `tokenizers` library) with BOS, EOS and the chat template of
its `tokenizer_config.json`, or the byte-level tokenizer of the built-in demo (`byte_level.encode` /
`byte_level.decode`).

Both give token ids as int32 arrays and text back. `render_chat` turns chat messages ([{"role", "content"}]) into text
with the checkpoint's own Jinja template, or one given (a server's --chat-template, a request's chat_template), run in
Jinja's sandbox (`render_template`); that text is encoded without adding special tokens again (the template writes
them). `continued` cuts a rendered chat after its final message, so that it is continued. `eos_ids` holds every id that
ends a generation: tokenizer_config.json's eos_token, then the `eos_token_id` (an id or a list) of
generation_config.json and of config.json, as transformers' generation stops on each (Llama 3's <|eot_id|> beside
<|end_of_text|>).

Text that is not valid Unicode (a lone surrogate: half of a UTF-16 pair, as a JSON "\ud800" escape gives) is a
`StarscreamError` naming its index, not a traceback from the tokenizers library.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..errors import CheckpointError, StarscreamError
from ..model.config import ModelConfig
from ..model.hf_config import read_json_object
from . import byte_level

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
EOS_FILES = ("generation_config.json", "config.json")
"""The files beside tokenizer.json whose `eos_token_id` declares more ids that end a generation, in this order."""
DEFAULT_TEMPLATE = "default"
"""The template transformers renders when `chat_template` is a list of named templates and none is asked for."""
SURROGATE = re.compile("[\ud800-\udfff]")
ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
"""The lone surrogates Python gives a command-line argument's bytes that are not UTF-8 (PEP 383)."""


def require_unicode(text: str, what: str = "text to encode", escaped_bytes: bool = False,
                    fix: str = "give text whose characters are whole") -> str:
    """`text`, unless it holds a lone surrogate (with `escaped_bytes`, one standing for a byte, PEP 383, passes):
    then a StarscreamError naming `what`, the index and `fix`."""
    for found in SURROGATE.finditer(text):
        if not (escaped_bytes and ESCAPED_BYTE.match(found.group())):
            raise StarscreamError(f"{what} is not valid Unicode (lone surrogate at index {found.start()}, "
                                  f"U+{ord(found.group()):04X}: half of a UTF-16 pair); {fix}")
    return text


class ByteTokenizer:
    """Token ids are UTF-8 bytes (vocabulary 256); no BOS, EOS or chat template."""

    vocab_size = byte_level.VOCAB_SIZE
    bos_id = eos_id = None
    eos_ids: tuple[int, ...] = ()
    highest_id, highest_source = byte_level.VOCAB_SIZE - 1, "byte 0xff"
    special_ids: frozenset[int] = frozenset()
    fingerprint = "bytes"
    """What decides the ids it gives (compared on resume, part of the token cache's key)."""

    def encode(self, text: str, special_tokens: bool = True) -> np.ndarray:
        """The UTF-8 bytes of `text`; bytes a command line gave that are not UTF-8 (PEP 383) stay those bytes."""
        return byte_level.encode(require_unicode(text, escaped_bytes=True)).astype(np.int32)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return byte_level.decode(token_ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None, *,
                    template: str | None = None, variables: dict | None = None) -> str:
        """The messages as `template` writes them (`render_template`, no BOS or EOS text); the byte-level tokenizer
        has no template of its own."""
        if template is None:
            raise StarscreamError("the byte-level tokenizer has no chat template; pass --tokenizer DIR (or --init DIR) "
                                  "with a tokenizer_config.json that holds one, or give JSON Lines with a 'text' field")
        return render_template(template, "the given chat template", messages=messages,
                               add_generation_prompt=add_generation_prompt, bos_token="", eos_token="",
                               **({"tools": tools} if tools else {}), **(variables or {}))


class HFTokenizer:
    """`directory/tokenizer.json`, with `bos_token`, `eos_token`, `add_bos_token`, `add_eos_token` (JSON booleans)
    and `chat_template` (a string, or Hugging Face's list of named templates, of which "default" renders) from
    `directory/tokenizer_config.json` where present; `eos_ids` adds the `eos_token_id` of generation_config.json and
    config.json beside it. `highest_id` is the largest id it can give (its vocabulary with the added tokens, and the
    special ids its post-processor inserts), `highest_source` what gives it; `special_ids` the ids of the tokens
    tokenizer.json marks special (what `decode` skips)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"{path} not found; pass a directory holding a Hugging Face tokenizer.json")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises plain Exceptions on malformed files
            raise CheckpointError(f"{path} is not a tokenizer the tokenizers library can read ({err})") from None
        config_path = self.directory / TOKENIZER_CONFIG_FILE
        settings = _read_json(config_path)
        self.bos_token, self.eos_token = (_token_text(settings.get(field), field, config_path)
                                          for field in ("bos_token", "eos_token"))
        self.bos_id, self.eos_id = self._id_of(self.bos_token), self._id_of(self.eos_token)
        self.add_bos, self.add_eos = (_boolean(settings, f"add_{token}_token", config_path) for token in ("bos", "eos"))
        self.chat_templates = _chat_templates(settings.get("chat_template"), config_path)
        self.chat_template = self.chat_templates.get(DEFAULT_TEMPLATE)
        self.eos_ids = tuple(dict.fromkeys([*([] if self.eos_id is None else [self.eos_id]),
                                            *(found for name in EOS_FILES
                                              for found in _declared_eos(self.directory / name))]))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
                                     if token.special)
        self.highest_id, self.highest_source = self._highest_id()
        identity = f"{self.add_bos}{self.add_eos}{settings.get('chat_template')}{self.bos_id}{self.eos_id}".encode()
        self.fingerprint = hashlib.sha256(path.read_bytes() + identity).hexdigest()
        """What decides the ids it gives: tokenizer.json and the settings used from tokenizer_config.json."""

    def _highest_id(self) -> tuple[int, str]:
        """(the largest id this tokenizer can give, what gives it): its vocabulary with the added tokens, the special
        ids its post-processor's configuration names, and what it gives encoding an empty and a short text."""
        found = [(-1, "nothing")]
        vocabulary = self._tokenizer.get_vocab(with_added_tokens=True)
        if vocabulary:
            token, token_id = max(vocabulary.items(), key=lambda item: item[1])
            found.append((token_id, f"token {token!r} of its vocabulary"))
        processor = self._tokenizer.post_processor
        if processor is not None:
            found += [(token_id, "a special id of its post-processor")
                      for token_id in _special_ids(json.loads(processor.__getstate__()))]
        for text in ("", "a"):
            ids = self._tokenizer.encode(text, add_special_tokens=True).ids
            if ids:
                found.append((max(ids), f"its post-processor, encoding {text!r}"))
        return max(found, key=lambda item: item[0])

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
        ids = self._tokenizer.encode(require_unicode(text), add_special_tokens=special_tokens).ids
        if special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        if special_tokens and self.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return np.asarray(ids, np.int32)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; special tokens left out unless `skip_special_tokens` is False (a tool-call
        parser reads markers such as Mistral's [TOOL_CALLS], which are special)."""
        return self._tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None, *,
                    template: str | None = None, variables: dict | None = None) -> str:
        """The messages as the checkpoint's chat template (its "default" one, where it names several), or
        `template` where given, writes them, with `tools` (OpenAI's tool definitions, which tool-calling templates
        write into the prompt) where given and `variables` (more names for the template, vLLM's
        chat_template_kwargs, such as Qwen3's enable_thinking; they override the others) (`render_template`)."""
        values = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                      eos_token=self.eos_token or "", **({"tools": tools} if tools else {}))
        if template is not None:
            return render_template(template, "the given chat template", **{**values, **(variables or {})})
        if not self.chat_template:
            if self.chat_templates:
                raise StarscreamError(f"{self.directory / TOKENIZER_CONFIG_FILE} holds chat templates named "
                                      f"{', '.join(self.chat_templates)} but none named {DEFAULT_TEMPLATE!r}, which "
                                      "is the one rendered; name one of them 'default'")
            raise StarscreamError(f"{self.directory / TOKENIZER_CONFIG_FILE} has no chat_template; give JSON Lines "
                                  "with a 'text' field, or a tokenizer whose configuration holds a template")
        return render_template(self.chat_template, f"the chat template of {self.directory}",
                               **{**values, **(variables or {})})


def render_template(template: str, what: str, **values) -> str:
    """`template` (Jinja, as Hugging Face renders chat templates: trimmed blocks, `raise_exception`) rendered with
    `values` in Jinja's sandbox. Whatever it raises (a syntax error, its raise_exception, a TypeError, ...) is one
    StarscreamError naming `what` and the failure."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _template_error
    try:
        return environment.from_string(template).render(**values)
    except Exception as err:  # a template may raise anything; TemplateError is its own raise_exception's
        failure = str(err) if isinstance(err, TemplateError) else f"{type(err).__name__}: {err}"
        raise StarscreamError(f"{what} failed on these messages: {' '.join(failure.split())}; fix the messages or "
                              "the template") from None


def check_template(template: str, what: str) -> str:
    """`template` once Jinja compiles it; StarscreamError naming `what` and the syntax error otherwise."""
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(template)
    except TemplateError as err:
        raise StarscreamError(f"{what} is not a Jinja template: {' '.join(str(err).split())}") from None
    return template


def continued(rendered: str, final: str) -> str:
    """`rendered` (a chat rendered without a generation prompt) cut right after the final message's text `final`,
    so that the model continues that message (vLLM's continue_final_message, as transformers cuts it): whatever the
    template writes after it (an end-of-turn, an EOS) is dropped; its trailing spaces are kept where the template
    kept them. StarscreamError when the text does not appear in `rendered`."""
    text = final.strip()
    at = rendered.rfind(text)
    if at < 0:
        raise StarscreamError("the final message's text does not appear in what the chat template wrote, so it "
                              "cannot be continued; send a template that writes message content as given")
    end = at + len(text)
    spacing = final[len(final.rstrip()):]
    return rendered[:end + len(spacing)] if rendered.startswith(spacing, end) else rendered[:end]


def _template_error(message: str):
    raise TemplateError(message)


def _read_json(path: Path) -> dict:
    """The JSON object in `path` ({} when there is no such file)."""
    return read_json_object(path, "settings") if path.is_file() else {}


def _boolean(settings: dict, key: str, path: Path) -> bool:
    """settings[key] when it is a JSON boolean; False when absent or null; a CheckpointError for anything else (the
    string "false" would read as true)."""
    value = settings.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise CheckpointError(f"{path}: {key} is {json.dumps(value)}, not a JSON boolean; write true or false (unquoted)")


def _chat_templates(entry, path: Path) -> dict[str, str]:
    """{name: template} of tokenizer_config.json's chat_template: one string (named "default"), or Hugging Face's
    list of {"name", "template"} objects; {} when there is none."""
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {DEFAULT_TEMPLATE: entry}
    if isinstance(entry, list) and all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                       and isinstance(item.get("template"), str) for item in entry):
        return {item["name"]: item["template"] for item in entry}
    raise CheckpointError(f"{path}: chat_template is {json.dumps(entry)[:60]}; expected a Jinja template string or a "
                          'list of {"name": ..., "template": ...} objects')


def _declared_eos(path: Path) -> list[int]:
    """The ids `eos_token_id` of the JSON file `path` declares (an id or a list of ids; none when absent)."""
    value = _read_json(path).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in values):
        raise CheckpointError(f"{path}: eos_token_id is {json.dumps(value)[:60]}; expected a token id or a list of "
                              "token ids (whole numbers of at least 0)")
    return values


def _special_ids(processor) -> list[int]:
    """Every special id a serialized post-processor names: TemplateProcessing's special_tokens' "ids", BERT's and
    RoBERTa's "sep" and "cls" ([token, id]), and those of a Sequence's processors."""
    if isinstance(processor, list):
        return [found for item in processor for found in _special_ids(item)]
    if not isinstance(processor, dict):
        return []
    found = []
    for key, value in processor.items():
        if key == "ids" and isinstance(value, list):
            found += [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
        elif key in ("sep", "cls") and isinstance(value, list) and len(value) == 2 and isinstance(value[1], int):
            found.append(value[1])
        else:
            found += _special_ids(value)
    return found


def _token_text(entry, field: str, where: Path) -> str | None:
    """A special token as tokenizer_config.json (`where`) gives it in `field`: a string, {"content": a string}, or
    null; a CheckpointError naming the file and the field otherwise."""
    text = entry.get("content") if isinstance(entry, dict) else entry
    if text is not None and not isinstance(text, str):
        raise CheckpointError(f"{where}: {field} is {entry!r}; give the token's text (a string, or {{\"content\": "
                              "...}) or null")
    return text


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
    if tokenizer.highest_id >= config.vocab_size:
        raise StarscreamError(f"{source} gives id {tokenizer.highest_id} ({tokenizer.highest_source}) but model "
                              f"{config.name} has {config.vocab_size} embeddings (ids 0-{config.vocab_size - 1}): "
                              "that id would fall outside the embedding; pass the model's own tokenizer, or fix its "
                              f"{TOKENIZER_FILE}")
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
