"""One process of the two-process mesh test (tests/hardware/test_mesh.py): `python multihost_worker.py COORDINATOR PROCESS_ID`.

Each process runs `starscream topology --topology 2x2x2 --simulate --json` with the launch flags, which joins the
other through jax.distributed (CPU collectives over gloo) and builds the simulated mesh: 2 nodes x 2 GPUs x 2
partitions, 4 CPU devices per process, so the gpu axis spans both processes and every xcd row lies in one (process
0 prints the JSON report). It then builds the same mesh with `build_topology_mesh`, checks psums over 'gpu' and over
'xcd' and prints one last "ok" line with what it saw.
"""
import argparse
import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.cli import topology as cli
from starscream_jax.hardware.mesh import build_topology_mesh, device_table

PROCESSES = 2


def main(coordinator: str, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cli.run(parser.parse_args(["--topology", "2x2x2", "--simulate", "--json", "--coordinator", coordinator,
                               "--num-processes", str(PROCESSES), "--process-id", str(process_id)]))
    topology, mesh = build_topology_mesh("2x2x2", simulate=True)
    assert len(jax.local_devices()) == 4, jax.local_devices()
    processes_per_gpu = [sorted({d.process_index for d in row}) for row in mesh.devices[0]]
    assert processes_per_gpu == [[0], [0], [1], [1]], processes_per_gpu

    # x_GxX[g, p] = 10 g + p, one element per device, sharded P('gpu', 'xcd').
    values_GxX = 10 * np.arange(4)[:, None] + np.arange(2)[None, :]
    sharding = NamedSharding(mesh, P(None, "gpu", "xcd"))
    x_1xGxX = jax.make_array_from_callback((1, 4, 2), sharding, lambda index: values_GxX[None][index])

    def sums(x):
        return jax.lax.psum(x, "gpu"), jax.lax.psum(x, "xcd")

    over_gpu, over_xcd = jax.jit(jax.shard_map(sums, mesh=mesh, in_specs=P(None, "gpu", "xcd"),
                                               out_specs=(P(None, "gpu", "xcd"), P(None, "gpu", "xcd"))))(x_1xGxX)
    for shard in over_gpu.addressable_shards:
        g, p = (index.start for index in shard.index[1:])
        assert int(shard.data.ravel()[0]) == values_GxX[:, p].sum(), (g, p, shard.data)
    for shard in over_xcd.addressable_shards:
        g, p = (index.start for index in shard.index[1:])
        assert int(shard.data.ravel()[0]) == values_GxX[g].sum(), (g, p, shard.data)
    print("ok", json.dumps({"process": jax.process_index(), "devices": device_table(mesh),
                            "shape": list(mesh.devices.shape), "nodes": topology.nodes}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
