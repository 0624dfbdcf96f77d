"""What a Slurm job of this pipeline spends on starting, on a preemption and on a lost node, on a
real Slurm cluster of namespace nodes on this machine (tests/cluster.py; root and Debian's
slurmctld, slurmd, slurm-client and munge needed):

- start: from `sbatch` to the first logged training step;
- preemption: from `scancel --signal=USR1 --batch` to the first step of the requeued job
  (checkpoint, exit, requeue, start, resume);
- node loss: from killing a node's processes to the first step of the requeued job on the
  nodes left (the survivors' end, Slurm noticing the node after SlurmdTimeout, requeue, resume).

    python -m bench.cluster [--rounds 2] [--nodes 2]

Each round is one job of the tiny GPT on a character-level corpus, on CPU nodes (one process
each, gloo over the cluster's bridge). docs/benchmarks.md records the medians."""
from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from common.cli import ArgumentParser, run_command
from tests import cluster as namespace_cluster
from tests.cluster import wait_until

REPO = Path(__file__).resolve().parent.parent
CONFIG = {
    "seed": 7, "model": {"flavor": "gpt-tiny"},
    "data": {"seq_len": 32, "micro_batch_size": 6, "num_workers": 1},
    "optimizer": {"lr": 3e-3}, "schedule": {"kind": "cosine", "warmup_steps": 2, "min_lr": 3e-4},
    "train": {"max_steps": 100000, "global_batch_size": 12, "log_interval": 1, "collective_timeout": 15},
    "zero": {"stage": 2}, "checkpoint": {"interval": 5, "keep": 2}, "eval": {"interval": 0},
}


def steps_after_resume(log: Path, resumes: int) -> bool:
    """The node log shows `resumes` resumed starts, and a training step after the last one."""
    text = log.read_text(errors="replace") if log.exists() else ""
    starts = [m.end() for m in re.finditer(r"resuming at step \d+", text)]
    if resumes == 0:
        return re.search(r"^step \d+/", text, re.M) is not None
    return len(starts) >= resumes and re.search(r"^step \d+/", text[starts[resumes - 1]:], re.M) is not None


def one_round(cluster, root: Path, config: Path, name: str, nodes: int) -> dict[str, float]:
    env = {**cluster.env, "OMP_NUM_THREADS": "1"}
    submitted = time.perf_counter()
    job = cluster.sbatch(f"--nodes={nodes}", f"--output={root}/logs/slurm-%x-%j.out", "launch/slurm.sbatch",
                         str(config), f"run_name={name}", cwd=REPO, env=env)
    node0 = root / "logs" / f"slurm-pretrain-{job}-node0.out"
    try:
        started = wait_until(lambda: steps_after_resume(node0, 0), "the first step", timeout=300)
        run = root / "runs" / name
        wait_until(lambda: (run / "ckpt" / "latest").exists(), "a checkpoint", timeout=300)
        signalled = time.perf_counter()
        subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=env, check=True)
        preempted = wait_until(lambda: steps_after_resume(node0, 1), "the requeued job's first step", timeout=300)
        lost = cluster.job_nodes(job)[-1]
        killed = time.perf_counter()
        cluster.kill_node(lost)
        resumed = wait_until(lambda: steps_after_resume(node0, 2), "the first step after the node loss", timeout=300)
    finally:
        subprocess.run(["scancel", str(job)], env=env)
    cluster.wait_nodes("down*", 60, nodes=[lost])
    cluster.start_node(lost)
    cluster.wait_nodes("idle", 60)
    return {"start": started - submitted, "preemption": preempted - signalled, "node loss": resumed - killed}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2, help="nodes per job (the cluster has one more)")
    args = parser.parse_args(argv)
    from data_pipeline.prepare import prepare

    reason = namespace_cluster.missing()
    if reason:
        raise SystemExit(f"error: {reason}")
    root = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir="/var/tmp"))
    cluster = namespace_cluster.Cluster(root / "slurm", args.nodes + 1)
    try:
        prepare("shakespeare", str(root / "data"), seq_len=32, val_fraction=0.05, tokenizer="char",
                max_docs=50, num_proc=1)
        config = root / "config.yaml"
        config.write_text(yaml.safe_dump({**CONFIG, "output_root": str(root / "runs"),
                                          "data": {**CONFIG["data"], "path": str(root / "data")}}))
        (root / "logs").mkdir()
        cluster.up()
        figures = [one_round(cluster, root, config, f"round{r}", args.nodes) for r in range(args.rounds)]
    finally:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.nodes} CPU nodes x 1 process, {os.cpu_count()} cores shared, {args.rounds} rounds "
          "(seconds: median, min-max)")
    for key in figures[0]:
        values = [f[key] for f in figures]
        print(f"  {key:<12} {statistics.median(values):6.1f}  ({min(values):.1f}-{max(values):.1f})")
    return 0


if __name__ == "__main__":
    run_command(main)
