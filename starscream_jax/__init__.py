"""starscream-jax: topology-aware sharding for JAX on partitioned chiplet GPUs.

The public API, in the order data flows through it:
  the mesh        `build_mesh` / `build_topology_mesh` (each physical GPU one row of a ('data', 'gpu', 'xcd') mesh),
                  `auto_axes` (the mesh with Auto axes, for models written for Flax's GSPMD guide),
                  `simulate_cpu_devices`, `Topology`, `parse_override`, `list_presets`, `load_preset`, `AXES`;
  layouts         `get_layout`, `LAYOUTS`, `Layout`, and `use_layout` to make one active while tracing (the
                  active layout is part of jit's cache key; on Auto axes it is also Flax's logical-axis rules);
                  `fit_batch` (the layout that places a batch its batch axes do not divide, as the commands fit it);
                  `Placement` (a layout on a mesh) and `jit` (a function jitted and bound to one placement);
  annotations     `param` (a parameter with logical axis names), `constrain` (an activation placed by name),
                  `weight` (a weight as a matmul uses it), `einsum` (a contraction with a placed result),
                  `shared_input` (one input of several matmuls, its gradient summed once), `shift` and `scale` (a
                  parameter added to or multiplying an activation elementwise), `create_sharded`
                  (a module created already sharded), `batch_sharding` (where a token batch goes);
  collectives     hierarchical collectives for per-device code inside `jax.shard_map`;
  Flax models     `in_vocabulary` (a layout under your logical names, `MAXTEXT`'s or a dict), `flax_rules` (a
                  rule table for Flax's `logical_axis_rules`), `weights_at_use` (Flax layers' weights gathered at
                  use), `derive` (the partition-aware layout of a GPU-level rule table), `cross_entropy` (a loss
                  on vocabulary-split logits) and `embed_lookup` (rows of a vocabulary-split table);
  the proof       `check`: any jitted step judged by the three principles, with the rule that placed each of its
                  parameters and the fix for each flat collective; `check_compiled`: a compiled program;
  checkpoints     `load_hf_model` (a Hugging Face model directory read straight into a layout's shards),
                  `export_hf_model`, `model_config_from_hf`.
Outside `use_layout` every annotation is the identity, so an annotated model also runs unsharded.
"""
from .analysis.check import StepCheck, check
from .analysis.principles import Check, check_compiled
from .errors import CheckpointError, PresetError, RunStopped, ShardingRuleError, StarscreamError, TopologyError
from .hardware.axes import AXES
from .hardware.mesh import auto_axes, build_mesh, build_topology_mesh
from .hardware.presets import list_presets, load_preset
from .hardware.simulation import simulate_cpu_devices
from .hardware.topology import Topology, parse_override
from .model.hf_checkpoint import export_hf_model, load_hf_model
from .model.hf_config import model_config_from_hf
from .model.ops import cross_entropy, embed_lookup
from .sharding.apply import (
    Placement,
    activation_spec,
    batch_sharding,
    constrain,
    einsum,
    jit,
    param,
    scale,
    shared_input,
    shift,
    use_layout,
    weight,
)
from .sharding.at_use import create_sharded
from .sharding.collectives import (
                                   all_gather_inside_gpu,
                                   all_reduce_across_gpus,
                                   hierarchical_all_gather,
                                   hierarchical_all_reduce,
                                   hierarchical_psum,
                                   reduce_scatter_inside_gpu,
)
from .sharding.derive import derive
from .sharding.flax_rules import MAXTEXT, STARSCREAM, Vocabulary, flax_rules, in_vocabulary, weights_at_use
from .sharding.layouts import LAYOUTS, Layout, fit_batch, get_layout

__all__ = [
    "AXES", "Check", "CheckpointError", "LAYOUTS", "Layout", "MAXTEXT", "Placement", "PresetError", "RunStopped",
    "STARSCREAM", "ShardingRuleError", "StarscreamError", "StepCheck", "Topology", "TopologyError", "Vocabulary",
    "activation_spec", "all_gather_inside_gpu", "all_reduce_across_gpus", "auto_axes", "build_mesh",
    "batch_sharding", "build_topology_mesh", "cross_entropy", "embed_lookup",
    "check", "check_compiled", "constrain", "create_sharded", "derive", "einsum", "export_hf_model", "fit_batch",
    "flax_rules",
    "get_layout", "hierarchical_all_gather", "hierarchical_all_reduce", "hierarchical_psum", "in_vocabulary",
    "jit", "list_presets", "load_hf_model", "load_preset", "model_config_from_hf", "param", "parse_override",
    "reduce_scatter_inside_gpu", "scale", "shared_input", "shift", "simulate_cpu_devices", "use_layout", "weight",
    "weights_at_use",
]
__version__ = "0.1.0"
