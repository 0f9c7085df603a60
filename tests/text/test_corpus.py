"""Training data from text and JSON Lines files: tokenized block by block, cached, packed with EOS between documents."""
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.text import corpus
from starscream_jax.text.tokenizer import load_tokenizer

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama"
MESSAGES = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "A friend."}]


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "ROMEO: I will."}) + "\n\n" + json.dumps({"messages": MESSAGES}) + "\n")
    return path


def test_json_lines_documents_are_packed_with_eos_after_each(jsonl, tmp_path):
    tokenizer = load_tokenizer(FIXTURE)
    tokens, _ = corpus.load_token_stream([jsonl], tokenizer, tmp_path / "cache")
    text = tokenizer.encode("ROMEO: I will.")
    chat = tokenizer.encode(tokenizer.render_chat(MESSAGES), special_tokens=False)
    np.testing.assert_array_equal(tokens, np.concatenate([text, [1], chat, [1]]))


def test_tokens_are_cached_once_per_file_and_tokenizer(jsonl, tmp_path, monkeypatch):
    tokenizer = load_tokenizer(FIXTURE)
    first = np.array(corpus.tokenize_file(jsonl, tokenizer, tmp_path / "cache")[0])
    monkeypatch.setattr(corpus, "documents", lambda *_: pytest.fail("tokenized a cached file again"))
    np.testing.assert_array_equal(corpus.tokenize_file(jsonl, tokenizer, tmp_path / "cache")[0], first)
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
    bytes_tokens, _ = corpus.tokenize_file(path, load_tokenizer(None), tmp_path / "cache")
    np.testing.assert_array_equal(bytes_tokens, np.frombuffer(path.read_bytes(), np.uint8))
    tokens, _ = corpus.tokenize_file(path, load_tokenizer(FIXTURE), tmp_path / "cache")
    assert tokens[0] == 0 and tokens[-1] == 1 and list(tokens).count(0) == 1
    assert load_tokenizer(FIXTURE).decode(tokens) == path.read_text()


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1 is not JSON"),
    (json.dumps({"prompt": "x"}), "line 1 has neither of a 'text' string and a 'messages' list"),
    (json.dumps({"text": "x", "messages": MESSAGES}), "line 1 has both of a 'text' string and a 'messages' list"),
    (json.dumps(["x"]), "line 1 has neither of a 'text' string"),
    (json.dumps({"text": 3}), "line 1: 'text' is a int; give a string"),
    (json.dumps({"messages": []}), "line 1: 'messages' is \\[\\]; give a non-empty list"),
    (json.dumps({"messages": [{"role": "user"}]}), "line 1: message 0 is {'role': 'user'}; each message needs a"),
    (json.dumps({"messages": [{"role": "user", "content": None}]}), "line 1: message 0 is"),
    (json.dumps({"messages": ["hi"]}), "line 1: message 0 is 'hi'; each message needs"),
])
def test_bad_json_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(StarscreamError, match=message):
        corpus.tokenize_file(path, load_tokenizer(FIXTURE), tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # no token file, no partial one


@pytest.mark.parametrize("record, field", [('{"text": "one \\ud800 two"}', "'text'"),
                                           ('{"messages": [{"role": "user", "content": "\\udce9"}]}',
                                            "message 0's 'content'")])
@pytest.mark.parametrize("tokenizer", [None, FIXTURE])
def test_a_record_holding_a_lone_surrogate_is_refused_naming_the_line(tmp_path, record, field, tokenizer):
    """JSON may escape half of a UTF-16 pair ("\\ud800"); that is no text (the byte tokenizer would even take
    \\udce9 for the byte 0xe9)."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + record + "\n")
    with pytest.raises(StarscreamError, match=rf"bad.jsonl line 2: {field} is not valid Unicode \(lone surrogate at "
                                              r"index \d+, U\+D[8C]\w\w: half of a UTF-16 pair\); the program that "
                                              r"wrote the file split a character"):
        corpus.tokenize_file(path, load_tokenizer(tokenizer), tmp_path / "cache")


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(StarscreamError, match="training data .*nowhere.txt not found"):
        corpus.tokenize_file(tmp_path / "nowhere.txt", load_tokenizer(None), tmp_path)


def test_a_directory_given_as_data_is_named_as_one(tmp_path):
    with pytest.raises(StarscreamError, match=r"training data .*texts is a directory; pass --data with its .txt or "
                                              r"\.jsonl files \(.*texts/\*\.txt\)"):
        corpus.tokenize_file((tmp_path / "texts").mkdir() or tmp_path / "texts", load_tokenizer(None), tmp_path)


@pytest.mark.parametrize("content, message", [
    ('{"text": "caf\xe9"}\n'.encode("latin-1"), r"byte 13 \(line 1\) is not UTF-8 \(0xe9\)"),
    ('{"text": "one"}\n{"text": "na\xefve"}\n'.encode("cp1252"), r"byte 28 \(line 2\) is not UTF-8 \(0xef\)"),
    ('{"text": "hi"}\n'.encode("utf-16"), r"byte 0 \(line 1\) is not UTF-8 \(0xff\)"),
    ('{"text": "hi"}\n'.encode("utf-16-le"), r"byte 1 \(line 1\) is a NUL character: the file is UTF-16 or binary"),
    (b'{"text": "\xc3"}\n', r"byte 10 \(line 1\) is not UTF-8 \(0xc3\)"),
])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
@pytest.mark.parametrize("tokenizer", [None, FIXTURE])
def test_text_that_is_not_utf8_is_refused_with_its_byte_offset(tmp_path, content, message, suffix, tokenizer):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(content)
    with pytest.raises(StarscreamError, match=rf"training data .*data{suffix}: {message}"):
        corpus.load_token_stream([path], load_tokenizer(tokenizer), tmp_path / "cache")


@pytest.mark.parametrize("name, message", [
    ("data.json", "is a JSON file; write one JSON object per line"),
    ("data.JSON", "is a JSON file"),
    ("data.jsonl.gz", "is a .gz file, not text; decompress"),
    ("data.parquet", "is a .parquet file, not text"),
])
def test_files_that_are_not_text_or_json_lines_are_refused_by_name(tmp_path, name, message):
    path = tmp_path / name
    path.write_text(json.dumps([{"text": "ROMEO: I will."}]))
    with pytest.raises(StarscreamError, match=message):
        corpus.load_token_stream([path], load_tokenizer(None), tmp_path / "cache")


def test_json_lines_are_recognised_in_any_case(tmp_path):
    path = tmp_path / "DATA.JSONL"
    path.write_text(json.dumps({"text": "ROMEO"}) + "\n")
    tokens, _ = corpus.load_token_stream([path], load_tokenizer(None), tmp_path / "cache")
    assert bytes(tokens.astype(np.uint8)) == b"ROMEO"  # the text, not the JSON around it


def test_files_are_fingerprinted_and_cached_by_content(tmp_path):
    """The same bytes under another path share the fingerprint and the cache; a file changed in place (same
    size, same modification time) is tokenized afresh."""
    first, moved = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("to be or not to be\n")
    moved.write_text("to be or not to be\n")
    tokenizer = load_tokenizer(FIXTURE)
    tokens, fingerprint = corpus.tokenize_file(first, tokenizer, tmp_path / "cache")
    assert (fingerprint.size, fingerprint.sha256) == (19, hashlib.sha256(first.read_bytes()).hexdigest())
    assert corpus.tokenize_file(moved, tokenizer, tmp_path / "cache")[1].same_content(fingerprint)
    stat = first.stat()
    first.write_text("TO BE OR NOT TO BE\n")
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed, changed_fingerprint = corpus.tokenize_file(first, tokenizer, tmp_path / "cache")
    assert not changed_fingerprint.same_content(fingerprint)
    assert tokenizer.decode(changed) == "TO BE OR NOT TO BE\n"


def test_a_partial_cache_file_of_a_process_gone_is_removed(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("to be\n")
    tokenizer = load_tokenizer(FIXTURE)
    key = corpus.cache_key(corpus.content_fingerprint(path), path, tokenizer)
    (tmp_path / "cache").mkdir()
    abandoned = tmp_path / "cache" / f"{key}.partial-{socket.gethostname()}-999999999"
    abandoned.write_bytes(b"12")
    corpus.tokenize_file(path, tokenizer, tmp_path / "cache")
    assert [entry.name for entry in (tmp_path / "cache").iterdir()] == [f"{key}.tokens"]
