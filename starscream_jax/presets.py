"""Hardware presets: one TOML file per machine and partition mode in `meshes/`, chip figures in `meshes/chips/`.

A chip file holds whole-GPU figures (each with its source in a comment) and the valid compute x memory pairs; a
preset file names a chip and a mode. Per-partition figures are derived here, so every number lives in one place.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import PresetError
from .resources import data_dir

PARTITIONS_PER_MODE = {"SPX": 1, "DPX": 2, "QPX": 4, "CPX": 8}

CHIP_FIELDS = (
    "xcds", "gpus_per_node", "peak_bf16_flops", "hbm_bytes", "hbm_bandwidth", "intra_gpu_bandwidth",
    "intra_gpu_latency", "inter_gpu_bandwidth", "inter_gpu_link_bandwidth", "inter_gpu_latency", "flat_bandwidth",
    "inter_node_bandwidth", "inter_node_latency",
)


@dataclass(frozen=True)
class Chip:
    """Whole-GPU figures of one chip (bandwidths in bytes/s, latencies in s, FLOP/s dense bf16)."""

    name: str
    description: str
    xcds: int
    gpus_per_node: int
    peak_bf16_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    intra_gpu_bandwidth: float
    intra_gpu_latency: float
    inter_gpu_bandwidth: float
    inter_gpu_link_bandwidth: float
    inter_gpu_latency: float
    flat_bandwidth: float
    inter_node_bandwidth: float
    inter_node_latency: float
    modes: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Preset:
    """A chip in one compute x memory partition mode."""

    name: str
    chip: Chip
    compute_mode: str
    memory_mode: str
    preview: bool = False

    @property
    def partitions_per_gpu(self) -> int:
        return PARTITIONS_PER_MODE[self.compute_mode]


def list_presets() -> list[str]:
    """Names of every preset file in meshes/."""
    return sorted(p.stem for p in data_dir("meshes").glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise PresetError(f"{path} is not valid TOML ({err}); fix the file") from None


def load_chip(name: str) -> Chip:
    """Reads meshes/chips/<name>.toml."""
    path = data_dir("meshes") / "chips" / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.toml"))
        raise PresetError(f"unknown chip {name!r}; known chips: {', '.join(known)}")
    raw = _read_toml(path)
    missing = [f for f in ("name", "description", "modes", *CHIP_FIELDS) if f not in raw]
    if missing:
        raise PresetError(f"{path} lacks {', '.join(missing)}; every chip file gives all of {', '.join(CHIP_FIELDS)}")
    modes = {mode: tuple(memory) for mode, memory in raw["modes"].items()}
    unknown = sorted(set(modes) - set(PARTITIONS_PER_MODE))
    if unknown:
        raise PresetError(f"{path}: unknown compute mode(s) {unknown}; use {sorted(PARTITIONS_PER_MODE)}")
    fields = {f: raw[f] for f in CHIP_FIELDS}
    return Chip(name=raw["name"], description=raw["description"], modes=modes, **fields)


def check_mode(chip: Chip, compute_mode: str, memory_mode: str) -> None:
    """Raises PresetError naming the valid pairs when the chip cannot run compute_mode + memory_mode."""
    if memory_mode not in chip.modes.get(compute_mode, ()):
        pairs = ", ".join(f"{c}+{m}" for c, mems in chip.modes.items() for m in mems)
        raise PresetError(
            f"{chip.description} cannot run {compute_mode}+{memory_mode}; valid compute+memory pairs: {pairs}"
        )
    if PARTITIONS_PER_MODE[compute_mode] > chip.xcds:
        raise PresetError(f"{compute_mode} needs {PARTITIONS_PER_MODE[compute_mode]} XCDs; {chip.name} has {chip.xcds}")


def load_preset(name: str) -> Preset:
    """Reads meshes/<name>.toml, e.g. `load_preset("mi300x-cpx-nps1")`."""
    path = data_dir("meshes") / f"{name}.toml"
    if not path.is_file():
        raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(list_presets())}")
    raw = _read_toml(path)
    missing = [f for f in ("name", "chip", "compute_mode", "memory_mode") if f not in raw]
    if missing:
        raise PresetError(f"{path} lacks {', '.join(missing)}; a preset names its chip, compute_mode and memory_mode")
    if raw["compute_mode"] not in PARTITIONS_PER_MODE:
        raise PresetError(f"{path}: compute_mode {raw['compute_mode']!r} is not one of {sorted(PARTITIONS_PER_MODE)}")
    chip = load_chip(raw["chip"])
    check_mode(chip, raw["compute_mode"], raw["memory_mode"])
    return Preset(name=raw["name"], chip=chip, compute_mode=raw["compute_mode"], memory_mode=raw["memory_mode"],
                  preview=bool(raw.get("preview", False)))


def preset_for(chip_name: str, compute_mode: str, memory_mode: str) -> Preset:
    """The preset of a chip in a mode (checked first, so an invalid pair names the valid ones)."""
    check_mode(load_chip(chip_name), compute_mode, memory_mode)
    return load_preset(f"{chip_name}-{compute_mode}-{memory_mode}".lower())
