"""The scripts under test, each imported from scripts/ by its file name (they are not a package)."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module named `name`, imported once per process."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # where its dataclasses look it up
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


@pytest.fixture(scope="session")
def script():
    """name -> scripts/<name>.py as a module (`load_script`)."""
    return load_script
