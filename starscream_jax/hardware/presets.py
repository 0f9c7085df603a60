"""Hardware presets: one TOML file per machine and partition mode in `meshes/`, chip figures in `meshes/chips/`.

A chip file holds whole-GPU figures (each with its source in a comment) and the valid compute x memory pairs; a
preset file names a chip and a mode. Per-partition figures are derived in `Topology`, so every number lives in one
place. Every loader takes an optional `directory` (default: the package's `meshes/`) so that other preset sets can
be read and checked.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..checks import of_type
from ..errors import PresetError
from ..resources import data_dir

PARTITIONS_PER_MODE = {"SPX": 1, "DPX": 2, "QPX": 4, "CPX": 8}
MEMORY_MODES = ("NPS1", "NPS2", "NPS4")

CHIP_FIELDS = (
    "xcds", "gpus_per_node", "peak_bf16_flops", "hbm_bytes", "hbm_bandwidth", "intra_gpu_bandwidth",
    "intra_gpu_latency", "inter_gpu_bandwidth", "inter_gpu_link_bandwidth", "inter_gpu_latency", "flat_bandwidth",
    "flat_latency", "inter_node_bandwidth", "inter_node_latency",
)
PRESET_FIELDS = ("name", "chip", "compute_mode", "memory_mode")
_PRESET_NAME = re.compile(r"^([a-z0-9]+)-([a-z]px)-(nps\d)$")


@dataclass(frozen=True, kw_only=True)
class Chip:
    """Whole-GPU figures of one chip (bandwidths in bytes/s, latencies in s, FLOP/s dense bf16).

    modes: the valid (compute mode, memory modes) pairs, e.g. (("SPX", ("NPS1",)), ("DPX", ("NPS1", "NPS2"))).
    vendor: the chip's maker ("nvidia", "amd"; "" when not given), which decides the libraries the model's kernels
    call there (decode attention through cuDNN on NVIDIA, `analysis.memory.reads_cache_in_place`).
    formats: the 8-bit formats its matrix units take (of EIGHT_BIT_FORMATS), e.g. ("int8", "float8_e4m3fnuz",
    "float8_e5m2fnuz") on MI300X, which has no OCP fp8.
    """

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
    flat_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    modes: tuple[tuple[str, tuple[str, ...]], ...]
    vendor: str = ""
    formats: tuple[str, ...] = ("int8",)

    def memory_modes(self, compute_mode: str) -> tuple[str, ...]:
        """The memory modes this chip runs with `compute_mode` (none for a compute mode it lacks)."""
        return dict(self.modes).get(compute_mode, ())

    def check_format(self, format_name: str) -> None:
        """Raises PresetError naming the chip and the formats it has when it does not compute in `format_name`."""
        if format_name not in self.formats:
            raise PresetError(f"{self.description} ({self.name}) does not compute in {format_name}; its 8-bit "
                              f"formats: {', '.join(self.formats)}")

    def fp8_pair(self) -> tuple[str, str]:
        """(e4m3, e5m2): the chip's fp8 formats for values and for gradients (OCP, or FNUZ on MI300X);
        PresetError when it has none."""
        for pair in FP8_PAIRS:
            if all(name in self.formats for name in pair):
                return pair
        raise PresetError(f"{self.description} ({self.name}) has no fp8 formats; its 8-bit formats: "
                          f"{', '.join(self.formats)}; use int8")

    def valid_pairs(self) -> str:
        """The compute+memory pairs this chip runs, e.g. "SPX+NPS1, DPX+NPS1, DPX+NPS2"."""
        return ", ".join(f"{compute}+{memory}" for compute, memories in self.modes for memory in memories)


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A chip in one compute x memory partition mode (`preview`: the vendor ships the mode as a preview)."""

    name: str
    chip: Chip
    compute_mode: str
    memory_mode: str
    preview: bool = False

    @property
    def partitions_per_gpu(self) -> int:
        return PARTITIONS_PER_MODE[self.compute_mode]


def _meshes(directory: Path | str | None) -> Path:
    return Path(directory) if directory is not None else data_dir("meshes")


def list_presets(directory: Path | str | None = None) -> list[str]:
    """Names of every preset file in `directory` (default: meshes/)."""
    return sorted(p.stem for p in _meshes(directory).glob("*.toml"))


def list_chips(directory: Path | str | None = None) -> list[str]:
    """Names of every chip file in `directory`/chips (default: meshes/chips/)."""
    return sorted(p.stem for p in (_meshes(directory) / "chips").glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise PresetError(f"{path} is not valid TOML ({err}); fix the syntax at that line") from None


def _require(raw: dict, fields: tuple[str, ...], path: Path, what: str) -> None:
    missing = [field for field in fields if field not in raw]
    if missing:
        raise PresetError(f"{path} lacks {', '.join(missing)}; {what} gives all of {', '.join(fields)}")


def _read_modes(raw_modes, path: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The [modes] table: compute mode -> list of memory modes."""
    example = 'e.g. DPX = ["NPS1", "NPS2"]'
    if not isinstance(raw_modes, dict) or not all(isinstance(m, list) for m in raw_modes.values()):
        raise PresetError(f"{path}: [modes] must map each compute mode to a list of memory modes, {example}")
    modes = tuple((compute, tuple(memories)) for compute, memories in raw_modes.items())
    unknown_compute = sorted({compute for compute, _ in modes} - set(PARTITIONS_PER_MODE))
    if unknown_compute:
        raise PresetError(f"{path}: unknown compute mode(s) {unknown_compute} in [modes]; use "
                          f"{', '.join(PARTITIONS_PER_MODE)}")
    unknown_memory = sorted({m for _, memories in modes for m in memories} - set(MEMORY_MODES))
    if unknown_memory:
        raise PresetError(f"{path}: unknown memory mode(s) {unknown_memory} in [modes]; use {', '.join(MEMORY_MODES)}")
    return modes


FP8_PAIRS = (("float8_e4m3fn", "float8_e5m2"), ("float8_e4m3fnuz", "float8_e5m2fnuz"))
"""The (e4m3, e5m2) fp8 formats of a chip: OCP's, then AMD gfx942's FNUZ ones (no negative zero, one NaN)."""
EIGHT_BIT_FORMATS = ("int8", *(name for pair in FP8_PAIRS for name in pair))
"""Every 8-bit format a chip file's `formats` may list (JAX dtype names)."""

VENDORS = ("", "nvidia", "amd")
"""A chip file's `vendor` values: it decides which vendor libraries the model's kernels call (cuDNN on NVIDIA)."""


def load_chip(name: str, directory: Path | str | None = None) -> Chip:
    """Reads `directory`/chips/<name>.toml (default: meshes/chips/)."""
    path = _meshes(directory) / "chips" / f"{name}.toml"
    if not path.is_file():
        raise PresetError(f"unknown chip {name!r} (no {path}); known chips: {', '.join(list_chips(directory))}")
    raw = _read_toml(path)
    _require(raw, ("name", "description", "modes", "formats", *CHIP_FIELDS), path, "every chip file")
    wrong = [f for f in CHIP_FIELDS if isinstance(raw[f], bool) or not isinstance(raw[f], int | float) or raw[f] <= 0]
    if wrong:
        raise PresetError(f"{path}: {', '.join(f'{f} = {raw[f]!r}' for f in wrong)}; each figure is a positive "
                          f"number (bytes, bytes/s, seconds or FLOP/s)")
    modes = _read_modes(raw["modes"], path)
    too_many = [compute for compute, _ in modes if PARTITIONS_PER_MODE[compute] > raw["xcds"]]
    if too_many:
        raise PresetError(f"{path}: [modes] lists {', '.join(too_many)} but xcds = {raw['xcds']}; a compute mode "
                          f"cannot have more partitions than the chip has XCDs")
    vendor = raw.get("vendor", "")
    if vendor not in VENDORS:
        raise PresetError(f"{path}: vendor = {vendor!r}; use one of {', '.join(map(repr, VENDORS))} (or leave it out)")
    fields = {f: raw[f] for f in CHIP_FIELDS}
    return Chip(name=raw["name"], description=raw["description"], modes=modes, vendor=vendor,
                formats=_read_formats(raw["formats"], path), **fields)


def _read_formats(raw_formats, path: Path) -> tuple[str, ...]:
    """The chip file's `formats`: a list of EIGHT_BIT_FORMATS names."""
    if not isinstance(raw_formats, list) or not all(name in EIGHT_BIT_FORMATS for name in raw_formats):
        raise PresetError(f"{path}: formats = {raw_formats!r}; list the 8-bit formats the chip computes in, of "
                          f"{', '.join(EIGHT_BIT_FORMATS)}")
    return tuple(raw_formats)


def check_mode(chip: Chip, compute_mode: str, memory_mode: str) -> None:
    """Raises PresetError naming the valid pairs when the chip cannot run compute_mode + memory_mode."""
    if memory_mode not in chip.memory_modes(compute_mode):
        raise PresetError(f"{chip.description} cannot run {compute_mode}+{memory_mode}; valid compute+memory "
                          f"pairs: {chip.valid_pairs()}")


def load_preset(name: str, directory: Path | str | None = None) -> Preset:
    """Reads `directory`/<name>.toml (default: meshes/), e.g. `load_preset("mi300x-cpx-nps1")`.

    A name of the form CHIP-MODE-NPSn whose chip exists but whose pair the chip cannot run ("mi300x-spx-nps4")
    names the chip's valid pairs.
    """
    of_type(name, str, "preset", f"a preset name ({', '.join(list_presets(directory))})", PresetError)
    path = _meshes(directory) / f"{name}.toml"
    if not path.is_file():
        _check_name_of_missing_preset(name, directory)
        raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(list_presets(directory))}")
    raw = _read_toml(path)
    _require(raw, PRESET_FIELDS, path, "a preset file")
    if raw["name"] != path.stem:
        raise PresetError(f"{path} says name = {raw['name']!r}; a preset's name is its file name, {path.stem!r}")
    if raw["compute_mode"] not in PARTITIONS_PER_MODE:
        raise PresetError(f"{path}: compute_mode {raw['compute_mode']!r} is not one of "
                          f"{', '.join(PARTITIONS_PER_MODE)}")
    if raw["memory_mode"] not in MEMORY_MODES:
        raise PresetError(f"{path}: memory_mode {raw['memory_mode']!r} is not one of {', '.join(MEMORY_MODES)}")
    if not isinstance(raw.get("preview", False), bool):
        raise PresetError(f"{path}: preview = {raw['preview']!r}; write preview = true or leave it out")
    chip = load_chip(raw["chip"], directory)
    try:
        check_mode(chip, raw["compute_mode"], raw["memory_mode"])
    except PresetError as err:
        raise PresetError(f"{path}: {err}") from None
    return Preset(name=raw["name"], chip=chip, compute_mode=raw["compute_mode"], memory_mode=raw["memory_mode"],
                  preview=raw.get("preview", False))


def _check_name_of_missing_preset(name: str, directory: Path | str | None) -> None:
    """For a missing CHIP-MODE-NPSn preset of a known chip, raises the error that names the chip's valid pairs."""
    parts = _PRESET_NAME.match(name)
    if parts and parts.group(1) in list_chips(directory):
        chip = load_chip(parts.group(1), directory)
        check_mode(chip, parts.group(2).upper(), parts.group(3).upper())


def preset_for(chip_name: str, compute_mode: str, memory_mode: str, directory: Path | str | None = None) -> Preset:
    """The preset of a chip in a mode (checked first, so an invalid pair names the valid ones)."""
    check_mode(load_chip(chip_name, directory), compute_mode, memory_mode)
    return load_preset(f"{chip_name}-{compute_mode}-{memory_mode}".lower(), directory)
