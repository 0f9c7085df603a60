"""The OpenAI request bodies as the server reads them (pydantic): each field's type and range, explicit nulls read
as absent (as vLLM reads them), chat content given as a list of text parts, and every other field of vLLM's OpenAI
protocol either at its neutral value or refused with a 400 naming it, so that nothing a vLLM client sends is dropped
without a word (`UNSUPPORTED`). Fields outside vLLM's protocol are ignored, as vLLM ignores them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import StarscreamError
from ..text.tokenizer import require_unicode
from .guided import (
    Grammar,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
    structural_tag_grammar,
)
from .scheduler import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_TOP_K, MAX_TOP_LOGPROBS
from .tools import PARSERS, ToolMode, function_of, named_grammar, required_grammar

HTTP_BAD_REQUEST, HTTP_UNAUTHORIZED, HTTP_NOT_FOUND = 400, 401, 404
HTTP_TOO_LARGE, HTTP_TOO_MANY, HTTP_UNAVAILABLE = 413, 429, 503
WHOLE_INT = 2 ** 31 - 1
MAX_N = 16
"""The most choices (`n`) one request may ask for; each is an engine request of its own."""

UNSUPPORTED = {
    "length_penalty": (1,), "use_beam_search": (False,), "suffix": ("",),
    "functions": ([],), "function_call": ("none",), "documents": ([],),
    "mm_processor_kwargs": ({},), "logits_processors": ([],),
    "priority": (0,), "reasoning_effort": (), "prompt_embeds": (), "kv_transfer_params": (), "vllm_xargs": ({},),
    "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": (), "service_tier": ("auto",),
    "store": (False,), "metadata": ({},),
}
"""Fields of vLLM's OpenAI protocol this server does not implement -> the values that ask for nothing (the field's
default; an explicit null counts as absent). Any other value is refused with a 400 naming the field. (`functions`
and `function_call`, OpenAI's deprecated form of tools, are not in vLLM's protocol either: send `tools`.)"""
INSTEAD = {"functions": "; send tools instead", "function_call": "; send tool_choice instead"}
"""What to send instead of a refused field, where something else does its work."""
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs", "structural_tag")
"""The fields that ask for structured output (`serving.guided`); a request gives at most one of them
(`structural_tag`, the structural tag's JSON text, is a field of chat requests only, as in vLLM)."""
BACKENDS = ("auto", "guidance", "llguidance")
"""guided_decoding_backend values served (every grammar runs on llguidance, vLLM's `guidance` backend)."""
TEMPLATE_RESERVED = ("chat_template", "tokenize", "messages")
"""Names chat_template_kwargs may not hold (vLLM refuses the first two; the messages are the request's own)."""
STRUCTURED_OUTPUT_KEYS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag",
                          "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties",
                          "disable_fallback"}
"""Keys of vLLM's `structured_outputs` read (`disable_fallback` asks for nothing: there is no other backend)."""
GRAMMAR_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The keys of `structured_outputs` that each ask for a grammar (a request gives one)."""


class ApiError(Exception):
    """A request refused with an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def unavailable(message: str) -> ApiError:
    return ApiError(HTTP_UNAVAILABLE, message, "server_error")


class StreamOptions(BaseModel):
    """stream_options: usage in a last chunk (`include_usage`), and in every chunk as well where
    `continuous_usage_stats` (vLLM's), each counting the tokens generated so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class Sampling(BaseModel):
    """The fields both routes share (OpenAI's names; top_k, min_p, min_tokens, repetition_penalty, ignore_eos,
    stop_token_ids, include_stop_str_in_output, prompt_logprobs, allowed_token_ids, bad_words, skip_special_tokens,
    spaces_between_special_tokens and cache_salt as vLLM adds them). logit_bias maps token ids (as JSON keys) to
    values in [-100, 100], at most MAX_LOGIT_BIAS of them, as OpenAI takes it. max_tokens 0 asks for the prompt alone:
    completions with echo (its text and log-probabilities), as vLLM serves it."""

    model_config = ConfigDict(extra="ignore")
    ECHO_ALONE: ClassVar[bool] = False
    """Whether echo with max_tokens 0 is served: the prompt alone (completions)."""
    model: str | None = None  # None: the served model, as vLLM reads it
    max_tokens: int | None = Field(default=None, ge=0, le=WHOLE_INT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=WHOLE_INT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=1e6, allow_inf_nan=False)
    min_tokens: int = Field(default=0, ge=0, le=WHOLE_INT)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-2 ** 63, lt=2 ** 63)  # vLLM's range: any 64-bit integer
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1)
    ignore_eos: bool = False
    user: str | None = None
    request_id: str | None = None
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=WHOLE_INT)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None

    def truncated(self, prompt: list[int], context: int) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: the model's context; None or a longer value: all
        of it), as vLLM truncates it."""
        keep = context if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return prompt[-keep:] if keep and keep < len(prompt) else prompt

    @model_validator(mode="after")
    def _nothing_generated_only_with_echo(self):
        if self.max_tokens == 0 and not (self.ECHO_ALONE and getattr(self, "echo", False)):
            raise ApiError(HTTP_BAD_REQUEST, "max_tokens 0 generates nothing; it is served with echo on completions "
                           "(the prompt and its log-probabilities); give at least 1", param="max_tokens")
        return self

    @model_validator(mode="after")
    def _truncation_leaves_a_prompt(self):
        if self.truncate_prompt_tokens == 0:
            raise ApiError(HTTP_BAD_REQUEST, "truncate_prompt_tokens 0 leaves no prompt; give -1 (the model's "
                           "context) or a number of tokens to keep, at least 1", param="truncate_prompt_tokens")
        return self

    @model_validator(mode="before")
    @classmethod
    def _at_the_door(cls, body):
        """Nulls read as absent; a field of vLLM's protocol this server does not implement is refused unless it
        asks for nothing."""
        if not isinstance(body, dict):
            return body
        body = {name: value for name, value in body.items() if value is not None}
        for name, neutral in UNSUPPORTED.items():
            if name in body and not any(_same(body[name], value) for value in neutral):
                instead = INSTEAD.get(name, "")
                raise ApiError(HTTP_BAD_REQUEST, f"{name} is not supported by this server; leave it out (or send "
                               f"{', '.join(repr(value) for value in neutral) or 'null'}){instead}", param=name)
        return body

    @model_validator(mode="after")
    def _logit_bias_is_ids_to_values(self):
        if not self.logit_bias:
            return self
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ApiError(HTTP_BAD_REQUEST, f"logit_bias holds {len(self.logit_bias)} entries; give at most "
                           f"{MAX_LOGIT_BIAS}", param="logit_bias")
        for key, value in self.logit_bias.items():
            token_id = key.strip()
            if not (token_id.isascii() and token_id.isdigit()) or not (math.isfinite(value) and -100 <= value <= 100):
                raise ApiError(HTTP_BAD_REQUEST, f"logit_bias entry {key!r}: {value} must map a token id to a value "
                               "in [-100, 100]", param="logit_bias")
        return self

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ApiError(HTTP_BAD_REQUEST, "stream_options applies to streamed responses only; send \"stream\": "
                           "true with it or leave it out", param="stream_options")
        return self

    @model_validator(mode="after")
    def _request_id_is_text(self):
        """request_id names the response (its `id`), which must be valid Unicode to be sent as JSON."""
        try:
            require_unicode(self.request_id or "", "request_id")
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err), param="request_id") from None
        return self

    @model_validator(mode="after")
    def _cache_salt_is_text(self):
        if self.cache_salt == "":
            raise ApiError(HTTP_BAD_REQUEST, "cache_salt is empty; give a non-empty text or leave it out",
                           param="cache_salt")
        return self

    @model_validator(mode="after")
    def _allowed_token_ids_allow_one(self):
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ApiError(HTTP_BAD_REQUEST, "allowed_token_ids is empty: no token could be drawn; give at least one "
                           "token id or leave it out", param="allowed_token_ids")
        return self

    def bad_word_ids(self, encode) -> tuple[tuple[int, ...], ...]:
        """bad_words as token-id sequences, as vLLM reads them: each word (its leading spaces dropped) encoded
        without special tokens, and again after one space where that gives as many tokens beginning with another
        (the word inside a text, where tokenizers write the space into its first token); `encode(text)` gives ids.
        ApiError naming bad_words for a word the tokenizer cannot encode (not valid Unicode), an empty word, a word
        of more than MAX_BAD_WORD_TOKENS tokens, or more than MAX_BAD_WORDS sequences."""
        sequences = []
        for word in self.bad_words or ():
            try:
                alone = tuple(int(token) for token in encode(word.lstrip()))
                spaced = tuple(int(token) for token in encode(" " + word.lstrip()))
            except StarscreamError as err:
                raise ApiError(HTTP_BAD_REQUEST, f"bad_words entry {word!r}: {err}", param="bad_words") from None
            if not alone or len(alone) > MAX_BAD_WORD_TOKENS:
                raise ApiError(HTTP_BAD_REQUEST, f"bad_words entry {word!r} is {len(alone)} tokens; give words of 1 "
                               f"to {MAX_BAD_WORD_TOKENS} tokens", param="bad_words")
            sequences.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise ApiError(HTTP_BAD_REQUEST, f"bad_words give {len(sequences)} token sequences (a word gives one or "
                           f"two); give at most {MAX_BAD_WORDS}", param="bad_words")
        return tuple(sequences)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, value) pairs."""
        return tuple((int(key), float(value)) for key, value in (self.logit_bias or {}).items())

    @model_validator(mode="after")
    def _best_of_is_n(self):
        """best_of would sample more choices than it returns, keeping the likeliest: only best_of = n (every
        choice returned) is served."""
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(HTTP_BAD_REQUEST, f"best_of {self.best_of} is not supported by this server: it returns "
                           f"every choice it samples; leave best_of out or send n ({self.n})", param="best_of")
        return self


    def grammar(self) -> Grammar | None:
        """The structured output the request asks for (`serving.guided`, not yet validated), or None; an
        ApiError naming the field when it is malformed or more than one field asks."""
        asked = [name for name in GRAMMAR_FIELDS if _asks(name, getattr(self, name, None))]
        if self.guided_decoding_backend not in (None, *BACKENDS):
            raise ApiError(HTTP_BAD_REQUEST, f"guided_decoding_backend {self.guided_decoding_backend!r} is not "
                           f"served; every grammar runs on llguidance: send one of {', '.join(BACKENDS)} or leave "
                           "it out", param="guided_decoding_backend")
        if len(asked) > 1:
            raise ApiError(HTTP_BAD_REQUEST, f"{' and '.join(asked)} each ask for structured output; give one",
                           param=asked[1])
        if not asked:
            return None
        try:
            return self._grammar_of(asked[0])
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err), param=asked[0]) from None

    def _grammar_of(self, name: str) -> Grammar:
        value, whitespace = getattr(self, name), self.guided_whitespace_pattern
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value, whitespace)
        if name == "guided_json":
            return json_schema_grammar(value, name, whitespace=whitespace)
        if name == "guided_regex":
            return regex_grammar(value, name)
        if name == "structural_tag":
            return structural_tag_grammar(value, name)
        return choice_grammar(value, name) if name == "guided_choice" else lark_grammar(value, name)


def _asks(name: str, value) -> bool:
    """Whether grammar field `name` holding `value` asks for structured output (response_format text does not)."""
    if name == "response_format":
        return value is not None and value.get("type") != "text"
    if name == "structured_outputs":
        return value is not None and any(value.get(key) not in (None, False) for key in GRAMMAR_KEYS)
    return value is not None


def _response_format(value: dict) -> Grammar:
    """OpenAI's response_format: {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}, or vLLM's {"type": "structural_tag", "structures": [...], "triggers": [...]}."""
    kind = value.get("type")
    if kind == "json_object":
        return json_object_grammar("response_format")
    if kind == "structural_tag":
        return structural_tag_grammar({key: item for key, item in value.items() if key != "type"}, "response_format")
    if kind != "json_schema":
        raise StarscreamError(f"response_format type {kind!r} is not supported; send text, json_object, "
                              "json_schema or structural_tag")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise StarscreamError("response_format json_schema must be {\"name\": ..., \"schema\": {...}}")
    return json_schema_grammar(spec.get("schema", {}), "response_format", strict=spec.get("strict") is True)


def _structured_outputs(value: dict, whitespace: str | None) -> Grammar:
    """vLLM's structured_outputs: one of json, regex, choice, grammar, json_object, structural_tag, with
    whitespace options."""
    unknown = sorted(set(value) - STRUCTURED_OUTPUT_KEYS)
    if unknown:
        raise StarscreamError(f"structured_outputs.{unknown[0]} is not supported; give json, regex, choice, "
                              "grammar, json_object or structural_tag")
    asked = [key for key in GRAMMAR_KEYS if value.get(key) not in (None, False)]
    if len(asked) > 1:
        raise StarscreamError(f"structured_outputs gives {' and '.join(asked)}; give one")
    key, field = asked[0], "structured_outputs"
    whitespace = value.get("whitespace_pattern") or whitespace
    flexible = value.get("disable_any_whitespace") is False
    if key == "json":
        return json_schema_grammar(value["json"], field, strict=value.get("disable_additional_properties") is True,
                                   whitespace=whitespace, flexible=flexible)
    if key == "json_object":
        return json_object_grammar(field, flexible=flexible)
    if key == "regex" and isinstance(value["regex"], str):
        return regex_grammar(value["regex"], field)
    if key == "choice" and isinstance(value["choice"], list):
        return choice_grammar(value["choice"], field)
    if key == "grammar" and isinstance(value["grammar"], str):
        return lark_grammar(value["grammar"], field)
    if key == "structural_tag":
        return structural_tag_grammar(value["structural_tag"], field)
    raise StarscreamError(f"structured_outputs.{key} has the wrong type; see vLLM's structured outputs")


def _same(given, neutral) -> bool:
    """`given` equals `neutral` as JSON values (1 and 1.0 alike, True not 1)."""
    if isinstance(given, bool) or isinstance(neutral, bool):
        return given is neutral
    return given == neutral


class CompletionRequest(Sampling):
    """A completions request; `echo` returns each prompt's text before its completion (as given, or decoded from
    its token ids), and with `logprobs` N its tokens' log-probabilities before the completion's (as lm-eval's
    loglikelihood tasks read them: with max_tokens 0, the prompt's alone)."""

    ECHO_ALONE: ClassVar[bool] = True
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = True
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (a text or token ids), or a batch (a list of texts or of token-id lists),
        each served as its own choices."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat turn: its text (a string, or text parts joined by newlines, as vLLM joins them; other kinds of part
    are refused: this server serves text models), and whatever else the turn holds (name, tool_calls,
    tool_call_id), passed to the chat template as given."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict:
        turn = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            other = next((part.type for part in self.content if part.type != "text"), None)
            if other is not None:
                raise ApiError(HTTP_BAD_REQUEST, f"message content of type {other!r} is not supported: this server "
                               "serves a text model; send text parts only", param="messages")
            turn["content"] = "\n".join(part.text or "" for part in self.content)
        turn.setdefault("content", "")
        if isinstance(turn.get("tool_calls"), list):
            turn["tool_calls"] = [_arguments_read(call) for call in turn["tool_calls"]]
        return turn


def _arguments_read(call):
    """A tool call of an assistant turn with its `function.arguments` JSON text read into an object, as chat
    templates expect it (they write it back out with `tojson`); text that is not JSON is left as it is."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


@dataclass(frozen=True, kw_only=True)
class TemplateOptions:
    """How a request's messages are rendered: `template` (the request's chat_template; None: the server's),
    `variables` (chat_template_kwargs, less the two below), `add_generation_prompt` and `continue_final` (the
    request's fields, or chat_template_kwargs' values of those names, which override them as in vLLM)."""

    template: str | None
    variables: dict
    add_generation_prompt: bool
    continue_final: bool


class ChatTemplateFields(BaseModel):
    """The fields that say how messages become the prompt, as vLLM reads them (chat, and /tokenize with
    messages): `add_generation_prompt` (the template's cue for a new assistant turn), `continue_final_message` (the
    last message is continued: nothing the template writes after it, no generation prompt), `chat_template` (a
    Jinja template instead of the server's), `chat_template_kwargs` (more names for the template) and `tools`
    (OpenAI's function tools, which tool-calling templates write into the prompt)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None

    @model_validator(mode="after")
    def _tools_are_functions(self):
        try:
            for tool in self.tools or ():
                function_of(tool)
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err), param="tools") from None
        return self

    def template_options(self) -> TemplateOptions:
        """The request's `TemplateOptions`; ApiError naming the field for a reserved name in chat_template_kwargs,
        or a generation prompt asked for with continue_final_message (the two cannot both hold)."""
        variables = dict(self.chat_template_kwargs or {})
        reserved = next((name for name in TEMPLATE_RESERVED if name in variables), None)
        if reserved is not None:
            raise ApiError(HTTP_BAD_REQUEST, f"chat_template_kwargs may not set {reserved!r}; send the request's own "
                           "field instead", param="chat_template_kwargs")
        prompt = variables.pop("add_generation_prompt", self.add_generation_prompt)
        continue_final = variables.pop("continue_final_message", self.continue_final_message)
        if continue_final and prompt:
            raise ApiError(HTTP_BAD_REQUEST, "continue_final_message continues the last message, and "
                           "add_generation_prompt (true unless given) starts a new one; send \"add_generation_prompt\""
                           ": false with it", param="continue_final_message")
        return TemplateOptions(template=self.chat_template, variables=variables, add_generation_prompt=bool(prompt),
                               continue_final=bool(continue_final))


class ChatRequest(Sampling, ChatTemplateFields):
    """A chat request; `tools` (OpenAI's function tools) reach the chat template, and `tool_choice` says how the
    answer becomes calls (`serving.tools`); the template fields of `ChatTemplateFields`; vLLM's `structural_tag`
    (a structural tag's JSON text, beside the other grammar fields); vLLM's `echo` (`echoed`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = False
    structural_tag: str | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = False  # the template writes them
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True

    def tool_mode(self, parser: str | None) -> ToolMode | None:
        """How the answer becomes tool calls (`serving.tools.ToolMode`; the first call alone where
        parallel_tool_calls is false, as vLLM keeps it), None when it does not (no tools, or tool_choice "none");
        `parser` is the server's --tool-call-parser for "auto". ApiError naming tool_choice for a choice it cannot
        serve."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none":
            return None
        if not self.tools:
            raise ApiError(HTTP_BAD_REQUEST, f"tool_choice {choice!r} needs tools; send tools or leave tool_choice "
                           "out", param="tool_choice")
        if choice == "auto":
            if parser is None:
                raise ApiError(HTTP_BAD_REQUEST, "tool_choice \"auto\" needs a tool-call parser, which this server "
                               "has none of for its model; start it with --tool-call-parser, or send tool_choice "
                               "\"required\" or a named function", param="tool_choice")
            return ToolMode("auto", PARSERS[parser], parallel=self.parallel_tool_calls)
        known = PARSERS.get(parser) if parser else None
        if choice == "required":
            return ToolMode("required", known, parallel=self.parallel_tool_calls)
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or choice.get("type", "function") != "function":
            raise ApiError(HTTP_BAD_REQUEST, f"tool_choice {choice!r} is not one of none, auto, required or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        return ToolMode("named", known, name)

    def grammar(self) -> Grammar | None:
        """The request's structured output (`Sampling.grammar`), or the grammar tool_choice "required" or a named
        function makes the answer follow (the two cannot be combined)."""
        asked = super().grammar()
        mode = self.tool_mode(next(iter(PARSERS)))  # (the parser does not matter here)
        if mode is None or mode.kind == "auto":
            return asked
        if asked is not None:
            raise ApiError(HTTP_BAD_REQUEST, f"tool_choice {mode.kind} makes the answer a tool call; it cannot also "
                           f"follow {asked.field}", param="tool_choice")
        try:
            return named_grammar(self.tools, mode.name) if mode.kind == "named" else \
                required_grammar(self.tools, self.parallel_tool_calls)
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err), param="tool_choice") from None

    def echoed(self, options: TemplateOptions) -> str:
        """The text the answer begins with under `echo`, as vLLM's: the last message's, where its role is the
        answer's (the assistant's with a generation prompt, else the last message's own: a continued message);
        else nothing."""
        last = self.messages[-1]
        if not self.echo or (options.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.for_template()["content"]

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ApiError(HTTP_BAD_REQUEST, "top_logprobs needs logprobs; send \"logprobs\": true with it",
                           param="top_logprobs")
        return self


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize, as vLLM reads it: a `prompt`, or chat `messages` rendered by the chat template (with the
    template fields of `ChatTemplateFields`); special tokens added by default to a prompt only (the template writes
    a chat's)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(HTTP_BAD_REQUEST, "give either prompt or messages", param="prompt")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def generation_defaults(path: Path) -> dict:
    """temperature, top_p and top_k of a generation_config.json (the ones it holds), as vLLM's `--generation-config
    auto` reads them for requests that leave them out; max_new_tokens and the rest are not read. StarscreamError
    naming the file and the field when one is out of range or the file is not a JSON object."""
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise StarscreamError(f"{path} is not JSON ({err}); fix it or pass --generation-config vllm") from None
    if not isinstance(settings, dict):
        raise StarscreamError(f"{path} holds no JSON object; fix it or pass --generation-config vllm")
    checks = {"temperature": lambda v: _finite(v) and 0 <= v <= 2, "top_p": lambda v: _finite(v) and 0 < v <= 1,
              "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and -1 <= v <= MAX_TOP_K}
    defaults = {}
    for name, valid in checks.items():
        if settings.get(name) is not None:
            if not valid(settings[name]):
                raise StarscreamError(f"{path}: {name} {settings[name]!r} is out of range; fix it or pass "
                                      "--generation-config vllm")
            defaults[name] = settings[name]
    return defaults


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
