#!/bin/bash
# Multi-host training under SLURM: one task (one nanotext process) per host, each using all of
# that host's accelerators; process 0's host is the coordinator.
#
#   sbatch --nodes=4 scripts/slurm_train.sh configs/speedrun.yml output_dir=/shared/runs/sr1
#
# output_dir must be on a file system every host sees: all processes write the checkpoint
# together. Mesh sizes (mesh.data, mesh.fsdp, mesh.tensor) count the devices of all hosts.
#
#SBATCH --job-name=nanotext
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
usage="usage: sbatch [--nodes=N] $0 CONFIG.yml [key=value ...]"
if [[ $# -lt 1 ]]; then
  echo "nanotext: error: no CONFIG given; $usage" >&2
  exit 2
fi
if [[ -z "${SLURM_JOB_NODELIST:-}" || -z "${SLURM_JOB_ID:-}" || -z "${SLURM_NTASKS:-}" ]]; then
  echo "nanotext: error: not inside a SLURM job (no SLURM_JOB_NODELIST): submit it; $usage" >&2
  exit 2
fi

# The address is given explicitly rather than with distributed.auto=true because JAX's SLURM
# detection assumes one process per GPU and would show each process only GPU $SLURM_LOCALID.
# (With --ntasks-per-node=<GPUs per host> and --gpus-per-task=1, distributed.auto=true is right.)
head_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${NANOTEXT_PORT:-$((20000 + SLURM_JOB_ID % 20000))}  # per job, so jobs sharing a host differ
export NANOTEXT_COORDINATOR_ADDRESS="$head_host:$port"
export NANOTEXT_NUM_PROCESSES="$SLURM_NTASKS"

# SLURM_PROCID differs per task, so it is read inside each task, not expanded here.
srun --kill-on-bad-exit=1 bash -c \
  'NANOTEXT_PROCESS_ID=$SLURM_PROCID exec python -m nanotext.train "$@"' nanotext "$@"
