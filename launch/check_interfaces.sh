#!/usr/bin/env bash
# The network interfaces a cluster profile names must exist on this node: gloo would fail later
# with a traceback, and NCCL would fall back to another network. Run by launch/slurm.sbatch (on
# the job's first node, before any task) and launch/torchrun.sh (on every node).
#   launch/check_interfaces.sh PROFILE   # PROFILE: only named in the message
# NCCL_SOCKET_IFNAME takes name prefixes, "=name" for an exact name and "^..." for exclusions
# (not checked); GLOO_SOCKET_IFNAME takes exact names. Both: comma-separated lists.
set -u
# this network namespace's interfaces (/sys/class/net can show another namespace's)
present=$(awk -F: 'NR > 2 {gsub(/ /, "", $1); print $1}' /proc/net/dev | sort)
for variable in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
  names=${!variable:-}
  [ -n "$names" ] && [[ "$names" != ^* ]] || continue
  IFS=, read -r -a wanted <<< "$names"
  for name in "${wanted[@]}"; do
    if [ "$variable" = NCCL_SOCKET_IFNAME ] && [[ "$name" != =* ]]; then
      grep -q "^${name}" <<< "$present" && continue
    elif grep -qx "${name#=}" <<< "$present"; then
      continue
    fi
    echo "error: $variable=$names: no interface ${name#=} on $(hostname); this node has: $(tr '\n' ' ' <<< "$present")(set it in ${1:-the cluster profile})" >&2
    exit 2
  done
done
