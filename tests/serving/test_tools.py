"""Tool calls read back from each family's format (Hermes tags, Llama 3 JSON, Mistral's [TOOL_CALLS] in both of
its forms), text that holds none left as the answer, the grammars of tool_choice required / named, and a streamed
answer split into content and OpenAI's tool-call deltas."""
import json

import llguidance
import pytest

from starscream_jax.serving.guided import checked
from starscream_jax.serving.tools import (
    PARSERS,
    ToolMode,
    ToolStream,
    default_parser,
    named_grammar,
    required_grammar,
)

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}]


def _named(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_hermes_reads_each_tagged_call_and_the_text_before():
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
    content, calls = PARSERS["hermes"].parse(text)
    assert content == "Let me look.\n" and _named(calls) == [("weather", {"city": "Oslo"}), ("time", {})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    unclosed = PARSERS["hermes"].parse('<tool_call>{"name": "time", "arguments": {}}')
    assert unclosed[0] is None and _named(unclosed[1]) == [("time", {})]
    for answer in ("just text", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert PARSERS["hermes"].parse(answer) == (answer, [])


def test_llama3_json_reads_the_whole_answer_as_calls():
    content, calls = PARSERS["llama3_json"].parse(' {"name": "weather", "parameters": {"city": "Rome"}}')
    assert content is None and _named(calls) == [("weather", {"city": "Rome"})]
    content, calls = PARSERS["llama3_json"].parse(
        '<|python_tag|>{"name": "time", "parameters": {}}; {"name": "weather", "parameters": {"city": "Oslo"}}')
    assert _named(calls) == [("time", {}), ("weather", {"city": "Oslo"})]
    for answer in ("The weather is fine.", '{"name": "time", "parameters": {}} and more', '{"city": 1}'):
        assert PARSERS["llama3_json"].parse(answer) == (answer, [])


def test_mistral_reads_a_json_list_and_the_args_form():
    content, calls = PARSERS["mistral"].parse(
        'Sure.[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]')
    assert content == "Sure." and _named(calls) == [("weather", {"city": "Oslo"}), ("time", {})]
    assert all(len(call.id) == 9 and call.id.isalnum() for call in calls)  # what Mistral's templates accept back
    content, calls = PARSERS["mistral"].parse('[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]time[ARGS]{}')
    assert content is None and _named(calls) == [("weather", {"city": "Rome"}), ("time", {})]
    assert PARSERS["mistral"].parse("[TOOL_CALLS] oops") == ("[TOOL_CALLS] oops", [])


def test_the_default_parser_follows_the_model_family():
    assert [default_parser(kind) for kind in ("llama", "qwen2", "qwen3_moe", "mixtral", "gemma2", None)] == \
        ["llama3_json", "hermes", "hermes", "mistral", None, None]


def _matches(grammar, text: str) -> bool:
    """Whether llguidance's matcher takes `text` whole under `grammar` (over a byte-level view of it)."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), checked(grammar).text, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def _byte_tokenizer():
    class Bytes:
        eos_token_id, bos_token_id = 256, None
        tokens = [bytes([i]) for i in range(256)] + [b""]
        special_token_ids = [256]

        def __call__(self, text):
            return list(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def test_required_and_named_grammars_admit_calls_and_nothing_else():
    required = required_grammar(TOOLS)
    assert _matches(required, '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", '
                              '"parameters": {}}]')
    assert not _matches(required, "[]") and not _matches(required, '[{"name": "nope", "parameters": {}}]')
    assert not _matches(required_grammar(TOOLS, parallel=False),
                        '[{"name": "time", "parameters": {}}, {"name": "time", "parameters": {}}]')
    named = named_grammar(TOOLS, "weather")
    assert _matches(named, '{"city": "Oslo"}') and not _matches(named, '{"town": "Oslo"}')
    assert ToolMode("required").calls('[{"name": "time", "parameters": {}}]')[1][0].name == "time"
    assert ToolMode("named", name="weather").calls('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    assert ToolMode("named", name="weather").calls('{"city": "Os') == ('{"city": "Os', [])


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Checking <tool_call>{"name": "time", "arguments": {}}</tool_call>'),
    ("llama3_json", ' {"name": "time", "parameters": {}}'),
    ("mistral", 'Checking [TOOL_CALLS][{"name": "time", "arguments": {}}]')])
def test_an_auto_stream_sends_the_content_then_the_calls_whole(parser, text):
    """Whatever the split of the text into deltas, the content streamed is the text before the calls, as the whole
    answer's content is, and the calls come once, at the end; an answer without calls streams whole."""
    for size in (1, 3, 7):
        stream = ToolStream(ToolMode("auto", PARSERS[parser]))
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        sent = [stream.add(piece, final=index == len(pieces) - 1) for index, piece in enumerate(pieces)]
        content = "".join(part for part, _ in sent)
        deltas = [delta for _, found in sent for delta in found]
        assert content == ("Checking " if parser != "llama3_json" else "")  # (llama: its leading space is the call's)
        assert PARSERS[parser].parse(text)[0] == (content or None)
        assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [(0, "time", "{}")]
        plain = ToolStream(ToolMode("auto", PARSERS[parser]))
        words = ["It is ", "{noon}", " <tool", " now [TOOL"]
        assert "".join(plain.add(w, final=i == 3)[0] for i, w in enumerate(words)) == "".join(words)


def test_a_named_stream_sends_the_arguments_as_they_come():
    stream = ToolStream(ToolMode("named", name="weather"))
    first, second = stream.add('{"city": ', False), stream.add('"Oslo"}', True)
    assert first[0] == "" and len(first[1]) == 1  # one entry for the call a chunk: id, name, first arguments
    assert first[1][0]["index"] == 0 and first[1][0]["id"]
    assert first[1][0]["function"] == {"name": "weather", "arguments": '{"city": '}
    assert second[1] == [{"index": 0, "function": {"arguments": '"Oslo"}'}}]


def test_forced_calls_take_mistral_ids_under_the_mistral_parser():
    for parser, short in ((PARSERS["mistral"], True), (PARSERS["hermes"], False), (None, False)):
        call = ToolMode("named", parser, "weather").calls('{"city": "Oslo"}')[1][0]
        listed = ToolMode("required", parser).calls('[{"name": "time", "parameters": {}}]')[1][0]
        assert (len(call.id) == 9) == short and (len(listed.id) == 9) == short


def test_without_parallel_tool_calls_only_the_first_call_is_kept_whole_and_streamed():
    """A model may write several calls whatever the request says; parallel_tool_calls false keeps the first, as
    vLLM does, in the whole answer and in the streamed deltas."""
    text = ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    single = ToolMode("auto", PARSERS["hermes"], parallel=False)
    assert _named(single.calls(text)[1]) == [("weather", {"city": "Oslo"})]
    assert len(ToolMode("auto", PARSERS["hermes"]).calls(text)[1]) == 2
    stream = ToolStream(single)
    deltas = stream.add(text[:30], final=False)[1] + stream.add(text[30:], final=True)[1]
    assert [delta["function"]["name"] for delta in deltas] == ["weather"]
