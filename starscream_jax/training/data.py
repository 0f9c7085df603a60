"""The demo corpus and deterministic batches placed straight onto a sharded mesh.

The demo's tokens are the UTF-8 bytes of its text (`text.byte_level`, a vocabulary of 256). It needs no download or
training, every byte is representable and encoding then decoding returns the original text exactly.

The batch for a training step is a pure function of (seed, step): resuming from a checkpoint at step s replays exactly
the batches an uninterrupted run would have seen. Each process builds only the rows and columns of the [batch, seq]
token array that its own devices hold (`jax.make_array_from_callback`), so no host ever materializes the whole batch
and the same code runs on one process or many.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from ..errors import StarscreamError
from ..resources import data_dir
from ..text.byte_level import VOCAB_SIZE

DEFAULT_CORPUS = data_dir("data") / "tinyshakespeare.txt"  # data/README.md says where it comes from


def load_corpus(path: str | Path = DEFAULT_CORPUS) -> np.ndarray:
    """The file's bytes as token ids [n] (uint8)."""
    corpus_path = Path(path)
    if not corpus_path.is_file():
        raise StarscreamError(
            f"corpus file {corpus_path} not found; expected a text file; pass --data PATH (default {DEFAULT_CORPUS})"
        )
    return np.fromfile(corpus_path, dtype=np.uint8)


def require_readable(paths: list[str]) -> None:
    """A StarscreamError naming the first data file that exists but cannot be read (its permissions, an I/O error),
    checked on its first byte before anything is tokenized: the corpus reader would fail with a bare OSError (one
    raised mid-read names no file). A missing file or a directory is left to the reader, which names it."""
    for path in paths:
        try:
            with open(path, "rb") as file:
                file.read(1)
        except (FileNotFoundError, IsADirectoryError):
            continue
        except OSError as error:
            raise StarscreamError(f"training data {path} cannot be read ({error.strerror}); make it readable, or "
                                  "pass --data files this user can read") from None


def split_corpus(tokens: np.ndarray, validation_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last `validation_fraction` of the tokens is held out for validation."""
    if not 0.0 < validation_fraction < 1.0:
        raise StarscreamError(
            f"validation fraction {validation_fraction} is outside (0, 1); pass a fraction such as 0.1"
        )
    split_index = int(len(tokens) * (1.0 - validation_fraction))
    return tokens[:split_index], tokens[split_index:]


def unigram_entropy_nats(tokens: np.ndarray) -> float:
    """Entropy of the byte frequencies, in nats: the loss of the best model that ignores context."""
    counts = np.bincount(tokens, minlength=VOCAB_SIZE)
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())


def nats_to_bits(nats: float) -> float:
    """A loss or entropy in nats, expressed in bits."""
    return nats / math.log(2.0)


@dataclass(frozen=True, kw_only=True)
class TokenBatches:
    """Windows of `seq_len` consecutive tokens drawn from `tokens`, `batch_size` per step.

    Row r of step s starts at `start_offsets(s)[r]`, drawn uniformly by a generator seeded with (seed, s): a pure
    function of (seed, step), the same on every process.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    source: str = "the data"
    """What `tokens` are, as an error names them."""

    def __post_init__(self):
        if len(self.tokens) <= self.seq_len:
            raise StarscreamError(
                f"{self.source}: {len(self.tokens)} tokens cannot fill one window of {self.seq_len} (--seq-len + 1); "
                "use a larger corpus or a shorter --seq-len"
            )

    def start_offsets(self, step: int) -> np.ndarray:
        """Start of each row's window for `step`: [batch_size] int64."""
        generator = np.random.default_rng(np.random.SeedSequence([self.seed, step]))
        return generator.integers(0, len(self.tokens) - self.seq_len + 1, size=self.batch_size)

    def block(self, step: int, index: tuple[slice, ...] = (slice(None), slice(None))) -> np.ndarray:
        """The part `index` (row slice, column slice) of step's [batch_size, seq_len] token array, as int32."""
        row_slice, column_slice = (tuple(index) + (slice(None), slice(None)))[:2]
        row_starts = self.start_offsets(step)[row_slice]
        columns = np.arange(self.seq_len)[column_slice]
        return self.tokens[row_starts[:, None] + columns[None, :]].astype(np.int32)

    def global_batch(self, step: int, sharding):
        """Step's tokens as a global jax.Array [batch_size, seq_len] int32 with `sharding`.

        Each process fills only the shards of its addressable devices, from the (seed, step) offsets.
        """
        return jax.make_array_from_callback(
            (self.batch_size, self.seq_len), sharding, lambda index: self.block(step, index)
        )
