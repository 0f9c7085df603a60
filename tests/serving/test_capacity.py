"""The KV cache sized from device memory: the free memory of the fullest device, less the steps' reserve, in pages
of what each device holds of one page per shard; every row at full context where devices report no memory; a clear
refusal when not even two pages fit."""
import pytest

from jax.sharding import NamedSharding, PartitionSpec

from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.serving import capacity

GIB = 2 ** 30


class Device:
    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use} if limit else None

    def memory_stats(self):
        return self.stats


def test_pages_follow_the_fullest_device():
    devices = [Device(80 * GIB, 16 * GIB), Device(80 * GIB, 20 * GIB)]
    size = capacity.size_from_memory(devices, page_bytes=2 ** 20, reserve=4 * GIB, utilization=0.9, floor_pages=9)
    assert size.pages_per_shard == (80 - 20 - 4) * 1024 and size.reserve_bytes == 4 * GIB
    assert "0.90 of device memory" in size.why


def test_devices_without_memory_figures_get_every_row_at_full_context():
    size = capacity.size_from_memory([Device(0, 0)], page_bytes=100, reserve=GIB, utilization=0.9, floor_pages=33)
    assert (size.pages_per_shard, size.reserve_bytes) == (33, 0)


def test_no_room_is_refused_naming_the_flags():
    with pytest.raises(StarscreamError, match="--gpu-memory-utilization"):
        capacity.size_from_memory([Device(10 * GIB, 9 * GIB)], page_bytes=GIB, reserve=GIB, utilization=0.5,
                                  floor_pages=3)


def test_pools_that_no_longer_fit_after_compiling_are_refused_with_the_pages_that_do():
    """What the programs took since the cache was sized comes out of the pools' share: refused before the
    allocation, naming --cache-pages with what fits now beside the reserve."""
    size = capacity.CacheSize(pages_per_shard=100, why="sized", pool_bytes_per_device=100 * GIB, reserve_bytes=2 * GIB)
    capacity.check_room([Device(120 * GIB, 20 * GIB)], size)  # exactly room
    with pytest.raises(StarscreamError, match="--cache-pages 88 "):
        capacity.check_room([Device(120 * GIB, 30 * GIB)], size)
    capacity.check_room([Device(0, 0)], size)  # no memory figures: nothing to check


def test_a_page_costs_each_device_its_split_of_every_pool():
    """[kv_heads 4, 8 pages, 16 positions, 32] bf16 pools for 6 layers (k and v) split kv heads over gpu (2) and
    pages over xcd (4): each device holds 2 heads x 2 pages; the float32 scales likewise."""
    mesh = build_mesh("1x2x4")
    pools = NamedSharding(mesh, PartitionSpec("gpu", "xcd"))
    shapes = [(12, (4, 4, 16, 32)), (12, (4, 4, 16))]
    per_device = capacity.page_bytes_per_device([pools, pools], shapes, ["bfloat16", "float32"])
    assert per_device == 12 * (2 * 1 * 16 * 32 * 2) + 12 * (2 * 1 * 16 * 4)


def test_pools_on_one_device_cost_their_whole_page():
    """Without a mesh (an engine on one device, placed by no layout) a page costs every byte of every pool."""
    per_device = capacity.page_bytes_per_device([None], [(12, (4, 1, 16, 32))], ["bfloat16"])
    assert per_device == 12 * 4 * 16 * 32 * 2


class _Device:  # what a device's memory_stats reports
    def __init__(self, gib):
        self.stats = {"bytes_limit": int(gib * 2 ** 30)} if gib else None

    def memory_stats(self):
        return self.stats


@pytest.mark.parametrize("gib, utilization, partitions, budget", [
    (126.9, 0.9, 1, 8192),  # an H200 at 0.9
    (40.0, 0.5, 1, 8192),  # an 80 GiB GPU at half
    (21.6, 0.9, 8, 8192),  # an MI300X partition in CPX mode (192 GiB in eight)
    (21.6, 0.9, 1, 2048), (36.0, 0.9, 1, 2048), (None, 0.9, 1, 2048)])
def test_the_steps_tokens_default_to_vllms_by_the_gpus_memory(gib, utilization, partitions, budget):
    assert capacity.default_token_budget([_Device(gib)] * 2, utilization, partitions) == budget


def test_the_step_reserve_bounds_the_largest_step_a_server_runs():
    """A prefill of the token budget, a decode of every row, and a mixed step's decode beside its own chunks: the
    reserve is twice the largest; a mixed step of no tokens changes nothing."""
    shape = dict(rows=64, table_positions=8192, d_model=4096, d_ff=14336, vocab=128256, kv_width=1024, itemsize=2)
    prefill, decode = (capacity.step_reserve_bytes(tokens=tokens, **{**shape, "rows": rows})
                       for tokens, rows in ((8192, 0), (0, 64)))
    assert capacity.step_reserve_bytes(tokens=8192, **shape) == max(prefill, decode)
    assert capacity.step_reserve_bytes(tokens=8192, mixed_tokens=0, **shape) == max(prefill, decode)
    one_chunk = capacity.step_reserve_bytes(tokens=512, **{**shape, "rows": 0})
    mixed = capacity.step_reserve_bytes(tokens=0, mixed_tokens=512, **shape)
    assert mixed == decode + one_chunk > max(decode, one_chunk)
