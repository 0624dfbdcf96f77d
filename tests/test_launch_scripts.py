"""The launch scripts under a simulated Slurm: stand-in scontrol/srun/scancel and a stand-in
Python interpreter on PATH record what the real ones would have been asked to run, and with which
environment."""
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""torchrun forwards these to its workers (SIGUSR1 is Slurm's warning); test_elastic.py checks
on a real torchrun that the trainers receive it."""

# srun: record the step's options, then start its tasks as slurmstepd would: --ntasks-per-node of
# them on every node (the job's count by default), with Slurm's per-task variables, and each task
# seeing the node's GPUs, or only its own one with --gpus-per-task=1 (the job's or the step's).
FAKE_SRUN = r"""#!/usr/bin/env bash
options=()
per_node=${SLURM_NTASKS_PER_NODE:-1}
gpus_per_task=${SLURM_GPUS_PER_TASK:-}
while [[ "$1" == --* ]]; do
  case "$1" in
    --ntasks-per-node=*) per_node=${1#*=} ;;
    --gpus-per-task=*) gpus_per_task=${1#*=} ;;
  esac
  options+=("$1")
  shift
done
echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-} ${options[*]}" >> "$RECORD_DIR/srun"
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  for ((task = 0; task < per_node; task++)); do
    gpus=$(seq -s, 0 $((SLURM_GPUS_ON_NODE - 1)))
    if [ -n "$gpus_per_task" ]; then gpus=$task; fi
    SLURM_NODEID=$node SLURM_PROCID=$((node * per_node + task)) SLURM_LOCALID=$task \
      SLURM_NTASKS=$((SLURM_JOB_NUM_NODES * per_node)) SLURM_STEP_TASKS_PER_NODE="$per_node(x$SLURM_JOB_NUM_NODES)" \
      CUDA_VISIBLE_DEVICES=$gpus "$@" &
    pids+=($!)
  done
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") printf 'gpu-a17\ngpu-b03\n' ;;
  "requeue "*) echo "$2" >> "$RECORD_DIR/requeued" ;;
  *) echo "unexpected scontrol $*" >&2; exit 1 ;;
esac
"""
# scancel --signal=USR1 JOB: deliver the signal to every stand-in trainer of the job.
FAKE_SCANCEL = r"""#!/usr/bin/env bash
echo "$*" >> "$RECORD_DIR/scancel"
for f in "$RECORD_DIR"/pid.*; do [ -e "$f" ] && kill -USR1 "$(cat "$f")"; done
"""
# hostname on the simulated nodes (the batch script runs on the first)
FAKE_HOSTNAME = r"""#!/usr/bin/env bash
if [ "${SLURM_NODEID:-0}" = 0 ]; then echo gpu-a17; else echo gpu-b03; fi
"""
# The interpreter torchrun.sh calls: record the command line, and the environment of a launch;
# pass the one-process check before the launch (in "hold-check" mode only once the test says so);
# in "wait" mode behave like a trainer that checkpoints on SIGUSR1 and exits with the requeue code.
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "NODE_RANK=${NODE_RANK:-} $*" >> "$RECORD_DIR/calls"
case " $* " in *" --check "*)
  if [ "${FAKE_MODE:-}" = hold-check ]; then
    touch "$RECORD_DIR/checking"
    for _ in $(seq 400); do [ -e "$RECORD_DIR/release" ] && break; sleep 0.05; done
  fi
  exit 0 ;;
esac
env -0 > "$RECORD_DIR/env.$$"
if [ "${FAKE_MODE:-}" = wait ]; then
  trap 'echo saved >> "$RECORD_DIR/saved.$NODE_RANK"; exit 75' USR1
  echo $$ > "$RECORD_DIR/pid.$NODE_RANK"
  for _ in $(seq 200); do sleep 0.1; done
  exit 1
fi
"""


def _install(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def slurm_env(tmp_path):
    """The batch script's environment in a job of 2 nodes x 4 GPUs that asked for the header's
    one task per node with 64 CPUs."""
    bin_dir, record_dir = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record_dir.mkdir()
    for name, body in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("scancel", FAKE_SCANCEL), ("fake-python", FAKE_PYTHON)]:
        _install(bin_dir, name, body)
    # nothing of the test process's own launch variables (an in-process test may have set them)
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("SLURM_", "SRUN_", "NNODES", "NODE_RANK", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
         "LOCAL_WORLD_SIZE", "CLUSTER_PROFILE", "CUDA_VISIBLE_DEVICES", "NCCL_"))}
    env.update({
        "PATH": f"{bin_dir}:{env['PATH']}",
        "RECORD_DIR": str(record_dir),
        "PYTHON": str(bin_dir / "fake-python"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu-[a17,b03]",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_CPUS_PER_TASK": "64",
        "SLURM_SUBMIT_DIR": str(REPO),
    })
    return env, record_dir


def _sbatch(env, *args, **kwargs):
    return subprocess.run(["bash", "launch/slurm.sbatch", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, **kwargs)


def _launched_environments(record: Path) -> list[dict[str, str]]:
    """The environment of each launched command (not of the checks), in SLURM_PROCID order."""
    environments = []
    for path in record.glob("env.*"):
        pairs = (item.partition("=") for item in path.read_text().split("\0") if item)
        environments.append({name: value for name, _, value in pairs})
    return sorted(environments, key=lambda e: int(e.get("SLURM_PROCID", "0")))


def test_sbatch_builds_one_torchrun_per_node(slurm_env):
    env, record = slurm_env
    result = _sbatch(env, "configs/tiny/gpt.yaml", "train.max_steps=7")
    assert result.returncode == 0, result.stderr
    # the step gets the job's CPUs per task: srun (Slurm >= 22.05) would otherwise give it one
    assert (record / "srun").read_text().splitlines() == [
        "SRUN_CPUS_PER_TASK=64 --kill-on-bad-exit=1 --cpus-per-task=64 --ntasks-per-node=1 "
        "--output=checkpoints/slurm-%x-%j-node%n.out"]
    calls = (record / "calls").read_text().splitlines()
    # the job's one check, in the batch script before srun, for all 8 processes; the nodes skip theirs
    assert calls[0] == "NODE_RANK= -m pretrain.train --check --world-size 8 --config configs/tiny/gpt.yaml train.max_steps=7"
    calls = sorted(calls[1:])
    config = str(REPO / "configs/tiny/gpt.yaml")
    expected = sorted([
        f"NODE_RANK={rank} -m pretrain.torchrun --nproc_per_node=4 --max-restarts=3 {TORCHRUN_SIGNALS} "
        f"--shutdown-timeout=240 --nnodes=2 --node_rank={rank} --master_addr=gpu-a17 "
        f"--master_port=24242 -m pretrain.train --config {config} train.max_steps=7"
        for rank in (0, 1)
    ])
    assert calls == expected
    assert not (record / "requeued").exists()


@pytest.mark.parametrize("gpus", ["per-node", "per-task"])
def test_sbatch_one_task_per_gpu(slurm_env, gpus):
    """TASK_PER_GPU=1: one check, then srun starts the trainer itself on every GPU (no torchrun),
    with the job's CPUs per task; each task takes its ranks from Slurm's variables (not from rank
    variables the submitting shell left behind) and its own GPU, whether it sees the node's four
    (--gpus-per-node) or only its own one (--gpus-per-task=1)."""
    from pretrain.training.engine import distributed_env, gpu_index

    env, record = slurm_env
    env.update({"TASK_PER_GPU": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
                "SLURM_CPUS_PER_TASK": "8", "RANK": "5", "LOCAL_RANK": "3", "WORLD_SIZE": "9"})
    if gpus == "per-task":
        env["SLURM_GPUS_PER_TASK"] = "1"
    result = _sbatch(env, "configs/tiny/gpt.yaml", "seed=2")
    assert result.returncode == 0, result.stderr
    assert (record / "srun").read_text().splitlines() == [
        "SRUN_CPUS_PER_TASK=8 --kill-on-bad-exit=1 --cpus-per-task=8 --ntasks-per-node=4 "
        "--output=checkpoints/slurm-%x-%j-node%n-task%t.out"]
    calls = (record / "calls").read_text().splitlines()
    assert calls == ["NODE_RANK= -m pretrain.train --check --world-size 8 --config configs/tiny/gpt.yaml seed=2"] + \
        ["NODE_RANK= -m pretrain.train --config configs/tiny/gpt.yaml seed=2"] * 8

    tasks = _launched_environments(record)
    assert len(tasks) == 8
    gpus_taken = {0: set(), 1: set()}
    for task in tasks:
        assert task["SRUN_CPUS_PER_TASK"] == "8" and task["MASTER_ADDR"] == "gpu-a17"
        assert "LOCAL_RANK" not in task and "RANK" not in task
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "environ", dict(task))  # the trainer's view, from this task's environment
            rank, world_size, local_rank = distributed_env()
            local_world_size = os.environ["LOCAL_WORLD_SIZE"]
        assert (rank, world_size, local_rank, local_world_size) == \
            (int(task["SLURM_PROCID"]), 8, int(task["SLURM_LOCALID"]), "4")
        visible = task["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == (4 if gpus == "per-node" else 1)
        gpus_taken[int(task["SLURM_NODEID"])].add(visible[gpu_index(local_rank, len(visible))])
    assert gpus_taken == {0: {"0", "1", "2", "3"}, 1: {"0", "1", "2", "3"}}  # one task on each GPU


def test_sbatch_job_array_picks_its_line(slurm_env, tmp_path):
    env, record = slurm_env
    listing = tmp_path / "sweep.txt"
    listing.write_text("# sweep\nconfigs/tiny/gpt.yaml seed=1\n\nconfigs/tiny/nrgpt.yaml seed=2\n")
    env["SLURM_ARRAY_TASK_ID"] = "1"
    result = _sbatch(env, str(listing))
    assert result.returncode == 0, result.stderr
    calls = (record / "calls").read_text().splitlines()
    assert len(calls) == 3  # the job's check, then the launch on each node
    assert calls[0].endswith("--config configs/tiny/nrgpt.yaml seed=2")
    assert all(c.endswith(f"--config {REPO / 'configs/tiny/nrgpt.yaml'} seed=2") for c in calls[1:])


@pytest.mark.parametrize("sent", [signal.SIGUSR1, signal.SIGTERM])
def test_sbatch_forwards_usr1_and_requeues(slurm_env, sent):
    """Slurm's warning (SIGUSR1, `--signal=B:USR1@...`): the trainers checkpoint and the job is
    requeued. SIGTERM (`scancel JOB`): they checkpoint and the job ends, not requeued."""
    env, record = slurm_env
    env["FAKE_MODE"] = "wait"
    job = subprocess.Popen(["bash", "launch/slurm.sbatch", "configs/tiny/gpt.yaml"], cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not all((record / f"pid.{r}").exists() for r in (0, 1)):
        assert time.time() < deadline, "stand-in trainers did not start"
        time.sleep(0.05)
    job.send_signal(sent)
    out, err = job.communicate(timeout=30)
    assert (record / "scancel").read_text().split() == ["--signal=USR1", "4242"]
    assert (record / "saved.0").exists() and (record / "saved.1").exists()
    if sent == signal.SIGUSR1:
        assert job.returncode == 0, err
        assert (record / "requeued").read_text().split() == ["4242"]
    else:
        assert job.returncode == 75 and not (record / "requeued").exists(), err
        assert "slurm.sbatch: stopped by SIGTERM (scancel or preemption), not requeueing; resubmit to resume" in err


def test_sbatch_signal_during_the_check_requeues_without_starting_tasks(slurm_env):
    """One task per GPU checks in the batch script itself: Slurm's warning arriving then requeues
    the job rather than starting trainers that nothing would tell to checkpoint."""
    env, record = slurm_env
    env.update({"TASK_PER_GPU": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
                "SLURM_CPUS_PER_TASK": "8", "FAKE_MODE": "hold-check"})
    job = subprocess.Popen(["bash", "launch/slurm.sbatch", "configs/tiny/gpt.yaml"], cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (record / "checking").exists():
        assert time.time() < deadline, "the check did not start"
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    (record / "release").touch()
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert (record / "requeued").read_text().split() == ["4242"]
    assert not (record / "srun").exists()


@pytest.mark.parametrize("knobs, args, line", [
    ({}, [], "error: no config given; usage: sbatch launch/slurm.sbatch CONFIG|CONFIG_LIST.txt [key=value ...]"),
    ({}, ["sweep.txt"], "error: sweep.txt is a config list, which needs a job array (sbatch --array=...)"),
    ({"SLURM_ARRAY_TASK_ID": "5"}, ["sweep.txt"], "error: sweep.txt has no line for array task 5"),
    ({"TASK_PER_GPU": "1"}, ["configs/tiny/gpt.yaml"],
     "error: TASK_PER_GPU=1 runs one task per GPU (per process on CPU nodes), but the job has 2 task(s) on 2 "
     "node(s) of 4 process(es); submit with --ntasks-per-node=4 and --cpus-per-task at a process's share of a "
     "node's cores"),
    ({"CLUSTER_PROFILE": "no/such/profile.sh"}, ["configs/tiny/gpt.yaml"],
     "error: CLUSTER_PROFILE=no/such/profile.sh: no such file; name an existing profile "
     "(see launch/cluster.sh) or unset it"),
])
def test_sbatch_refuses_bad_input_in_one_line(slurm_env, tmp_path, knobs, args, line):
    env, record = slurm_env
    (tmp_path / "sweep.txt").write_text("configs/tiny/gpt.yaml seed=1\n")
    env.update(knobs, SLURM_SUBMIT_DIR=str(tmp_path))  # where the relative list is found
    result = subprocess.run(["bash", str(REPO / "launch/slurm.sbatch"), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.splitlines() == [line], result.stderr
    assert not (record / "srun").exists() and not (record / "calls").exists()  # nothing was started


# The profile a cluster whose first hostname is not routable needs (as launch/cluster.sh shows).
PROFILE = 'export NCCL_SOCKET_IFNAME=lo\nMASTER_ADDR="$(hostname)-ib"\n'


def test_cluster_profile_is_sourced_by_both_launchers(slurm_env, tmp_path):
    env, record = slurm_env
    _install(tmp_path / "bin", "hostname", FAKE_HOSTNAME)
    profile = tmp_path / "profile.sh"
    profile.write_text(PROFILE)
    env["CLUSTER_PROFILE"] = str(profile)
    # under Slurm: the address is the first node's on every node (each node's torchrun.sh sources
    # the profile again, where $(hostname) is that node's own name)
    result = _sbatch(env, "configs/tiny/gpt.yaml")
    assert result.returncode == 0, result.stderr
    launches = [c for c in (record / "calls").read_text().splitlines() if "pretrain.torchrun" in c]
    assert len(launches) == 2 and all(" --master_addr=gpu-a17-ib " in c for c in launches)
    assert [e["NCCL_SOCKET_IFNAME"] for e in _launched_environments(record)] == ["lo", "lo"]

    # torchrun.sh by hand on the first node: the profile's address, unless the caller gives one
    for path in record.iterdir():
        path.unlink()
    by_hand = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    by_hand.update(NPROC_PER_NODE="2", NNODES="2", NODE_RANK="0")
    for caller in ({}, {"MASTER_ADDR": "10.0.0.5"}):
        result = subprocess.run(["bash", "launch/torchrun.sh", "configs/tiny/gpt.yaml"], cwd=REPO,
                                env={**by_hand, **caller}, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    launches = [c for c in (record / "calls").read_text().splitlines() if "pretrain.torchrun" in c]
    assert [c.split("--master_addr=")[1].split()[0] for c in launches] == ["gpu-a17-ib", "10.0.0.5"]
    assert [e["NCCL_SOCKET_IFNAME"] for e in _launched_environments(record)] == ["lo", "lo"]


def test_torchrun_script_profile_default_and_missing(tmp_path):
    """No launch/cluster.sh: nothing is sourced. A CLUSTER_PROFILE that names no file: one line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _install(bin_dir, "fake-python", FAKE_PYTHON)
    (tmp_path / "launch").mkdir()
    for script in ("torchrun.sh", "check_interfaces.sh"):
        shutil.copy2(REPO / "launch" / script, tmp_path / "launch" / script)
    env = {"PATH": os.environ["PATH"], "RECORD_DIR": str(tmp_path), "PYTHON": str(bin_dir / "fake-python"),
           "NPROC_PER_NODE": "2"}
    config = str(REPO / "configs/tiny/gpt.yaml")
    result = subprocess.run(["bash", "launch/torchrun.sh", config], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (tmp_path / "calls").unlink()
    result = subprocess.run(["bash", "launch/torchrun.sh", config], cwd=tmp_path, capture_output=True,
                            env={**env, "CLUSTER_PROFILE": "no/such/profile.sh"}, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: CLUSTER_PROFILE=no/such/profile.sh: no such file; name an "
                                          "existing profile (see launch/cluster.sh) or unset it"]
    assert not (tmp_path / "calls").exists()  # nothing was started


def test_torchrun_script_static_and_c10d(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _install(bin_dir, "fake-python", FAKE_PYTHON)
    base = {"PATH": os.environ["PATH"], "RECORD_DIR": str(tmp_path), "PYTHON": str(bin_dir / "fake-python")}
    runs = [
        {"NPROC_PER_NODE": "2"},
        {"NPROC_PER_NODE": "8", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5"},
        {"NPROC_PER_NODE": "8", "NNODES": "3", "RDZV_ENDPOINT": "head:29400", "RDZV_ID": "job7"},
    ]
    for extra in runs:
        result = subprocess.run(["bash", "launch/torchrun.sh", "configs/tiny/gpt.yaml", "seed=3"],
                                cwd=REPO, env={**base, **extra}, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    config = REPO / "configs/tiny/gpt.yaml"
    tail = f"-m pretrain.train --config {config} seed=3"
    head = (f"-m pretrain.torchrun --nproc_per_node={{}} --max-restarts=3 {TORCHRUN_SIGNALS} "
            "--shutdown-timeout=300")
    # each launch checks once, in one process, for the whole world size, before torchrun starts
    # (on the nodes after the first of a static rendezvous without the run's lock: --node-rank)
    assert calls[0::2] == [f"NODE_RANK={node} -m pretrain.train --check --world-size {world} --node-rank "
                           f"{node or 0} --config {config} seed=3" for node, world in (("", 2), ("1", 16), ("", 24))]
    assert calls[1] == f"NODE_RANK= {head.format(2)} --standalone {tail}"
    assert calls[3] == (f"NODE_RANK=1 {head.format(8)} --nnodes=2 --node_rank=1 "
                        f"--master_addr=10.0.0.5 --master_port=29500 {tail}")
    assert calls[5] == (f"NODE_RANK= {head.format(8)} --nnodes=3 "
                        f"--rdzv_backend=c10d --rdzv_endpoint=head:29400 --rdzv_id=job7 {tail}")


def test_torchrun_script_rejects_missing_config_and_rank(tmp_path):
    result = subprocess.run(["bash", "launch/torchrun.sh", "no/such.yaml"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.splitlines() == ["error: config file not found: no/such.yaml"]
    env = {"PATH": os.environ["PATH"], "NPROC_PER_NODE": "1", "NNODES": "2", "PYTHON": "true"}
    result = subprocess.run(["bash", "launch/torchrun.sh", "configs/tiny/gpt.yaml"], cwd=REPO,
                            env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: NODE_RANK must be set when NNODES > 1 (or set RDZV_ENDPOINT)"]


@pytest.mark.parametrize("knobs, line", [
    ({"NPROC_PER_NODE": "two"}, "error: NPROC_PER_NODE=two: must be a whole number of at least 1"),
    ({"NPROC_PER_NODE": "0"}, "error: NPROC_PER_NODE=0: must be a whole number of at least 1"),
    ({"NNODES": "two"}, "error: NNODES=two: must be a whole number of at least 1"),
    ({"NNODES": "0"}, "error: NNODES=0: must be a whole number of at least 1"),
    ({"NNODES": "-2"}, "error: NNODES=-2: must be a whole number of at least 1"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.5"},
     "error: NODE_RANK=2: must be a whole number from 0 to 1"),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "http"},
     "error: MASTER_PORT=http: must be a whole number from 1 to 65535"),
    ({"GRACE_SECONDS": "5m"}, "error: GRACE_SECONDS=5m: must be a whole number of at least 0"),
    ({"RESTARTS": "-1"}, "error: RESTARTS=-1: must be a whole number of at least 0"),
])
def test_torchrun_script_refuses_bad_knobs_in_one_line(tmp_path, knobs, line):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _install(bin_dir, "fake-python", FAKE_PYTHON)
    env = {"PATH": os.environ["PATH"], "RECORD_DIR": str(tmp_path), "PYTHON": str(bin_dir / "fake-python"),
           "NPROC_PER_NODE": "2", **knobs}
    result = subprocess.run(["bash", "launch/torchrun.sh", "configs/tiny/gpt.yaml"], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.splitlines() == [line], result.stderr
    assert not (tmp_path / "calls").exists()  # nothing was started


def test_torchrun_script_names_the_configs_of_a_directory():
    result = subprocess.run(["bash", "launch/torchrun.sh", "configs/tiny"], cwd=REPO,
                            capture_output=True, text=True)
    configs = ", ".join(f"configs/tiny/{p.name}" for p in sorted((REPO / "configs/tiny").glob("*.yaml")))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: configs/tiny is a directory; give one of its configs: {configs}"]


def test_the_launch_check_refuses_a_world_of_no_processes():
    result = subprocess.run([sys.executable, "-m", "pretrain.train", "--check", "--world-size", "0",
                             "--config", "configs/tiny/gpt.yaml"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: argument --world-size: must be >= 1, got 0 (see --help)"]
