#!/usr/bin/env bash
# The system packages tests/e2e/test_slurm.py needs: it starts a one-node SLURM cluster of this
# machine with Debian's slurmctld, slurmd, slurm-client and munge, as root; without them it
# skips with one line naming them. Best effort and quiet: no apt, no root or no network leaves
# the tests skipped, and `make test` goes on.
set -uo pipefail
packages=(slurmctld slurmd slurm-client munge)
if [[ -x /usr/sbin/slurmctld && -x /usr/sbin/slurmd && -x /usr/sbin/munged ]] \
   && command -v sbatch >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null || [[ "$(id -u)" != 0 ]]; then
  echo "test: no apt-get or not root: the SLURM tests will skip (they need ${packages[*]})" >&2
  exit 0
fi
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=120 "${packages[@]}" >/dev/null 2>&1
}
if apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; }; then
  echo "test: installed ${packages[*]} for the SLURM tests"
else
  echo "test: could not install ${packages[*]}; the SLURM tests will skip" >&2
fi
