#!/usr/bin/env bash
# Install DCP's Python dependencies into the NGC PyTorch image without replacing what it ships.
# NGC images list their own package versions in /etc/pip/constraint.txt (and point
# PIP_CONSTRAINT at it). A pin of ours for a package the image already constrains would make
# pip fail or downgrade the image's build, so such lines are dropped and the image's version is
# used; everything else is installed under the same constraints.
#   usage: docker/install_requirements.sh requirements-container.txt [constraint file]
set -euo pipefail
reqs="$1"
constraints="${2:-/etc/pip/constraint.txt}"
filtered="$(mktemp)"
trap 'rm -f "${filtered}"' EXIT

normalise() { tr '[:upper:]_.' '[:lower:]--'; }

if [[ -f "${constraints}" ]]; then
  shipped="$(sed -E 's/[[:space:]]*#.*//; s/[<>=!~;[ ].*//' "${constraints}" | normalise | sort -u)"
else
  shipped=""
fi
while IFS= read -r line || [[ -n "${line}" ]]; do
  name="$(printf '%s' "${line}" | sed -E 's/[[:space:]]*#.*//; s/[<>=!~;[ ].*//' | normalise)"
  if [[ -z "${name}" ]]; then
    continue
  fi
  if [[ -n "${shipped}" ]] && grep -qx -- "${name}" <<<"${shipped}"; then
    echo "keeping the image's ${name} (constrained in ${constraints}); not installing: ${line}"
    continue
  fi
  printf '%s\n' "${line}" >>"${filtered}"
done <"${reqs}"

if [[ -f "${constraints}" ]]; then
  pip install --no-cache-dir -c "${constraints}" -r "${filtered}"
else
  pip install --no-cache-dir -r "${filtered}"
fi
