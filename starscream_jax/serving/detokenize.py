"""Incremental detokenization with stop strings: each request's new tokens become new text in time proportional to
the new tokens, not to the text so far.

Offsets over the token ids (the scheme vLLM's detokenizer uses, here over any `decode(ids) -> str`): the text of
the new tokens is `decode(ids[prefix:]) - decode(ids[prefix:read])`, where `prefix` lags one emission behind
`read`, so a decoder that drops a leading space or merges bytes across a boundary still sees the token before;
while the decoded window ends in U+FFFD (a character whose bytes have not all arrived) nothing is emitted and the
window grows. The last few prompt tokens seed the window, so the first generated token gets its leading space.

Stop strings are matched in the text not yet sent plus the new text only: up to the longest stop string's length
less one character is held back (it may be the start of a stop string), so a stop string spanning tokens is found
exactly once, and the text ends where it begins (or after it, `include_stop`). Tokens that arrive together (an
engine's output of several steps) are matched one at a time, so the text ends at the token that completes the stop
string, whatever arrived after it (`taken`), as vLLM's one token a step ends it. As vLLM does, stop strings are
looked for only once more than `min_tokens` tokens have arrived.

Special tokens kept in the text (skip_special_tokens false) stand one space apart from their neighbours where a
request leaves vLLM's `spaces_between_special_tokens` true (`spaced_special`), as vLLM's and Hugging Face's slow
detokenizers join them; false writes them as the tokenizer's decoder does.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Collection

PROMPT_CONTEXT = 5
"""Prompt tokens that seed the window (vLLM's initial read offset is as many)."""


def spaced_special(decode: Callable[[list[int]], str], special_ids: Collection[int]) -> Callable[[list[int]], str]:
    """`decode` (one that keeps special tokens) with each token of `special_ids` and each run of other tokens
    decoded apart and the non-empty pieces joined by one space."""
    def spaced(token_ids: list[int]) -> str:
        pieces = []
        for special, run in itertools.groupby(token_ids, special_ids.__contains__):
            run = list(run)
            pieces += [decode([token]) for token in run] if special else [decode(run)]
        return " ".join(piece for piece in pieces if piece)
    return spaced


class IncrementalText:
    """One request's generated text, emitted as its tokens arrive (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: list[int], stop: tuple[str, ...] = (),
                 include_stop: bool = False, min_tokens: int = 0):
        self._decode = decode
        self._ids = list(prompt[-PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._include_stop = include_stop
        self._min_tokens, self._tokens = min_tokens, 0
        self._unsent = ""
        self.stopped: str | None = None
        """The stop string met, once one is: the text is complete, later tokens are ignored."""
        self.taken = 0
        """How many of the last `add`'s tokens made its text: all of them, or those up to the one that completed
        the stop string met."""

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The text to send after `token_ids` (the request's newest tokens; `final` on its last): "" while it may
        still be a partial character or the start of a stop string. With stop strings, one token at a time."""
        if not self._stop:
            self.taken = len(token_ids)
            return self._add(token_ids, final)
        pieces, self.taken = [], 0
        for i, token in enumerate(token_ids):
            if self.stopped:
                break
            pieces.append(self._add([token], final and i == len(token_ids) - 1))
            self.taken = i + 1
        if not token_ids and final:
            pieces.append(self._add([], final))
        return "".join(pieces)

    def _add(self, token_ids: list[int], final: bool) -> str:
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._tokens += len(token_ids)
        text = self._unsent + self._new_text(final)
        stops = self._stop if self._tokens > self._min_tokens else ()
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            start, self.stopped = min(found)
            self._unsent = ""
            return text[:start + (len(self.stopped) if self._include_stop else 0)]
        keep = 0 if final else min(self._hold, len(text))
        send, self._unsent = text[:len(text) - keep], text[len(text) - keep:]
        return send

    def _new_text(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if not final and (len(window) <= len(before) or window.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(before):]
