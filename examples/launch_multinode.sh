#!/usr/bin/env bash
# Multi-node GRPO launch with torchrun: run this same script on every node.
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/launch_multinode.sh examples/configs/qwen2.5_14b_dapo_multinode.yaml
# Each node runs 8 processes (one per GPU); TP/PP come from the config, DP = world size / (TP x PP).
# Run it from the same directory of a shared file system on every node: the config's output_dir is relative
# to it, and every rank writes its part of each checkpoint there (the run stops at start where it is not shared).
# A run continues with --resume on as many nodes as are left, or more: its checkpoint is resharded for
# the new layout (checkpoint/train_state.py); with fewer nodes, lower TP/PP with --set where they must.
# Under a time limit (SLURM's --time), pass --set exit_duration_in_mins=M with M the limit less the longest
# step and a save: the run checkpoints and ends itself before it is killed.
set -euo pipefail
CONFIG=${1:?usage: launch_multinode.sh CONFIG.yaml [--set key=value ...]}
shift
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# (torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed collective ends the job rather than hanging it)
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m specroll_mcore.cli train --config "$CONFIG" "$@"
