#!/usr/bin/env bash
# Multi-node trex training under SLURM: one `trex launch` (torchrun) per node, c10d rendezvous on the
# first node. A preemption (SIGTERM) saves a checkpoint and the step exits 143; a failed rank's own
# exit code (2 user error, 3 non-finite, 4 a rank stopped answering) is the step's exit code.
#
#   sbatch --nodes=8 --gpus-per-node=8 scripts/slurm_train.sh recipes/deepseek_v4_flash_sft.toml --resume auto
#
# Works unchanged on NVIDIA (NCCL) and Ascend (HCCL) nodes: trex picks the backend from the device.
#SBATCH --job-name=trex
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

RECIPE=${1:?usage: sbatch scripts/slurm_train.sh RECIPE [trex train options]}
shift
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${PORT:-29500}

# The data, read, tokenized and packed once before any rank starts (trex data prepare, on every core of
# one node) into DATA_CACHE, which every node must see: on a shared file system one node prepares for
# all. With node-local disks, point DATA_CACHE at a local path and each node's first rank prepares its
# own copy at the start of training instead. The --set options of the command line reach both steps.
DATA_CACHE=${DATA_CACHE:-$PWD/.trex-data-cache}
SETS=(--set "data.cache_dir=\"$DATA_CACHE\"")
ARGS=("$@")
for ((i = 0; i < ${#ARGS[@]}; i++)); do
    if [[ ${ARGS[i]} == --set ]]; then SETS+=(--set "${ARGS[i + 1]}"); fi
done
srun --nodes=1 --ntasks=1 .venv/bin/trex data prepare "$RECIPE" "${SETS[@]}"

srun --kill-on-bad-exit=1 .venv/bin/trex launch \
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$PORT" --rdzv-id "$SLURM_JOB_ID" \
    train "$RECIPE" "${SETS[@]:0:2}" "$@"
