"""Hardware presets: the shipped set, cited figures, valid mode pairs, and clear errors for malformed files."""
import re
import shutil

import pytest

from starscream_jax.errors import PresetError
from starscream_jax.hardware.presets import (
    CHIP_FIELDS,
    PARTITIONS_PER_MODE,
    check_mode,
    list_chips,
    list_presets,
    load_chip,
    load_preset,
    preset_for,
)
from starscream_jax.resources import data_dir

MI300X_PAIRS = {("SPX", "NPS1"), ("DPX", "NPS1"), ("DPX", "NPS2"), ("QPX", "NPS1"), ("QPX", "NPS4"), ("CPX", "NPS1"),
                ("CPX", "NPS4")}
MI355X_PAIRS = {("SPX", "NPS1"), ("DPX", "NPS2"), ("QPX", "NPS2"), ("CPX", "NPS2")}


def test_shipped_presets_cover_every_valid_mode_of_each_chip():
    expected = {f"{chip}-{c}-{m}".lower() for chip, pairs in (("mi300x", MI300X_PAIRS), ("mi355x", MI355X_PAIRS))
                for c, m in pairs}
    assert set(list_presets()) == expected | {"h200", "cpu"}
    assert set(list_chips()) == {"mi300x", "mi355x", "h200", "cpu"}
    for chip, pairs in (("mi300x", MI300X_PAIRS), ("mi355x", MI355X_PAIRS)):
        modes = load_chip(chip).modes
        assert {(c, m) for c, memories in modes for m in memories} == pairs


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_matches_its_file_name(name):
    preset = load_preset(name)
    assert preset.name == name
    assert preset.partitions_per_gpu == PARTITIONS_PER_MODE[preset.compute_mode]
    if preset.chip.name in ("mi300x", "mi355x"):
        assert name == f"{preset.chip.name}-{preset.compute_mode}-{preset.memory_mode}".lower()


def test_only_mi355x_cpx_is_a_preview_mode():
    assert [name for name in list_presets() if load_preset(name).preview] == ["mi355x-cpx-nps2"]


def test_every_figure_and_preset_states_its_source_in_a_comment():
    meshes = data_dir("meshes")
    for path in (meshes / "chips").glob("*.toml"):
        lines = path.read_text().splitlines()
        for field in CHIP_FIELDS:
            line = next(line for line in lines if re.match(rf"{field}\s*=", line))
            assert "#" in line and line.split("#", 1)[1].strip(), f"{path.name}: {field} has no source comment"
    for path in meshes.glob("*.toml"):
        assert path.read_text().startswith("# "), f"{path.name} does not open with a comment"


def test_chip_figures_match_the_hardware_reference():
    mi300x, mi355x, h200 = load_chip("mi300x"), load_chip("mi355x"), load_chip("h200")
    assert (mi300x.xcds, mi300x.hbm_bytes, mi300x.peak_bf16_flops) == (8, 192e9, 1307.4e12)
    assert (mi300x.hbm_bandwidth, mi300x.inter_gpu_link_bandwidth) == (5.3e12, 448e9)
    assert (mi355x.xcds, mi355x.hbm_bytes, mi355x.hbm_bandwidth) == (8, 288e9, 8.0e12)
    assert (h200.xcds, h200.hbm_bytes, h200.hbm_bandwidth) == (1, 141e9, 4.8e12)


@pytest.mark.parametrize("chip, compute, memory, valid", [
    ("mi300x", "SPX", "NPS4", "SPX+NPS1, DPX+NPS1, DPX+NPS2, QPX+NPS1, QPX+NPS4, CPX+NPS1, CPX+NPS4"),
    ("mi355x", "QPX", "NPS4", "SPX+NPS1, DPX+NPS2, QPX+NPS2, CPX+NPS2"),
    ("mi355x", "CPX", "NPS1", "SPX+NPS1, DPX+NPS2, QPX+NPS2, CPX+NPS2"),
    ("h200", "CPX", "NPS1", "SPX+NPS1"),
])
def test_invalid_mode_pair_names_the_valid_pairs(chip, compute, memory, valid):
    expected = re.escape(f"cannot run {compute}+{memory}; valid compute+memory pairs: {valid}") + "$"
    with pytest.raises(PresetError, match=expected):
        preset_for(chip, compute, memory)
    with pytest.raises(PresetError, match=re.escape(valid)):
        load_preset(f"{chip}-{compute}-{memory}".lower())


def test_valid_pair_passes_the_check():
    check_mode(load_chip("mi300x"), "QPX", "NPS4")
    assert preset_for("mi355x", "DPX", "NPS2").name == "mi355x-dpx-nps2"


def test_unknown_preset_and_chip_list_the_known_ones():
    with pytest.raises(PresetError, match="unknown preset 'mi400x'; known presets: cpu, h200, mi300x-cpx-nps1"):
        load_preset("mi400x")
    with pytest.raises(PresetError, match="unknown chip 'mi250'.*known chips: cpu, h200, mi300x, mi355x"):
        load_chip("mi250")


@pytest.fixture
def preset_dir(tmp_path):
    """A copy of the shipped presets to break one file at a time."""
    shutil.copytree(data_dir("meshes"), tmp_path / "meshes")
    return tmp_path / "meshes"


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def test_copied_presets_load_from_another_directory(preset_dir):
    _edit(preset_dir / "chips" / "mi300x.toml", "hbm_bytes = 192e9", "hbm_bytes = 256e9")
    assert load_preset("mi300x-cpx-nps1", preset_dir).chip.hbm_bytes == 256e9
    assert load_preset("mi300x-cpx-nps1").chip.hbm_bytes == 192e9
    assert list_presets(preset_dir) == list_presets()


PRESET_FILE = "mi300x-cpx-nps1.toml"
CHIP_FILE = "chips/mi300x.toml"


@pytest.mark.parametrize("file, old, new, message", [
    (PRESET_FILE, 'chip = "mi300x"', 'chip = "mi300x', r"mi300x-cpx-nps1\.toml is not valid TOML .*; fix the syntax"),
    (PRESET_FILE, 'memory_mode = "NPS1"', "", r"mi300x-cpx-nps1\.toml lacks memory_mode; a preset file gives all of"),
    (PRESET_FILE, '"CPX"', '"XPX"', r"mi300x-cpx-nps1\.toml: compute_mode 'XPX' is not one of SPX, DPX, QPX, CPX"),
    (PRESET_FILE, '"NPS1"', '"NPS3"', r"mi300x-cpx-nps1\.toml: memory_mode 'NPS3' is not one of NPS1, NPS2, NPS4"),
    (PRESET_FILE, '"NPS1"', '"NPS2"', r"mi300x-cpx-nps1\.toml: AMD Instinct MI300X cannot run CPX\+NPS2; valid"),
    (PRESET_FILE, 'name = "mi300x-cpx-nps1"', 'name = "mi300x-cpx"',
     r"mi300x-cpx-nps1\.toml says name = 'mi300x-cpx'; a preset's name is its file name, 'mi300x-cpx-nps1'"),
    (PRESET_FILE, 'chip = "mi300x"', 'chip = "mi250"', r"unknown chip 'mi250' \(no .*chips/mi250\.toml\)"),
    (PRESET_FILE, 'memory_mode = "NPS1"', 'memory_mode = "NPS1"\npreview = "yes"',
     r"mi300x-cpx-nps1\.toml: preview = 'yes'; write preview = true or leave it out"),
    (CHIP_FILE, "[modes]\n", "modes = 3\n[unused]\n", r"mi300x\.toml: \[modes\] must map each compute mode"),
    (CHIP_FILE, "[modes]", "[modes_of_partitioning]", r"mi300x\.toml lacks modes; every chip file gives all of"),
    (CHIP_FILE, "hbm_bandwidth = 5.3e12", "", r"mi300x\.toml lacks hbm_bandwidth; every chip file gives all of"),
    (CHIP_FILE, "hbm_bandwidth = 5.3e12", 'hbm_bandwidth = "5.3 TB/s"',
     r"mi300x\.toml: hbm_bandwidth = '5.3 TB/s'; each figure is a positive number"),
    (CHIP_FILE, "hbm_bytes = 192e9", "hbm_bytes = 0", r"mi300x\.toml: hbm_bytes = 0; each figure is a positive number"),
    (CHIP_FILE, 'CPX = ["NPS1", "NPS4"]', 'OPX = ["NPS1"]',
     r"mi300x\.toml: unknown compute mode\(s\) \['OPX'\] in \[modes\]; use SPX, DPX, QPX, CPX"),
    (CHIP_FILE, 'CPX = ["NPS1", "NPS4"]', 'CPX = ["NPS1", "NPS8"]',
     r"mi300x\.toml: unknown memory mode\(s\) \['NPS8'\] in \[modes\]; use NPS1, NPS2, NPS4"),
    (CHIP_FILE, "xcds = 8 ", "xcds = 4 ", r"mi300x\.toml: \[modes\] lists CPX but xcds = 4; a compute mode cannot"),
])
def test_malformed_file_names_the_file_and_the_fix(preset_dir, file, old, new, message):
    _edit(preset_dir / file, old, new)
    with pytest.raises(PresetError, match=message) as caught:
        load_preset("mi300x-cpx-nps1", preset_dir)
    assert "\n" not in str(caught.value)
