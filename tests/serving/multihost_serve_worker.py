"""One process of the two-process serving test (tests/serving/test_engine.py):
`python multihost_serve_worker.py COORDINATOR PROCESS_ID PROMPTS_JSON NEW_TOKENS`.

Both processes join through jax.distributed (CPU collectives over gloo, 4 simulated devices each) and build the
1 x 2 x 4 mesh, its gpu axis spanning the processes, and the same engine as tests/serving/conftest.py's "1x2x4".
Process 0 schedules and serves the prompts, broadcasting each step (`serving.multihost.StepBroadcast`), then
stops the other, which runs every step it is sent (`serving.multihost.follow`). Process 0 prints "tokens" and the
greedy tokens as JSON, then "penalized" and the greedy tokens under PENALIZED (its slots written on both
processes), then "staggered" and the greedy tokens of the prompts arriving while others decode (`conftest.staggered`:
mixed steps), process 1 "followed" and the steps it ran.
"""
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from conftest import CASES, engine_config, load_case_model, staggered  # noqa: E402

from starscream_jax.hardware.mesh import build_mesh  # noqa: E402
from starscream_jax.serving.engine import Engine  # noqa: E402
from starscream_jax.serving.multihost import StepBroadcast, follow  # noqa: E402
from starscream_jax.serving.scheduler import SamplingParams  # noqa: E402

CASE = "1x2x4"
PENALIZED = dict(repetition_penalty=1.8, presence_penalty=1.0, logit_bias=((7, -11.0),), min_tokens=2)


def main(coordinator: str, process_id: int, prompts: list[list[int]], new_tokens: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
    mesh, (prefill, decode) = build_mesh(CASE), CASES[CASE]
    assert sorted({device.process_index for device in mesh.devices[0, 1]}) == [1]  # the second GPU: process 1
    engine = Engine(load_case_model(CASE, prefill, mesh), engine_config(CASE, mesh), mesh, prefill, decode,
                    channel=StepBroadcast())
    if process_id == 0:
        engine.keep_followers()  # an idle leader's word first: the follower waits on for a step
        tokens = engine.generate(prompts, SamplingParams(max_tokens=new_tokens))
        penalized = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, **PENALIZED))
        arriving = staggered(engine, prompts, new_tokens)
        engine.stop_followers()
        print("tokens", json.dumps(tokens), flush=True)
        print("penalized", json.dumps(penalized), flush=True)
        print("staggered", json.dumps(arriving), flush=True)
    else:
        print("followed", follow(engine), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))
