"""The request bodies at the door: every field of vLLM's OpenAI protocol is either read or refused with a 400
naming it (a field added to this list that is neither fails here: nothing is dropped without a word), nulls read as
absent, chat content as text parts; a batch of prompts, n and best_of, and the /tokenize body."""
import json

import pytest
from pydantic import ValidationError

from starscream_jax.errors import StarscreamError
from starscream_jax.serving.requests import (
    UNSUPPORTED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    TokenizeRequest,
    generation_defaults,
)

VLLM_COMPLETION_FIELDS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "add_special_tokens", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs", "priority", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "bad_words", "prompt_embeds", "kv_transfer_params",
    "vllm_xargs", "cache_salt", "request_id")
VLLM_CHAT_FIELDS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "parallel_tool_calls", "user", "best_of",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "metadata", "store", "modalities", "audio", "prediction", "service_tier", "web_search_options", "functions",
    "function_call", "structural_tag", "return_token_ids")
BASE = {"completions": (CompletionRequest, {"model": "m", "prompt": "hi"}),
        "chat": (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})}


@pytest.mark.parametrize("route, fields", [("completions", VLLM_COMPLETION_FIELDS), ("chat", VLLM_CHAT_FIELDS)])
def test_every_vllm_field_is_read_or_refused_by_name(route, fields):
    model, base = BASE[route]
    refused_here = UNSUPPORTED
    silent = [name for name in fields if name not in model.model_fields and name not in refused_here]
    assert not silent, f"fields a vLLM client sends that {route} would drop without a word: {silent}"
    for name in fields:
        if name in refused_here:
            with pytest.raises(ApiError) as refused:
                model.model_validate({**base, name: {"asks": "for something"}})
            assert refused.value.param == name and refused.value.status == 400 and name in refused.value.message
            for neutral in refused_here[name]:
                model.model_validate({**base, name: neutral})  # its default asks for nothing: accepted


def test_nulls_read_as_absent_and_neutral_values_of_unbuilt_fields_pass():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "temperature": None, "stop": None,
                                             "length_penalty": 1.0, "best_of": None, "max_tokens": None})
    assert body.temperature == 1.0 and body.stop is None and body.max_tokens is None
    with pytest.raises(ApiError, match="length_penalty"):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "length_penalty": 0.5})


def test_sampling_fields_are_read_and_bad_values_name_their_field():
    body = ChatRequest.model_validate({**BASE["chat"][1], "presence_penalty": 0.5, "frequency_penalty": -1,
                                       "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 3, "logprobs": True,
                                       "top_logprobs": 20, "logit_bias": {"12": 5, " 7": -100}})
    assert (body.presence_penalty, body.frequency_penalty, body.repetition_penalty) == (0.5, -1.0, 1.2)
    assert body.bias_pairs() == ((12, 5.0), (7, -100.0)) and body.top_logprobs == 20
    assert CompletionRequest.model_validate({**BASE["completions"][1], "logprobs": 20}).logprobs == 20
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_p", 1.5), ("min_tokens", -1), ("top_logprobs", 21)):
        with pytest.raises(ValidationError, match=field):
            ChatRequest.model_validate({**BASE["chat"][1], "logprobs": True, field: value})
    for bias, message in (({"x": 1}, "'x'"), ({"1": 101}, "101"), ({str(i): 1 for i in range(301)}, "at most 300"),
                          ({"\u00b2": 1}, "'\u00b2'"), ({"\u0663": 1}, "'\u0663'")):  # digits, not ASCII ones
        with pytest.raises(ApiError, match=message) as refused:
            ChatRequest.model_validate({**BASE["chat"][1], "logit_bias": bias})
        assert refused.value.param == "logit_bias" and refused.value.status == 400
    with pytest.raises(ApiError, match="top_logprobs needs logprobs") as refused:
        ChatRequest.model_validate({**BASE["chat"][1], "top_logprobs": 3})
    assert refused.value.param == "top_logprobs"


def test_chat_content_as_text_parts_and_a_tool_call_turn():
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]})
    turns = [message.for_template() for message in body.messages]
    assert turns[0] == {"role": "user", "content": "a\nb"}
    assert turns[1]["content"] == "" and turns[1]["tool_calls"][0]["id"] == "1"
    image = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ApiError, match="image_url"):
        image.messages[0].for_template()


def test_prompt_batches_n_best_of_and_the_tokenize_bodies():
    def prompts(prompt):
        return CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts()

    assert prompts("a") == ["a"] and prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"] and prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "a", "n": 2, "best_of": 2}).n == 2
    with pytest.raises(ApiError, match="best_of 3") as refused:
        CompletionRequest.model_validate({"model": "m", "prompt": "a", "n": 2, "best_of": 3})
    assert refused.value.param == "best_of"
    with pytest.raises(ValidationError, match="less than or equal to 16"):
        ChatRequest.model_validate({**BASE["chat"][1], "n": 17})
    assert TokenizeRequest.model_validate({"prompt": "a"}).add_special_tokens is None
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}):
        with pytest.raises(ApiError, match="either prompt or messages"):
            TokenizeRequest.model_validate(body)


def test_generation_defaults_read_the_sampling_fields_and_refuse_bad_ones(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text('{"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 5, "eos_token_id": [1, 2]}')
    assert generation_defaults(path) == {"temperature": 0.6, "top_p": 0.9}
    path.write_text('{"top_k": true}')
    with pytest.raises(StarscreamError, match="top_k True is out of range"):
        generation_defaults(path)


TAG = {"type": "structural_tag", "triggers": ["<f="],
       "structures": [{"begin": "<f=w>", "schema": {"type": "object"}, "end": "</f>"}]}


def test_structured_output_fields_give_one_grammar_named_by_its_field():
    def grammar(**fields):
        return ChatRequest.model_validate({**BASE["chat"][1], **fields}).grammar()

    assert grammar() is None and grammar(response_format={"type": "text"}) is None
    assert grammar(response_format={"type": "json_object"}).field == "response_format"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    strict = grammar(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                            "strict": True}})
    assert strict.field == "response_format" and '"additionalProperties":false' in strict.text
    assert grammar(guided_json=schema, guided_whitespace_pattern=" ?").field == "guided_json"
    assert grammar(guided_regex="a+", guided_decoding_backend="guidance").field == "guided_regex"
    assert grammar(structured_outputs={"choice": ["a", "b"]}).field == "structured_outputs"
    assert CompletionRequest.model_validate({**BASE["completions"][1], "guided_choice": ["a"]}).grammar()
    tag = grammar(response_format=TAG)
    assert tag.field == "response_format" and '"<f=w>"' not in tag.text and '"w>" %json' in tag.text
    spec = json.dumps({key: value for key, value in TAG.items() if key != "type"})
    assert grammar(structured_outputs={"structural_tag": spec}).text == grammar(structural_tag=spec).text == tag.text
    for fields, param, message in (
            ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "each ask for structured output"),
            ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
            ({"response_format": {"type": "structural_tag"}}, "response_format", "triggers must be"),
            ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format", "format"),
            ({"response_format": {**TAG, "triggers": ["<g"]}}, "response_format", "none of the triggers"),
            ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs", "not JSON"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format",
             "json_schema must be"),
            ({"structured_outputs": {"regex": "a", "structural_tag": {}}}, "structured_outputs", "structural_tag"),
            ({"guided_choice": []}, "guided_choice", "non-empty list")):
        with pytest.raises(ApiError, match=message) as refused:
            grammar(**fields)
        assert refused.value.param == param and refused.value.status == 400


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}}]


def test_tool_choice_gives_a_mode_and_a_grammar_or_names_what_is_wrong():
    def chat(**fields):
        return ChatRequest.model_validate({**BASE["chat"][1], **fields})

    assert chat().tool_mode("hermes") is None and chat(tools=TOOLS, tool_choice="none").tool_mode(None) is None
    assert chat(tools=TOOLS).tool_mode("hermes").kind == "auto" and chat(tools=TOOLS).grammar() is None
    required = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.tool_mode(None).kind == "required" and '"maxItems":1' in required.grammar().text
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert named.tool_mode(None).name == "weather" and named.grammar().field == "tool_choice"
    for fields, parser, message in (
            ({"tools": TOOLS}, None, "needs a tool-call parser"),
            ({"tool_choice": "required"}, "hermes", "needs tools"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "hermes",
             "'x', which tools does not hold"),
            ({"tools": TOOLS, "tool_choice": "sometimes"}, "hermes", "is not one of"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "weather"}}, "hermes", "is not one of"),
            ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "hermes", "cannot also follow")):
        with pytest.raises(ApiError, match=message) as refused:
            request = chat(**fields)
            request.tool_mode(parser)
            request.grammar()
        assert refused.value.param == "tool_choice"
    with pytest.raises(ApiError, match="each tool must be") as refused:
        chat(tools=[{"type": "function", "function": {"description": "no name"}}])
    assert refused.value.param == "tools"


def test_a_tool_call_turn_reaches_the_template_with_its_arguments_read():
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    turns = [message.for_template() for message in body.messages]
    assert turns[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert turns[1] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_the_deprecated_function_fields_point_to_tools():
    for name, instead in (("functions", "send tools instead"), ("function_call", "send tool_choice instead")):
        with pytest.raises(ApiError, match=instead) as refused:
            ChatRequest.model_validate({**BASE["chat"][1], name: [{"name": "f"}]})
        assert refused.value.param == name


def test_echo_and_prompt_logprobs_are_read_and_max_tokens_0_only_with_echo_on_completions():
    assert CompletionRequest.model_validate({**BASE["completions"][1], "echo": True}).echo
    lm_eval = CompletionRequest.model_validate({**BASE["completions"][1], "echo": True, "max_tokens": 0,
                                                "logprobs": 1, "temperature": 0})
    assert (lm_eval.echo, lm_eval.max_tokens, lm_eval.logprobs) == (True, 0, 1)
    for model, base in BASE.values():
        assert model.model_validate({**base, "prompt_logprobs": 20}).prompt_logprobs == 20
        for bad in (-1, 21, 1.5, "2", True):
            with pytest.raises(ValidationError, match="prompt_logprobs"):
                model.model_validate({**base, "prompt_logprobs": bad})
        with pytest.raises(ApiError, match="max_tokens 0") as refused:
            model.model_validate({**base, "max_tokens": 0})
        assert refused.value.param == "max_tokens"
    _refused(ChatRequest, {**BASE["chat"][1], "echo": True, "max_tokens": 0}, "max_tokens")


def test_chat_echo_begins_the_answer_with_the_last_message_where_its_role_is_the_answers():
    """As vLLM's: with a generation prompt the answer is the assistant's, so only an assistant's last message is
    echoed; without one (a continued message) the last message is, whatever its role; without echo nothing."""
    def echoed(messages, **fields):
        body = ChatRequest.model_validate({"messages": messages, **fields})
        return body.echoed(body.template_options())

    user, assistant = {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text",
                                                                                          "text": "Sure"}]}
    assert echoed([user, assistant], echo=True) == "Sure" and echoed([user], echo=True) == ""
    assert echoed([user], echo=True, add_generation_prompt=False) == "hi"
    assert echoed([user, assistant], echo=True, continue_final_message=True, add_generation_prompt=False) == "Sure"
    assert echoed([user, assistant]) == ""


def _refused(model, body: dict, field: str):
    """The ApiError `body` meets, which must be a 400 naming `field` (or fail the test)."""
    with pytest.raises(ApiError) as refused:
        model.model_validate(body)
    assert refused.value.status == 400 and refused.value.param == field, refused.value.message
    return refused.value


def test_template_options_read_the_template_fields_as_vllm_does():
    chat = BASE["chat"][1]
    plain = ChatRequest.model_validate(chat).template_options()
    assert (plain.template, plain.variables, plain.add_generation_prompt, plain.continue_final) == (None, {}, True,
                                                                                                  False)
    given = ChatRequest.model_validate({**chat, "chat_template": "{{ x }}", "add_generation_prompt": False,
                                        "continue_final_message": True,
                                        "chat_template_kwargs": {"enable_thinking": False}}).template_options()
    assert (given.template, given.variables, given.continue_final) == ("{{ x }}", {"enable_thinking": False}, True)
    # chat_template_kwargs override the fields of the same names, as vLLM merges them
    overridden = ChatRequest.model_validate({**chat, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert not overridden.template_options().add_generation_prompt
    for body in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        with pytest.raises(ApiError, match="add_generation_prompt") as refused:
            ChatRequest.model_validate({**chat, **body}).template_options()
        assert refused.value.param == "continue_final_message"
    for reserved in ("chat_template", "tokenize", "messages"):
        with pytest.raises(ApiError, match=reserved) as refused:
            ChatRequest.model_validate({**chat, "chat_template_kwargs": {reserved: 1}}).template_options()
        assert refused.value.param == "chat_template_kwargs"
    tokenize = TokenizeRequest.model_validate({"messages": chat["messages"], "continue_final_message": True,
                                               "add_generation_prompt": False})
    assert tokenize.template_options().continue_final
    with pytest.raises(ValidationError, match="chat_template_kwargs"):
        ChatRequest.model_validate({**chat, "chat_template_kwargs": "enable_thinking"})


def test_allowed_token_ids_bad_words_and_special_token_fields():
    body = CompletionRequest.model_validate({**BASE["completions"][1], "allowed_token_ids": [3, 5],
                                             "bad_words": ["ab", " c"], "skip_special_tokens": False,
                                             "spaces_between_special_tokens": False})
    assert body.allowed_token_ids == [3, 5] and not body.skip_special_tokens
    # each word alone, and after a space where that gives as many tokens beginning with another
    encode = {"ab": [1, 2], " ab": [9, 2], "c": [4], " c": [4, 4]}.__getitem__
    assert body.bad_word_ids(encode) == ((1, 2), (9, 2), (4,))
    _refused(CompletionRequest, {**BASE["completions"][1], "allowed_token_ids": []}, "allowed_token_ids")
    for words, message in ((["a" * 9], "9 tokens"), ([""], "0 tokens"), (["a"] * 129, "at most 128")):
        body = CompletionRequest.model_validate({**BASE["completions"][1], "bad_words": words})
        with pytest.raises(ApiError, match=message) as refused:
            body.bad_word_ids(lambda text: [ord(character) for character in text.strip()])
        assert refused.value.param == "bad_words"
    for field, value in (("allowed_token_ids", ["x"]), ("bad_words", "word"), ("skip_special_tokens", "maybe")):
        with pytest.raises(ValidationError, match=field):
            CompletionRequest.model_validate({**BASE["completions"][1], field: value})


def test_model_is_optional_seeds_take_any_64_bit_integer_and_stream_options_need_a_stream():
    """As vLLM reads them: a body without a model is the served model's; a seed of any 64-bit integer is taken (the
    engine folds it into its range: `scheduler.engine_seed`); stream_options without stream is a 400."""
    body = CompletionRequest.model_validate({"prompt": "hi"})
    assert body.model is None and body.seed is None
    for seed in (0, 2 ** 31, 2 ** 63 - 1, -2 ** 63):
        assert CompletionRequest.model_validate({"prompt": "hi", "seed": seed}).seed == seed
    for seed in (2 ** 63, -2 ** 63 - 1):
        with pytest.raises(ValidationError, match="seed"):
            CompletionRequest.model_validate({"prompt": "hi", "seed": seed})
    streamed = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}}
    assert CompletionRequest.model_validate(streamed).stream_options.continuous_usage_stats
    with pytest.raises(ApiError, match="stream_options applies to streamed") as refused:
        CompletionRequest.model_validate({**streamed, "stream": False})
    assert refused.value.param == "stream_options" and refused.value.status == 400


def test_tokenize_takes_tools_and_text_a_tokenizer_cannot_encode_is_a_400_naming_its_field():
    """/tokenize reads chat's tools (a bad one named), as vLLM's renders them into the template; a bad word the
    tokenizer refuses (a lone surrogate) and a request_id that could not be sent back as JSON are 400s naming them;
    without parallel_tool_calls the tool mode keeps one call."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert TokenizeRequest.model_validate({"messages": BASE["chat"][1]["messages"], "tools": tools}).tools == tools
    _refused(TokenizeRequest, {"messages": BASE["chat"][1]["messages"], "tools": [{"type": "web"}]}, "tools")

    def encode(text):
        raise StarscreamError("text to encode is not valid Unicode; give text whose characters are whole")

    body = CompletionRequest.model_validate({**BASE["completions"][1], "bad_words": ["\ud800"]})
    with pytest.raises(ApiError, match="not valid Unicode") as refused:
        body.bad_word_ids(encode)
    assert refused.value.param == "bad_words" and refused.value.status == 400
    _refused(CompletionRequest, {**BASE["completions"][1], "request_id": "id-\ud800"}, "request_id")
    assert CompletionRequest.model_validate({**BASE["completions"][1], "request_id": "id-1"}).request_id == "id-1"
    single = ChatRequest.model_validate({**BASE["chat"][1], "tools": tools, "parallel_tool_calls": False})
    assert not single.tool_mode("hermes").parallel and ChatRequest.model_validate(
        {**BASE["chat"][1], "tools": tools}).tool_mode("hermes").parallel
