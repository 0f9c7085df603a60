"""Structured output: a request's grammar (a JSON schema, any JSON object, a regular expression, a choice of
strings, a Lark or GBNF grammar, vLLM's structural tags) as the `llguidance` library builds it, and the matcher that
says, before each token, which tokens the grammar allows.

Why llguidance (over xgrammar or outlines-core): it needs no PyTorch (the masks are plain int32 bit words this
library moves into the compiled step itself); it is the engine behind vLLM's `guidance` backend; it computes a
mask lazily from the matcher's state over a token trie, in tens of microseconds for a 128k vocabulary, with no
up-front compile of every state; and one library takes JSON schema, regular expressions and Lark / GBNF grammars.

Where each part runs: the API process turns the request's fields into a grammar (`Grammar`: llguidance's grammar
text and the field it came from) and validates it without a tokenizer (`checked`), so a bad schema is a 400 naming
its field before anything is queued; the grammar text crosses to the engine in `SamplingParams`. The engine
process owns a `Guide` per request (it sees every token first): it compiles the grammar against the model's
tokenizer (`grammar_tokenizer`), writes the allowed-token bits of a row's next token into the row's slot on the
device before the step that samples it, and advances the matcher by each token it reads back. A mask is
`mask_words(V)` int32 words, bit `v % 32` of word `v // 32` set where token v is allowed (llguidance's layout).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from ..errors import StarscreamError

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as `json.dumps` writes it: a grammar that lets a model write any whitespace lets a weak one write
whitespace forever (what vLLM's `disable_any_whitespace` guards against); `whitespace_pattern` (vLLM's
`guided_whitespace_pattern`) or `disable_any_whitespace: false` asks for flexible whitespace instead."""
FLEXIBLE_JSON = {"whitespace_flexible": True}


@dataclass(frozen=True)
class Grammar:
    """llguidance's grammar text (what `LLMatcher.grammar_from_*` gives) and the request field it was built from
    (errors name it)."""

    field: str
    text: str


def mask_words(vocab: int) -> int:
    """int32 words of one token mask over a vocabulary of `vocab` ids."""
    return (vocab + 31) // 32


def allowed_bits(token_ids, vocab: int) -> np.ndarray:
    """The mask [mask_words(vocab)] int32 that allows exactly `token_ids` (vLLM's allowed_token_ids), in
    llguidance's layout, so that it intersects a grammar's mask by a bitwise and."""
    ids = np.asarray(token_ids, np.int64)
    words = np.zeros(mask_words(vocab), np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def _json_object(value, field: str, what: str, fix: str) -> dict:
    """`value` as a JSON object: a dict as given, or one parsed from its JSON text; StarscreamError naming `field`,
    `what` was wrong and the `fix` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise StarscreamError(f"{field}: {what} is not JSON ({err}); {fix}") from None
    if not isinstance(value, dict):
        raise StarscreamError(f"{field}: {what} is a {type(value).__name__}; {fix}")
    return value


def json_schema_grammar(schema, field: str, strict: bool = False, whitespace: str | None = None,
                        flexible: bool = False) -> Grammar:
    """The grammar of JSON text that validates against `schema` (a dict, or its JSON text). `strict` (OpenAI's
    json_schema.strict): an object schema that does not say otherwise takes no properties beyond its own, as
    OpenAI's strict mode requires. `whitespace`: a regular expression of the whitespace allowed between tokens;
    `flexible`: any whitespace; else compact (`COMPACT_JSON`)."""
    schema = _json_object(schema, field, "the schema", "send a JSON schema object")
    if strict:
        schema = closed_objects(schema)
    options = {"whitespace_flexible": True, "whitespace_pattern": whitespace} if whitespace else \
        FLEXIBLE_JSON if flexible else COMPACT_JSON
    try:
        return Grammar(field, llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options))
    except (ValueError, TypeError) as err:
        raise StarscreamError(f"{field}: {err}") from None


def closed_objects(schema):
    """`schema` with `additionalProperties: false` on every object schema that has `properties` and does not set
    it (nested schemas included; the input is not changed)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def json_object_grammar(field: str, flexible: bool = False) -> Grammar:
    """Any JSON object (OpenAI's response_format json_object)."""
    return json_schema_grammar({"type": "object"}, field, flexible=flexible)


def regex_grammar(pattern: str, field: str) -> Grammar:
    """Text that the regular expression matches whole (Rust's regex syntax)."""
    return Grammar(field, llguidance.LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: list[str], field: str) -> Grammar:
    """Exactly one of `choices` (strings)."""
    if not choices or not all(isinstance(choice, str) for choice in choices):
        raise StarscreamError(f"{field}: give a non-empty list of strings")
    return Grammar(field, llguidance.grammar_from("choice", json.dumps(choices)))


def lark_grammar(text: str, field: str) -> Grammar:
    """A Lark grammar (llguidance's dialect, `start` its root), or a GBNF (EBNF) one, converted to Lark."""
    try:
        return Grammar(field, llguidance.grammar_from("grammar", text))
    except ValueError as err:
        raise StarscreamError(f"{field}: {' '.join(str(err).split())}") from None


def structural_tag_grammar(spec, field: str) -> Grammar:
    """vLLM's structural tags (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, or its JSON
    text): free text in which, wherever a trigger is written, one of the structures follows whole: its `begin`
    (which starts with that trigger), JSON that validates against its `schema` (compact, `COMPACT_JSON`; no
    schema: any JSON), then its `end`; llguidance's lazy lexemes (`StructTag`) build it."""
    spec = _json_object(spec, field, "the structural tag", "send an object with structures and triggers")
    if "format" in spec:
        raise StarscreamError(f"{field}: the structural tag's \"format\" form is not supported; give structures and "
                              "triggers")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise StarscreamError(f"{field}: triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise StarscreamError(f"{field}: structures must be a non-empty list of {{begin, schema, end}} objects")
    return Grammar(field, llguidance.StructTag.to_grammar([_struct_tag(item, triggers, field)
                                                            for item in structures]))


def _struct_tag(structure, triggers: list[str], field: str) -> llguidance.StructTag:
    """One structure of a structural tag as llguidance's `StructTag`, under the first trigger its begin starts
    with."""
    schema = structure.get("schema") if isinstance(structure, dict) else None
    if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str) \
            or not isinstance(structure.get("end"), str) or not isinstance(schema, (dict, type(None))):
        raise StarscreamError(f"{field}: each structure must be {{\"begin\": text, \"schema\": {{...}}, "
                              "\"end\": text}")
    trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
    if trigger is None:
        raise StarscreamError(f"{field}: structure begin {structure['begin']!r} starts with none of the triggers")
    return llguidance.StructTag(trigger=trigger, begin=structure["begin"], end=structure["end"],
                                grammar={**(schema or {}), "x-guidance": COMPACT_JSON})


def checked(grammar: Grammar) -> Grammar:
    """`grammar`, once llguidance finds it valid (no tokenizer needed: a schema, regex or grammar error shows
    without one); StarscreamError naming its field otherwise."""
    error = llguidance.LLMatcher.validate_grammar(grammar.text)
    if error:
        raise StarscreamError(f"{grammar.field}: {_one_line(error)}")
    return grammar


def _one_line(message: str) -> str:
    """llguidance's message (several lines, with a caret under the place) on one line, at most 300 characters."""
    return " ".join(message.split())[:300] or "invalid grammar"


def grammar_tokenizer(tokenizer, vocab: int) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance reads it (its token trie, built once per engine): the tokenizer.json
    of a Hugging Face tokenizer's directory, `vocab` ids (the model's, which may exceed the tokenizer's: the
    ids beyond it are never allowed), its EOS ids ending a grammar. StarscreamError for a tokenizer without a
    tokenizer.json (the byte-level demo one) or with one llguidance cannot read (the server then serves without
    structured output, refusing a grammar by name)."""
    directory = getattr(tokenizer, "directory", None)
    path = Path(directory) / "tokenizer.json" if directory is not None else None
    if path is None or not path.is_file():
        raise StarscreamError("structured output needs a Hugging Face tokenizer (tokenizer.json); this model's "
                              "tokenizer has none")
    eos = list(getattr(tokenizer, "eos_ids", ()))
    try:
        return llguidance.LLTokenizer(path.read_text(), n_vocab=vocab, eos_token=eos or None)
    except (ValueError, RuntimeError) as err:  # a tokenizer.json llguidance cannot read (its decoder, its model)
        raise StarscreamError(f"structured output cannot read {path} ({_one_line(str(err))})") from None


class Guide:
    """One request's matcher: the grammar compiled against the model's tokenizer, advanced by each token the
    engine reads back; `finished` once the grammar takes no more tokens (it ended, or took an EOS id)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: Grammar):
        self.field = grammar.field
        try:
            self.matcher = llguidance.LLMatcher(tokenizer, grammar.text, log_level=0)
        except Exception as err:  # misuse at the API level (grammar errors leave the matcher in error instead)
            raise StarscreamError(f"{grammar.field}: {_one_line(str(err))}") from None
        if self.matcher.is_error():
            raise StarscreamError(f"{grammar.field}: {_one_line(self.matcher.get_error())}")

    def advance(self, token: int) -> bool:
        """Consumes `token`; False when the grammar did not allow it (the matcher is then in error)."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class MaskBuilder:
    """The allowed-token bits of many guides' next tokens at once, computed in parallel by llguidance's thread
    pool (it releases the interpreter lock) into one host buffer [rows, mask_words(V)] int32."""

    def __init__(self, vocab: int, threads: int | None = None):
        self.words = mask_words(vocab)
        self._executor = llguidance.LLExecutor(threads)

    def masks(self, guides: list[Guide | None], rows: int) -> np.ndarray:
        """[rows, words] int32: guide i's mask in row i (rows >= len(guides)); the rest, and rows whose guide is
        None, allow every token."""
        out = np.full((rows, self.words), -1, np.int32)
        pairs = [(guide.matcher, index) for index, guide in enumerate(guides) if guide is not None]
        if pairs:
            fill_next_token_bitmask_par(self._executor, pairs, out)
        return out
