"""Training text beyond the demo corpus: plain text files and JSON Lines, tokenized once, cached, packed.

A `.txt` file is one document; a `.jsonl` file holds one document per line, a `text` field or chat `messages`
(rendered by the tokenizer's chat template). Files are read a block of lines at a time, never whole, and their tokens
are appended to a cache file as they come: the cache (`CACHE_DIR/<key>.tokens`, raw int32) is keyed by the file's
path, size and modification time and by the tokenizer, so a second run (or a resumed one) reads it back as a
memory map without tokenizing again. Documents are packed end to end, each closed by EOS where the tokenizer has
one, and training windows are drawn from the packed stream (`data.TokenBatches`); the last tenth is held out.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import StarscreamError
from .tokenizer import TOKENIZER_FILE, ByteTokenizer, HFTokenizer

LINES_PER_BLOCK = 4096
"""Lines of a text file encoded at once (blocks end at line ends, so no token straddles two blocks' text)."""
TOKEN_DTYPE = np.int32


def documents(path: Path, tokenizer: ByteTokenizer | HFTokenizer) -> Iterator[np.ndarray]:
    """The token ids of `path`, one array per block (text) or document (JSON Lines), EOS after each document."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield np.concatenate([_record_tokens(path, number, line, tokenizer), eos]).astype(TOKEN_DTYPE)
        return
    with path.open(encoding="utf-8", errors="replace") as lines:
        block, first = [], True
        for line in lines:
            block.append(line)
            if len(block) == LINES_PER_BLOCK:
                yield tokenizer.encode("".join(block), special_tokens=first)
                block, first = [], False
        yield np.concatenate([tokenizer.encode("".join(block), special_tokens=first), eos]).astype(TOKEN_DTYPE)


def _record_tokens(path: Path, number: int, line: str, tokenizer) -> np.ndarray:
    """One JSON Lines record: {"text": ...} encoded with special tokens, or {"messages": [...]} rendered by the
    chat template (which writes its own special tokens)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise StarscreamError(f"{path} line {number} is not JSON ({err}); each line must be one JSON object") from None
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return tokenizer.encode(record["text"])
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return tokenizer.encode(tokenizer.render_chat(record["messages"]), special_tokens=False)
    raise StarscreamError(f"{path} line {number} has neither a 'text' string nor a 'messages' list; give one per "
                          "line")


def cache_key(path: Path, tokenizer: ByteTokenizer | HFTokenizer) -> str:
    """A name that changes when the file or the tokenizer does."""
    stat = path.stat()
    if isinstance(tokenizer, HFTokenizer):
        identity = hashlib.sha256((tokenizer.directory / TOKENIZER_FILE).read_bytes()).hexdigest()
        identity += f"{tokenizer.add_bos}{tokenizer.add_eos}{tokenizer.chat_template}{tokenizer.eos_id}"
    else:
        identity = "bytes"
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{identity}"
    return f"{path.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def tokenize_file(path: str | Path, tokenizer: ByteTokenizer | HFTokenizer, cache_dir: str | Path) -> np.ndarray:
    """The tokens of `path` [n] int32, from the cache when present, else tokenized block by block into it."""
    path = Path(path)
    if not path.is_file():
        raise StarscreamError(f"training data {path} not found; pass --data with existing .txt or .jsonl files")
    cache = Path(cache_dir) / f"{cache_key(path, tokenizer)}.tokens"
    if not cache.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".partial-{os.getpid()}")
        with partial.open("wb") as out:
            for block in documents(path, tokenizer):
                out.write(block.astype(TOKEN_DTYPE).tobytes())
        partial.replace(cache)
    return np.memmap(cache, dtype=TOKEN_DTYPE, mode="r") if cache.stat().st_size else np.zeros(0, TOKEN_DTYPE)


def load_token_stream(paths, tokenizer: ByteTokenizer | HFTokenizer, cache_dir: str | Path) -> np.ndarray:
    """The packed tokens of every file in order [n] int32 (a memory map when there is one file)."""
    streams = [tokenize_file(path, tokenizer, cache_dir) for path in paths]
    return streams[0] if len(streams) == 1 else np.concatenate(streams)
