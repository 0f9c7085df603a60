"""Tool calling: the calls a chat model writes, read back into OpenAI's `tool_calls`, and the grammars that make it
write one when the request says it must.

`tool_choice` (OpenAI's): "none" (the tools are in the prompt; the text is the answer), "auto" (the model may
call: its text is read after generation by the parser of its family, as vLLM's `--tool-call-parser` reads it),
"required" (a grammar makes the text a JSON array of one or more {"name", "parameters"} objects, one per call, each
naming a tool and matching its parameters' schema) or a named function (a grammar makes the text the arguments
of that function, a JSON object matching its parameters' schema). The grammars are structured output
(`serving.guided`), so the calls always parse.

Parsers, by the format each family's chat template teaches its model (`PARSERS`, `default_parser`):
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
  call, after any text.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`; several joined by ";").
- `mistral` (Mistral, Mixtral): `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or (newer tokenizers)
  `name[ARGS]{...}` per call.
A parser reads text decoded with special tokens kept (Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are
special); text that does not parse as calls is the answer as written.
"""
from __future__ import annotations

import abc
import json
import re
import secrets
import string
from dataclasses import dataclass

from ..errors import StarscreamError
from .guided import Grammar, json_schema_grammar

FAMILY_PARSERS = {"llama": "llama3_json", "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes",
                  "qwen3_moe": "hermes", "mistral": "mistral", "mixtral": "mistral"}
"""A model's `model_type` (config.json) -> the parser of its family's tool-call format."""


@dataclass(frozen=True)
class ToolCall:
    """One call: its id, the function's name and its arguments as JSON text (OpenAI's `function.arguments`)."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls entry (with `index`, as a streamed delta carries it)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def new_id(alphanumeric9: bool = False) -> str:
    """A call id: "call_" and 24 hex digits, or 9 letters and digits (what Mistral's templates require of ids
    sent back to them)."""
    if alphanumeric9:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def _call(entry, arguments_key: str, make_id=new_id) -> ToolCall | None:
    """A ToolCall of a parsed {"name", arguments_key} object, its id from `make_id()`; None when it is not one."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return None
    arguments = entry.get(arguments_key, entry.get("arguments", entry.get("parameters", {})))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(make_id(), entry["name"], text)


class ToolParser(abc.ABC):
    """Reads a family's calls out of generated text (`parse`) and, while streaming, says where they may begin
    (`start`), so the text before them streams as content and the calls come whole."""

    name = ""
    marker = ""

    @abc.abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content before the calls, None if empty; the calls), or (text, []) when it holds none (each
        family's parser says how)."""

    def start(self, text: str) -> tuple[int | None, int]:
        """(where the calls begin in `text`, None while not; how many characters at its end to hold back, as the
        beginning of a marker)."""
        found = text.find(self.marker)
        if found >= 0:
            return found, 0
        return None, _partial_suffix(text, self.marker)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesParser(ToolParser):
    name, marker = "hermes", "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[start:]):
            try:
                call = _call(json.loads(body.strip()), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start] or None, calls


class Llama3JsonParser(ToolParser):
    name, marker = "llama3_json", "<|python_tag|>"

    def parse(self, text):
        body = text.strip()
        body = body[len(self.marker):].lstrip() if body.startswith(self.marker) else body
        if not body.startswith("{"):
            return text, []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                entry, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call(entry, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = _skip(body, at, ";")
        return None, calls

    def start(self, text):
        body = text.lstrip()
        if body.startswith(("{", self.marker)):
            return 0, 0  # (the whole answer is the calls: its leading whitespace is not content)
        if not body or self.marker.startswith(body):
            return None, len(text)
        return None, 0


def _skip(text: str, at: int, separator: str) -> int:
    """`at` moved past whitespace and one `separator` (and the whitespace after it)."""
    while at < len(text) and text[at].isspace():
        at += 1
    if text.startswith(separator, at):
        at += len(separator)
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class MistralParser(ToolParser):
    name, marker = "mistral", "[TOOL_CALLS]"

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for part in text[start:].split(self.marker)[1:]:
            found = self._calls(part.strip())
            if found is None:
                return text, []
            calls += found
        return text[:start] or None, calls

    @staticmethod
    def _calls(part: str) -> list[ToolCall] | None:
        """The calls of one [TOOL_CALLS] part: a JSON list (or object), or `name[ARGS]{...}`."""
        if "[ARGS]" in part and not part.startswith(("[", "{")):
            name, _, arguments = part.partition("[ARGS]")
            try:
                json.loads(arguments)
            except ValueError:
                return None
            return [ToolCall(new_id(True), name.strip(), arguments.strip())]
        try:
            entries = json.loads(part)
        except ValueError:
            return None
        entries = entries if isinstance(entries, list) else [entries]
        calls = [_call(entry, "arguments", lambda: new_id(True)) for entry in entries]
        return None if not calls or None in calls else calls


PARSERS = {parser.name: parser for parser in (HermesParser(), Llama3JsonParser(), MistralParser())}
"""--tool-call-parser's names -> parsers."""


def default_parser(model_type: str | None) -> str | None:
    """The parser of a model family (config.json's model_type), None for a family this library knows none of."""
    return FAMILY_PARSERS.get(model_type or "")


def function_of(tool) -> dict:
    """A tool's function definition ({"name", "parameters", ...}); StarscreamError naming `tools` otherwise."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise StarscreamError("tools: each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                              "\"parameters\": {...}}}")
    return function


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def named_grammar(tools: list, name: str) -> Grammar:
    """The grammar of the arguments of tool `name` (its parameters' schema; strict where the tool says so)."""
    function = next((function_of(tool) for tool in tools if function_of(tool)["name"] == name), None)
    if function is None:
        raise StarscreamError(f"tool_choice: names function {name!r}, which tools does not hold")
    return json_schema_grammar(_parameters(function), "tool_choice", strict=bool(function.get("strict")))


def required_grammar(tools: list, parallel: bool = True) -> Grammar:
    """The grammar of a JSON array of one call (or more, with `parallel`): {"name": a tool's name, "parameters":
    its arguments}."""
    calls = [{"type": "object", "properties": {"name": {"const": function["name"]},
                                               "parameters": _parameters(function)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for function in map(function_of, tools)]
    if not calls:
        raise StarscreamError("tool_choice: \"required\" needs at least one tool in tools")
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return json_schema_grammar(schema, "tool_choice")


@dataclass(frozen=True)
class ToolMode:
    """How a request's text becomes tool calls: "auto" (read by `parser`), "required" (a JSON array of calls) or
    "named" (the arguments of function `name`); the server's `parser` also decides the calls' ids (Mistral's
    templates take back only 9 letters and digits). Without `parallel` (the request's parallel_tool_calls false)
    only the first call is kept, as vLLM keeps it: a model may write several calls whatever the request says."""

    kind: str
    parser: ToolParser | None = None
    name: str = ""
    parallel: bool = True

    def new_id(self) -> str:
        return new_id(self.parser is not None and self.parser.name == "mistral")

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole generated text (the first call alone without `parallel`); text that does not
        parse is content, with no calls."""
        content, calls = self._parsed(text)
        return content, calls if self.parallel else calls[:1]

    def _parsed(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.kind == "auto":
            return self.parser.parse(text)
        if self.kind == "named":
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [ToolCall(self.new_id(), self.name, text)]
        try:
            entries = json.loads(text)
        except ValueError:
            return text, []
        calls = [_call(entry, "parameters", self.new_id) for entry in entries] if isinstance(entries, list) else [None]
        return (text, []) if not calls or None in calls else (None, calls)


class ToolStream:
    """One streamed choice's text split into content deltas and tool-call deltas (OpenAI's streamed shapes):
    "named" streams the arguments as they come, after a first delta with the call's id and name; "auto" streams
    content until the parser's marker may begin, holds the rest, and gives the calls whole at the end (or the
    held text as content, if it holds none); "required" gives the calls at the end."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.text = ""
        self._sent = 0  # characters of `text` already sent as content (auto)
        self._named: ToolCall | None = None
        self.calls: list[ToolCall] = []

    def add(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) after the choice's new `text` (`final` on its last)."""
        self.text += text
        if self.mode.kind == "named":
            return "", self._named_deltas(text)
        if self.mode.kind == "auto" and not final:
            begins, hold = self.mode.parser.start(self.text)
            end = begins if begins is not None else len(self.text) - hold
            content, self._sent = self.text[self._sent:max(end, self._sent)], max(end, self._sent)
            return content, []
        if not final:
            return "", []
        content, self.calls = self.mode.calls(self.text)
        if not self.calls:
            rest, self._sent = self.text[self._sent:], len(self.text)
            return (rest if self.mode.kind == "auto" else content or ""), []
        return "", [call.openai(index) for index, call in enumerate(self.calls)]

    def _named_deltas(self, text: str) -> list[dict]:
        """The named call's delta of `text`: its id and name with the first arguments, then arguments alone (one
        entry for the call's index a chunk, as OpenAI streams it)."""
        if self._named is None:
            self._named = ToolCall(self.mode.new_id(), self.mode.name, "")
            self.calls = [self._named]
            first = self._named.openai(0)
            first["function"]["arguments"] = text
            return [first]
        return [{"index": 0, "function": {"arguments": text}}] if text else []
