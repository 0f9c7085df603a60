"""The byte-level vocabulary of the built-in demo: a text's UTF-8 bytes are its token ids (`VOCAB_SIZE` 256)."""
from __future__ import annotations

import numpy as np

from ..errors import StarscreamError

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    """Text -> token ids [n] (uint8): its UTF-8 bytes. Exact inverse of `decode` for any text. Bytes that are not
    UTF-8, as Python keeps them in command-line arguments (lone surrogates, PEP 383), come back as those bytes."""
    return np.frombuffer(text.encode("utf-8", errors="surrogateescape"), dtype=np.uint8).copy()


def decode(token_ids) -> str:
    """Token ids [n] (ints in 0..255) -> text. Byte runs that are not valid UTF-8 become U+FFFD."""
    token_array = np.asarray(token_ids)
    if token_array.size and (token_array.min() < 0 or token_array.max() >= VOCAB_SIZE):
        raise StarscreamError(
            f"token ids span {token_array.min()}..{token_array.max()}; the byte tokenizer expects 0..{VOCAB_SIZE - 1}; "
            "decode only ids produced by this tokenizer or a model with vocab_size 256"
        )
    return token_array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
