#!/usr/bin/env bash
# Installs a single-machine SLURM (slurmctld, slurmd, slurm-client) and munge from Debian packages,
# for the tests in tests/e2e/test_slurm*.py. Idempotent: when every binary is already on PATH it
# returns at once without touching apt.
#
# Tunables (environment):
#   SLURM_APT_PACKAGES   packages to install        (default: "slurmctld slurmd slurm-client munge")
#   SLURM_APT_UPDATE     run apt-get update first   (default: 1; set 0 when the lists are fresh)
#
# Needs root (apt). --no-install-recommends keeps it to ~8 packages / ~13 MB; every plugin the
# tests use (cons_tres, linuxproc, munge, gres/gpu) is in slurm-wlm-basic-plugins.
set -euo pipefail

SLURM_APT_PACKAGES=${SLURM_APT_PACKAGES:-"slurmctld slurmd slurm-client munge"}
SLURM_APT_UPDATE=${SLURM_APT_UPDATE:-1}

missing=0
for bin in slurmctld slurmd sbatch srun scontrol sinfo squeue scancel munged munge unmunge; do
  command -v "$bin" >/dev/null 2>&1 || { missing=1; break; }
done
if [ "$missing" = 0 ]; then
  echo "install_slurm: slurm and munge already installed"
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  echo "install_slurm: installing the Debian packages needs root (apt-get); run as root or install: $SLURM_APT_PACKAGES" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if [ "$SLURM_APT_UPDATE" = 1 ]; then
  apt-get update -qq
fi
# shellcheck disable=SC2086  # the package list is meant to word-split
apt-get install -y -qq --no-install-recommends $SLURM_APT_PACKAGES
# sbatch --version would need a slurm.conf, so ask dpkg for the version.
echo "install_slurm: installed slurm $(dpkg-query -W -f='${Version}' slurm-client)"
