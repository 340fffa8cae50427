#!/usr/bin/env bash
# A real, throw-away SLURM cluster on this machine, for the e2e tests (tests/e2e/test_slurm*.py).
#
#   local_slurm.sh start DIR   writes DIR/slurm.conf (+ gres.conf), starts munged, slurmctld and one
#                              slurmd per fake node, and waits until every node is idle
#   local_slurm.sh stop DIR    stops exactly the daemons that `start DIR` started, by their pid files
#
# Everything lives under DIR (config, state, spool, logs, pid files, the munge socket), so several
# clusters can coexist and nothing is written to /etc or /run. Clients and jobs find the cluster
# through SLURM_CONF=DIR/slurm.conf (jobs inherit it). Needs root and the Debian packages slurmctld,
# slurmd, slurm-client and munge (.ci/install_slurm.sh).
#
# Tunables (environment, read by `start`):
#   LOCAL_SLURM_NODES          fake nodes, all on 127.0.0.1 (default 1; names node1..nodeN)
#   LOCAL_SLURM_CPUS           CPUs each node advertises (default: nproc)
#   LOCAL_SLURM_GPUS           fake GPUs per node, as character devices (default 0)
#   LOCAL_SLURM_MEM_MB         RealMemory per node (default 4000)
#   LOCAL_SLURM_CTLD_PORT      slurmctld port (default 16817; the tests pass a free one)
#   LOCAL_SLURM_SLURMD_PORT    port of node1; nodeK uses this + K - 1 (default 16818)
#   LOCAL_SLURM_AUTH           munge | none (default munge; none needs no munged, loopback only)
set -euo pipefail

cmd=${1:?usage: local_slurm.sh start|stop DIR}
D=$(realpath -m "${2:?usage: local_slurm.sh start|stop DIR}")
export SLURM_CONF=$D/slurm.conf

NODES=${LOCAL_SLURM_NODES:-1}
CPUS=${LOCAL_SLURM_CPUS:-$(nproc)}
GPUS=${LOCAL_SLURM_GPUS:-0}
MEM_MB=${LOCAL_SLURM_MEM_MB:-4000}
CTLD_PORT=${LOCAL_SLURM_CTLD_PORT:-16817}
SLURMD_PORT=${LOCAL_SLURM_SLURMD_PORT:-16818}
AUTH=${LOCAL_SLURM_AUTH:-munge}
MUNGE_SOCKET=$D/munge/munge.socket

write_conf() {
  local auth_lines gres_cfg="" i
  if [ "$AUTH" = munge ]; then
    # A private munged socket keeps this cluster independent of any system munged.
    auth_lines="AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET"
  else
    auth_lines="AuthType=auth/none
CredType=cred/none"
  fi
  [ "$GPUS" -gt 0 ] && gres_cfg="Gres=gpu:$GPUS"
  cat > "$SLURM_CONF" <<CONF
ClusterName=localtest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
$auth_lines
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
EnforcePartLimits=ALL
GresTypes=gpu
# Fake nodes advertise what the config says, not what this 2-core VM has.
SlurmdParameters=config_overrides
# Short timers so requeued jobs and killed steps settle quickly in tests.
KillWait=10
# srun's I/O and step messages on 2 loaded cores: the default 10 s once timed out in the full suite
# ("eio_message_socket_accept ... Socket timed out on send/recv", the step failed).
MessageTimeout=60
MinJobAge=600
SchedulerParameters=bf_interval=1,sched_interval=2
SlurmctldPort=$CTLD_PORT
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
CONF
  : > "$D/gres.conf"
  for i in $(seq 1 "$NODES"); do
    echo "NodeName=node$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i - 1)) CPUs=$CPUS RealMemory=$MEM_MB $gres_cfg State=UNKNOWN" >> "$SLURM_CONF"
    if [ "$GPUS" -gt 0 ]; then
      # slurmd only accepts character devices as GPU files; c 1 3 is /dev/null's number.
      mkdir -p "$D/dev/node$i"
      for g in $(seq 0 $((GPUS - 1))); do
        [ -e "$D/dev/node$i/nvidia$g" ] || mknod "$D/dev/node$i/nvidia$g" c 1 3
      done
      echo "NodeName=node$i Name=gpu File=$D/dev/node$i/nvidia[0-$((GPUS - 1))]" >> "$D/gres.conf"
    fi
  done
  echo "PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >> "$SLURM_CONF"
}

start_munge() {
  install -d -o munge -g munge -m 0755 "$D/munge"
  setsid runuser -u munge -- munged -F --socket="$MUNGE_SOCKET" --pid-file="$D/munge/munged.pid" \
    --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed" \
    > "$D/log/munged.out" 2>&1 < /dev/null &
  for _ in $(seq 100); do
    munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "local_slurm: munged did not come up; see $D/log/munged.out and $D/munge/munged.log" >&2
  return 1
}

all_idle() {
  local states
  states=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
  [ "$states" = "idle " ]
}

start() {
  mkdir -p "$D"/{state,spool,log,run}
  write_conf
  [ "$AUTH" = munge ] && start_munge
  # -c: ignore saved state, so a drain left by an earlier run cannot keep nodes down.
  setsid slurmctld -D -c > "$D/log/slurmctld.out" 2>&1 < /dev/null &
  for i in $(seq 1 "$NODES"); do
    mkdir -p "$D/spool/node$i"
    setsid slurmd -D -N "node$i" > "$D/log/slurmd-node$i.out" 2>&1 < /dev/null &
  done
  for _ in $(seq 300); do
    all_idle && return 0
    sleep 0.1
  done
  echo "local_slurm: nodes not idle after 30 s: $(sinfo -N 2>&1 | tr '\n' ';'); logs in $D/log" >&2
  return 1
}

wait_gone() {
  local p=$1
  for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$p" 2>/dev/null || true
}

stop() {
  local pids p f
  # Jobs outlive slurmd (slurmstepd keeps them running), so cancel them first and let them end.
  if [ -f "$SLURM_CONF" ] && scontrol ping >/dev/null 2>&1; then
    scancel --user=root >/dev/null 2>&1 || true
    for _ in $(seq 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  pids=$(cat "$D"/run/*.pid 2>/dev/null || true)
  # Slurm removes its own pid files on exit, so read them before asking it to stop.
  for p in $pids; do kill -TERM "$p" 2>/dev/null || true; done
  for p in $pids; do wait_gone "$p"; done
  f=$D/munge/munged.pid
  if [ -f "$f" ]; then
    p=$(cat "$f")
    kill -TERM "$p" 2>/dev/null || true
    wait_gone "$p"
  fi
}

case $cmd in
  start) start ;;
  stop) stop ;;
  *) echo "usage: local_slurm.sh start|stop DIR" >&2; exit 2 ;;
esac
