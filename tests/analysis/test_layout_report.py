"""One layout's result: the tokens per device principle 1 divides by are the known ones, not a guess."""
from pathlib import Path

import pytest

from starscream_jax.analysis.layout_report import tokens_per_device
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding.layouts import get_layout


@pytest.mark.parametrize("layout, expected", [
    ("gpu_tp", 8 * 32),           # tokens split over data (1) only
    ("flat_tp", 8 * 32),
    ("starscream_tp", 8 // 4 * 32),  # batch over (data, xcd): 4 ways
    ("flat_fsdp", 8 // 8 * 32),      # batch over every device
    ("starscream_cp", 8 * (32 // 4)),  # the sequence over xcd
])
def test_tokens_per_device_follow_the_layouts_batch_and_seq_rules(layout, expected):
    assert tokens_per_device(get_layout(layout), build_mesh("2x4"), (8, 32)) == expected


def test_the_result_cache_key_is_the_same_in_every_process():
    """Sets in a layout (its may_replicate names) iterate in an order that follows each process's string hashing;
    the key must not, or a second `plan` compiles everything again."""
    import os
    import subprocess
    import sys

    script = ("from starscream_jax.hardware.simulation import simulate_cpu_devices; simulate_cpu_devices(2)\n"
              "from starscream_jax.analysis.compile import make_settings\n"
              "from starscream_jax.analysis.layout_report import ResultCache\n"
              "from starscream_jax.hardware.mesh import build_topology_mesh\n"
              "topology, mesh = build_topology_mesh('cpu', gpus=2, simulate=True)\n"
              "settings = make_settings('tiny', 'train', 8, 32, 'starscream_tp', 2)\n"
              "print(ResultCache('cache')._path(settings, topology, mesh, 'starscream_tp').name)\n")
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(keys) == 1


def test_a_result_reads_back_from_its_json_and_the_cache_as_it_was_written(tiny_decode, tmp_path):
    """`to_json` / `from_json` round trip a layout's whole result, each typed field as it was (tuples, nested
    results, None figures): the cache `plan` and `inspect` share returns what was compiled; and the JSON
    `inspect --json` prints keeps its keys."""
    import json

    from starscream_jax.analysis.json_form import from_json, to_json
    from starscream_jax.analysis.layout_report import LayoutResult, ResultCache

    settings, topology, mesh, compiled = tiny_decode
    cache = ResultCache(tmp_path)
    for name, result in compiled.items():
        written = json.loads(json.dumps(to_json(result)))
        assert from_json(LayoutResult, written) == result
        cache.put(settings, topology, mesh, name, result)
        assert cache.get(settings, topology, mesh, name) == result
        assert written["memory_per_device"]["compiled"]["temp_bytes"] == result.memory_per_device.compiled.temp_bytes
        assert written["estimate"]["serial_s"] == result.estimate.serial_s  # derived figures written beside
        assert set(written["principles"]["shape_preservation"]) == {"ok", "violations", "unjudged", "attention",
                                                                    "not_judged", "judged_ops"}
    assert compiled["flat_tp"].principles.shape_preservation.violations  # non-empty tuples round trip too


def test_two_writers_of_one_entry_at_once_leave_it_whole(tiny_decode, tmp_path, monkeypatch):
    """A second writer of the same entry runs between the first one's write and its rename (two `plan` processes,
    or two test workers, sharing a cache): both finish, the entry reads back, no temporary file is left."""
    import pathlib

    from starscream_jax.analysis.layout_report import ResultCache

    settings, topology, mesh, compiled = tiny_decode
    cache, result = ResultCache(tmp_path), compiled["starscream_decode"]
    write_text, interleaved = pathlib.Path.write_text, []

    def write_then_let_another_writer_in(path, text):
        written = write_text(path, text)
        if not interleaved:
            interleaved.append(path)
            cache.put(settings, topology, mesh, "starscream_decode", result)
        return written

    monkeypatch.setattr(pathlib.Path, "write_text", write_then_let_another_writer_in)
    cache.put(settings, topology, mesh, "starscream_decode", result)
    assert interleaved and cache.get(settings, topology, mesh, "starscream_decode") == result
    assert [path.suffix for path in tmp_path.iterdir()] == [".json"]


def test_a_cached_result_without_principle_1_is_judged_again_when_inspect_asks_for_it(tiny_decode, tmp_path,
                                                                                       monkeypatch):
    """What `plan` keeps (principle 1 skipped: gpu_tp not compiled) serves the next plan as it is, but `inspect`,
    which judges principle 1, compiles the layout and gpu_tp again instead of showing the skipped verdict; a judged
    result serves both, as does one compared with gpu_tp but judged in part (compiling again would judge the same
    ops). (Compiling is replaced by a refusal here: what is asked to compile is what is checked.)"""
    import dataclasses

    from starscream_jax.analysis import layout_report
    from starscream_jax.analysis.layout_report import SKIPPED, ResultCache, inspect_layouts
    from starscream_jax.analysis.principles import KernelVerdict, UnjudgedOp
    from starscream_jax.errors import ShardingRuleError

    settings, topology, mesh, compiled = tiny_decode
    judged = compiled["starscream_decode"]
    skipped = dataclasses.replace(judged, principles=dataclasses.replace(
        judged.principles, shape_preservation=KernelVerdict(
            ok=None, violations=(), unjudged=(UnjudgedOp("dot.1", "no reference program"),), not_judged=SKIPPED)))
    one = dataclasses.replace(settings, layouts=("starscream_decode",))
    compiles = []

    def refuse(settings, name, mesh):
        compiles.append(name)
        raise ShardingRuleError("not compiled in this test")

    monkeypatch.setattr(layout_report, "compile_step", refuse)
    cache = ResultCache(tmp_path)
    cache.put(one, topology, mesh, "starscream_decode", skipped)
    assert inspect_layouts(one, topology, mesh, cache=cache, reference=False) == {"starscream_decode": skipped}
    assert compiles == []
    refused = {}
    assert inspect_layouts(one, topology, mesh, refused, cache) == {}
    assert compiles == ["starscream_decode", "gpu_tp"] and list(refused) == ["starscream_decode"]
    cache.put(one, topology, mesh, "starscream_decode", judged)
    assert inspect_layouts(one, topology, mesh, cache=cache) == {"starscream_decode": judged}
    assert judged.principles.shape_preservation.judged and len(compiles) == 2
    partly = dataclasses.replace(judged, principles=dataclasses.replace(judged.principles, shape_preservation=(
        KernelVerdict(ok=None, violations=(), unjudged=(UnjudgedOp("dot.1", "no counterpart in the reference"),),
                      judged_ops=3))))
    cache.put(one, topology, mesh, "starscream_decode", partly)  # compared with gpu_tp: compiling again gives the same
    assert inspect_layouts(one, topology, mesh, cache=cache) == {"starscream_decode": partly} and len(compiles) == 2


def test_a_vocabulary_the_layouts_do_not_split_is_compiled_padded_as_inference_loads_it(tmp_path):
    """A model file of 390 tokens decoded under starscream_decode (vocabulary over 8 partitions) beside gpu_tp
    (over 2 GPUs): both compile the 392 rows inference loads (`vocabulary.padded_config`) and are judged, where
    the unpadded vocabulary could not place."""
    from starscream_jax.analysis.compile import make_settings
    from starscream_jax.analysis.layout_report import inspect_layouts
    from starscream_jax.hardware.mesh import build_topology_mesh

    model = tmp_path / "odd.toml"
    tiny = (Path(__file__).resolve().parents[2] / "models" / "tiny.toml").read_text()
    model.write_text(tiny.replace("vocab_size = 256", "vocab_size = 390"))
    topology, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    settings = make_settings(str(model), "decode", 8, 16, "starscream_decode", layers=2)
    result = inspect_layouts(settings, topology, mesh)["starscream_decode"]
    embedding = next(entry for entry in result.inputs if entry.name == "params/embedding/value")
    assert embedding.shape == [392, 128]
    assert result.principles.shape_preservation.compared
    assert settings.config.vocab_size == 390  # the caller's settings are left as they were
