"""Checks of single values: whole numbers, finite numbers and writable directories, each refused in one line."""
import math

import pytest

from starscream_jax.checks import finite_number, whole_number, writable_directory
from starscream_jax.errors import StarscreamError


@pytest.mark.parametrize("value, message", [
    (0, "--steps 0: must be at least 1; pass 1 or more"),
    (-3, "--steps -3: must be at least 1"),
    (2.5, "--steps 2.5: expected a whole number"),
    (True, "--steps True: expected a whole number"),
    ("4", "--steps '4': expected a whole number"),
])
def test_whole_numbers_below_the_minimum_or_of_another_type_are_refused(value, message):
    with pytest.raises(StarscreamError, match=message):
        whole_number(value, "--steps")


@pytest.mark.parametrize("value, positive, message", [
    (math.nan, False, "--lr nan: must be a finite number zero or more"),
    (math.inf, False, "--lr inf: must be a finite number"),
    (-1e-3, False, "--lr -0.001: must be a finite number zero or more"),
    (0.0, True, "--lr 0.0: must be a finite number above zero"),
    ("fast", False, "--lr 'fast': expected a number"),
])
def test_non_finite_negative_or_zero_numbers_are_refused(value, positive, message):
    with pytest.raises(StarscreamError, match=message):
        finite_number(value, "--lr", positive=positive)


def test_accepted_values_come_back():
    assert whole_number(0, "--seed", minimum=0) == 0
    assert finite_number(3, "--lr", positive=True) == 3.0


def test_a_directory_path_under_a_file_is_refused_and_a_new_one_is_not_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StarscreamError, match=rf"--run-dir {blocker}/runs/a: {blocker} is a file, not a directory"):
        writable_directory(blocker / "runs" / "a", "--run-dir")
    assert writable_directory(tmp_path / "new" / "run", "--run-dir") == tmp_path / "new" / "run"
    assert not (tmp_path / "new").exists()


def test_a_directory_whose_permission_bits_allow_but_whose_file_system_refuses_is_refused():
    """/proc looks writable to root by its bits; a file created there tells (and nothing is left anywhere)."""
    with pytest.raises(StarscreamError, match=r"--plot /proc/x: cannot write there \(.* in /proc\); pass a directory "
                                              r"on a writable file system"):
        writable_directory("/proc/x", "--plot")


def test_process_alive_tells_a_running_process_from_one_gone():
    import os
    import subprocess

    from starscream_jax.checks import process_alive

    gone = subprocess.Popen(["true"])
    gone.wait()
    assert process_alive(os.getpid()) and not process_alive(gone.pid)
