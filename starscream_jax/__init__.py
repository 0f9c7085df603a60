"""starscream-jax: topology-aware sharding for JAX on partitioned chiplet GPUs."""
from .errors import PresetError, ShardingRuleError, StarscreamError, TopologyError
from .mesh import AXES, build_mesh, build_topology_mesh, simulate_cpu_devices
from .presets import list_presets, load_preset
from .topology import Topology, parse_override

__all__ = [
    "AXES", "PresetError", "ShardingRuleError", "StarscreamError", "Topology", "TopologyError", "build_mesh",
    "build_topology_mesh", "list_presets", "load_preset", "parse_override", "simulate_cpu_devices",
]
__version__ = "0.1.0"
