"""The model configurations a run can name: models/<name>.toml, a TOML file at a path, or a Hugging Face model
directory (`hf_config`). Above both `config` (the dataclass) and `hf_config` (config.json <-> ModelConfig), so
neither imports the other back."""
from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from ..errors import PresetError
from ..resources import data_dir
from .config import FIELDS, ModelConfig
from .hf_config import model_config_from_hf


def list_model_configs() -> list[str]:
    return sorted(p.stem for p in data_dir("models").glob("*.toml"))


def load_model_config(name_or_path: str | Path, **overrides) -> ModelConfig:
    """Reads models/<name>.toml, a TOML file at a path in the same format, or the config.json of a Hugging Face
    model directory (`hf_config`); keyword overrides win."""
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return model_config_from_hf(path, **overrides)
    if not path.is_file():
        path = data_dir("models") / f"{name_or_path}.toml"
    if not path.is_file():
        raise PresetError(f"unknown model {str(name_or_path)!r}; give a file path, a model directory holding "
                          f"config.json, or one of {', '.join(list_model_configs())}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise PresetError(f"{path} is not valid TOML ({err}); fix the file") from None
    raw = {**raw, **overrides}
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise PresetError(f"{path}: unknown field(s) {unknown}; known fields: {', '.join(FIELDS)}")
    missing = [n for n, f in FIELDS.items()
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in raw]
    if missing:
        raise PresetError(f"{path}: missing field(s) {missing}")
    return ModelConfig(**raw)
