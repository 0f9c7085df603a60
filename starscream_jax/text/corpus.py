"""Training text beyond the demo corpus: plain text files and JSON Lines, read as written, tokenized once, cached,
packed.

A `.jsonl` file (any case) holds one document per line: a `text` string, or chat `messages` (a list of {"role",
"content"} strings, rendered by the tokenizer's chat template); any other file is one UTF-8 text document. Files are
decoded strictly: a byte that is not UTF-8, a NUL (UTF-16 or a binary file), a JSON file that is not JSON Lines or a
compressed file is a `StarscreamError` naming the file and the byte offset or line, never text with replacement
characters. Each file is fingerprinted by its content (`DataFingerprint`: size and SHA-256 of the bytes tokenized),
which a resumed run compares with the run's. Tokens are appended to a cache file as they come: the cache
(`CACHE_DIR/<key>.tokens`, raw int32) is keyed by that content and by the tokenizer, so a second run (or a resumed
one) reads it back as a memory map without tokenizing again. Documents are packed end to end, each closed by EOS
where the tokenizer has one, and training windows are drawn from the packed stream (`training.data.TokenBatches`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..checks import created_directory, process_alive
from ..errors import StarscreamError
from .tokenizer import ByteTokenizer, HFTokenizer, require_unicode

LINES_PER_BLOCK = 4096
"""Lines of a text file encoded at once (blocks end at line ends, so no token straddles two blocks' text)."""
TOKEN_DTYPE = np.int32
NOT_TEXT = (".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".parquet", ".arrow", ".npy", ".npz", ".bin", ".pdf",
            ".safetensors")
"""Suffixes of compressed or binary files, refused by name rather than read as text."""


@dataclass(frozen=True)
class DataFingerprint:
    """What a data file held when it was read: its size in bytes and the SHA-256 of those bytes. Two files with
    the same size and hash give the same tokens, wherever they lie."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def same_content(self, other: DataFingerprint) -> bool:
        return (self.size, self.sha256) == (other.size, other.sha256)


def file_kind(path: Path) -> str:
    """"jsonl" or "text", by the file's suffix in any case; a JSON or compressed/binary file is refused."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".json":
        raise StarscreamError(f"training data {path} is a JSON file; write one JSON object per line "
                              '({"text": ...} or {"messages": [...]}) into a .jsonl file')
    if suffix in NOT_TEXT:
        raise StarscreamError(f"training data {path} is a {suffix} file, not text; decompress or convert it to "
                              ".txt (UTF-8) or .jsonl")
    return "text"


class Lines:
    """The lines of a file as (line number, text), decoded strictly as UTF-8 while every byte read is hashed;
    `fingerprint` is complete once the lines are exhausted. A byte that is not UTF-8, or a NUL, is a
    StarscreamError naming the byte offset and line."""

    def __init__(self, path: Path):
        self.path = path
        self._hash, self._size = hashlib.sha256(), 0

    def __iter__(self) -> Iterator[tuple[int, str]]:
        with self.path.open("rb") as lines:
            for number, raw in enumerate(lines, 1):
                yield number, self._decoded(raw, number)
                self._hash.update(raw)
                self._size += len(raw)

    def _decoded(self, raw: bytes, number: int) -> str:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise StarscreamError(f"training data {self.path}: byte {self._size + err.start} (line {number}) is "
                                  f"not UTF-8 (0x{raw[err.start]:02x}); training text must be UTF-8: convert the file "
                                  "(e.g. iconv -f LATIN1 -t UTF-8)") from None
        if "\0" in text:
            raise StarscreamError(f"training data {self.path}: byte {self._size + raw.index(0)} (line {number}) "
                                  "is a NUL character: the file is UTF-16 or binary, not UTF-8 text; "
                                  "convert it to UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
        return text

    @property
    def fingerprint(self) -> DataFingerprint:
        return DataFingerprint(str(self.path), self._size, self._hash.hexdigest())


def documents(lines: Lines, kind: str, tokenizer: ByteTokenizer | HFTokenizer) -> Iterator[np.ndarray]:
    """The token ids of a file's `lines`, one array per block (text) or document (JSON Lines), EOS after each
    document."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    if kind == "jsonl":
        for number, line in lines:
            if line.strip():
                record = _record_tokens(f"{lines.path} line {number}", line, tokenizer)
                yield np.concatenate([record, eos]).astype(TOKEN_DTYPE)
        return
    block, first = [], True
    for _, line in lines:
        block.append(line)
        if len(block) == LINES_PER_BLOCK:
            yield tokenizer.encode("".join(block), special_tokens=first)
            block, first = [], False
    yield np.concatenate([tokenizer.encode("".join(block), special_tokens=first), eos]).astype(TOKEN_DTYPE)


def _record_tokens(where: str, line: str, tokenizer) -> np.ndarray:
    """One JSON Lines record: {"text": ...} encoded with special tokens, or {"messages": [...]} rendered by the
    chat template (which writes its own special tokens)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise StarscreamError(f"{where} is not JSON ({err}); each line must be one JSON object") from None
    if not isinstance(record, dict) or ("text" in record) == ("messages" in record):
        found = "both" if isinstance(record, dict) and "text" in record else "neither"
        raise StarscreamError(f"{where} has {found} of a 'text' string and a 'messages' list; give one per line")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise StarscreamError(f"{where}: 'text' is a {type(record['text']).__name__}; give a string")
        return tokenizer.encode(_whole_text(where, "'text'", record["text"]))
    _check_messages(where, record["messages"])
    for index, message in enumerate(record["messages"]):
        for field in ("role", "content"):
            _whole_text(where, f"message {index}'s {field!r}", message[field])
    return tokenizer.encode(tokenizer.render_chat(record["messages"]), special_tokens=False)


def _whole_text(where: str, what: str, text: str) -> str:
    """`text`, unless it holds a lone surrogate (a JSON escape such as "\\ud800" without its pair): then a
    StarscreamError naming the file, line and field."""
    return require_unicode(text, f"{where}: {what}", fix="the program that wrote the file split a character; fix or "
                                                         "drop that record")


def _check_messages(where: str, messages) -> None:
    """A StarscreamError unless `messages` is a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise StarscreamError(f"{where}: 'messages' is {messages!r:.60}; give a non-empty list of "
                              "{\"role\": ..., \"content\": ...} objects")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise StarscreamError(f"{where}: message {index} is {message!r:.60}; each message needs a 'role' "
                                  "string and a 'content' string")


def cache_key(fingerprint: DataFingerprint, path: Path, tokenizer: ByteTokenizer | HFTokenizer) -> str:
    """A name that changes when the file's content or the tokenizer does."""
    text = f"{fingerprint.size}|{fingerprint.sha256}|{file_kind(path)}|{tokenizer.fingerprint}"
    return f"{path.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def content_fingerprint(path: Path) -> DataFingerprint:
    """The file's size and SHA-256, read in one pass."""
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256")
    return DataFingerprint(str(path), path.stat().st_size, digest.hexdigest())


def tokenize_file(path: str | Path, tokenizer: ByteTokenizer | HFTokenizer,
                  cache_dir: str | Path) -> tuple[np.ndarray, DataFingerprint]:
    """(tokens [n] int32, the content fingerprint of what they came from): from the cache when present, else
    tokenized block by block into it. A file that changes while being read is refused."""
    path = _existing(path)
    kind, fingerprint = file_kind(path), content_fingerprint(path)
    cache = Path(cache_dir) / f"{cache_key(fingerprint, path, tokenizer)}.tokens"
    if not cache.is_file():
        created_directory(cache.parent, "--token-cache")
        _remove_abandoned(cache)
        partial = cache.parent / f"{cache.stem}.partial-{socket.gethostname()}-{os.getpid()}"
        try:
            lines = Lines(path)
            with partial.open("wb") as out:
                for block in documents(lines, kind, tokenizer):
                    out.write(block.astype(TOKEN_DTYPE).tobytes())
            _require_unchanged(fingerprint, lines.fingerprint)
            partial.replace(cache)
        finally:
            partial.unlink(missing_ok=True)
    tokens = np.memmap(cache, dtype=TOKEN_DTYPE, mode="r") if cache.stat().st_size else np.zeros(0, TOKEN_DTYPE)
    return tokens, fingerprint


def text_bytes(path: str | Path) -> tuple[np.ndarray, DataFingerprint]:
    """(the bytes of a UTF-8 text file as byte-level token ids [n] uint8, its fingerprint), checked as `Lines`
    checks them."""
    path = _existing(path)
    if file_kind(path) != "text":
        raise StarscreamError(f"training data {path}: JSON Lines take a tokenizer's path (`tokenize_file`)")
    lines = Lines(path)
    blocks = [line.encode("utf-8") for _, line in lines]
    return np.frombuffer(b"".join(blocks), np.uint8), lines.fingerprint


def load_token_stream(paths, tokenizer: ByteTokenizer | HFTokenizer,
                      cache_dir: str | Path) -> tuple[np.ndarray, list[DataFingerprint]]:
    """(the packed tokens of every file in order [n] int32, each file's fingerprint). Text files under the
    byte-level tokenizer are their own bytes (nothing to cache); the rest goes through the token cache."""
    streams = [text_bytes(path) if isinstance(tokenizer, ByteTokenizer) and file_kind(Path(path)) == "text"
               else tokenize_file(path, tokenizer, cache_dir) for path in paths]
    tokens = [stream.astype(TOKEN_DTYPE) if stream.dtype != TOKEN_DTYPE else stream for stream, _ in streams]
    return tokens[0] if len(tokens) == 1 else np.concatenate(tokens), [fingerprint for _, fingerprint in streams]


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise StarscreamError(f"training data {path} is a directory; pass --data with its .txt or .jsonl files "
                              f"({path}/*.txt)")
    if not path.is_file():
        raise StarscreamError(f"training data {path} not found; pass --data with existing .txt or .jsonl files")
    return path


def _require_unchanged(before: DataFingerprint, read: DataFingerprint) -> None:
    if not before.same_content(read):
        raise StarscreamError(f"training data {before.path} changed while it was being read ({before.size} bytes, "
                              f"then {read.size}); let whatever writes it finish and run again")


def _remove_abandoned(cache: Path) -> None:
    """Deletes partial cache files of `cache` that processes of this host no longer running left behind (a run
    killed mid-tokenization)."""
    prefix = f"{cache.stem}.partial-{socket.gethostname()}-"
    for partial in cache.parent.glob(f"{prefix}*"):
        pid = partial.name[len(prefix):]
        if pid.isdigit() and not process_alive(int(pid)):
            partial.unlink(missing_ok=True)
