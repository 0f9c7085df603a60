#!/usr/bin/env bash
# SLURM batch job for starscream-jax on AMD Instinct MI300X nodes in CPX mode (8 GPUs x 8 partitions = 64 devices a
# node). It checks the partition mode of every node, prints the topology JAX detects, runs the accelerator tests on the
# first node and a short training run over all nodes (mesh: data = nodes, gpu = 8, xcd = 8).
#
# Submit from the repository root, on a filesystem every node sees, once .venv is made there
# (python3 -m venv .venv && .venv/bin/pip install -e ".[rocm,test]"):
#     sbatch scripts/rocm_job.sh                       one node, one process owning all 64 partitions
#     sbatch --nodes=2 scripts/rocm_job.sh             two nodes, one process on each
#     PROCS_PER_NODE=8 sbatch scripts/rocm_job.sh      one process per GPU, each shown its own 8 partitions
#     PRESET=mi300x-cpx-nps4 STEPS=50 sbatch scripts/rocm_job.sh
# Settings (sbatch hands the submitting shell's environment on):
#     PRESET            preset the nodes must be in, mi300x-<spx|dpx|qpx|cpx>-<nps1|nps2|nps4> (default mi300x-cpx-nps1)
#     PROCS_PER_NODE    1 (default): one process per node; 8: one process per GPU, through ROCR_VISIBLE_DEVICES
#     STEPS             steps of the training run (default 20)
#     VENV              virtual environment to run from (default .venv in the submit directory)
#     COORDINATOR_PORT  port of the jax.distributed coordinator on the first node (default derived from the job id)
#     SYSFS             where sysfs is mounted (default /sys)
# Results go to runs/rocm-<job id>/ (partition check, topology, test report, training log).
# `bash scripts/rocm_job.sh --check-node` runs the partition check alone, on the machine it is started on.
#
#SBATCH --job-name=starscream-mi300x
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=01:00:00

set -euo pipefail

readonly GPUS_PER_NODE=8
PRESET=${PRESET:-mi300x-cpx-nps1}
PROCS_PER_NODE=${PROCS_PER_NODE:-1}
STEPS=${STEPS:-20}
SYSFS=${SYSFS:-/sys}

fail() {
  echo "rocm_job.sh: $*" >&2
  exit 1
}

# Logical devices per GPU in a compute mode of the MI300X (8 XCDs).
partitions_per_gpu() {
  case "$1" in
    SPX) echo 1 ;;
    DPX) echo 2 ;;
    QPX) echo 4 ;;
    CPX) echo 8 ;;
    *) fail "PRESET=$PRESET names compute mode '$1'; expected spx, dpx, qpx or cpx" ;;
  esac
}

IFS=- read -r chip compute_mode memory_mode rest <<<"$PRESET"
compute_mode=${compute_mode^^}
memory_mode=${memory_mode^^}
[[ $chip == mi300x && -z $rest && $memory_mode =~ ^NPS[124]$ ]] ||
  fail "PRESET=$PRESET is not of the form mi300x-<spx|dpx|qpx|cpx>-<nps1|nps2|nps4>; set it to the mode of the nodes"
PARTITIONS=$(partitions_per_gpu "$compute_mode")
DEVICES_PER_NODE=$((GPUS_PER_NODE * PARTITIONS))

# Comma-separated device ids: $1, $1 + 1, ... ($2 of them).
id_list() {
  seq -s, "$1" "$(($1 + $2 - 1))"
}

# GPU devices the driver exposes: KFD topology nodes with SIMDs (CPU nodes have none), one per partition.
count_kfd_gpu_nodes() {
  local properties count=0
  for properties in "$SYSFS"/class/kfd/kfd/topology/nodes/*/properties; do
    [[ -e $properties ]] || continue
    if awk '$1 == "simd_count" && $2 > 0 { found = 1 } END { exit !found }' "$properties"; then
      count=$((count + 1))
    fi
  done
  echo "$count"
}

# Checks this machine: every GPU in the preset's compute and memory mode, and all its partitions exposed.
# The amdgpu driver shows the modes on each physical GPU's PCI device (partition 0).
check_node() {
  local mode_file gpu_dir compute memory gpus=0 devices
  for mode_file in "$SYSFS"/bus/pci/devices/*/current_compute_partition; do
    [[ -e $mode_file ]] || continue
    gpu_dir=$(dirname "$mode_file")
    compute=$(<"$mode_file")
    memory=$(<"$gpu_dir/current_memory_partition")
    echo "$HOSTNAME GPU $(basename "$gpu_dir"): ${compute^^}/${memory^^}"
    [[ ${compute^^} == "$compute_mode" && ${memory^^} == "$memory_mode" ]] ||
      fail "$HOSTNAME GPU $(basename "$gpu_dir") is in ${compute^^}/${memory^^}, expected $compute_mode/$memory_mode" \
        "for PRESET=$PRESET; switch the node with amd-smi (docs/rocm.md) or set PRESET to its mode"
    gpus=$((gpus + 1))
  done
  ((gpus == GPUS_PER_NODE)) ||
    fail "$HOSTNAME shows $gpus partitionable GPUs in $SYSFS/bus/pci/devices, expected $GPUS_PER_NODE;" \
      "check that the amdgpu driver is loaded (lsmod | grep amdgpu) and sees every GPU (amd-smi list)"
  devices=$(count_kfd_gpu_nodes)
  ((devices == DEVICES_PER_NODE)) ||
    fail "$HOSTNAME exposes $devices GPU devices in $SYSFS/class/kfd, expected $DEVICES_PER_NODE" \
      "($GPUS_PER_NODE GPUs x $PARTITIONS partitions); reload the driver after a mode change (docs/rocm.md)"
  echo "$HOSTNAME: $gpus GPUs in $compute_mode/$memory_mode, $devices devices"
}

# The job decides which partitions each process sees: device lists left by the submitting shell, a Slurm prolog or
# Slurm's GPU binding of a step would hide some of them.
clear_device_lists() {
  unset ROCR_VISIBLE_DEVICES HIP_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES GPU_DEVICE_ORDINAL
}

# One process of a job step. One process per GPU sees only its GPU's partitions, taken as consecutive ROCr ids
# (GPU g owns g*8 .. g*8+7; starscream topology then verifies that they share one GPU); one process per node sees all.
# JAX_LOCAL_DEVICE_IDS stops jax.distributed.initialize from keeping only the device numbered like SLURM_LOCALID,
# which its SLURM detection does when no device ids are given.
run_task() {
  clear_device_lists
  if ((PROCS_PER_NODE == GPUS_PER_NODE)); then
    ROCR_VISIBLE_DEVICES=$(id_list $((SLURM_LOCALID * PARTITIONS)) "$PARTITIONS")
    export ROCR_VISIBLE_DEVICES
    JAX_LOCAL_DEVICE_IDS=$(id_list 0 "$PARTITIONS")
  else
    JAX_LOCAL_DEVICE_IDS=$(id_list 0 "$DEVICES_PER_NODE")
  fi
  export JAX_LOCAL_DEVICE_IDS
  exec "$@"
}

# Runs a command in every process of the job (PROCS_PER_NODE on each node); they join through jax.distributed.
launch() {
  srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$((SLURM_JOB_NUM_NODES * PROCS_PER_NODE))" \
    --ntasks-per-node="$PROCS_PER_NODE" bash "$SCRIPT" --task "$@"
}

main() {
  [[ -n ${SLURM_JOB_ID:-} ]] ||
    fail "not inside a SLURM job: submit it with 'sbatch scripts/rocm_job.sh', or run '--check-node' alone"
  local repo=$SLURM_SUBMIT_DIR nodes results mesh_args
  SCRIPT=$repo/scripts/rocm_job.sh
  [[ -f $SCRIPT ]] || fail "$SCRIPT not found: submit the job from the repository root"
  ((PROCS_PER_NODE == 1 || PROCS_PER_NODE == GPUS_PER_NODE)) ||
    fail "PROCS_PER_NODE=$PROCS_PER_NODE; expected 1 (one process per node) or $GPUS_PER_NODE (one per GPU)"
  VENV=${VENV:-$repo/.venv}
  [[ -x $VENV/bin/starscream ]] || fail "no starscream in $VENV/bin; make the environment first:" \
    "python3 -m venv .venv && .venv/bin/pip install -e '.[rocm,test]'"
  export PATH="$VENV/bin:$PATH"
  clear_device_lists
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  ((${#nodes[@]} == SLURM_JOB_NUM_NODES)) || fail "scontrol listed ${#nodes[@]} nodes for $SLURM_JOB_NUM_NODES"
  export JAX_COORDINATOR_ADDRESS="${nodes[0]}:${COORDINATOR_PORT:-$((20000 + SLURM_JOB_ID % 10000))}"
  # One data-parallel replica per node; every process joins jax.distributed from the environment set above.
  mesh_args=(--no-simulate --preset "$PRESET" --gpus "$GPUS_PER_NODE" --nodes "$SLURM_JOB_NUM_NODES"
    --data-parallel "$SLURM_JOB_NUM_NODES" --distributed)
  results=$repo/runs/rocm-$SLURM_JOB_ID
  mkdir -p "$results"
  cd "$repo"

  echo "== partition mode, $SLURM_JOB_NUM_NODES node(s), preset $PRESET"
  srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
    bash "$SCRIPT" --check-node | tee "$results/partition_check.txt"

  echo "== topology, $PROCS_PER_NODE process(es) per node, coordinator $JAX_COORDINATOR_ADDRESS"
  launch starscream topology "${mesh_args[@]}" | tee "$results/topology.txt"

  echo "== accelerator tests on ${nodes[0]}"
  env -u JAX_COORDINATOR_ADDRESS XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python -m pytest -m "gpu or rocm" -q --junitxml="$results/pytest.xml"

  echo "== training, $STEPS steps"
  launch starscream train --layout starscream_tp "${mesh_args[@]}" --steps "$STEPS" | tee "$results/train.log"
  echo "results in $results"
}

case "${1:-}" in
  --check-node) check_node ;;
  --task)
    shift
    run_task "$@"
    ;;
  "") main ;;
  *) fail "unknown argument '$1'; expected none (under sbatch), --check-node, or --task COMMAND..." ;;
esac
