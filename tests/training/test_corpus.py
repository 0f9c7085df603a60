"""Training data from text and JSON Lines files: tokenized block by block, cached, packed with EOS between documents."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.training import corpus
from starscream_jax.training.tokenizer import load_tokenizer

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama"
MESSAGES = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "A friend."}]


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "ROMEO: I will."}) + "\n\n" + json.dumps({"messages": MESSAGES}) + "\n")
    return path


def test_json_lines_documents_are_packed_with_eos_after_each(jsonl, tmp_path):
    tokenizer = load_tokenizer(FIXTURE)
    tokens = corpus.load_token_stream([jsonl], tokenizer, tmp_path / "cache")
    text = tokenizer.encode("ROMEO: I will.")
    chat = tokenizer.encode(tokenizer.render_chat(MESSAGES), special_tokens=False)
    np.testing.assert_array_equal(tokens, np.concatenate([text, [1], chat, [1]]))


def test_tokens_are_cached_once_per_file_and_tokenizer(jsonl, tmp_path, monkeypatch):
    tokenizer = load_tokenizer(FIXTURE)
    first = np.array(corpus.tokenize_file(jsonl, tokenizer, tmp_path / "cache"))
    monkeypatch.setattr(corpus, "documents", lambda *_: pytest.fail("tokenized a cached file again"))
    np.testing.assert_array_equal(corpus.tokenize_file(jsonl, tokenizer, tmp_path / "cache"), first)
    assert len(list((tmp_path / "cache").glob("*.tokens"))) == 1
    monkeypatch.undo()
    changed = tmp_path / "tokenizer"  # the same vocabulary, adding EOS itself: another cache entry
    changed.mkdir()
    shutil.copy(FIXTURE / "tokenizer.json", changed)
    settings = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**settings, "add_eos_token": True}))
    corpus.tokenize_file(jsonl, load_tokenizer(changed), tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.tokens"))) == 2


def test_text_is_read_in_blocks_of_lines_with_the_same_tokens(tmp_path, monkeypatch):
    """A file is encoded a few lines at a time (never read whole): with the byte tokenizer the blocks give exactly
    the file's bytes; with BPE the blocks end at line ends, BOS comes once and EOS closes the file."""
    path = tmp_path / "play.txt"
    path.write_text("".join(f"line {i}: to be or not to be\n" for i in range(10)))
    monkeypatch.setattr(corpus, "LINES_PER_BLOCK", 3)
    bytes_tokens = corpus.tokenize_file(path, load_tokenizer(None), tmp_path / "cache")
    np.testing.assert_array_equal(bytes_tokens, np.frombuffer(path.read_bytes(), np.uint8))
    tokens = corpus.tokenize_file(path, load_tokenizer(FIXTURE), tmp_path / "cache")
    assert tokens[0] == 0 and tokens[-1] == 1 and list(tokens).count(0) == 1
    assert load_tokenizer(FIXTURE).decode(tokens) == path.read_text()


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1 is not JSON"),
    (json.dumps({"prompt": "x"}), "line 1 has neither a 'text' string nor a 'messages' list"),
])
def test_bad_json_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(StarscreamError, match=message):
        corpus.tokenize_file(path, load_tokenizer(FIXTURE), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.tokens"))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(StarscreamError, match="training data .*nowhere.txt not found"):
        corpus.tokenize_file(tmp_path / "nowhere.txt", load_tokenizer(None), tmp_path)
