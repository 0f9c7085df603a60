"""Streamed, sharded loading of a Hugging Face checkpoint: time, GB/s and peak host memory against the checkpoint.

Writes a random bfloat16 checkpoint of a model configuration (default Llama 3.2 1B: 2.5 GB in 1 GB shards, written
tensor by tensor), then, in a fresh process on simulated CPU devices, loads it into a layout's shards
(`load_hf_model`) and reports the load time, the checkpoint bytes per second, the bytes read from the files (each
device's slices; replicated tensors are read once per device), the bytes the devices hold (float32 parameters; on a
simulated mesh they live in host memory too) and the peak resident memory above what the process held before
loading. Host memory beyond the devices' own bytes is the loader's overhead.

    python scripts/bench_hf_load.py --dir /tmp/llama3.2-1b-random --mesh 2x4 --layout starscream_tp
    python scripts/bench_hf_load.py --quick --out /tmp/hf_load.json     # smoke run: the tiny model's checkpoint
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from starscream_jax.benchmarks import harness


def write_checkpoint(model: str, directory: Path, shard_gib: float) -> None:
    """A random bfloat16 checkpoint of `model` in `directory`, built one tensor at a time."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from starscream_jax.model.catalog import load_model_config
    from starscream_jax.model.hf_checkpoint import INDEX_FILE, sources
    from starscream_jax.model.hf_config import hf_config_from_model

    config = load_model_config(model)
    shapes = _param_shapes(config)
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    shard, shard_bytes, weight_map, files = {}, 0, {}, []

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)
        shard, shard_bytes = {}, 0

    for path, source in sources(config).items():
        shape = source.tensor_shape(shapes[path])
        for name in source.tensor_names(shapes[path]):
            tensor = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
            if shard and shard_bytes + tensor.nbytes > shard_gib * 2**30:
                flush()
            shard[name] = tensor
            shard_bytes += tensor.nbytes
    flush()
    total = sum((directory / name).stat().st_size for name in files)
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(hf_config_from_model(config, "bfloat16"), indent=2))


def _param_shapes(config) -> dict[str, tuple[int, ...]]:
    from flax import nnx

    from starscream_jax.model.decoder import abstract_model
    from starscream_jax.sharding.apply import path_name

    abstract = abstract_model(config)
    return {path_name(path): tuple(v.shape) for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


READ_METHOD = "_view"
"""The method of `hf_checkpoint.CheckpointReader` that reads one tensor's bytes from its file, (self, source, name,
ours) -> the block read; `measure` counts what it returns."""


def measure(directory: Path, mesh_shape: str, layout: str) -> dict:
    """Load `directory` into `layout` on a simulated mesh (run in a fresh process); the figures as a dict."""
    import jax

    from starscream_jax.hardware.mesh import build_mesh
    from starscream_jax.model import hf_checkpoint

    read_bytes = 0
    read_view = getattr(hf_checkpoint.CheckpointReader, READ_METHOD)

    def counting(self, source, name, ours):
        nonlocal read_bytes
        block = read_view(self, source, name, ours)
        read_bytes += block.nbytes
        return block

    setattr(hf_checkpoint.CheckpointReader, READ_METHOD, counting)
    mesh = build_mesh(mesh_shape)
    sampler = AnonymousMemoryPeak()
    started, cpu_started = time.perf_counter(), time.process_time()
    with sampler:
        model = hf_checkpoint.load_hf_model(directory, layout, mesh)
        leaves = jax.tree.leaves(model)
        jax.block_until_ready(leaves)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    checkpoint = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    device_bytes = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)
    return {"checkpoint_bytes": checkpoint, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "gb_per_s": checkpoint / seconds / 1e9, "gb_per_cpu_s": checkpoint / cpu_seconds / 1e9,
            "read_bytes": read_bytes, "device_bytes": device_bytes, "peak_anonymous_above_start": sampler.peak,
            "loader_overhead": sampler.peak - device_bytes, "peak_rss_above_start": sampler.peak_rss,
            "mesh": mesh_shape, "layout": layout}


class AnonymousMemoryPeak:
    """The peak, above its value on entry, of the process' anonymous resident memory (RssAnon: what the program
    allocated, not the checkpoint's file pages that safetensors maps) and of its whole resident set, sampled every
    5 ms by a thread."""

    def __enter__(self):
        self._start, self._start_rss = _status("RssAnon"), _status("VmRSS")
        self.peak = self.peak_rss = 0
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, _status("RssAnon") - self._start)
            self.peak_rss = max(self.peak_rss, _status("VmRSS") - self._start_rss)
            time.sleep(0.005)
        self.peak = max(self.peak, _status("RssAnon") - self._start)

    def __exit__(self, *exc_info):
        self._running = False
        self._thread.join()


def _status(field: str) -> int:
    """A memory field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b", help="model configuration to write a checkpoint of")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/starscream-bench-checkpoint"))
    parser.add_argument("--mesh", default="2x4", help="GPUSxPARTITIONS of the simulated mesh")
    parser.add_argument("--layout", default="starscream_tp")
    parser.add_argument("--shard-gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here, with the run's metadata")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the tiny model's checkpoint in shards of 64 KiB, in a directory of its own")
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.shard_gib = "tiny", 2**-14
        args.dir = args.dir.with_name(args.dir.name + "-tiny")
    if args.measure_only:
        print(json.dumps(measure(args.dir, args.mesh, args.layout)))
        return 0
    if not (args.dir / "config.json").is_file():
        started = time.perf_counter()
        write_checkpoint(args.model, args.dir, args.shard_gib)
        print(f"wrote {args.dir} in {time.perf_counter() - started:.0f} s")
    gpus, partitions = map(int, args.mesh.split("x"))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={gpus * partitions}",
           "JAX_PLATFORMS": "cpu"}
    child = subprocess.run([sys.executable, __file__, "--measure-only", "--dir", str(args.dir), "--mesh", args.mesh,
                            "--layout", args.layout], env=env, capture_output=True, text=True)
    if child.returncode:  # the measuring process failed: its own error, not a CalledProcessError around it
        sys.stderr.write(child.stderr)
        return child.returncode
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    gib = 2**30
    print(f"{args.model} checkpoint {figures['checkpoint_bytes'] / gib:.2f} GiB (bfloat16) -> {args.layout} on a "
          f"simulated {args.mesh} mesh: {figures['seconds']:.1f} s ({figures['gb_per_s']:.2f} GB/s), "
          f"{figures['cpu_seconds']:.1f} s of CPU ({figures['gb_per_cpu_s']:.2f} GB per CPU second)")
    print(f"  read from the files: {figures['read_bytes'] / gib:.2f} GiB "
          f"({figures['read_bytes'] / figures['checkpoint_bytes']:.2f} x the checkpoint)")
    print(f"  held by the devices (float32): {figures['device_bytes'] / gib:.2f} GiB; peak allocated host memory "
          f"above the start: {figures['peak_anonymous_above_start'] / gib:.2f} GiB, of which beyond the devices' own "
          f"bytes: {figures['loader_overhead'] / 2**20:.0f} MiB "
          f"({figures['loader_overhead'] / figures['checkpoint_bytes']:.1%} of the checkpoint); resident set with "
          f"the mapped checkpoint pages: {figures['peak_rss_above_start'] / gib:.2f} GiB")
    harness.write_json(args.out, {"meta": {**harness.run_info(__file__, argv).as_dict(), "model": args.model},
                                  **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
