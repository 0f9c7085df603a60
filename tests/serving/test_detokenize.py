"""Incremental detokenization: the pieces of a stream join to the whole text for any split of the tokens, a
character whose bytes span tokens is never cut, and a stop string spanning tokens ends the text exactly where it
begins (or after it), with nothing of it sent before."""
import functools
from pathlib import Path

import numpy as np
import pytest

from starscream_jax.serving.detokenize import IncrementalText, spaced_special
from starscream_jax.text.tokenizer import ByteTokenizer, load_tokenizer

LLAMA = Path(__file__).parents[1] / "fixtures" / "hf" / "llama"


def stream(text: IncrementalText, tokens: list[int], sizes) -> list[str]:
    """The pieces `text` emits for `tokens` fed in batches of `sizes` (cycled), the last batch final."""
    pieces, start, index = [], 0, 0
    while start < len(tokens):
        end = min(start + sizes[index % len(sizes)], len(tokens))
        pieces.append(text.add(tokens[start:end], final=end == len(tokens)))
        start, index = end, index + 1
    return pieces


@pytest.mark.parametrize("sizes", [(1,), (3,), (2, 5, 1)])
def test_pieces_join_to_the_whole_text(sizes):
    tokenizer = load_tokenizer(LLAMA)
    rng = np.random.default_rng(0)
    prompt, generated = rng.integers(3, 380, 7).tolist(), rng.integers(3, 380, 40).tolist()
    pieces = stream(IncrementalText(tokenizer.decode, prompt), generated, sizes)
    assert "".join(pieces) == tokenizer.decode(generated)


def test_a_character_split_over_tokens_is_sent_whole():
    tokenizer = ByteTokenizer()
    text = "né 𝄞 ✓ end"
    pieces = stream(IncrementalText(tokenizer.decode, []), tokenizer.encode(text).tolist(), (1,))
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)
    assert "𝄞" in pieces  # its four bytes arrive as four tokens and leave as one piece


@pytest.mark.parametrize("include, expected", [(False, "abc "), (True, "abc STOP")])
def test_a_stop_string_over_several_tokens_ends_the_text(include, expected):
    tokenizer = ByteTokenizer()
    text = IncrementalText(tokenizer.decode, [], stop=("STOP", "never"), include_stop=include)
    pieces = stream(text, tokenizer.encode("abc STOP and more").tolist(), (2,))
    assert "".join(pieces) == expected and text.stopped
    assert not any("S" in piece for piece in pieces[:-1]) or include  # the stop's start was held back
    assert text.add(tokenizer.encode("x").tolist()) == ""  # nothing after the stop


@pytest.mark.parametrize("include", [False, True])
def test_tokens_arriving_together_end_at_the_one_that_completes_the_stop(include):
    """Several steps' tokens in one `add` (an engine ahead of the HTTP process): the text and `taken` end at the
    token that completes the stop string, whatever the batch holds after it; the stop string met is named."""
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ab STOP cd").tolist()
    for size in (1, 3, len(ids)):
        text = IncrementalText(tokenizer.decode, [], stop=("STOP", "zz"), include_stop=include)
        taken, pieces = 0, []
        for start in range(0, len(ids), size):
            pieces.append(text.add(ids[start:start + size], final=start + size >= len(ids)))
            taken += text.taken
            if text.stopped:
                break
        assert taken == len("ab STOP") and text.stopped == "STOP"
        assert "".join(pieces) == ("ab STOP" if include else "ab ")


def test_held_back_text_is_sent_at_the_end():
    tokenizer = ByteTokenizer()
    text = IncrementalText(tokenizer.decode, [], stop=("xyz!",))
    assert text.add(tokenizer.encode("abcxy").tolist()) == "ab"  # "cxy" may start the stop string
    assert text.add([], final=True) == "cxy" and not text.stopped


def test_stop_strings_wait_for_min_tokens():
    """As vLLM: a stop string met within the first min_tokens tokens does not end the text; one after does."""
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ab.cd.ef").tolist()
    assert "".join(stream(IncrementalText(tokenizer.decode, [], (".",)), ids, (1,))) == "ab"
    assert "".join(stream(IncrementalText(tokenizer.decode, [], (".",), min_tokens=4), ids, (1,))) == "ab.cd"


def test_special_tokens_stand_a_space_apart_when_spaced():
    """As vLLM's slow detokenizer joins them: each special token and each run of other tokens decoded apart, the
    pieces joined by one space, whole or streamed."""
    tokenizer = load_tokenizer(LLAMA)
    keep = functools.partial(tokenizer.decode, skip_special_tokens=False)
    hello, world = tokenizer.encode("hello", False).tolist(), tokenizer.encode("world", False).tolist()
    spaced = spaced_special(keep, tokenizer.special_ids)
    tokens = [1] + hello + [0, 0] + world
    assert tokenizer.special_ids == {0, 1} and spaced(tokens) == "</s> hello <s> <s> world"
    assert keep(tokens) == "</s>hello<s><s>world"
    assert "".join(stream(IncrementalText(spaced, world), tokens, (1,))) == " </s> hello <s> <s> world"
