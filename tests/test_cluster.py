"""Multi-node for real: launch/slurm.sbatch and launch/torchrun.sh on a Slurm cluster of namespace
nodes (tests/cluster.py), CPU nodes with gloo over the cluster's bridge. Each job trains the
tiny GPT on a character-level corpus for a dozen steps; losses are compared with a run of the
same world size on this one host.

The cluster needs root and Debian's slurmctld, slurmd, slurm-client and munge (.ci/run installs
them). Without them these tests skip with one line saying what is missing, except in CI
(CI=true), where that is a failure."""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

import trainer_runs as runs
from tests import cluster as namespace_cluster
from tests.cluster import wait_until

REPO = Path(__file__).resolve().parent.parent
N_STEPS, CKPT_INTERVAL = runs.N_STEPS, runs.CKPT_INTERVAL
COLLECTIVE_TIMEOUT_S = 15
BASE_CONFIG = {
    **runs.BASE_CONFIG,
    # 12 sequences: 6 x 2 processes, or 4 x 3
    "data": {**runs.BASE_CONFIG["data"], "micro_batch_size": 6},
    "train": {**runs.BASE_CONFIG["train"], "global_batch_size": 12, "collective_timeout": COLLECTIVE_TIMEOUT_S},
    "eval": {"interval": 0},
}
"""The trainer tests' run (tests/trainer_runs.py) with a global batch that 2 and 3 processes share."""


@pytest.fixture(scope="module")
def shared():
    """The cluster's shared filesystem for these tests: outside /tmp, which every node has its
    own of. Holds the dataset, the config, the runs and the job logs."""
    reason = namespace_cluster.missing()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the multi-node tests, but {reason}")
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="pretrain-cluster-tests-", dir="/var/tmp"))
    from data_pipeline.prepare import prepare

    # 11,920 windows: streaming's canonical node count 16, which 3 nodes do not divide
    prepare("shakespeare", str(root / "data"), seq_len=32, val_fraction=0.05, tokenizer="char",
            max_docs=50, num_proc=1)
    config = {**BASE_CONFIG, "output_root": str(root / "runs"),
              "data": {**BASE_CONFIG["data"], "path": str(root / "data")}}
    (root / "base.yaml").write_text(yaml.safe_dump(config))
    (root / "logs").mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm(shared):
    """Three namespace nodes n1-n3 under Slurm, for the whole module."""
    cluster = namespace_cluster.Cluster(shared / "slurm", 3)
    try:
        yield cluster.up()
    finally:
        cluster.down()


@pytest.fixture(autouse=True)
def no_job_left(slurm):
    """A test that fails leaves no job behind to disturb the next one's nodes."""
    yield
    subprocess.run(["scancel", "--user=root"], env=slurm.env, check=False, capture_output=True)


def job_env(**extra: str) -> dict[str, str]:
    """What the tests submit with (sbatch exports it to the job): one thread per process, as
    the one-host references run, and nothing of this process's own launch variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def submit(slurm, shared: Path, *sbatch_options: str, overrides=(), env=None) -> int:
    """`sbatch [options] launch/slurm.sbatch BASE_CONFIG [overrides]` from the repository, as the
    README writes it, with the job's output in the shared logs directory."""
    return slurm.sbatch(f"--output={shared}/logs/slurm-%x-%j.out", *sbatch_options,
                        "launch/slurm.sbatch", str(shared / "base.yaml"), *overrides,
                        cwd=REPO, env=job_env(**(env or {})))


def log(shared: Path, job: int, node: int | None = None) -> str:
    path = shared / "logs" / (f"slurm-pretrain-{job}.out" if node is None else f"slurm-pretrain-{job}-node{node}.out")
    return path.read_text(errors="replace") if path.exists() else ""


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss, the last value logged for each step (a resumed run logs its steps
    after the checkpoint again)."""
    from pretrain.scaling.experiments.common import scalar_curve

    return dict(scalar_curve(run_dir, "train/loss"))


def one_host_run(shared: Path, name: str, processes: int, *overrides: str) -> dict[int, float]:
    """The same config trained by torchrun on this host (loopback), for reference."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", "-m", "pretrain.train", "--config",
               str(shared / "base.yaml"), f"run_name={name}", *overrides]
    done = subprocess.run(command, cwd=REPO, env=job_env(PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(shared / "runs" / name)


def assert_same_losses(got: dict[int, float], expected: dict[int, float], rel: float = 0.0) -> None:
    assert sorted(got) == sorted(expected) == list(range(1, N_STEPS + 1))
    for step, value in expected.items():
        assert math.isclose(got[step], value, rel_tol=rel, abs_tol=0.0), (step, got[step], value)


def held_from(step: int, hold: Path) -> list[str]:
    """Overrides that hold a run before `step` while the file `hold` exists (or until a stop
    signal): a test acts on a run at a known step, however fast the host trains it."""
    return [f"fault.step_stall_file={hold}", f"fault.step_stall_from={step}"]


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and "[rank" not in text, text[-3000:]


@pytest.fixture(scope="module")
def reference_two(shared):
    """The uninterrupted 2-process run on one host."""
    return one_host_run(shared, "one-host-2", 2)


def test_a_preempted_job_checkpoints_requeues_and_resumes_exactly(slurm, shared, reference_two):
    """`scancel --signal=USR1 --batch` mid-run, in the one-task-per-process mode (TASK_PER_GPU=1,
    srun starts the trainers itself): checkpoint, requeue (restart 1), resume; every step's loss
    equals the uninterrupted one-host run's (2 processes either way: the same two micro-batches,
    summed in either order)."""
    hold = shared / "hold-preempted"
    hold.touch()
    job = submit(slurm, shared, "--nodes=2", "--ntasks-per-node=1", env={"TASK_PER_GPU": "1"},
                 overrides=["run_name=preempted", *held_from(CKPT_INTERVAL + 1, hold)])
    run = shared / "runs" / "preempted"
    wait_until(lambda: (run / "ckpt" / "step_00000004" / "complete.json").exists(), "the first checkpoint")
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm.env, check=True)
    wait_until(lambda: "requeueing job" in log(shared, job), "the requeue")
    hold.unlink()  # the requeued run goes on
    fields = slurm.wait_job(job, 240, states=("COMPLETED", "FAILED", "CANCELLED"))
    output = log(shared, job)
    assert fields["JobState"] == "COMPLETED", output[-3000:]
    assert fields["Restarts"] == "1"
    assert "2 node(s) x 1 process(es)" in output
    assert "asking the trainers to checkpoint and stop" in output and f"requeueing job {job}" in output
    assert "restart 1" in output
    task0 = (shared / "logs" / f"slurm-pretrain-{job}-node0-task0.out").read_text()
    task1 = (shared / "logs" / f"slurm-pretrain-{job}-node1-task1.out").read_text()
    assert "saved checkpoint" in task0 and re.search(r"resuming at step \d+", task0)
    no_traceback(task0 + task1)
    assert_same_losses(losses(run), reference_two)


def test_a_time_limit_warning_checkpoints_requeues_and_resumes_exactly(slurm, shared, reference_two):
    """The time limit's warning, `--signal=B:USR1@600`, in the default mode (one torchrun per
    node): checkpoint, requeue (restart 1), resume, every step's loss equal to the uninterrupted
    one-host run's. The job starts with 30 minutes; once its first checkpoint is being written
    (checkpoints stall on fault.checkpoint_stall_file until the warning has arrived, so the job
    cannot finish first, and a warning during the setup would stop it before anything is saved)
    its limit is cut to 10 minutes, inside the warning's 600 s, and slurmctld sends the warning
    on its next periodic check (every 30 s)."""
    stall = shared / "stall-time-limited"
    stall.touch()
    job = submit(slurm, shared, "--nodes=2", "--time=30", "--signal=B:USR1@600",
                 overrides=["run_name=time-limited", f"fault.checkpoint_stall_file={stall}"])
    first = shared / "runs" / "time-limited" / "ckpt" / "step_00000004"
    wait_until(lambda: (first / "mp_rank_00_model_states.pt").exists(), "the first checkpoint's files")
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], env=slurm.env, check=True)
    wait_until(lambda: "got USR1" in log(shared, job), "the time limit's warning", timeout=60)
    # the requeued job keeps its limit and would be warned again at once: back to 30 minutes
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=30"], env=slurm.env, check=True)
    stall.unlink()
    fields = slurm.wait_job(job, 240, states=("COMPLETED", "FAILED", "CANCELLED"))
    output = log(shared, job)
    assert fields["JobState"] == "COMPLETED", (output + log(shared, job, 0) + log(shared, job, 1))[-3000:]
    assert fields["Restarts"] == "1"
    assert f"requeueing job {job}" in output and "restart 1" in output
    node0 = log(shared, job, 0)
    assert re.search(r"stopping at step \d+ on SIGUSR1: checkpoint saved, exit code 75", node0), node0[-3000:]
    assert re.search(r"resuming at step \d+", node0)
    no_traceback(node0 + log(shared, job, 1))
    assert_same_losses(losses(shared / "runs" / "time-limited"), reference_two)


def test_three_nodes_train_like_two_processes_on_one_host(slurm, shared, reference_two):
    """3 nodes, which streaming's partition refuses against its canonical node count (16 here):
    the same global batches as 2 processes on one host, so the same losses, up to the rounding
    of sums over 3 ranks' contributions instead of 2."""
    job = submit(slurm, shared, "--nodes=3", overrides=["run_name=three"])
    fields = slurm.wait_job(job, 240)
    assert fields["JobState"] == "COMPLETED", (log(shared, job) + log(shared, job, 0))[-3000:]
    assert "3 node(s) x 1 process(es)" in log(shared, job)
    assert "micro-batch 4 x 3 process(es)" in log(shared, job, 0)
    assert_same_losses(losses(shared / "runs" / "three"), reference_two, rel=1e-5)


def test_a_two_node_run_resubmitted_on_three_nodes_continues_it(slurm, shared, reference_two):
    """The preempted test's 2-node run, resubmitted on 3 nodes for 4 more steps: the checkpoint
    is converted once to the new layout and the run continues where it stopped; its first new
    step equals the 2-process run continued on one host, up to the rounding of 3 ranks' sums."""
    run = shared / "runs" / "preempted"
    assert max(losses(run)) == N_STEPS, "needs the preempted test's run"
    longer = f"train.max_steps={N_STEPS + 4}"
    job = submit(slurm, shared, "--nodes=3", overrides=["run_name=preempted", longer])
    continued_here = one_host_run(shared, "one-host-2", 2, longer)
    fields = slurm.wait_job(job, 240)
    node0 = log(shared, job, 0)
    assert fields["JobState"] == "COMPLETED", (log(shared, job) + node0)[-3000:]
    assert f"resuming at step {N_STEPS}" in node0 and "micro-batch 4 x 3 process(es)" in node0
    continued = losses(run)
    assert sorted(continued) == list(range(1, N_STEPS + 5))
    for step in range(N_STEPS + 1, N_STEPS + 5):
        assert math.isclose(continued[step], continued_here[step], rel_tol=1e-5), (step, continued[step])


def test_node_lost_mid_checkpoint_requeues_and_resumes_from_the_newest_complete_one(slurm, shared,
                                                                                   reference_two):
    """The README's line for CPU nodes, `sbatch --nodes=2 launch/slurm.sbatch CONFIG` (one process
    per node, no GPU request). A node fails while the job writes its second checkpoint: the surviving node ends within
    train.collective_timeout in one line naming the lost node, Slurm requeues the job on the
    nodes that are up, and it resumes from the first checkpoint (never the partial second one),
    with the uninterrupted run's losses."""
    stall, hold = shared / "stall-checkpoints", shared / "hold-node-lost"
    hold.touch()
    job = submit(slurm, shared, "--nodes=2", overrides=["run_name=node-lost", f"fault.checkpoint_stall_file={stall}",
                                                         *held_from(CKPT_INTERVAL + 1, hold)])
    run = shared / "runs" / "node-lost"
    wait_until(lambda: (run / "ckpt" / "step_00000004" / "complete.json").exists(), "the first checkpoint")
    stall.touch()  # the next checkpoint waits, written but not marked complete, until this goes
    hold.unlink()
    partial = run / "ckpt" / "step_00000008"
    wait_until(lambda: (partial / "mp_rank_00_model_states.pt").exists(), "the second checkpoint's files")
    lost = slurm.job_nodes(job)[1]
    slurm.kill_node(lost)
    killed = time.monotonic()
    stall.unlink()
    wait_until(lambda: "a collective failed" in log(shared, job, 0), "the survivor's line", timeout=60)
    assert time.monotonic() - killed < COLLECTIVE_TIMEOUT_S + 10
    node0 = log(shared, job, 0)
    survivor = next(line for line in node0.splitlines() if "a collective failed" in line)
    assert f"lost the connection to n{lost}" in survivor, survivor
    no_traceback(node0)
    assert not (partial / "complete.json").exists()
    # Slurm notices the lost node after SlurmdTimeout and requeues the job on two nodes that are up
    fields = slurm.wait_job(job, 300, states=("COMPLETED", "FAILED", "CANCELLED"))
    slurm.wait_nodes("down*", 60, nodes=[lost])
    slurm.start_node(lost)
    assert fields["JobState"] == "COMPLETED", log(shared, job)[-3000:]
    assert fields["Restarts"] == "1"
    assert "resuming at step 4" in log(shared, job, 0)
    assert_same_losses(losses(run), reference_two)
    slurm.wait_nodes("idle", 60)


def trainer_pid(node: int, rank: int) -> int:
    """The pid of the trainer process of global `rank` on namespace node `node` (not its loader's
    workers, not its torchrun)."""
    namespace = namespace_cluster.NETNS_PREFIX + namespace_cluster.node_name(node)
    pids = namespace_cluster.sh("ip", "netns", "pids", namespace)
    for pid in pids.stdout.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            comm = Path(f"/proc/{pid}/comm").read_bytes()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        first_start = b"TORCHELASTIC_RESTART_COUNT=0" in environ
        # (the trainer's resource tracker and loader workers inherit its environment)
        trainer = b"pretrain.train" in command and b"pt_data_worker" not in comm
        if f"RANK={rank}".encode() in environ and trainer and first_start:
            return int(pid)
    raise AssertionError(f"no trainer of rank {rank} on n{node}")


def test_a_rank_killed_on_one_node_restarts_in_the_job_without_a_requeue(slurm, shared, reference_two):
    """The README's line for CPU nodes, `sbatch --nodes=2 launch/slurm.sbatch CONFIG`, with its
    default in-job restarts. Rank 1's trainer on the second node is killed with SIGKILL mid-run:
    both nodes restart their ranks in place from the newest complete checkpoint, the job is not
    requeued, its output says once which rank died where (restart 1 of 3), and the run ends with
    the uninterrupted run's losses."""
    hold = shared / "hold-rank-killed"
    hold.touch()
    job = submit(slurm, shared, "--nodes=2",
                 overrides=["run_name=rank-killed", *held_from(2 * CKPT_INTERVAL + 2, hold)])
    run = shared / "runs" / "rank-killed"
    wait_until(lambda: (run / "ckpt" / f"step_{2 * CKPT_INTERVAL:08d}" / "complete.json").exists(),
               "the second checkpoint")
    node = slurm.job_nodes(job)[1]
    victim = trainer_pid(node, rank=1)
    os.kill(victim, signal.SIGKILL)  # during its step 9, or held before step 10
    hold.unlink()
    fields = slurm.wait_job(job, 240, states=("COMPLETED", "FAILED", "CANCELLED"))
    logs = log(shared, job) + log(shared, job, 0) + log(shared, job, 1)
    assert fields["JobState"] == "COMPLETED", logs[-3000:]
    assert fields["Restarts"] == "0"
    died = [line for line in logs.splitlines() if "died of" in line]
    assert died == [f"torchrun: rank 1 (pid {victim}) on {namespace_cluster.node_name(node)} died of SIGKILL; "
                    "restarting this node's ranks from the newest complete checkpoint (restart 1 of 3)"], logs[-3000:]
    assert f"resuming at step {2 * CKPT_INTERVAL}" in log(shared, job, 0)
    no_traceback(logs)
    assert_same_losses(losses(run), reference_two)


def test_a_config_that_cannot_split_its_batch_ends_before_any_task_and_is_not_requeued(slurm, shared):
    job = submit(slurm, shared, "--nodes=3", overrides=["run_name=bad-split", "train.global_batch_size=8"])
    fields = slurm.wait_job(job, 120)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0" and fields["Restarts"] == "0"
    errors = [line for line in log(shared, job).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.global_batch_size=8: 3 processes cannot share it" in errors[0]
    assert not log(shared, job, 0)  # no srun step ran
    assert not (shared / "runs" / "bad-split").exists()


def test_a_profile_naming_a_missing_interface_ends_in_one_line(slurm, shared, tmp_path):
    profile = shared / "ib-profile.sh"
    profile.write_text("export GLOO_SOCKET_IFNAME=ib0\n")
    job = submit(slurm, shared, "--nodes=2", overrides=["run_name=no-ib"], env={"CLUSTER_PROFILE": str(profile)})
    fields = slurm.wait_job(job, 120)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0" and fields["Restarts"] == "0"
    errors = [line for line in log(shared, job).splitlines() if line.startswith("error:")]
    assert errors == [f"error: GLOO_SOCKET_IFNAME=ib0: no interface ib0 on n1; this node has: eth0 lo "
                      f"(set it in {profile})"]
    assert not log(shared, job, 0)


def test_max_requeues_reached_is_said(slurm, shared):
    """A preemption with MAX_REQUEUES=0 (here during the job's check, before any task): the job
    says it does not requeue, and ends."""
    job = submit(slurm, shared, "--nodes=2", overrides=["run_name=no-requeue"], env={"MAX_REQUEUES": "0"})
    wait_until(lambda: "slurm.sbatch: 2 node(s)" in log(shared, job), "the job to start")
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm.env, check=True)
    fields = slurm.wait_job(job, 120)
    output = log(shared, job)
    assert "slurm.sbatch: not requeueing, MAX_REQUEUES=0 reached" in output, output
    assert fields["Restarts"] == "0" and fields["JobState"] == "FAILED" and fields["ExitCode"] == "75:0"


def test_a_scaling_sweep_runs_as_a_job_array_and_fits(slurm, shared):
    sweep = {"name": "sw", "base_config": str(shared / "base.yaml"), "output_root": str(shared / "sweeps"),
             "families": {"gpt": {"flavor": "gpt-tiny"}}, "sizes": {"w8": {"n_embd": 8}, "w16": {"n_embd": 16}, "w32": {"n_embd": 32}},
             "tokens": {"fixed": [3072]},
             "slurm": {"gpus_per_node": 0, "time": "0:10:00",
                       "extra_args": [f"--output={shared}/logs/slurm-%x-%A_%a.out"]}}
    path = shared / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    env = {**job_env(PYTHONPATH=str(REPO)), "SLURM_CONF": str(slurm.conf)}
    done = subprocess.run([sys.executable, "-m", "pretrain.scaling", "run", str(path), "--slurm"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    script = shared / "sweeps" / "sw" / "submit.sh"
    assert "--gpus-per-node" not in script.read_text()
    submitted = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = int(submitted.stdout.split()[-1])
    for task in (0, 1, 2):
        fields = slurm.wait_job(f"{job}_{task}", 300)
        assert fields["JobState"] == "COMPLETED", fields
    fit = subprocess.run([sys.executable, "-m", "pretrain.scaling", "fit", str(shared / "sweeps" / "sw"),
                          "--out", str(shared / "fit")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert fit.returncode == 0, fit.stderr
    fits = (shared / "fit" / "fits.md").read_text()
    assert "L(N)" in fits and "gpt" in fits, fits


def two_host_launch(bare, shared: Path, node: int, name: str, *overrides: str) -> subprocess.Popen:
    """launch/torchrun.sh on namespace node `node` (1 or 2) of a two-host static rendezvous."""
    # without in-job restarts: this test is about how a launch ends when its peer is cut off or
    # lost (with them, each restart would wait train.collective_timeout for the peer again)
    env = job_env(NNODES="2", NODE_RANK=str(node - 1), MASTER_ADDR="n1", MASTER_PORT="29511",
                  NPROC_PER_NODE="1", GRACE_SECONDS="5", RESTARTS="0")
    command = bare.on_node(node, ["bash", "launch/torchrun.sh", str(shared / "base.yaml"), f"run_name={name}",
                                  *overrides])
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def test_two_host_torchrun_survives_a_network_cut_and_a_lost_host_and_resumes_exactly(slurm, shared,
                                                                                      reference_two):
    """Two hosts without Slurm (n1 and n2 of the cluster, started by hand as a user would). A
    network cut (n2's link down) mid-run: n1 ends within train.collective_timeout in one line
    instead of hanging. Both started again; then n2 killed mid-run: n1 ends in one line naming
    it. Both started again: the run ends with the uninterrupted run's losses. The runs are held
    at a given step until n2 is cut or killed."""
    name = "two-hosts"
    run = shared / "runs" / name
    hold = shared / "hold-two-hosts"

    def launch_both_held_after(checkpoint: int):
        """Both hosts, held before step `checkpoint + 2`; returns once they wait there."""
        hold.touch()
        hosts = [two_host_launch(slurm, shared, node, name, *held_from(checkpoint + 2, hold)) for node in (1, 2)]
        wait_until(lambda: (run / "ckpt" / f"step_{checkpoint:08d}" / "complete.json").exists() and
                   checkpoint + 1 in losses(run), f"step {checkpoint + 1}", timeout=240)
        return hosts

    def survivor_line(first: subprocess.Popen, since: float) -> str:
        hold.unlink()  # n1 goes on to the next step's collectives
        try:
            out, _ = first.communicate(timeout=COLLECTIVE_TIMEOUT_S + 40)
        except subprocess.TimeoutExpired:
            stop(first)
            pytest.fail(f"n1's launch still running {time.monotonic() - since:.0f} s after its peer went:\n"
                        + first.communicate()[0][-3000:])
        # the timeout, then the trainer's and its launcher's exits (slower on a busy host)
        assert time.monotonic() - since < COLLECTIVE_TIMEOUT_S + 20 and first.returncode == 1, out[-3000:]
        no_traceback(out)
        return out.strip().splitlines()[-1]

    def stop(host: subprocess.Popen) -> None:
        for pid in runs.process_tree(host.pid):
            os.kill(pid, signal.SIGKILL)
        host.wait()

    first, second = launch_both_held_after(CKPT_INTERVAL)
    slurm.cut(2)
    try:
        line = survivor_line(first, time.monotonic())
    finally:
        slurm.cut(2, up=True)
    assert line.startswith("error: a collective failed on n1, another process sent nothing for "
                           f"train.collective_timeout={COLLECTIVE_TIMEOUT_S} s"), line
    stop(second)  # cut off from n1's rendezvous store, its launcher can wait long after its trainer

    first, second = launch_both_held_after(2 * CKPT_INTERVAL)
    killed = time.monotonic()
    stop(second)  # the host's launcher and trainer die at once
    line = survivor_line(first, killed)
    assert line.startswith("error: a collective failed on n1, lost the connection to n2 "), line

    first, second = (two_host_launch(slurm, shared, node, name) for node in (1, 2))
    out, _ = first.communicate(timeout=300)
    second.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, out[-3000:]
    assert f"resuming at step {2 * CKPT_INTERVAL}" in out, out[-3000:]
    assert_same_losses(losses(run), reference_two)


def test_nodes_without_a_shared_filesystem_train_from_s3_and_resume_from_the_store(slurm, shared, reference_two):
    """No shared dataset and no shared run directory: each node's output root is its own /tmp,
    the dataset and the checkpoints are in an S3 store (moto's server, a separate process
    listening on the cluster's bridge). A 2-node job is preempted with USR1 once its first
    checkpoint is in the store, requeued, and resumes from the store (the first node's own
    copy holds only its ranks' files); every step's loss equals the uninterrupted run's."""
    from common import objectstore
    from bench.s3_server import S3Server
    from data_pipeline.prepare import prepare

    server = S3Server(shared, host=f"{namespace_cluster.SUBNET}.1")
    try:
        env = server.env()
        data, remote = f"{server.bucket('cluster-data')}/shakespeare", server.bucket("cluster-runs")
        with pytest.MonkeyPatch.context() as here:
            for name, value in env.items():
                here.setenv(name, value)
            # the shared fixture's dataset, prepared into the store instead
            prepare("shakespeare", data, seq_len=32, val_fraction=0.05, tokenizer="char", max_docs=50, num_proc=1)
            private = f"/tmp/pretrain-private-{os.getpid()}"
            hold = shared / "hold-s3"
            hold.touch()
            job = submit(slurm, shared, "--nodes=2", env=env,
                         overrides=["run_name=s3-private", f"output_root={private}", f"data.path={data}",
                                    f"checkpoint.remote={remote}", *held_from(CKPT_INTERVAL + 1, hold)])
            first = f"{remote}/s3-private/ckpt/step_{CKPT_INTERVAL:08d}/complete.json"
            wait_until(lambda: objectstore.exists(first), "the first checkpoint in the store")
            subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm.env, check=True)
            wait_until(lambda: "requeueing job" in log(shared, job), "the requeue")
            hold.unlink()
            fields = slurm.wait_job(job, 240, states=("COMPLETED", "FAILED", "CANCELLED"))
            node0 = log(shared, job, 0)
            assert fields["JobState"] == "COMPLETED", (log(shared, job) + node0 + log(shared, job, 1))[-3000:]
            assert fields["Restarts"] == "1"
            assert re.search(r"fetched checkpoint step_\d+ from s3://cluster-runs/s3-private/ckpt/", node0), node0[-3000:]
            assert re.search(r"resuming at step \d+", node0)
            no_traceback(node0 + log(shared, job, 1))
            assert not (shared / "runs" / "s3-private").exists()
            assert objectstore.exists(f"{remote}/s3-private/ckpt/step_{N_STEPS:08d}/complete.json")
        # rank 0's TensorBoard files, on whichever nodes rank 0 ran (each node's /tmp, seen
        # through its slurmd's mount namespace)
        gathered = shared / "s3-private-tb"
        for name, daemon in slurm.daemons.items():
            tb = Path(f"/proc/{daemon.pid}/root{private}/s3-private/tb")
            if name.startswith("slurmd-") and tb.is_dir():
                shutil.copytree(tb, gathered / "tb", dirs_exist_ok=True)
        assert_same_losses(losses(gathered), reference_two)
    finally:
        server.stop()
