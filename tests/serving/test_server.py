"""The HTTP server on a real uvicorn on a localhost port, over the tiny Hugging Face checkpoint's engine on a
simulated (1, 2, 4) mesh (conftest.py), its loop on a thread behind the same sockets and messages as the engine
process: the official `openai` client (completions, chat, streaming, logprobs), OpenAI-style errors, /health,
/models, /metrics, a bounded load of concurrent clients (some cancelled midway, some refused with 429) after which
every page is free, and a shutdown that lets the running stream finish."""
import asyncio
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from starscream_jax.serving.client import EngineClient
from starscream_jax.serving.core import EngineThread
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
    engine = engine_for("1x2x4")
    loop = EngineThread(engine)
    server = Server(EngineClient(loop.addresses, loop.alive), llama_tokenizer, MODEL, engine.info(),
                    max_pending=MAX_PENDING)
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


def test_chat_uses_the_template_and_streams(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, seed=1)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_bad_requests_get_openai_errors(client, served):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="word " * 80, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    response = httpx.post(served[0] + "/v1/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_health_models_and_metrics(client, served):
    assert httpx.get(served[0] + "/health").json() == {"status": "ok"}
    assert [model.id for model in client.models.list()] == [MODEL]
    text = httpx.get(served[0] + "/metrics").text
    for series in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                   "vllm:request_queue_time_seconds_bucket", 'starscream:programs_compiled{model_name="tiny-llama",'
                   'when="serving"} 0.0'):
        assert series in text, series
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text


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
