#!/usr/bin/env bash
# One node of a multi-node training job without SLURM (see launch/README.md).
# Tunables (environment): MASTER_ADDR (node 0's address; required for NNODES > 1), MASTER_PORT (29500),
# NNODES (1), NODE_RANK (0 .. NNODES-1, required for NNODES > 1; node 0 hosts the store at MASTER_ADDR),
# NPROC_PER_NODE (GPUs on this node, or 2 on CPU), RDZV_ID (megatron-gtpo), PYTHON (.venv-gpu/bin/python on a
# node with GPUs when scripts/setup_gpu.sh made it, else .venv/bin/python).
# torchrun's static rendezvous: the c10d backend unpickles its rendezvous state from the store (docs/security.md).
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then
  sed -n "2,7p" "$0"; echo "usage: $0 RESOLVED_CONFIG.yaml [--resume]"; exit 0
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${GPUS:-0}" -gt 0 ] && [ -x "$REPO/.venv-gpu/bin/python" ]; then PYTHON=${PYTHON:-$REPO/.venv-gpu/bin/python}; fi
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$([ "${GPUS:-0}" -gt 0 ] && echo "$GPUS" || echo 2)}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
if [ "$NNODES" -gt 1 ] && [ -z "${NODE_RANK:-}" ]; then
  echo "$0: NNODES=$NNODES needs NODE_RANK (0 on the MASTER_ADDR node, then 1 .. NNODES-1)" >&2; exit 2
fi
exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node-rank="${NODE_RANK:-0}" \
  --nproc-per-node="$NPROC_PER_NODE" --rdzv-backend=static --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  --rdzv-id="${RDZV_ID:-megatron-gtpo}" -m megatron_gtpo.cli.worker "$@"
