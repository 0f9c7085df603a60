"""The HTTP server on a real uvicorn on a localhost port, over the tiny Hugging Face checkpoint's engine on a
simulated (1, 2, 4) mesh (conftest.py), its loop on a thread behind the same sockets and messages as the engine
process: the official `openai` client (completions, chat, streaming, logprobs, a batch of prompts and n choices
each), OpenAI-style errors, /health, /ping, /version, /models, /metrics, /tokenize and /detokenize, a bounded
load of concurrent clients (some cancelled midway, some refused with 429) after which every page is free, and a
shutdown that lets the running stream finish. Without an engine: the API key, CORS, the generation config's
sampling defaults and the stats line."""
import asyncio
import importlib.metadata
import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from starlette.testclient import TestClient

from starscream_jax.serving.client import EngineClient
from starscream_jax.serving.core import EngineThread
from starscream_jax.serving.protocol import EngineInfo, EngineStats
from starscream_jax.serving.requests import CompletionRequest
from starscream_jax.serving.server import Server

MODEL = "tiny-llama"
MAX_PENDING = 12


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served(engine_for, llama_tokenizer):
    """(base URL, Server, uvicorn.Server) of a server on a thread over the (1, 2, 4) engine of conftest.py."""
    yield from _serving(engine_for("1x2x4"), llama_tokenizer)


@pytest.fixture(scope="module")
def scoring_client(engine_for, llama_tokenizer):
    """An `openai` client of a server over conftest's (1, 2, 4) engine that computes prompt log-probabilities (as
    `--enable-prompt-logprobs` starts one)."""
    for url, _, _ in _serving(engine_for("1x2x4-logprobs"), llama_tokenizer):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _serving(engine, llama_tokenizer):
    """Yields (base URL, Server, uvicorn.Server) of a server on a thread over `engine`, then stops it."""
    loop = EngineThread(engine)
    server = Server(EngineClient(loop.addresses, loop.alive), llama_tokenizer, MODEL, engine.info(),
                    max_pending=MAX_PENDING, trust_request_chat_template=True)
    server.engine_loop, server.engine = loop, engine
    port = _free_port()
    http = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", server, http
    http.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def _wait_idle(server, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.client.load
        if server.client.pending == 0 and stats is not None and stats.running == stats.waiting == 0:
            return server.engine.stats()
        time.sleep(0.05)
    raise AssertionError("the engine did not become idle")


def test_completions_whole_and_streamed_agree(client, served):
    whole = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0, logprobs=1)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and whole.usage.completion_tokens >= 1
    assert len(choice.logprobs.token_logprobs) == whole.usage.completion_tokens
    assert all(value <= 0 for value in choice.logprobs.token_logprobs)
    streamed = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
    assert _wait_idle(served[1]).pages_used == 0


def test_echo_returns_the_prompt_before_the_completion(client, llama_tokenizer):
    """As given for a text prompt, decoded for token ids; whole and streamed alike; with logprobs a 400."""
    sampling = {"model": MODEL, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(prompt="hello world", **sampling).choices[0].text
    echoed = client.completions.create(prompt="hello world", echo=True, **sampling).choices[0].text
    assert echoed == "hello world" + plain
    streamed = client.completions.create(prompt="hello world", echo=True, stream=True, **sampling)
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed
    ids = [int(token) for token in llama_tokenizer.encode("hello world", False)]
    by_ids = client.completions.create(prompt=ids, echo=True, **sampling).choices[0].text
    assert by_ids.startswith(llama_tokenizer.decode(ids))
    for asks, field in (({"echo": True, "logprobs": 1}, "echo"), ({"extra_body": {"prompt_logprobs": 1}},
                                                                   "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError, match="--enable-prompt-logprobs") as refused:
            client.completions.create(prompt="hello world", **{**sampling, **asks})  # (this server computes none)
        assert refused.value.body["param"] == field


def test_loglikelihood_as_lm_eval_asks_and_prompt_logprobs(scoring_client, llama_tokenizer, unsharded_llama):
    """lm-eval's local-completions loglikelihood request (echo, max_tokens 0, logprobs 1, temperature 0) of a
    prompt longer than a prefill chunk: its logprobs cover the prompt alone, the first token's null, the others the
    unsharded model's log_softmax (and each top-1 tells whether the token is greedy, as lm-eval reads it); streamed
    alike in the first chunk; vLLM's prompt_logprobs on completions and chat; bad values are a 400 naming it."""
    ids = [int(token) for token in llama_tokenizer.encode("the quick brown fox jumps over the lazy dog", False)]
    assert len(ids) > 8  # conftest's chunk
    logits = np.asarray(unsharded_llama(np.asarray([ids], np.int32)).logits[0], np.float64)
    reference = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = [None] + reference[np.arange(len(ids) - 1), ids[1:]].tolist()
    asked = dict(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0)
    whole = scoring_client.completions.create(**asked)
    choice, logprobs = whole.choices[0], whole.choices[0].logprobs
    assert choice.text == llama_tokenizer.decode(ids) and whole.usage.completion_tokens == 0
    assert logprobs.tokens == [llama_tokenizer.decode([token]) for token in ids] and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[0] is None and logprobs.text_offset[0] == 0
    np.testing.assert_allclose(logprobs.token_logprobs[1:], want[1:], atol=2e-4)
    greedy = [max(top, key=top.get) == text for top, text in zip(logprobs.top_logprobs[1:], logprobs.tokens[1:])]
    assert greedy == [int(row.argmax()) == token for row, token in zip(reference, ids[1:])]
    streamed = list(scoring_client.completions.create(**asked, stream=True))
    assert streamed[0].choices[0].logprobs.token_logprobs == logprobs.token_logprobs
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
    scored = scoring_client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                               extra_body={"prompt_logprobs": 2}).choices[0]
    entries = scored.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and 2 <= len(entries[1]) <= 3
    np.testing.assert_allclose([entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:])],
                               want[1:], atol=2e-4)
    assert all(entry[str(token)]["rank"] >= 1 for entry, token in zip(entries[1:], ids[1:]))
    chat = scoring_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1
    for bad in (-1, 21, 1.5, "2", True):
        with pytest.raises(openai.BadRequestError) as refused:
            scoring_client.completions.create(model=MODEL, prompt=ids, extra_body={"prompt_logprobs": bad})
        assert refused.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as refused:
        scoring_client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_token_ids_truncation_and_ids_as_logprob_tokens(client, llama_tokenizer):
    """return_token_ids gives a choice's generated ids (which decode to its text) and its prompt's, whole and
    streamed, on both routes; truncate_prompt_tokens keeps the prompt's last tokens (0 is a 400); with
    return_tokens_as_token_ids the logprobs name ids."""
    sampling = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    ids = [int(token) for token in llama_tokenizer.encode("hello world again and again", False)]
    whole = client.completions.create(prompt=ids, **sampling, extra_body={"return_token_ids": True}).choices[0]
    assert whole.prompt_token_ids == ids and llama_tokenizer.decode(whole.token_ids) == whole.text
    chunks = list(client.completions.create(prompt=ids, stream=True, **sampling,
                                            extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert [i for chunk in chunks for i in getattr(chunk.choices[0], "token_ids", [])] == whole.token_ids
    cut = client.completions.create(prompt=ids, **sampling,
                                    extra_body={"return_token_ids": True, "truncate_prompt_tokens": 2})
    assert cut.choices[0].prompt_token_ids == ids[-2:] and cut.usage.prompt_tokens == 2
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **sampling,
                                          extra_body={"return_token_ids": True})
    answer = chat.choices[0]
    assert chat.prompt_token_ids and llama_tokenizer.decode(answer.token_ids) == answer.message.content
    named = client.completions.create(prompt=ids, logprobs=1, **sampling,
                                      extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert named.logprobs.tokens == [f"token_id:{i}" for i in whole.token_ids]
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens 0"):
        client.completions.create(prompt=ids, **sampling, extra_body={"truncate_prompt_tokens": 0})


def test_a_stop_string_ends_the_text_before_it(client):
    free = client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), f"no stop string to take from {free!r}"
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0,
                                             stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(response) if stream else [response]
        text = "".join(chunk.choices[0].text for chunk in chunks)
        assert text == free[:free.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].stop_reason == stop


def test_a_stop_string_ends_the_token_ids_and_usage_at_the_token_that_completes_it(client, llama_tokenizer):
    """However many steps' tokens reach the HTTP process at once, the choice's token ids end at the token whose
    text completes the stop string, and usage counts those (as vLLM's one token a step ends them)."""
    sampling = {"model": MODEL, "prompt": "hello world", "max_tokens": 12, "temperature": 0,
                "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    free = client.completions.create(**sampling).choices[0].token_ids
    texts = [llama_tokenizer.decode(free[:end]) for end in range(len(free) + 1)]
    end = next(end for end in range(2, len(free)) if texts[end] != texts[end - 1] and texts[end - 1].strip())
    stop = texts[end][len(texts[end - 1]) - 1:]  # the last character before token `end` and its text
    done = next(n for n in range(1, len(free) + 1) if stop in texts[n])
    for _ in range(3):
        answer = client.completions.create(**sampling, stop=[stop])
        assert answer.choices[0].token_ids == free[:done] and answer.usage.completion_tokens == done



def test_a_stop_string_ends_its_choice_in_the_engine_while_the_others_run(client, served):
    """A choice ended by a stop string is cancelled in the engine at once, not when the response's last choice
    ends: the engine generates its tokens up to the stop and the other choice's, not two whole choices."""
    sampling = {"model": MODEL, "max_tokens": 30, "temperature": 0, "extra_body": {"ignore_eos": True}}
    texts = [client.completions.create(prompt=prompt, **sampling).choices[0].text for prompt in ("hello world", "x")]
    stop = next(texts[0][i:i + 2] for i in range(len(texts[0])) if texts[0][i:i + 2].strip()
                and texts[0][i:i + 2] not in texts[1])
    before = _wait_idle(served[1]).generated_tokens
    both = client.completions.create(prompt=["hello world", "x"], stop=[stop], **sampling)
    assert both.choices[0].finish_reason == "stop" and both.choices[1].finish_reason == "length"
    assert _wait_idle(served[1]).generated_tokens - before < 2 * 30 - 10

def test_chat_uses_the_template_and_streams(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, seed=1)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")



def test_chat_echo_begins_the_answer_with_the_continued_message_whole_and_streamed(client):
    """vLLM's chat echo: the continued final message's text, then what the model wrote after it, in the whole
    answer and in the chunks after the role's."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    sampling = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0,
                "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
    plain = client.chat.completions.create(**sampling).choices[0].message.content
    echoed = client.chat.completions.create(**{**sampling, "extra_body": {**sampling["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == "Sure" + plain
    chunks = list(client.chat.completions.create(**{**sampling, "extra_body": {**sampling["extra_body"],
                                                                               "echo": True}}, stream=True))
    assert chunks[1].choices[0].delta.content == "Sure"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Sure" + plain

def test_top_logprobs_penalties_and_logit_bias_through_the_openai_client(client, served, llama_tokenizer):
    """Chat's top_logprobs and completions' logprobs N come back in OpenAI's shapes (greedy: the chosen token is
    the likeliest); a repetition penalty changes the greedy text (the random checkpoint repeats its last token);
    a logit bias of 100 forces a token; a bias outside the vocabulary is a 400 naming logit_bias."""
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    assert content and all(len(entry.top_logprobs) == 5 for entry in content)
    for entry in content:
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].token == entry.token
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=5, stream=True)
    streamed_top = [[top.logprob for top in entry.top_logprobs] for chunk in streamed if chunk.choices
                    and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert streamed_top == [[top.logprob for top in entry.top_logprobs] for entry in content]
    sampling = {"model": MODEL, "prompt": "hello world", "max_tokens": 6, "temperature": 0,
                "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(logprobs=3, **sampling).choices[0]
    assert len(whole.logprobs.top_logprobs) == len(whole.logprobs.tokens) == 6
    for top, token, value in zip(whole.logprobs.top_logprobs, whole.logprobs.tokens,
                                 whole.logprobs.token_logprobs):
        assert 1 <= len(top) <= 4 and top[token] == pytest.approx(value) and max(top.values()) == pytest.approx(value)
    penalized = client.completions.create(**{**sampling, "extra_body": {"ignore_eos": True,
                                                                        "repetition_penalty": 1.8}}).choices[0]
    assert penalized.text != whole.text
    forced = llama_tokenizer.encode("world", False).tolist()[-1]
    biased = client.completions.create(**sampling, logit_bias={str(forced): 100}, logprobs=0).choices[0]
    assert biased.logprobs.tokens == [llama_tokenizer.decode([forced])] * 6
    stopping = {**sampling, "logit_bias": {str(forced): 100}, "logprobs": 0}
    stopped = client.completions.create(**{**stopping, "extra_body": {"stop_token_ids": [forced],
                                                                       "return_token_ids": True}})
    choice = stopped.choices[0]  # the forced token stops it at once: counted and scored, its text left out
    assert choice.finish_reason == "stop" and choice.stop_reason == forced and choice.text == ""
    assert choice.token_ids == [forced] and len(choice.logprobs.tokens) == stopped.usage.completion_tokens == 1
    shown = client.completions.create(**{**stopping, "extra_body": {"stop_token_ids": [forced],
                                                                     "include_stop_str_in_output": True}})
    assert shown.choices[0].text == llama_tokenizer.decode([forced])
    held = client.completions.create(**{**stopping, "extra_body": {"stop_token_ids": [forced], "min_tokens": 3}})
    held = held.choices[0]  # the stop id masked for 3 tokens, then forced
    assert held.finish_reason == "stop" and len(held.logprobs.tokens) == 4
    eos = llama_tokenizer.eos_ids[0]  # an EOS id among the stop ids stops as EOS (no stop_reason), as vLLM's does
    ending = {**sampling, "logit_bias": {str(eos): 100}}
    for ignore_eos, reason in ((False, None), (True, eos)):
        ended = client.completions.create(**{**ending, "extra_body": {"stop_token_ids": [eos],
                                                                      "ignore_eos": ignore_eos}}).choices[0]
        assert ended.finish_reason == "stop" and ended.stop_reason == reason
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(**sampling, logit_bias={"100000": 1})
    assert _wait_idle(served[1]).pages_used == 0


def test_special_tokens_allowed_ids_bad_words_and_a_request_template(client, served, llama_tokenizer):
    """skip_special_tokens false shows a special token's text (a bias of 100 forces <s>), one space apart from the
    text beside it unless spaces_between_special_tokens is false; true leaves it out; allowed_token_ids hold every
    generated token to the list; a bad word's token never comes; a request's chat_template renders the prompt with
    its chat_template_kwargs; bad values are 400s naming the field."""
    sampling = {"model": MODEL, "prompt": "hello world", "max_tokens": 4, "temperature": 0, "logit_bias": {"0": 100}}
    skipped = client.completions.create(**sampling).choices[0]
    kept = client.completions.create(**sampling, extra_body={"skip_special_tokens": False}).choices[0]
    joined = client.completions.create(**sampling, extra_body={"skip_special_tokens": False,
                                                                "spaces_between_special_tokens": False}).choices[0]
    special = llama_tokenizer.decode([0], skip_special_tokens=False)
    assert skipped.text == "" and joined.text == special * 4 and kept.text == f" {special}" * 4
    plain = {"model": MODEL, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
    greedy = client.completions.create(**plain, extra_body={"return_token_ids": True}).choices[0].token_ids
    allowed = [token for token in (40, 41, 42) if token not in greedy]
    held = client.completions.create(**plain, extra_body={"return_token_ids": True, "allowed_token_ids": allowed})
    assert held.choices[0].token_ids and set(held.choices[0].token_ids) <= set(allowed)
    word = llama_tokenizer.decode([greedy[0]])
    banned = client.completions.create(**plain, extra_body={"return_token_ids": True, "bad_words": [word]})
    assert greedy[0] not in banned.choices[0].token_ids
    template = "{{ greeting }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"chat_template": template, "return_token_ids": True,
                                                      "chat_template_kwargs": {"greeting": "howdy"}})
    assert chat.model_extra["prompt_token_ids"] == llama_tokenizer.encode("howdy|hi", False).tolist()
    for body, field in (({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),
                        ({"chat_template": "{% if %}"}, "chat_template"),
                        ({"continue_final_message": True}, "continue_final_message")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body=body)
        assert refused.value.body["param"] == field
    assert _wait_idle(served[1]).pages_used == 0


def test_cache_salt_shares_prefix_pages_only_with_the_same_salt(client, served):
    """A prompt's two full pages are found again under its salt, never under another salt or none; an empty salt
    is a 400 naming cache_salt."""
    prompt = list(range(70, 79))

    def hits_after(salt):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        return _wait_idle(served[1]).prefix_hit_pages

    start = hits_after("tenant-a")
    assert hits_after("tenant-b") == hits_after(None) == start
    assert hits_after("tenant-a") == start + 2
    with pytest.raises(openai.BadRequestError) as refused:
        hits_after("")
    assert refused.value.body["param"] == "cache_salt"


def test_bad_requests_get_openai_errors(client, served):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="word " * 80, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    for body in ({"logit_bias": {"\u00b2": 1}}, {"stream_options": {"include_usage": True}},
                 {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                  "tool_choice": {"type": "function", "function": "w"}}):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = httpx.post(served[0] + route, json={"model": MODEL, "prompt": "x", "max_tokens": 2, **body},
                              timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(body.keys() - {
            "messages", "tools"})), response.text
    response = httpx.post(served[0] + "/v1/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_a_body_without_a_model_continuous_usage_and_chat_logprob_bytes(client, served):
    """As vLLM serves them: a body without `model` is the served model's; stream_options continuous_usage_stats
    puts the usage so far in every chunk; chat logprobs give each token's UTF-8 bytes."""
    answer = httpx.post(served[0] + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30).json()
    assert answer["model"] == MODEL and answer["usage"]["completion_tokens"] >= 1
    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and all(chunk.usage for chunk in chunks)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert all(bytes(top.bytes).decode("utf-8", "replace") == top.token for top in entry.top_logprobs)


def test_health_models_and_metrics(client, served):
    assert httpx.get(served[0] + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL] and models[0].created > 1.7e9
    text = httpx.get(served[0] + "/metrics").text
    for series in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                   "vllm:request_queue_time_seconds_bucket", 'starscream:programs_compiled{model_name="tiny-llama",'
                   'when="serving"} 0.0'):
        assert series in text, series
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text


def _texts(chunks) -> dict[int, str]:
    """Each choice's text, joined from interleaved stream chunks."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.text or "")
    return texts


def test_a_batch_of_prompts_with_n_choices_each(client, served):
    """Choice p * n + i is prompt p's i-th, seeded seed + i; usage counts each prompt once and every choice's
    tokens; the stream interleaves the choices' chunks and ends in one usage chunk and one [DONE]."""
    sampling = {"model": MODEL, "max_tokens": 5, "temperature": 0.9, "seed": 7, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=["hello world", "abc"], n=2, **sampling)
    assert [choice.index for choice in whole.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(prompt=prompt, **{**sampling, "seed": seed}).choices[0].text
             for prompt in ("hello world", "abc") for seed in (7, 8)]
    assert [choice.text for choice in whole.choices] == alone
    prompt_tokens = sum(len(httpx.post(served[0] + "/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"])
                        for text in ("hello world", "abc"))
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.completion_tokens == 20
    chunks = list(client.completions.create(prompt=["hello world", "abc"], n=2, stream=True,
                                            stream_options={"include_usage": True}, **sampling))
    assert _texts(chunks) == {index: text for index, text in enumerate(alone)}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    ids = httpx.post(served[0] + "/tokenize", json={"prompt": "abc"}).json()["tokens"]
    by_ids = client.completions.create(prompt=[ids, ids], **{**sampling, "seed": 8})
    assert [choice.text for choice in by_ids.choices] == [alone[3], alone[3]]
    with httpx.stream("POST", served[0] + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "abc", "n": 3, "max_tokens": 3, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines.count("data: [DONE]") == 1 and lines[-1] == "data: [DONE]"
    assert _wait_idle(served[1]).pages_used == 0


def test_chat_with_n_choices_and_n_bounds(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, n=2)
    assert [choice.index for choice in whole.choices] == [0, 1]
    assert whole.choices[0].message.content == whole.choices[1].message.content  # greedy: alike
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, n=2,
                                                 stream=True))
    for index in (0, 1):
        mine = [chunk.choices[0] for chunk in chunks if chunk.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason in ("stop", "length")
        assert "".join(choice.delta.content or "" for choice in mine) == whole.choices[index].message.content
    with pytest.raises(openai.BadRequestError, match="n:") as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=17)
    assert refused.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=2)
    assert len(client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=2, n=2).choices) == 2
    with pytest.raises(openai.BadRequestError, match="more than the 12 this server queues"):  # never fits: a 400,
        client.completions.create(model=MODEL, prompt=["x"] * (MAX_PENDING // 2 + 1), max_tokens=2, n=2)  # not 429


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"]}
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"c": {"enum": ["O", "R"]}, "d": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["c", "d"]}, "strict": True}},
         {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {}}}}]
"""Short names: the test engine's context is 64 tokens, and its tokenizer spends about one token a character."""


def test_structured_output_through_the_openai_client(client):
    """A json_schema (strict) answer parses and validates whatever the seed, whole and streamed; a regex and a
    choice are obeyed on completions; a bad schema, regex or grammar is a 400 naming its field."""
    messages = [{"role": "user", "content": "hi"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0,
                                                seed=seed, response_format=response_format).choices[0]
        value = json.loads(answer.message.content)
        assert answer.finish_reason == "stop" and set(value) == {"ok", "color"} and value["color"] in ("red", "green")
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=0,
                                            response_format=response_format, stream=True)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks)) == json.loads(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=0,
                                       response_format=response_format).choices[0].message.content)
    regex = client.completions.create(model=MODEL, prompt="hello", max_tokens=20, temperature=1.0, seed=1,
                                      extra_body={"guided_regex": r"[0-9]{3}-(ab|cd)"}).choices[0]
    assert re.fullmatch(r"[0-9]{3}-(ab|cd)", regex.text) and regex.finish_reason == "stop"
    choice = client.completions.create(model=MODEL, prompt="hello", max_tokens=20, temperature=1.0, seed=2,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert choice.choices[0].text in ("left", "right")
    for extra, param in (({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
            ({"guided_regex": "a(b"}, "guided_regex"), ({"guided_grammar": "start: nothing_here"}, "guided_grammar")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, extra_body=extra)
        assert refused.value.body["param"] == param and param in refused.value.body["message"]


def test_a_structural_tag_makes_each_trigger_a_whole_structure(client, llama_tokenizer):
    """A bias forces the trigger "@" wherever the text is free; the structural tag makes each one the rest of its
    begin, JSON of its schema and its end."""
    colors = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
              "additionalProperties": False}
    tag = {"type": "structural_tag", "triggers": ["@"],
           "structures": [{"begin": "@call", "schema": colors, "end": ";"}]}
    at = llama_tokenizer.encode("@", False).tolist()[0]
    text = client.completions.create(model=MODEL, prompt="hello", max_tokens=30, temperature=0,
                                     logit_bias={str(at): 100}, extra_body={"response_format": tag}).choices[0].text
    calls = text.split("@call")
    assert calls[0] == "" and len(calls) > 2, text
    for call in calls[1:-1]:
        assert call.endswith(";") and json.loads(call[:-1])["color"] in ("red", "green"), text


def test_tool_choice_required_and_named_give_parsed_calls_whole_and_streamed(client, served):
    """Named and required calls parse (a named one calls its function), whole and streamed (ids, names, then
    arguments that join into JSON), with finish_reason tool_calls; a conversation holding an assistant turn of
    tool calls and a tool turn is served; tool_choice auto needs a parser, an answer without calls is text, and a
    Hermes call (the random model made to write one by a regex) is read by the hermes parser, whole and streamed
    (the text before it as content, the call whole)."""
    turns = [{"role": "user", "content": "w"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
                 "name": "time", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "call_0", "content": "9"}]
    assert client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, tool_choice="none",
                                          max_tokens=3).choices[0].message.content is not None
    messages = turns[:1]
    named = {"type": "function", "function": {"name": "w"}}
    cases = ((named, TOOLS), ("required", TOOLS[1:]))  # (one call of t: what 40 tokens hold)
    for choice, tools in cases:
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                                max_tokens=40, temperature=1.0, seed=3,
                                                parallel_tool_calls=False).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
        calls = answer.message.tool_calls
        assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
        arguments = json.loads(calls[0].function.arguments)
        if choice is named:
            assert calls[0].function.name == "w" and set(arguments) == {"c", "d"} and 1 <= arguments["d"] <= 7
        else:
            assert calls[0].function.name == "t" and arguments == {}
    for choice, tools in cases:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                                     max_tokens=40, temperature=1.0, seed=3, stream=True,
                                                     parallel_tool_calls=False))
        deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and deltas[0].id and deltas[0].function.name
        for chunk in chunks:  # one entry for a call's index a chunk
            indices = [call.index for call in chunk.choices[0].delta.tool_calls or ()]
            assert len(indices) == len(set(indices)), chunk
        whole = {}
        for delta in deltas:
            whole[delta.index] = whole.get(delta.index, "") + (delta.function.arguments or "")
        assert all(isinstance(json.loads(arguments), dict) for arguments in whole.values())
    served[1].tool_parser = None
    with pytest.raises(openai.BadRequestError, match="needs a tool-call parser"):
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=5)
    served[1].tool_parser = "hermes"
    plain = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=5,
                                           temperature=0).choices[0]  # auto: no call in the random model's text
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")
    forced = {"guided_regex": r'o<tool_call>\{"name":"t","arguments":\{\}\}'}  # auto, the text made a Hermes call
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40,
                                            extra_body=forced).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content == "o"
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls] == [("t", "{}")]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40,
                                                 extra_body=forced, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "o"
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "t", "{}")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    served[1].tool_parser = None



def test_the_response_id_follows_x_request_id_or_request_id(client):
    """As vLLM names a response: "cmpl-" / "chatcmpl-" and the X-Request-Id header, else the body's request_id;
    two requests of one id run side by side (the engine's ids stay the server's)."""
    asked = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "extra_body": {"request_id": "job-7"}}
    assert client.completions.create(**asked).id == "cmpl-job-7"
    assert {chunk.id for chunk in client.completions.create(**asked, n=2, stream=True)} == {"cmpl-job-7"}
    assert client.completions.create(**asked, extra_headers={"X-Request-Id": "trace-1"}).id == "cmpl-trace-1"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"request_id": "job-8"})
    assert chat.id == "chatcmpl-job-8"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).id.startswith("cmpl-")


def test_tokenize_renders_the_requests_tools(served, llama_tokenizer):
    """/tokenize with messages writes the request's tools into the template, as chat does (vLLM reads them)."""
    template = "{% if tools %}{{ tools | length }}:{% endif %}{{ messages[0].content }}"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template, "tools": TOOLS}
    tokens = httpx.post(served[0] + "/tokenize", json=body).json()["tokens"]
    assert tokens == llama_tokenizer.encode("2:hi", False).tolist()

def test_tokenize_detokenize_version_ping_and_no_embeddings(served, llama_tokenizer):
    url = served[0]
    tokens = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert tokens["tokens"] == llama_tokenizer.encode("hello world").tolist()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == served[1].context
    bare = httpx.post(url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == llama_tokenizer.encode("hello world", False).tolist()
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                               "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"] > 0
    text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": llama_tokenizer.decode(tokens["tokens"])} and "hello" in text["prompt"]
    outside = httpx.post(url + "/detokenize", json={"tokens": [10 ** 9]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    other = httpx.post(url + "/tokenize", json={"model": "gpt-9", "prompt": "x"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert httpx.post(url + "/tokenize", json={"model": MODEL}).status_code == 400
    assert httpx.get(url + "/version").json() == {"version": importlib.metadata.version("starscream-jax")}
    assert httpx.get(url + "/ping").status_code == httpx.post(url + "/ping").status_code == 200
    embeddings = httpx.post(url + "/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert embeddings.status_code == 404 and "generation only" in embeddings.json()["error"]["message"]


def test_chat_templates_of_the_server_and_the_request_continue_and_kwargs_through_tokenize(llama_tokenizer):
    """The server's template replaces the tokenizer's, a request's replaces both and reads chat_template_kwargs
    (where the server trusts request templates; else it is refused);
    continue_final_message ends the prompt with the final message's text (no end-of-turn, no generation prompt);
    a template that fails names chat_template, one that drops the final message names continue_final_message."""
    http = TestClient(_offline_server(llama_tokenizer, chat_template="S:{% for m in messages %}{{ m.content }}"
                                                                     "{% endfor %}",
                                      trust_request_chat_template=True).app())
    hi = [{"role": "user", "content": "hi"}]

    def tokens(**body):
        response = http.post("/tokenize", json={"messages": hi, **body})
        return response.json()["tokens"] if response.status_code == 200 else response.json()["error"]["param"]

    assert tokens() == llama_tokenizer.encode("S:hi", False).tolist()
    assert tokens(chat_template="{{ mode }}/{{ messages[0].content }}",
                  chat_template_kwargs={"mode": "fast"}) == llama_tokenizer.encode("fast/hi", False).tolist()
    own = TestClient(_offline_server(llama_tokenizer).app())
    turns = hi + [{"role": "assistant", "content": "Hello"}]
    body = {"messages": turns, "continue_final_message": True, "add_generation_prompt": False}
    continued = own.post("/tokenize", json=body).json()["tokens"]
    text = llama_tokenizer.decode(continued, skip_special_tokens=False)
    whole = llama_tokenizer.render_chat(turns)
    assert text.endswith("Hello") and whole.startswith(text) and whole != text
    assert tokens(chat_template="{% if %}") == "chat_template"
    assert tokens(chat_template="{{ raise_exception('no') }}") == "chat_template"
    assert tokens(continue_final_message=True, add_generation_prompt=False, chat_template="x") == \
        "continue_final_message"
    untrusted = own.post("/tokenize", json={"messages": hi, "chat_template": "{{ 1 }}"})
    assert untrusted.status_code == 400 and "--trust-request-chat-template" in untrusted.json()["error"]["message"]


class _IdleClient:
    """An engine client that was never started (the routes that need no engine, and the stats line)."""

    failed, pending, load, on_step = None, 0, None, None


def _offline_server(tokenizer, programs: int = 0, **options) -> Server:
    info = EngineInfo(context=64, vocab_size=512, max_num_seqs=8, pages_total=100, page_size=4, programs=programs)
    return Server(_IdleClient(), tokenizer, MODEL, info, **options)



def test_a_body_not_read_as_json_and_a_bad_word_that_is_not_text_are_400s(llama_tokenizer):
    """curl's -d without a JSON content type (a form body) is a 400 naming the header to send; a bad word holding
    a lone surrogate is a 400 naming bad_words, not a server error."""
    http = TestClient(_offline_server(llama_tokenizer).app())
    form = http.post("/v1/completions", content=b'{"prompt": "hi"}',
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 400 and "Content-Type: application/json" in form.json()["error"]["message"]
    bad = http.post("/v1/completions", content=b'{"prompt": "hi", "bad_words": ["\\ud800"]}',
                    headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words"

def test_the_programs_compiled_at_start_are_served_before_any_step(llama_tokenizer):
    http = TestClient(_offline_server(llama_tokenizer, programs=14).app())
    assert f'starscream:programs_compiled{{model_name="{MODEL}",when="start"}} 14.0' in http.get("/metrics").text


def test_the_api_key_guards_v1_only_and_cors_answers_preflights(llama_tokenizer):
    app = _offline_server(llama_tokenizer, api_key="sesame", allowed_origins=["https://ui.example"]).app()
    http = TestClient(app)  # no lifespan: these routes need no engine
    missing = http.get("/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer sesame"}).json()["data"][0]["id"] == MODEL
    for route in ("/health", "/ping", "/version", "/metrics"):
        assert http.get(route).status_code == 200, route
    preflight = http.options("/v1/chat/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
    refused = http.get("/v1/models", headers={"Origin": "https://ui.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://ui.example"
    stranger = http.options("/v1/models", headers={"Origin": "https://evil.example",
                                                   "Access-Control-Request-Method": "GET"})
    assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers
    plain = TestClient(_offline_server(llama_tokenizer).app())
    assert plain.get("/v1/models").status_code == 200
    assert plain.options("/v1/models", headers={"Origin": "https://ui.example",
                                                "Access-Control-Request-Method": "GET"}).status_code == 405


def test_sampling_defaults_fill_only_what_a_request_leaves_out(llama_tokenizer):
    server = _offline_server(llama_tokenizer, sampling_defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    bare = CompletionRequest.model_validate({"model": MODEL, "prompt": "x"})
    params = server._params(bare, [1, 2], logprobs=False, chat=False)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    given = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "temperature": 0, "top_k": -1,
                                              "top_p": None})
    params = server._params(given, [1, 2], logprobs=False, chat=False)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 0)
    params = _offline_server(llama_tokenizer)._params(bare, [1, 2], logprobs=False, chat=False)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)


def test_the_stats_line_reads_the_step_counters_while_busy(llama_tokenizer):
    server = _offline_server(llama_tokenizer)
    assert server.stats_line(0.0) is None  # the first call starts the interval
    assert server.stats_line(5.0) is None  # no step yet
    load = dict(prefix_queried_pages=0, prefix_hit_pages=0, preemptions=0, programs=2, programs_after_start=0)
    server.client.load = EngineStats(running=3, waiting=1, pages_used=25, pages_total=100, generated_tokens=500, **load)
    server.prompt_tokens_submitted = 200
    assert server.stats_line(15.0) == ("prompt throughput: 20.0 tokens/s, generation throughput: 50.0 tokens/s, "
                                       "running: 3 reqs, waiting: 1 reqs, KV cache usage: 25.0%")
    server.client.load = EngineStats(running=0, waiting=0, pages_used=0, pages_total=100, generated_tokens=600, **load)
    assert "generation throughput: 10.0 tokens/s, running: 0 reqs" in server.stats_line(25.0)  # the last tokens
    assert server.stats_line(35.0) is None  # idle: nothing logged


async def _one_client(url, index):
    """A client's request: every third streams and hangs up after its first token; returns its status."""
    body = {"model": MODEL, "prompt": "abc " * (1 + index % 7), "max_tokens": 4 + index % 9, "temperature": 0.7,
            "seed": index, "stream": index % 3 == 0}
    async with httpx.AsyncClient(timeout=120) as http:
        if not body["stream"]:
            response = await http.post(url + "/v1/completions", json=body)
            assert response.status_code == 429 or response.json()["choices"][0]["text"] is not None
            return response.status_code
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code == 200:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # hang up midway
            return response.status_code


def test_bounded_load_answers_every_request_and_frees_every_page(served):
    url, server, _ = served

    async def load():
        return await asyncio.gather(*(_one_client(url, index) for index in range(40)))

    statuses = asyncio.run(load())
    assert set(statuses) <= {200, 429} and statuses.count(200) >= MAX_PENDING
    stats = _wait_idle(server)
    assert stats.pages_used == 0 and server.client.pending == 0


def test_shutdown_lets_the_running_stream_finish(served):
    url, server, http = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="bye", max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    http.should_exit = True  # what uvicorn's SIGTERM handler sets
    rest = list(stream)
    assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason in ("stop", "length")
    deadline = time.monotonic() + 30
    while server.engine_loop.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine_loop.alive() and server.shutting_down
