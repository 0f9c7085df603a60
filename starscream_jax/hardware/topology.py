"""The `Topology` value: how many nodes, physical GPUs and partitions, in which mode, with which hardware figures.

A topology comes from a preset (`Topology.from_preset`), from an override string (`parse_override`: "8x8",
"2x8x8", a preset name, or "PRESET:GPUS"), or from detection on a real machine (the mesh builder does that).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..checks import of_type
from ..errors import StarscreamError, TopologyError
from .presets import PARTITIONS_PER_MODE, Preset, list_presets, load_preset

OVERRIDE_ENV = "STARSCREAM_TOPOLOGY"
MODE_FOR_PARTITIONS = {count: mode for mode, count in PARTITIONS_PER_MODE.items()}


@dataclass(frozen=True, kw_only=True)
class Topology:
    """nodes x gpus_per_node physical GPUs, each split into partitions_per_gpu logical devices.

    Per-partition figures divide the chip's whole-GPU figures by the compute mode's partition count.
    """

    preset: Preset
    nodes: int
    gpus_per_node: int
    partitions_per_gpu: int

    @classmethod
    def from_preset(cls, preset: Preset | str, gpus: int | None = None, nodes: int = 1,
                    partitions: int | None = None) -> Topology:
        """`gpus` GPUs per node (default: the chip's board size); `partitions` only for the cpu preset."""
        preset = load_preset(preset) if isinstance(preset, str) else preset
        if partitions is not None and preset.chip.name != "cpu" and partitions != preset.partitions_per_gpu:
            raise TopologyError(
                f"preset {preset.name} has {preset.partitions_per_gpu} partitions per GPU, not {partitions}; "
                f"drop the partition count or pick a preset in the mode you want ({', '.join(list_presets())})")
        topology = cls(preset=preset, nodes=nodes,
                       gpus_per_node=preset.chip.gpus_per_node if gpus is None else gpus,
                       partitions_per_gpu=preset.partitions_per_gpu if partitions is None else partitions)
        topology.validate()
        return topology

    def validate(self) -> None:
        """Raises TopologyError unless every count is a positive integer, a node holds no more GPUs than the chip's
        board (the cpu preset's simulated nodes any number) and partitions fit the chip's XCDs."""
        for name in ("nodes", "gpus_per_node", "partitions_per_gpu"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name} is {getattr(self, name)}; it must be a positive integer")
        board = self.preset.chip.gpus_per_node
        if self.preset.chip.name != "cpu" and self.gpus_per_node > board:
            raise TopologyError(f"{self.gpus_per_node} GPUs per node, but a node of {self.preset.chip.name} holds "
                                f"{board}; spread them over nodes ({-(-self.gpus_per_node // board)} nodes of "
                                f"{board} GPUs: NODESxGPUSxPARTITIONS, or --nodes)")
        if self.partitions_per_gpu > self.preset.chip.xcds:
            raise TopologyError(f"{self.partitions_per_gpu} partitions per GPU, but chip {self.preset.chip.name} "
                                f"has {self.preset.chip.xcds} XCDs; use at most {self.preset.chip.xcds}")

    @property
    def compute_mode(self) -> str:
        if self.preset.chip.name == "cpu":
            return MODE_FOR_PARTITIONS.get(self.partitions_per_gpu, f"{self.partitions_per_gpu}-way")
        return self.preset.compute_mode

    @property
    def memory_mode(self) -> str:
        return self.preset.memory_mode

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def num_devices(self) -> int:
        return self.num_gpus * self.partitions_per_gpu

    @property
    def devices_per_chip(self) -> int:
        """How many logical devices share one chip's figures: the compute mode's partition count (on the cpu
        preset, the partitions asked for). It differs from partitions_per_gpu when only some partitions of each GPU
        are visible, or when a grouping treats whole GPUs as partitions."""
        return self.partitions_per_gpu if self.preset.chip.name == "cpu" else self.preset.partitions_per_gpu

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one partition."""
        return self.preset.chip.peak_bf16_flops / self.devices_per_chip

    @property
    def hbm_bytes(self) -> float:
        """HBM bytes of one partition."""
        return self.preset.chip.hbm_bytes / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        """HBM bytes/s of one partition."""
        return self.preset.chip.hbm_bandwidth / self.devices_per_chip

    @property
    def ridge_point(self) -> float:
        """FLOP per HBM byte above which a local kernel is compute-bound."""
        return self.peak_flops / self.hbm_bandwidth

    def describe(self) -> dict:
        """A JSON-ready summary."""
        chip = self.preset.chip
        return {
            "preset": self.preset.name, "chip": chip.description, "compute_mode": self.compute_mode,
            "memory_mode": self.memory_mode, "preview": self.preset.preview, "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node, "partitions_per_gpu": self.partitions_per_gpu,
            "num_devices": self.num_devices,
            "per_partition": {"peak_bf16_flops": self.peak_flops, "hbm_bytes": self.hbm_bytes,
                              "hbm_bandwidth": self.hbm_bandwidth},
            "links": {"intra_gpu_bandwidth": chip.intra_gpu_bandwidth, "inter_gpu_bandwidth": chip.inter_gpu_bandwidth,
                      "inter_gpu_latency": chip.inter_gpu_latency, "inter_node_bandwidth": chip.inter_node_bandwidth},
        }


_SHAPE = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+)$")
_FORMS = "write GPUSxPARTITIONS (8x8), NODESxGPUSxPARTITIONS (2x8x8), a preset name or PRESET:GPUS (mi300x-cpx-nps1:4)"


def parse_override(text: str) -> Topology:
    """Reads "GPUSxPARTITIONS" ("8x8"), "NODESxGPUSxPARTITIONS" ("2x8x8"), a preset name, or "PRESET:GPUS".

    A bare shape uses the cpu preset's figures; partitions of 1, 2, 4 or 8 map to SPX, DPX, QPX, CPX.
    Anything else raises one TopologyError that quotes the text and the accepted forms.
    """
    of_type(text, str, "topology override", "a string such as '8x8', '2x8x8' or 'mi300x-cpx-nps1:4'", TopologyError)
    text = text.strip().lower()
    try:
        return _parse(text)
    except StarscreamError as err:
        raise TopologyError(f"topology override {text!r}: {err}; {_FORMS}") from None


def _parse(text: str) -> Topology:
    shape = _SHAPE.match(text)
    if shape:
        nodes, gpus, partitions = (int(shape.group(1) or 1), int(shape.group(2)), int(shape.group(3)))
        return Topology.from_preset("cpu", gpus=gpus, nodes=nodes, partitions=partitions)
    name, colon, gpus = text.partition(":")
    if colon and not gpus.isdigit():
        raise TopologyError(f"after ':' comes a GPU count, found {gpus!r}")
    if re.fullmatch(r"[\dx]+", name):
        raise TopologyError("a shape is two or three integers joined by 'x'")
    return Topology.from_preset(name, gpus=int(gpus) if colon else None)


def override_from_env() -> Topology | None:
    """The topology named by $STARSCREAM_TOPOLOGY, if set; a malformed value names the variable."""
    text = os.environ.get(OVERRIDE_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_override(text)
    except TopologyError as err:
        raise TopologyError(f"${OVERRIDE_ENV}: {err}") from None
