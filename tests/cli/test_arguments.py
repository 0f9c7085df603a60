"""The argument types the commands share, checked as the flags are read: before anything compiles."""
import argparse

import pytest

from starscream_jax.cli import main as cli
from starscream_jax.cli.arguments import output_file


@pytest.mark.parametrize("path, message", [
    ("/proc/x.png", r"directory /proc: cannot write there \(.* in /proc\); pass a directory on a writable"),
    ("/tmp", r"/tmp is a directory; pass a file path such as /tmp/plot.png"),
    ("plot.txt", r"plot.txt: matplotlib cannot write .txt files; end the name in one of .*\.png"),
])
def test_a_plot_path_that_cannot_be_written_is_refused(path, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        output_file(path)


def test_plot_paths_that_can_be_written_pass(tmp_path):
    assert output_file(str(tmp_path / "new" / "plan.svg")) == tmp_path / "new" / "plan.svg"
    assert output_file(str(tmp_path / "plan")) == tmp_path / "plan"
    assert not (tmp_path / "new").exists()


def test_inspect_refuses_an_unwritable_plot_while_parsing(monkeypatch, capsys):
    """Before the compile that takes minutes on a large model, not after it."""
    monkeypatch.setattr("starscream_jax.cli.inspect.inspect_layouts", lambda *_: pytest.fail("nothing compiles"))
    with pytest.raises(SystemExit) as exit_status:
        cli.main(["inspect", "--model", "tiny", "--plot", "/proc/x.png"])
    assert exit_status.value.code == 2
    assert "argument --plot: directory /proc: cannot write there" in capsys.readouterr().err
