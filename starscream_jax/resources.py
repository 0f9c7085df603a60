"""Where the data files live: `meshes/` (hardware presets) and `models/` (model configurations).

A source checkout (editable install) reads them beside the package; an installed wheel reads the copies that
setup.cfg's data_files put under `<prefix>/share/starscream-jax/`.
"""
import sys
from pathlib import Path


def data_dir(kind: str) -> Path:
    """The directory that holds the `kind` files ("meshes" or "models")."""
    checkout = Path(__file__).resolve().parent.parent / kind
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "starscream-jax" / kind
