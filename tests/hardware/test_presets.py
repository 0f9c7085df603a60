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


SOURCE_KEY = re.compile(r"^#\s+\[([\w-]+)\]\s+(.*)$")


def source_links(text: str) -> dict[str, str]:
    """{key: the text after "[key]" up to the next key} of a chip file's header, e.g. {"mi300": "ROCm docs ... https://..."}."""
    links, key = {}, None
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        found = SOURCE_KEY.match(line)
        if found:
            key = found[1]
            links[key] = found[2]
        elif key is not None:
            links[key] += " " + line.lstrip("# ")
    return links


@pytest.mark.parametrize("chip", ["mi300x", "mi355x", "h200"])
def test_every_figure_of_a_real_chip_links_its_source_or_says_it_has_none(chip):
    """Each figure's comment cites a [key] that the file's header gives a web address for, or says it is an
    assumption (no published figure) or follows from the chip having no partitions."""
    text = (data_dir("meshes") / "chips" / f"{chip}.toml").read_text()
    links = source_links(text)
    assert links and all("https://" in link for link in links.values()), links
    for field in CHIP_FIELDS:
        comment = next(line for line in text.splitlines() if re.match(rf"{field}\s*=", line)).split("#", 1)[1]
        keys = re.findall(r"\[([\w-]+)\]", comment)
        assert all(key in links for key in keys), f"{chip}.toml {field}: unknown source {keys}"
        assert keys or "assumption" in comment or "no partitions" in comment, f"{chip}.toml {field}: no source"


def test_every_preset_opens_with_a_comment_and_cites_no_missing_file():
    for path in [*data_dir("meshes").glob("*.toml"), *(data_dir("meshes") / "chips").glob("*.toml")]:
        text = path.read_text()
        assert text.startswith("# "), f"{path.name} does not open with a comment"
        assert not re.search(r"(?<![/\w-])[\w-]+\.md\b", text), f"{path.name} cites a .md file the repository lacks"


def test_chip_figures_agree_with_the_partition_facts_the_vendor_states_separately():
    """Figures checked against other published facts, not typed again: an MI300X CPX partition is one XCD with 24 GB
    and an NPS4 memory partition 48 GB (AMD's partitioning guide); 7 xGMI peers at 64 GB/s each (ROCm xGMI blog);
    an MI355X CPX partition 36 GB of 288 (ROCm GPU specs); the H200 is one die."""
    mi300x, mi355x, h200 = load_chip("mi300x"), load_chip("mi355x"), load_chip("h200")
    assert mi300x.hbm_bytes / PARTITIONS_PER_MODE["CPX"] == pytest.approx(24e9)
    assert mi300x.hbm_bytes / 4 == pytest.approx(48e9)
    assert mi300x.xcds == PARTITIONS_PER_MODE["CPX"] == mi355x.xcds
    assert mi300x.inter_gpu_link_bandwidth == pytest.approx((mi300x.gpus_per_node - 1) * 64e9)
    assert mi355x.hbm_bytes / PARTITIONS_PER_MODE["CPX"] == pytest.approx(36e9)
    assert h200.xcds == 1 and h200.modes == (("SPX", ("NPS1",)),)


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
    (CHIP_FILE, 'vendor = "amd"', 'vendor = "AMD Inc."', r"mi300x\.toml: vendor = 'AMD Inc\.'; use one of '', 'nvidia'"),
])
def test_malformed_file_names_the_file_and_the_fix(preset_dir, file, old, new, message):
    _edit(preset_dir / file, old, new)
    with pytest.raises(PresetError, match=message) as caught:
        load_preset("mi300x-cpx-nps1", preset_dir)
    assert "\n" not in str(caught.value)


def test_a_preset_name_that_is_not_text_is_named():
    with pytest.raises(PresetError, match=r"preset None \(NoneType\): expected a preset name \(cpu, "):
        load_preset(None)
