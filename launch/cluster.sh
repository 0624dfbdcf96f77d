# Cluster profile: this cluster's network settings, sourced (by bash, with set -u) by
# launch/torchrun.sh and launch/slurm.sbatch before they start anything. Everything below is an
# example: uncomment and adapt. For another cluster, copy this file and set CLUSTER_PROFILE=path.
#
# Under Slurm it is read on the job's first node, where the batch script runs and whose exports
# reach every task, and again by each node's torchrun.sh. A MASTER_ADDR given to torchrun.sh
# beats the profile's, so under Slurm every node keeps the first node's.

# NCCL's own pick of interface can be a container bridge or a management network: name the fast one.
# export NCCL_SOCKET_IFNAME=ib0

# The same for gloo, the collectives of a run on CPUs.
# export GLOO_SOCKET_IFNAME=ib0

# Only the InfiniBand adapters (and ports) wired to the GPUs' fabric; others may be down or slower.
# export NCCL_IB_HCA=mlx5_0:1,mlx5_1:1

# No working InfiniBand: NCCL then uses TCP sockets on NCCL_SOCKET_IFNAME.
# export NCCL_IB_DISABLE=1

# The first node's hostname resolves to an address other nodes cannot reach: use its fast-network name.
# MASTER_ADDR="$(hostname)-ib"

# Log NCCL's choice of interfaces and transports, to see that the settings above took effect.
# export NCCL_DEBUG=INFO
