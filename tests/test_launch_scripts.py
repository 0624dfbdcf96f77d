"""The launch scripts under a simulated Slurm: stand-in scontrol/srun/scancel and a stand-in
Python interpreter on PATH record what the real ones would have been asked to run."""
import os
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

# srun: runs its command once per node, as slurmstepd would, with the per-node variables set.
FAKE_SRUN = r"""#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
  pids+=($!)
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
for f in "$RECORD_DIR"/pid.*; do kill -USR1 "$(cat "$f")"; done
"""
# The interpreter torchrun.sh calls: record the command line; pass the one-process check before
# the launch; in "wait" mode behave like a trainer that checkpoints on SIGUSR1 and exits with the
# requeue code.
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "NODE_RANK=${NODE_RANK:-} $*" >> "$RECORD_DIR/calls"
case " $* " in *" --check "*) exit 0 ;; esac
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
    bin_dir, record_dir = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record_dir.mkdir()
    for name, body in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("scancel", FAKE_SCANCEL), ("fake-python", FAKE_PYTHON)]:
        _install(bin_dir, name, body)
    # nothing of the test process's own launch variables (an in-process test may have set them)
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("SLURM_", "NNODES", "NODE_RANK", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))}
    env.update({
        "PATH": f"{bin_dir}:{env['PATH']}",
        "RECORD_DIR": str(record_dir),
        "PYTHON": str(bin_dir / "fake-python"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu-[a17,b03]",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_SUBMIT_DIR": str(REPO),
    })
    return env, record_dir


def test_sbatch_builds_one_torchrun_per_node(slurm_env):
    env, record = slurm_env
    result = subprocess.run(["bash", "launch/slurm.sbatch", "configs/tiny/gpt.yaml", "train.max_steps=7"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = sorted((record / "calls").read_text().splitlines())
    config = str(REPO / "configs/tiny/gpt.yaml")
    expected = sorted([
        f"NODE_RANK={rank} -m pretrain.torchrun --nproc_per_node=4 {TORCHRUN_SIGNALS} "
        f"--shutdown-timeout=240 --nnodes=2 --node_rank={rank} --master_addr=gpu-a17 "
        f"--master_port=24242 -m pretrain.train --config {config} train.max_steps=7"
        for rank in (0, 1)
    ] + [f"NODE_RANK={rank} -m pretrain.train --check --world-size 8 --config {config} train.max_steps=7"
         for rank in (0, 1)])
    assert calls == expected
    assert not (record / "requeued").exists()


def test_sbatch_one_task_per_gpu(slurm_env):
    """TASK_PER_GPU=1: srun starts the trainer itself on every GPU (no torchrun)."""
    env, record = slurm_env
    env["TASK_PER_GPU"] = "1"
    result = subprocess.run(["bash", "launch/slurm.sbatch", "configs/tiny/gpt.yaml", "seed=2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = (record / "calls").read_text().splitlines()
    assert calls == ["NODE_RANK= -m pretrain.train --config configs/tiny/gpt.yaml seed=2"] * 2


def test_sbatch_job_array_picks_its_line(slurm_env, tmp_path):
    env, record = slurm_env
    listing = tmp_path / "sweep.txt"
    listing.write_text("# sweep\nconfigs/tiny/gpt.yaml seed=1\n\nconfigs/tiny/nrgpt.yaml seed=2\n")
    env["SLURM_ARRAY_TASK_ID"] = "1"
    result = subprocess.run(["bash", "launch/slurm.sbatch", str(listing)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = (record / "calls").read_text().splitlines()
    assert len(calls) == 4  # per node: the check, then the launch
    assert all(c.endswith(f"--config {REPO / 'configs/tiny/nrgpt.yaml'} seed=2") for c in calls)


def test_sbatch_forwards_usr1_and_requeues(slurm_env):
    env, record = slurm_env
    env["FAKE_MODE"] = "wait"
    job = subprocess.Popen(["bash", "launch/slurm.sbatch", "configs/tiny/gpt.yaml"], cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not all((record / f"pid.{r}").exists() for r in (0, 1)):
        assert time.time() < deadline, "stand-in trainers did not start"
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` delivers
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert (record / "scancel").read_text().split() == ["--signal=USR1", "4242"]
    assert (record / "saved.0").exists() and (record / "saved.1").exists()
    assert (record / "requeued").read_text().split() == ["4242"]


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
    head = f"-m pretrain.torchrun --nproc_per_node={{}} {TORCHRUN_SIGNALS} --shutdown-timeout=300"
    # each launch checks once, in one process, for the whole world size, before torchrun starts
    assert calls[0::2] == [f"NODE_RANK={node} -m pretrain.train --check --world-size {world} --config {config} seed=3"
                           for node, world in (("", 2), ("1", 16), ("", 24))]
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
