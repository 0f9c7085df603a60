"""`starscream serve`: its flags become the engine's configuration; bad input is one error line before anything
loads; run as a user runs it (its own process and its engine's, here the model-free engine) it serves the `openai`
client, refuses a taken port in one line, ends on SIGTERM, and when its engine dies fails the running streams,
answers 503 and exits with status 1; an API key, CORS, logging and a model directory's generation config reach the
server (the server itself: tests/serving/test_server.py)."""
import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from starscream_jax.cli import main as cli
from starscream_jax.cli import generate, serve
from starscream_jax.errors import StarscreamError
from starscream_jax.serving.engine import EngineConfig

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "llama"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_set_the_engine_configuration():
    """vLLM's flag names and today's aliases; --max-num-seqs is split among the cache shards."""
    config = serve.engine_config(parse("--page-size", "8", "--cache-pages", "64", "--max-seqs", "6",
                                       "--token-budget", "128", "--chunk", "32", "--kernel", "gather",
                                       "--max-model-len", "96", "--gpu-memory-utilization", "0.5",
                                       "--mixed-chunks", "0"), shards=4)
    assert config == EngineConfig(page_size=8, pages_per_shard=64, rows_per_shard=2, token_budget=128, chunk=32,
                                  kernel="gather", max_model_len=96, memory_utilization=0.5, mixed_chunks=0)
    defaults = serve.engine_config(parse(), shards=1)
    assert (defaults.pages_per_shard, defaults.rows_per_shard, defaults.token_budget, defaults.memory_utilization,
            defaults.max_model_len, defaults.mixed_chunks) == (None, 256, 2048, 0.9, None, 1)  # the CPU: no memory



def test_serve_reads_the_model_from_the_arguments_generate_reads():
    """Both commands take the model's source from `arguments.add_model_source_arguments`: the same flags, values
    and defaults."""
    dests = ("checkpoint", "model_dir", "step", "dtype", "prefill_layout", "decode_layout", "quantize",
             "quantize_scales", "kv_cache")
    for argv in ((), ("--model-dir", "m", "--dtype", "bfloat16", "--decode-layout", "gpu_tp", "--kv-cache", "int8")):
        read = []
        for command in (generate, serve):
            parser = argparse.ArgumentParser()
            command.add_arguments(parser)
            read.append({dest: getattr(parser.parse_args(argv), dest) for dest in dests})
        assert read[0] == read[1]


@pytest.mark.parametrize("argv, message", [
    (("--model-dir", "m", "--checkpoint", "runs/x"), "--model-dir contradicts --checkpoint"),
    (("--model-dir", "m", "--step", "2"), "--model-dir contradicts --step"),
])
def test_contradicting_flags_are_one_error_line(capsys, argv, message):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("starscream serve: error: ")


@pytest.mark.parametrize("argv, message", [
    (("--port", "70000"), "--port 70000: give a port number from 0 to 65535"),
    (("--kernel", "flash"), "invalid choice: 'flash'"),
    (("--page-size", "0"), "--page-size"),
    (("--gpu-memory-utilization", "1.5"), "give a fraction above 0 and at most 1"),
    (("--fake-engine", "-3"), "give a positive number of milliseconds"),
    (("--timeout-keep-alive", "0"), "give a positive number of seconds"),
    (("--served-model-name", " "), "give the name requests use for the model"),
])
def test_bad_values_are_refused_as_the_flags_are_read(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]


class ServeCommand:
    """`starscream serve --fake-engine` as a user starts it: its own process (which starts the engine's), killed
    with everything it started when the test ends."""

    def __init__(self, port: int, env: dict, *flags: str):
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "starscream_jax.cli.main", "serve", "--fake-engine",
                                         "20", "--port", str(port), "--compilation-cache", "", *flags], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)

    def healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the server never became healthy")

    def engine_pid(self) -> int:
        """The engine process: the command's child that multiprocessing spawned (not its resource tracker)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                command = (stat.parent / "cmdline").read_bytes()
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == self.process.pid and \
                        b"spawn_main" in command:
                    return int(stat.parent.name)
        raise AssertionError("no engine process")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def serve_command(cpu_child_env, free_port):
    started = []

    def start(*flags: str, port: int | None = None, env: dict | None = None) -> ServeCommand:
        started.append(ServeCommand(port or free_port(), {**cpu_child_env(1), **(env or {})}, *flags))
        return started[-1]

    yield start
    for command in started:
        command.close()


def idle_seconds_kept(url: str, limit: float) -> float:
    """Seconds the server at `url` keeps an idle kept-alive connection open after answering on it (to `limit`)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=limit)
    try:
        connection.request("GET", "/health")
        answer = connection.getresponse()
        assert answer.status == 200 and answer.read() == b'{"status":"ok"}' and not answer.will_close
        answered = time.monotonic()
        with contextlib.suppress(TimeoutError):
            assert connection.sock.recv(1) == b""  # closed by the server
        return time.monotonic() - answered
    finally:
        connection.close()


def test_the_command_serves_refuses_a_taken_port_and_ends_on_sigterm(serve_command):
    server = serve_command("--timeout-keep-alive", "1.5")
    server.healthy()
    assert 1.0 < idle_seconds_kept(server.url, limit=10.0) < 4.0  # uvicorn's default would keep it 5 s
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    chunks = list(client.completions.create(model="fake", prompt="hello", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "hellohe"
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices  # usage in its own last chunk
    assert 'vllm:time_to_first_token_seconds_count{model_name="fake"} 1.0' in httpx.get(server.url + "/metrics").text
    taken = serve_command(port=int(server.url.rsplit(":", 1)[1]))
    assert taken.process.wait(60) == 2
    output = taken.process.stdout.read()
    assert output.count("\n") == 1 and "cannot listen on" in output and "--port" in output
    engine = server.engine_pid()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == -signal.SIGTERM  # drained, then ended by the signal, as uvicorn leaves it
    assert not Path(f"/proc/{engine}").exists()  # the engine stopped before


def test_a_dead_engine_fails_the_streams_answers_503_and_ends_the_command(serve_command):
    server = serve_command()
    server.healthy()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": "fake", "prompt": "abc", "max_tokens": 2000, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(server.engine_pid(), signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"server_error"' in rest[-2] and "engine stopped" in rest[-2]
    refused = httpx.post(server.url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    assert server.process.wait(30) == 1


def test_http_flags_and_the_api_key_from_the_environment(monkeypatch, capsys):
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    defaults = parse()
    assert (defaults.api_key, defaults.allowed_origins, defaults.allowed_methods, defaults.allowed_headers,
            defaults.log_level, defaults.generation_config) == (None, [], ["*"], ["*"], "info", "auto")
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    assert parse().api_key == "from-env" and parse("--api-key", "given").api_key == "given"
    assert parse("--allowed-origins", '["https://a.example", "*"]').allowed_origins == ["https://a.example", "*"]
    assert parse("--allowed-origins", "*").allowed_origins == ["*"]
    for argv, message in ((("--allowed-origins", '{"a": 1}'), "give a JSON list of strings"),
                          (("--log-level", "loud"), "invalid choice: 'loud'")):
        with pytest.raises(SystemExit):
            cli.main(["serve", *argv])
        assert message in capsys.readouterr().err.splitlines()[-1]


def test_generation_config_gives_the_sampling_defaults(tmp_path):
    """As vLLM's --generation-config: 'auto' reads --model-dir's file (temperature, top_p, top_k; max_new_tokens
    and the rest not), a directory its own, 'vllm' none."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 99, "repetition_penalty": 1.1,
         "eos_token_id": 1}))
    read = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert serve.sampling_defaults(parse("--model-dir", str(tmp_path))) == (read, tmp_path / "generation_config.json")
    assert serve.sampling_defaults(parse("--model-dir", str(tmp_path), "--generation-config", "vllm")) == ({}, None)
    assert serve.sampling_defaults(parse("--generation-config", str(tmp_path)))[0] == read
    assert serve.sampling_defaults(parse("--model-dir", str(tmp_path / "none"))) == ({}, None)
    with pytest.raises(StarscreamError, match="not found"):
        serve.sampling_defaults(parse("--generation-config", str(tmp_path / "none")))
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(StarscreamError, match="temperature -1 is out of range"):
        serve.sampling_defaults(parse("--model-dir", str(tmp_path)))


def test_the_command_asks_for_its_key_answers_browsers_and_logs(serve_command, tmp_path):
    """A key from the environment guards /v1/ (not /health), CORS answers the allowed origin's preflight, the
    model directory's generation_config.json is announced as the defaults, and each request is an access-log
    line."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.5, "max_new_tokens": 10}')
    server = serve_command("--model-dir", str(tmp_path), "--allowed-origins", '["https://ui.example"]',
                           env={serve.API_KEY_ENV: "sesame"})
    server.healthy()
    refused = httpx.get(server.url + "/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
    assert client.completions.create(model="fake", prompt="hello", max_tokens=3).usage.completion_tokens == 3
    preflight = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://ui.example"
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(30)
    output = server.process.stdout.read()
    assert "sampling defaults from" in output and "temperature 0.5" in output and "max_new_tokens" not in output
    assert '"POST /v1/completions HTTP/1.1" 200' in output and '"GET /v1/models HTTP/1.1" 401' in output


def test_the_tool_call_parser_follows_the_model_family_unless_given():
    fixtures = FIXTURE.parent

    def parser(choice, model_dir):
        return serve.tool_call_parser(argparse.Namespace(tool_call_parser=choice, model_dir=model_dir))

    assert [parser("auto", str(fixtures / name)) for name in ("llama", "qwen3", "mixtral", "gemma2")] == \
        ["llama3_json", "hermes", "mistral", None]
    assert parser("auto", None) is None and parser("none", str(FIXTURE)) is None
    assert parser("mistral", str(FIXTURE)) == "mistral"


def test_the_chat_template_flag_reads_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    assert serve.chat_template(parse("--chat-template", str(path))) == path.read_text()
    assert serve.chat_template(parse("--chat-template", r"{{ messages[0].content }}\n")) == \
        "{{ messages[0].content }}\n"
    assert serve.chat_template(parse()) is None
    with pytest.raises(StarscreamError, match="no such file"):
        serve.chat_template(parse("--chat-template", str(tmp_path / "missing.jinja")))
    with pytest.raises(StarscreamError, match="not a Jinja template"):
        serve.chat_template(parse("--chat-template", "{% if %}"))
