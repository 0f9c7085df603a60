"""Structured output in the engine: a grammar's text (regex, choice, JSON schema) is what the engine generates
on the tiny checkpoint, sharded and not, with and without overlap, beside unguided rows that are left as they
were; a guided request ends ("stop") when its grammar does; bad grammars name their field."""
import json
import re

import llguidance
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.serving.guided import (
    Grammar,
    checked,
    choice_grammar,
    closed_objects,
    grammar_tokenizer,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from starscream_jax.serving.scheduler import SamplingParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


def _run(engine, grammar, tokenizer, prompts=("hello world", "a b c"), **params):
    ids = [tokenizer.encode(prompt).tolist() for prompt in prompts]
    events = {}
    ids_by = [f"g{index}" for index in range(len(ids))]
    for request_id, prompt in zip(ids_by, ids):
        engine.submit(request_id, prompt, SamplingParams(grammar=grammar, **{"max_tokens": 40, **params}))
    engine.submit("plain", ids[0], SamplingParams(max_tokens=6))
    while engine.busy:
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    return {request_id: (tokenizer.decode([e.token for e in found]), found[-1].finish_reason,
                         [e.token for e in found]) for request_id, found in events.items()}


@pytest.mark.parametrize("case", ["1x1x1", "1x2x4", "1x1x1-sync"])
def test_regex_and_choice_are_obeyed_and_end_the_request(engine_for, llama_tokenizer, case):
    """Sampled rows under a regex end at its last character; the unguided row beside them gives the tokens it
    gives alone."""
    engine = engine_for(case)
    alone = engine.generate([llama_tokenizer.encode("hello world").tolist()], SamplingParams(max_tokens=6))[0]
    pattern = r"[0-9]{2,4}-[a-c]{1,3}!"
    out = _run(engine, checked(regex_grammar(pattern, "guided_regex")), llama_tokenizer, temperature=1.0, seed=3)
    for request_id in ("g0", "g1"):
        text, reason, _ = out[request_id]
        assert re.fullmatch(pattern, text) and reason == "stop", (text, reason)
    assert out["plain"][2] == alone
    out = _run(engine, checked(choice_grammar(["yes", "no", "maybe not"], "guided_choice")), llama_tokenizer)
    assert out["g0"][0] in ("yes", "no", "maybe not") and out["g0"][1] == "stop"
    assert engine.scheduler.pages_used == 0


def test_json_schema_output_parses_and_validates(engine_for, llama_tokenizer):
    grammar = checked(json_schema_grammar(SCHEMA, "response_format"))
    for seed in range(3):
        out = _run(engine_for("1x2x4"), grammar, llama_tokenizer, temperature=1.0, seed=seed)
        for request_id in ("g0", "g1"):
            value = json.loads(out[request_id][0])
            assert set(value) == {"ok", "color", "n"} and isinstance(value["ok"], bool)
            assert value["color"] in ("red", "green") and 0 <= value["n"] <= 9


def test_bad_grammars_name_their_field():
    with pytest.raises(StarscreamError, match="^response_format: .*objekt"):
        checked(json_schema_grammar({"type": "objekt"}, "response_format"))
    with pytest.raises(StarscreamError, match="^guided_regex: .*unclosed group"):
        checked(regex_grammar("a(b", "guided_regex"))
    with pytest.raises(StarscreamError, match="^guided_grammar: .*foo"):
        checked(lark_grammar("start: foo", "guided_grammar"))
    with pytest.raises(StarscreamError, match="^guided_choice: give a non-empty list"):
        choice_grammar([], "guided_choice")
    with pytest.raises(StarscreamError, match="^guided_json: the schema is not JSON"):
        json_schema_grammar("{", "guided_json")


def test_a_gbnf_grammar_is_read_and_strict_schemas_are_closed():
    checked(lark_grammar('root ::= "a" | "b"', "guided_grammar"))
    closed = closed_objects({"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
                             "additionalProperties": True})
    assert closed["additionalProperties"] is True and closed["properties"]["a"]["additionalProperties"] is False


def test_a_guided_request_without_a_tokenizer_is_refused(engine_for):
    engine = engine_for("1x1x1")
    tokenizer, engine._grammar_tokenizer = engine._grammar_tokenizer, None
    try:
        with pytest.raises(StarscreamError, match="guided_regex: this engine serves no structured output"):
            engine.submit("x", [3, 4], SamplingParams(grammar=regex_grammar("a", "guided_regex")))
    finally:
        engine._grammar_tokenizer = tokenizer


def test_guided_requests_survive_preemption(engine_for, llama_tokenizer):
    """Eight guided requests on one shard of 12 usable pages: some are preempted and recomputed, and each still
    ends at its grammar's end (its matcher kept what it had taken; the mask of its slot is rewritten)."""
    engine = engine_for("1x1x1")
    before = engine.stats().preemptions
    prompts = [f"p{index} q" for index in range(8)]
    pattern = r"[0-9]{4,6}-[a-c]{2,3}!"
    out = _run(engine, checked(regex_grammar(pattern, "guided_regex")), llama_tokenizer, prompts=prompts,
               temperature=1.0, seed=11)
    assert engine.stats().preemptions > before
    for index in range(8):
        text, reason, _ = out[f"g{index}"]
        assert re.fullmatch(pattern, text) and reason == "stop", (index, text, reason)
    assert engine.scheduler.pages_used == 0


def test_a_grammar_that_fails_to_compile_refuses_its_request_after_submit(engine_for, llama_tokenizer):
    """Grammars compile off the engine's loop: one the tokenizer-free check would have caught (here sent
    unchecked) is refused at the next step, naming its field, while a plain request beside it runs."""
    engine = engine_for("1x2x4")
    bad = Grammar("guided_regex", llguidance.LLMatcher.grammar_from_regex("a(b"))
    engine.submit("bad", [3, 4, 5], SamplingParams(grammar=bad))
    engine.submit("fine", [3, 4, 5], SamplingParams(max_tokens=3))
    tokens = []
    while engine.busy:
        tokens += [event for event in engine.step() if event.request_id == "fine"]
        refused = engine.refused()
        if refused:
            assert [request_id for request_id, _ in refused] == ["bad"]
            assert refused[0][1].startswith("guided_regex: ") and "regex" in refused[0][1]
            break
    else:
        raise AssertionError("the bad grammar was not refused")
    assert "bad" not in engine.running_ids()
    while engine.busy:
        tokens += engine.step()
    assert len(tokens) == 3 and engine.scheduler.pages_used == 0


def test_a_tokenizer_llguidance_cannot_read_is_a_clear_error(tmp_path):
    """A WordPiece decoder (the random-weight benchmark model's) is refused in one line, so a server starts without
    structured output instead of failing."""
    from tokenizers import Tokenizer, decoders, models

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t0"))
    words.decoder = decoders.WordPiece(prefix="##")
    words.save(str(tmp_path / "tokenizer.json"))

    class Words:
        directory, eos_ids = tmp_path, (1,)

    with pytest.raises(StarscreamError, match="structured output cannot read"):
        grammar_tokenizer(Words(), 8)


def test_allowed_token_ids_intersect_the_grammars_mask(engine_for, llama_tokenizer):
    """A choice's greedy answer, then the same grammar with allowed_token_ids holding only the other answer's
    tokens (and the EOS ids): both masks apply, so the other answer comes."""
    engine = engine_for("1x2x4")
    grammar = checked(choice_grammar(["yes", "no"], "guided_choice"))
    first = _run(engine, grammar, llama_tokenizer, prompts=("hello world",))["g0"][0]
    other = "no" if first == "yes" else "yes"
    allowed = tuple(llama_tokenizer.encode(other, False).tolist()) + tuple(llama_tokenizer.eos_ids)
    text, reason, _ = _run(engine, grammar, llama_tokenizer, prompts=("hello world",), allowed_token_ids=allowed)["g0"]
    assert (text, reason) == (other, "stop")


def test_a_guided_row_keeps_its_grammar_in_mixed_steps(engine_for, llama_tokenizer):
    """A JSON-schema row decoding (seeded) while other prompts arrive, its mask written before each step that
    samples it, mixed steps among them: its text parses and validates, and equals the same request's alone."""
    engine = engine_for("1x2x4")
    grammar = checked(json_schema_grammar(SCHEMA, "response_format"))
    params = SamplingParams(grammar=grammar, max_tokens=40, temperature=1.0, seed=4)
    prompt = llama_tokenizer.encode("hello world").tolist()
    alone = engine.generate([prompt], params)[0]
    engine.step_times.clear()
    engine.submit("guided", prompt, params)
    tokens = []
    for arriving in range(4):  # a prompt of two chunks arrives every third step
        for _ in range(3):
            tokens += [event.token for event in engine.step() if event.request_id == "guided"]
        engine.submit(f"arriving{arriving}", [3 + arriving] * 14, SamplingParams(max_tokens=2))
    while engine.busy:
        tokens += [event.token for event in engine.step() if event.request_id == "guided"]
    value = json.loads(llama_tokenizer.decode(tokens))
    assert set(value) == {"ok", "color", "n"} and tokens == alone
    assert any(step.prefill_rows and step.decode_rows and step.programs == 1 for step in engine.step_times)
