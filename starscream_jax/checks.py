"""Checks of single input values, shared by every configuration and command: each returns the value or raises a
`StarscreamError` that names the value and the fix. `name` is how the user gave the value (a flag such as
"--steps", or a configuration field such as "model tiny: n_layers")."""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from .errors import StarscreamError


def whole_number(value, name: str, minimum: int = 1) -> int:
    """`value` when it is an int (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StarscreamError(f"{name} {value!r}: expected a whole number; pass one such as {max(minimum, 1)}")
    if value < minimum:
        raise StarscreamError(f"{name} {value}: must be at least {minimum}; pass {minimum} or more")
    return value


def finite_number(value, name: str, *, positive: bool = False) -> float:
    """`value` when it is a finite real number, not negative (and above zero when `positive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StarscreamError(f"{name} {value!r}: expected a number")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "above zero" if positive else "zero or more"
        raise StarscreamError(f"{name} {value}: must be a finite number {bound}")
    return float(value)


def writable_directory(path: str | os.PathLike, name: str) -> Path:
    """`path` as a Path when it is a directory this process can write into, or can be created as one (its nearest
    existing ancestor is a writable directory: a file is created there and removed at once, which the permission
    bits alone do not tell on a pseudo or read-only file system such as /proc, even for root). Nothing is left."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StarscreamError(f"{name} {path}: {existing} is a file, not a directory; pass a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StarscreamError(f"{name} {path}: {existing} is not writable by this user; pass a directory you can "
                              "write to")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise StarscreamError(f"{name} {path}: cannot write there ({error.strerror or error} in {existing}); pass a "
                              "directory on a writable file system") from None
    return path


def of_type(value, kinds: type | tuple[type, ...], name: str, expected: str, error=StarscreamError):
    """`value` when it is an instance of `kinds`; else `error` (a StarscreamError) saying what `name` should be."""
    if not isinstance(value, kinds):
        raise error(f"{name} {_short(value)} ({type(value).__name__}): expected {expected}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def created_directory(path: str | os.PathLike, name: str) -> Path:
    """`path`, created (with its parents) when missing, once a file could be written in it: a directory on a
    read-only or pseudo file system (/proc, /sys) is a StarscreamError naming it, not an OSError later."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise StarscreamError(f"{name} {path}: cannot write there ({error.strerror or error}); pass a directory on "
                              "a writable file system") from None
    return path


def process_alive(pid: int) -> bool:
    """Whether a process with `pid` exists on this host (one owned by another user counts): whether a lock or a
    partial file that process left is still in use."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
