"""The engine's per-row settings end to end on the tiny checkpoint (1, 2, 4 mesh, conftest.engine_for): penalties
give the greedy tokens of a numpy reference over the unsharded model's logits (and other tokens than without
them), logit_bias forces a token, min_tokens holds back a stop token, top_logprobs return the model's likeliest
tokens, and a request without any of them runs as before beside one with them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.errors import StarscreamError
from starscream_jax.serving.scheduler import SamplingParams

PROMPT = [5, 17, 42, 9, 300, 7]
NEW = 8


def _run(engine, params, prompts=(PROMPT,)):
    """Every event of `prompts` run to the end, by request."""
    ids = [f"s{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.submit(request_id, list(prompt), params[request_id] if isinstance(params, dict) else params)
    events = {request_id: [] for request_id in ids}
    while engine.busy:
        for event in engine.step():
            events[event.request_id].append(event)
    return [events[request_id] for request_id in ids]


@nnx.jit
def _every_logit(model, tokens_1S):
    return model(tokens_1S).logits[0]


def _reference(model, prompt, new, presence=0.0, frequency=0.0, repetition=1.0, bias=()):
    """Greedy tokens with vLLM's logit bias, then penalties, applied in numpy to the unsharded model's logits. The
    tokens so far sit at the front of one buffer of the final length (one program for every step): causal
    attention keeps the zeros after them out of their logits."""
    tokens = list(prompt)
    buffer = np.zeros((1, len(prompt) + new), np.int32)
    for _ in range(new):
        buffer[0, :len(tokens)] = tokens
        logits = np.asarray(_every_logit(model, jnp.asarray(buffer))[len(tokens) - 1], np.float64)
        for token, value in bias:
            logits[token] += value
        generated = tokens[len(prompt):]
        counts = np.bincount(generated, minlength=logits.size) if generated else np.zeros(logits.size)
        seen = (counts > 0) | np.isin(np.arange(logits.size), prompt)
        scale = np.where(seen, repetition, 1.0)
        logits = np.where(logits > 0, logits / scale, logits * scale) - frequency * counts - presence * (counts > 0)
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("penalty", [{"presence": 2.0}, {"frequency": 2.0}, {"repetition": 1.8}])
def test_penalties_give_the_reference_greedy_tokens(engine_for, unsharded_llama, penalty):
    """The random checkpoint repeats the prompt's last token (7) with a margin of 12 in its logit; a bias of -11
    on it leaves a margin a presence penalty of 2 can overturn."""
    engine = engine_for("1x2x4")
    bias = ((7, -11.0),)
    plain = _reference(unsharded_llama, PROMPT, NEW, bias=bias)
    want = _reference(unsharded_llama, PROMPT, NEW, **penalty, bias=bias)
    assert want != plain, "the penalty changes nothing on this prompt: the check could not fail"
    params = SamplingParams(max_tokens=NEW, logit_bias=bias,
                            **{f"{name}_penalty": value for name, value in penalty.items()})
    together = _run(engine, {"s0": params, "s1": SamplingParams(max_tokens=NEW)}, [PROMPT, PROMPT])
    assert [event.token for event in together[0]] == want
    # a row without any setting beside it is untouched
    assert [event.token for event in together[1]] == _reference(unsharded_llama, PROMPT, NEW)


def test_logit_bias_forces_a_token(engine_for):
    engine = engine_for("1x2x4")
    events = _run(engine, SamplingParams(max_tokens=5, logit_bias=((123, 100.0),)))[0]
    assert [event.token for event in events] == [123] * 5


def test_min_tokens_holds_back_a_stop_token(engine_for):
    engine = engine_for("1x2x4")
    first = _run(engine, SamplingParams(max_tokens=NEW))[0][0].token
    stopped = _run(engine, SamplingParams(max_tokens=NEW, stop_tokens=(first,)))[0]
    assert [event.finish_reason for event in stopped] == ["stop"]
    held = _run(engine, SamplingParams(max_tokens=NEW, stop_tokens=(first,), min_tokens=4))[0]
    assert len(held) >= 4 and first not in [event.token for event in held[:4]]


def test_top_logprobs_are_the_models_likeliest(engine_for, unsharded_llama):
    engine = engine_for("1x2x4")
    events = _run(engine, SamplingParams(max_tokens=3, top_logprobs=5, logprobs=True))[0]
    logits = _every_logit(unsharded_llama, jnp.asarray([PROMPT], jnp.int32))[-1]
    want = np.asarray(jax.nn.log_softmax(logits))
    first = events[0]
    assert len(first.top_tokens) == 5 and first.top_tokens[0] == first.token
    assert list(first.top_tokens) == np.argsort(-want)[:5].tolist()
    np.testing.assert_allclose(first.top_logprobs, np.sort(want)[::-1][:5], rtol=1e-4, atol=1e-5)
    assert all(len(event.top_tokens) == 5 for event in events)
    assert not _run(engine, SamplingParams(max_tokens=2))[0][0].top_tokens


def test_bad_settings_are_one_line_refusals(engine_for):
    engine = engine_for("1x2x4")
    vocab = engine.model_config.vocab_size
    with pytest.raises(StarscreamError, match=f"logit_bias token id {vocab} is outside"):
        engine.submit("b", [1, 2], SamplingParams(logit_bias=((vocab, 1.0),)))
    for bad, field in (({"presence_penalty": 3.0}, "presence_penalty"), ({"min_p": 1.5}, "min_p"),
                       ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"top_logprobs": 21}, "top_logprobs"),
                       ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
                       ({"logit_bias": ((1, 101.0),)}, "logit_bias")):
        with pytest.raises(StarscreamError, match=field):
            SamplingParams(**bad)
    assert not engine.busy


def test_allowed_token_ids_restrict_every_token(engine_for):
    """The plain greedy tokens are never among the three allowed ids: every token is then one of them (the EOS id
    is not allowed, so the request runs to max_tokens, as vLLM's)."""
    engine = engine_for("1x2x4")
    plain = [event.token for event in _run(engine, SamplingParams(max_tokens=NEW))[0]]
    allowed = tuple(token for token in (3, 11, 250, 77) if token not in plain)[:3]
    events = _run(engine, SamplingParams(max_tokens=NEW, allowed_token_ids=allowed))[0]
    assert len(events) == NEW and {event.token for event in events} <= set(allowed)


def test_bad_words_ban_a_token_and_a_two_token_sequence(engine_for):
    """A one-token bad word never appears; a two-token one (the greedy output's first two tokens: the random
    checkpoint repeats the prompt's last token) never completes, though its first token still comes (the prompt's
    tokens do not count, as in vLLM), whether the host has read that token yet or not (the step keeps each slot's
    newest tokens itself); a row without bad words beside them is untouched."""
    engine = engine_for("1x2x4")
    plain = [event.token for event in _run(engine, SamplingParams(max_tokens=NEW))[0]]
    single = _run(engine, SamplingParams(max_tokens=NEW, bad_words=((plain[0],),)))[0]
    assert plain[0] not in [event.token for event in single]
    first, second = plain[:2]
    together = _run(engine, {"s0": SamplingParams(max_tokens=NEW, bad_words=((first, second),)),
                             "s1": SamplingParams(max_tokens=NEW)}, [PROMPT, PROMPT])
    banned = [event.token for event in together[0]]
    assert banned != plain and banned[0] == first
    assert all((a, b) != (first, second) for a, b in zip(banned, banned[1:]))
    assert [event.token for event in together[1]] == plain


def test_a_penalized_row_keeps_its_tokens_in_mixed_steps(engine_for, unsharded_llama):
    """A row under a presence penalty and a logit bias (the sampler's extra passes, its slot's counts) decoding
    while another request's prompt arrives: the steps that hold both run as one mixed program, and each request's
    tokens are the reference's."""
    engine = engine_for("1x2x4")
    bias = ((7, -11.0),)
    penalized = SamplingParams(max_tokens=NEW, logit_bias=bias, presence_penalty=2.0)
    engine.step_times.clear()
    engine.submit("penalized", PROMPT, penalized)
    events = {"penalized": [], "arriving": []}

    def step():
        for event in engine.step():
            events[event.request_id].append(event.token)

    step()
    step()
    arriving = [3, 8, 250, 11, 90, 33, 2, 71, 140, 5, 66, 12, 301, 44, 9, 18, 27]  # two chunks of 8, then decode
    engine.submit("arriving", arriving, SamplingParams(max_tokens=NEW))
    while engine.busy:
        step()
    assert events["penalized"] == _reference(unsharded_llama, PROMPT, NEW, presence=2.0, bias=bias)
    assert events["arriving"] == _reference(unsharded_llama, arriving, NEW)
    assert sum(1 for step in engine.step_times if step.prefill_rows and step.decode_rows and step.programs == 1) == 2
