#!/usr/bin/env bash
# Launch `python -m pretrain.train` under torchrun, on one node or several.
#
#   launch/torchrun.sh CONFIG [key=value ...]
#
# Single node (default): all local GPUs, or NPROC_PER_NODE processes (1 on a CPU-only machine).
# Several nodes: run this on every node with the same NNODES, MASTER_ADDR, MASTER_PORT and
# each node's NODE_RANK; or set RDZV_ENDPOINT=host:port (c10d rendezvous, any node order).
#
# Environment knobs:
#   NPROC_PER_NODE   processes per node (default: number of visible GPUs, else 1)
#   NNODES           number of nodes (default 1 -> --standalone)
#   NODE_RANK        this node's rank, 0..NNODES-1 (static rendezvous)
#   MASTER_ADDR      address of node 0 (static rendezvous); beats the cluster profile's
#   MASTER_PORT      port on node 0 (default 29500)
#   RDZV_ENDPOINT    host:port of a c10d rendezvous (instead of NODE_RANK/MASTER_ADDR)
#   RDZV_ID          rendezvous id shared by all nodes (default: job id or "pretrain")
#   GRACE_SECONDS    how long torchrun lets workers checkpoint after SIGTERM/SIGUSR1 (default 300)
#   RESTARTS         in-job restarts of this node's workers after a rank crashed, hung (the trainer's
#                    watchdog) or lost its peer, each resuming from the newest complete checkpoint
#                    (default 3; 0: none). Used up, the launch ends with one line and the failure's
#                    exit code (1: slurm.sbatch does not requeue it)
#   PYTHON           interpreter (default: .venv/bin/python if present, else python3)
#   CLUSTER_PROFILE  the cluster profile to source (default: launch/cluster.sh, if present)
#   SKIP_CHECK       1: the caller ran `pretrain.train --check` for the whole job already
#                    (slurm.sbatch does, once per job), so this node does not run it again
set -euo pipefail

fail() {  # a bad input: one line, exit 2
  echo "error: $*" >&2
  exit 2
}

# whole_number NAME MIN [MAX]: the knob NAME must be a whole number in [MIN, MAX] (written
# back without leading zeros). At most 9 digits: bash's arithmetic wraps longer ones around.
whole_number() {
  local name=$1 min=$2 max=${3:-} value=${!1}
  if ! [[ "$value" =~ ^[0-9]{1,9}$ ]] || ((10#$value < min)) || { [ -n "$max" ] && ((10#$value > max)); }; then
    if [ -n "$max" ]; then fail "$name=$value: must be a whole number from $min to $max"; fi
    fail "$name=$value: must be a whole number of at least $min"
  fi
  printf -v "$name" %d "$((10#$value))"
}

if [ $# -lt 1 ]; then
  fail "no config given; usage: launch/torchrun.sh CONFIG [key=value ...]"
fi
config=$1
shift
if [ -d "$config" ]; then
  shopt -s nullglob
  configs=("${config%/}"/*.yaml "${config%/}"/*.yml)
  [ ${#configs[@]} -gt 0 ] || fail "$config is a directory with no YAML config in it; give a config file"
  listing=$(printf ', %s' "${configs[@]}")
  fail "$config is a directory; give one of its configs: ${listing:2}"
fi
[ -f "$config" ] || fail "config file not found: $config"
config=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")

repo_root=$(cd "$(dirname "$0")/.." && pwd)

# The cluster profile (network settings, see launch/cluster.sh). A MASTER_ADDR the caller gives
# beats the profile's: slurm.sbatch hands every node the one it chose on node 0, where a profile
# line such as MASTER_ADDR=$(hostname)-ib, evaluated again here, would name this node instead.
caller_master_addr=${MASTER_ADDR:-}
profile=${CLUSTER_PROFILE:-$repo_root/launch/cluster.sh}
if [ -f "$profile" ]; then
  source "$profile"
elif [ -n "${CLUSTER_PROFILE:-}" ]; then
  fail "CLUSTER_PROFILE=$CLUSTER_PROFILE: no such file; name an existing profile (see launch/cluster.sh) or unset it"
fi
MASTER_ADDR=${caller_master_addr:-${MASTER_ADDR:-}}

"$repo_root/launch/check_interfaces.sh" "$profile" || exit 2

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$repo_root/.venv/bin/python" ]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi

if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi
NNODES=${NNODES:-1}
GRACE_SECONDS=${GRACE_SECONDS:-300}
RESTARTS=${RESTARTS:-3}
whole_number NPROC_PER_NODE 1
whole_number NNODES 1
whole_number GRACE_SECONDS 0
whole_number RESTARTS 0

# torchrun forwards these signals to its workers and waits GRACE_SECONDS for them to save a
# checkpoint. By default it does not handle SIGUSR1 (Slurm's early warning) and dies of it,
# leaving the workers to be killed with the job step before they have saved. These must be
# flags: torchrun overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with its flag's default.
# pretrain.torchrun is torchrun itself, exiting with the trainer's code (75 after a checkpoint
# saved on a signal, 2 for a bad config) and leaving out torchrun's own failure report, so that
# rank 0's one-line error is the last line of a failed launch.
node_rank=0  # of a static multi-node rendezvous; 0 for every node of a c10d one
args=(--nproc_per_node="$NPROC_PER_NODE" --max-restarts="$RESTARTS"
      --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
      --shutdown-timeout="$GRACE_SECONDS")
if [ "$NNODES" = 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  args+=(--standalone)
elif [ -n "${RDZV_ENDPOINT:-}" ]; then
  args+=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT"
         --rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-pretrain}}")
else
  [ -n "${NODE_RANK:-}" ] || fail "NODE_RANK must be set when NNODES > 1 (or set RDZV_ENDPOINT)"
  [ -n "$MASTER_ADDR" ] || fail "MASTER_ADDR must be set when NNODES > 1 (or set RDZV_ENDPOINT)"
  MASTER_PORT=${MASTER_PORT:-29500}
  whole_number NODE_RANK 0 "$((NNODES - 1))"
  node_rank=$NODE_RANK
  whole_number MASTER_PORT 1 65535
  args+=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR"
         --master_port="$MASTER_PORT")
fi

cd "$repo_root"
# The config, data and resume checks once, in one process, before any rank starts. On the nodes
# after the first they leave out whether another trainer holds the run: node 0's check asks
# that, and here the holder could be this job's own rank 0, started already.
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  "$PYTHON" -m pretrain.train --check --world-size "$((NPROC_PER_NODE * NNODES))" \
    --node-rank "$node_rank" --config "$config" "$@" || exit
fi
exec "$PYTHON" -m pretrain.torchrun "${args[@]}" -m pretrain.train --config "$config" "$@"
