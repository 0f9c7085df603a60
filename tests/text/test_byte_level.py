"""The byte-level vocabulary: a text's UTF-8 bytes, decoded back exactly."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from starscream_jax.errors import StarscreamError
from starscream_jax.text import byte_level


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_encode_decode_round_trip_is_exact(text):
    assert byte_level.decode(byte_level.encode(text)) == text


def test_tokens_are_the_utf8_bytes():
    ascii_text = bytes(range(128)).decode("ascii")
    assert byte_level.encode(ascii_text).tolist() == list(range(128))
    assert byte_level.encode("é").tolist() == [0xC3, 0xA9]
    assert byte_level.decode([0xC3, 0xA9]) == "é"


def test_decode_rejects_ids_outside_the_vocabulary():
    with pytest.raises(StarscreamError, match="0..255"):
        byte_level.decode([72, 256])
