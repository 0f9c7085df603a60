"""The engine loop apart from HTTP, over the same sockets and messages as the engine process, with the model-free
engine (`serving.fake`): one message per step holding every running request's tokens, a refusal that reaches its
request alone, a stop that drains, and an engine that fails ending every open stream with its error."""
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from starscream_jax.serving.client import EngineClient
from starscream_jax.serving.core import EngineThread
from starscream_jax.serving.fake import FakeEngine
from starscream_jax.serving.scheduler import SamplingParams

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama"
"""The Llama fixture, named here: `from conftest import` picks another folder's conftest when several run at once."""


def fake(**overrides) -> FakeEngine:
    return FakeEngine(**{"vocab_size": 50, "context": 64, "max_num_seqs": 8, "step_s": 0.002, **overrides})


async def started(engine) -> tuple[EngineThread, EngineClient, list]:
    loop = EngineThread(engine)
    steps = []
    client = EngineClient(loop.addresses, loop.alive, steps.append)
    await client.start()
    return loop, client, steps


async def drain(stream) -> tuple[list[int], str | None, str | None, int]:
    """(tokens, finish reason, error, takes) of a stream read to its end."""
    tokens, takes = [], 0
    while True:
        delta = await stream.take()
        takes += 1
        tokens += delta.tokens
        if delta.finish_reason is not None or delta.error is not None:
            return tokens, delta.finish_reason, delta.error, takes


def test_one_message_per_step_holds_every_request():
    async def run():
        loop, client, steps = await started(fake())
        streams = [client.submit(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=5)) for i in range(4)]
        results = await asyncio.gather(*(drain(stream) for stream in streams))
        await client.stop(drain=True, timeout=10)
        await client.close()
        return loop, client, steps, results

    loop, client, steps, results = asyncio.run(run())
    assert [tokens for tokens, *_ in results] == [[1 + i, 2, 3, 1 + i, 2] for i in range(4)]
    assert all(reason == "length" for _, reason, _, _ in results)
    busy = [step for step in steps if step.outputs]
    assert max(len(step.outputs) for step in busy) == 4  # a step carries every running request's token
    assert sum(len(step.outputs) for step in busy) == 20 and len(busy) <= 10
    assert not loop.alive() and client.pending == 0


def test_a_slow_reader_takes_several_steps_at_once():
    async def run():
        loop, client, steps = await started(fake())
        stream = client.submit("slow", [4, 5], SamplingParams(max_tokens=12))
        while sum(len(step.outputs) for step in steps) < 12:
            await asyncio.sleep(0.01)  # the steps arrive while nobody reads
        result = await drain(stream)
        await client.stop(drain=True, timeout=10)
        await client.close()
        return result

    tokens, reason, error, takes = asyncio.run(run())
    assert tokens == [4, 5] * 6 and reason == "length" and error is None and takes == 1


def test_a_refusal_reaches_its_request_alone():
    async def run():
        loop, client, _ = await started(fake())
        bad = client.submit("bad", [99], SamplingParams(max_tokens=2))  # 99 is outside the vocabulary of 50
        good = client.submit("good", [7], SamplingParams(max_tokens=2))
        results = await asyncio.gather(drain(bad), drain(good))
        await client.stop(drain=True, timeout=10)
        await client.close()
        return results

    (_, bad_reason, bad_error, _), (tokens, reason, error, _) = asyncio.run(run())
    assert bad_reason == "refused" and "vocabulary" in bad_error
    assert tokens == [7, 7] and error is None


def test_a_cancel_that_leaves_the_engine_idle_sends_its_load():
    """The gauges the API serves read the last message's load: a cancel of the only request, after which the
    engine has no step to run, still sends one (nothing running), not only the next request's first step."""
    async def run():
        loop, client, steps = await started(fake(step_s=0.01))
        stream = client.submit("long", [3, 4], SamplingParams(max_tokens=40))
        await stream.take()
        client.cancel("long")
        for _ in range(200):
            if steps and steps[-1].stats.running == 0:
                break
            await asyncio.sleep(0.01)
        await client.stop(drain=True, timeout=10)
        await client.close()
        return steps

    steps = asyncio.run(run())
    assert steps[-1].stats.running == 0 and not steps[-1].outputs


class FailingEngine(FakeEngine):
    def step(self):
        if self._generated >= 3:
            raise RuntimeError("device lost")
        return super().step()


def test_a_failed_engine_ends_every_stream_and_refuses_the_next():
    async def run():
        loop, client, _ = await started(FailingEngine(vocab_size=50, context=64, max_num_seqs=8, step_s=0.002))
        stream = client.submit("a", [1, 2], SamplingParams(max_tokens=20))
        result = await drain(stream)
        later = await client.submit("b", [1], SamplingParams()).take()
        await client.close()
        return loop, client, result, later

    loop, client, (tokens, reason, error, _), later = asyncio.run(run())
    assert tokens == [1, 2, 1] and reason is None and "device lost" in error
    assert "device lost" in later.error and "device lost" in client.failed
    loop.join(5)
    assert not loop.alive() and isinstance(loop.error, RuntimeError)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_starscream_serve_over_two_processes(cpu_child_env, free_port):
    """`starscream serve` on two processes of 4 CPU devices each (the 1 x 2 x 4 mesh across them): each starts its
    engine process, which joins the mesh; process 0's serves, process 1's follows; a completion comes back, and
    SIGTERM to process 0 ends both."""
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    common = ["--model-dir", str(FIXTURE), "--preset", "mi300x-qpx-nps1", "--nodes", "2", "--gpus", "1",
              "--no-simulate", "--coordinator", coordinator, "--num-processes", "2", "--port", str(port),
              "--max-num-seqs", "8", "--max-model-len", "64", "--chunk", "8", "--page-size", "4",
              "--max-num-batched-tokens", "16", "--compilation-cache", ""]
    processes = [subprocess.Popen([sys.executable, "-m", "starscream_jax.cli.main", "serve", *common, "--process-id",
                                   str(index)], env=cpu_child_env(4), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True) for index in range(2)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.5)
        answer = httpx.post(url + "/v1/completions", timeout=60, json={"model": "llama", "prompt": "hello",
                                                                       "max_tokens": 4, "temperature": 0}).json()
        assert answer["usage"]["completion_tokens"] == 4
        processes[0].send_signal(signal.SIGTERM)
        assert processes[1].wait(60) == 0 and processes[0].wait(60) == -signal.SIGTERM
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


PARENT = '''
import sys, time
from starscream_jax.serving.core import EngineProcess


def build():
    time.sleep(600)  # a model loading or compiling


if __name__ == "__main__":
    engine = EngineProcess(build)
    engine.process.start()
    print(engine.process.pid, flush=True)
    time.sleep(600)
'''


@pytest.mark.parametrize("ending", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
# any ending leaves the engine another parent; SIGKILL, which no handler can catch, keeps the claim by default
def test_the_engine_process_ends_with_the_process_that_started_it(tmp_path, ending):
    """Killed, or sent SIGTERM before a server installs its handlers, the process that started an engine takes it
    along while it still builds (an engine left behind would hold the devices' memory)."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, ending)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _running(child):
            time.sleep(0.1)
        assert not _running(child)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has: its parent has not read its status yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
