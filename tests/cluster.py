"""A real Slurm cluster on this machine: each node a network namespace with its own address,
hostname, /tmp and /dev/shm, the rest of the filesystem shared (as a cluster's shared filesystem
is). Debian's slurmctld, slurmd and munge run it; `sbatch`, `srun`, `scancel` and `sinfo` are
the real clients.

The controller and munge run in this machine's own network namespace, on the address of a bridge
that connects the nodes' veth pairs; everything the cluster writes lives in one directory outside
/tmp (which each node has its own of). Nodes are `n1`, `n2`, ...; their addresses, the bridge and
the ports are this module's constants, and only namespaces this module creates are addressed.

Used by tests/test_cluster.py, and by hand:
    python -m tests.cluster up 3 DIR     # prints the SLURM_CONF to export, Ctrl-C tears it down
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.cli import ArgumentParser, positive_int

SUBNET = "10.213.7"
"""The cluster's private /24: the controller's bridge is .1, node k is .(10 + k)."""
BRIDGE = "pretrainbr0"
NETNS_PREFIX = "pretrain-"
"""Node k's network namespace is `pretrain-nk` (its hostname `nk`)."""
CTLD_PORT, SLURMD_PORT = 16817, 16818
REPO = Path(__file__).resolve().parent.parent
PIDS = Path("/run/pretrain-test-cluster.pids")
"""The daemons of the running cluster, so that the next one ends those a killed run left behind
(they hold the ports)."""
REQUIRED = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}
"""The programs a cluster needs, with the Debian package of each."""


def missing() -> str | None:
    """Why no cluster can run here (one line), or None."""
    if os.geteuid() != 0:
        return "the test cluster needs root (network namespaces, mounts)"
    absent = sorted({package for program, package in REQUIRED.items() if not shutil.which(program)})
    if absent:
        return f"the test cluster needs Debian's {' '.join(absent)} (apt-get install {' '.join(absent)})"
    if not shutil.which("ip") or not shutil.which("nsenter"):
        return "the test cluster needs iproute2 and util-linux (ip, nsenter)"
    return None


def sh(*argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, **kwargs)


def node_name(k: int) -> str:
    return f"n{k}"


def node_address(k: int) -> str:
    return f"{SUBNET}.{10 + k}"


def veth(k: int) -> str:
    """The node's end of its link on the bridge's side (`ip link set vethK down` cuts it off)."""
    return f"pretrainv{k}"


def end_leftover_daemons() -> None:
    """End the daemons that a cluster whose run was killed before its teardown left running."""
    if not PIDS.exists():
        return
    for pid in PIDS.read_text().split():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if Path(command.decode()).name in ("munged", "slurmctld", "slurmd", "nsenter"):
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    PIDS.unlink()


def remove_network(nodes: int = 8) -> None:
    """Remove the namespaces and bridge this module creates (left over or not)."""
    for k in range(1, nodes + 1):
        name = f"{NETNS_PREFIX}{node_name(k)}"
        if Path("/run/netns", name).exists():
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", name, check=False)
        sh("ip", "link", "del", veth(k), check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


class Cluster:
    """`nodes` namespace nodes, with Slurm on them when `slurm` (else bare hosts for torchrun)."""

    def __init__(self, root: Path, nodes: int, slurm: bool = True):
        self.root = Path(root)
        self.nodes = nodes
        self.slurm = slurm
        self.conf = self.root / "slurm.conf"
        self.hosts = self.root / "hosts"
        self.daemons: dict[str, subprocess.Popen] = {}

    # -- the network ---------------------------------------------------------------------------

    def _network_up(self) -> None:
        remove_network()
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        lines = ["127.0.0.1 localhost", f"{SUBNET}.1 ctl"]
        for k in range(1, self.nodes + 1):
            name = f"{NETNS_PREFIX}{node_name(k)}"
            sh("ip", "netns", "add", name)
            sh("ip", "link", "add", veth(k), "type", "veth", "peer", "name", "eth0", "netns", name)
            sh("ip", "link", "set", veth(k), "master", BRIDGE, "up")
            sh("ip", "-n", name, "addr", "add", f"{node_address(k)}/24", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
            lines.append(f"{node_address(k)} {node_name(k)}")
        self.hosts.write_text("\n".join(lines) + "\n")

    def on_node(self, k: int, argv: list[str]) -> list[str]:
        """`argv` as a command that runs on node k: in its network namespace, under its hostname,
        with the cluster's /etc/hosts and a /tmp and /dev/shm of its own. The repository stays
        shared even where it lies under /tmp (a clone there, as CI may make): as on a cluster,
        the code is on the shared filesystem."""
        kept = [path for path in (REPO,) if Path("/tmp") in path.parents]
        handle = self.root / f"tmp-of-the-machine-{node_name(k)}"  # the machine's /tmp, for a moment
        handle.mkdir(exist_ok=True)
        rebind = "".join(f"mkdir -p {path} && mount --bind {handle}/{path.relative_to('/tmp')} {path} && "
                         for path in kept)
        setup = (f"hostname {node_name(k)} && mount --bind {self.hosts} /etc/hosts && "
                 f"mount -t tmpfs tmpfs /dev/shm && mount --bind /tmp {handle} && "
                 f"mount -t tmpfs tmpfs /tmp && {rebind}umount -l {handle} && exec \"$@\"")
        return ["nsenter", f"--net=/run/netns/{NETNS_PREFIX}{node_name(k)}", "unshare", "--uts",
                "--mount", "sh", "-c", setup, "node", *argv]

    def cut(self, k: int, up: bool = False) -> None:
        """Take node k's link down (a network cut), or back up."""
        sh("ip", "link", "set", veth(k), "up" if up else "down")

    # -- Slurm ---------------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment that makes sbatch, srun, scontrol and sinfo talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        munge = self.root / "munge"
        (self.root / "state").mkdir()
        (self.root / "spool").mkdir()
        node_lines = [f"NodeName={node_name(k)} NodeAddr={node_address(k)} CPUs={os.cpu_count()} "
                      "State=UNKNOWN" for k in range(1, self.nodes + 1)]
        settings = {
            "ClusterName": "pretraintest",
            # the controller runs here, so under this machine's name, reached at the bridge
            "SlurmctldHost": f"{socket.gethostname().split('.')[0]}({SUBNET}.1)",
            "SlurmctldPort": CTLD_PORT,
            "SlurmdPort": SLURMD_PORT,
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            # cred_expire: a requeued job waits this long (default 120 s) before it starts again
            "AuthInfo": f"socket={munge}/munge.socket,cred_expire=5",
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "StateSaveLocation": self.root / "state",
            "SlurmdSpoolDir": self.root / "spool" / "%n",
            "SlurmctldPidFile": self.root / "slurmctld.pid",
            "SlurmdPidFile": self.root / "spool" / "slurmd-%n.pid",
            "SlurmctldLogFile": self.root / "slurmctld.log",
            "SlurmdLogFile": self.root / "slurmd-%n.log",
            # no cgroups in a namespace node: track processes by their parent pids
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "MpiDefault": "none",
            "MailProg": shutil.which("true"),
            "SlurmdTimeout": 10,
            "SlurmctldTimeout": 10,
            "MessageTimeout": 5,
            "KillWait": 5,
            "JobRequeue": 1,
            "ReturnToService": 2,
            "MinJobAge": 600,
            # a requeued job becomes eligible after cred_expire; only the backfill scheduler's
            # periodic pass starts it then (default every 30 s)
            "SchedulerParameters": "bf_interval=1",
        }
        text = "\n".join(f"{key}={value}" for key, value in settings.items())
        text += "\n" + "\n".join(node_lines)
        names = ",".join(node_name(k) for k in range(1, self.nodes + 1))
        text += f"\nPartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP\n"
        self.conf.write_text(text)

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                              env=self.env, start_new_session=True)
        log.close()
        with PIDS.open("a") as pids:
            pids.write(f"{self.daemons[name].pid}\n")

    def _munge_up(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._start("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
        self._wait(lambda: (munge / "munge.socket").exists(), 10, "munged to open its socket")

    def start_node(self, k: int) -> None:
        """Start node k's slurmd (again, after a node loss)."""
        self._start(f"slurmd-{node_name(k)}", self.on_node(k, ["slurmd", "-D", "-N", node_name(k)]))

    def kill_node(self, k: int) -> None:
        """Node k fails: every process of its namespace (slurmd, the job's steps) killed at once."""
        for pid in sh("ip", "netns", "pids", f"{NETNS_PREFIX}{node_name(k)}").stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        daemon = self.daemons.pop(f"slurmd-{node_name(k)}", None)
        if daemon is not None:
            daemon.wait()

    def node_states(self) -> dict[str, str]:
        out = sh("sinfo", "--noheader", "--Node", "--format=%N %t", env=self.env, check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, state: str, timeout: float = 30, nodes: list[int] | None = None) -> None:
        names = [node_name(k) for k in (nodes or range(1, self.nodes + 1))]
        self._wait(lambda: all(self.node_states().get(n) == state for n in names), timeout,
                   f"nodes {','.join(names)} to be {state} (sinfo: {self.node_states()})")

    def up(self) -> "Cluster":
        self.root.mkdir(parents=True, exist_ok=True)
        end_leftover_daemons()
        self._network_up()
        if self.slurm:
            self._write_config()
            self._munge_up()
            self._start("slurmctld", ["slurmctld", "-D", "-i"])
            for k in range(1, self.nodes + 1):
                self.start_node(k)
            self.wait_nodes("idle")
        return self

    def down(self) -> None:
        for name, daemon in reversed(list(self.daemons.items())):
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self.daemons.clear()
        PIDS.unlink(missing_ok=True)
        remove_network(self.nodes)

    # -- jobs ----------------------------------------------------------------------------------

    def sbatch(self, *args: str, cwd: Path, env: dict | None = None) -> int:
        """Submit a job; its id."""
        done = sh("sbatch", "--parsable", *args, cwd=cwd, env={**self.env, **(env or {})},
                  check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (empty once Slurm forgot the job)."""
        out = sh("scontrol", "--oneliner", "show", "job", str(job_id), env=self.env, check=False).stdout
        fields = {}
        for word in out.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: int, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED",
                                                              "TIMEOUT", "NODE_FAIL")) -> dict[str, str]:
        """Wait until the job reaches one of `states`; its fields."""
        seen = {}

        def reached():
            seen.update(self.job(job_id))
            return seen.get("JobState") in states
        self._wait(reached, timeout, f"job {job_id} to reach {'/'.join(states)} "
                                     f"(last: {seen.get('JobState')}, {seen.get('Reason')})")
        return seen

    def job_nodes(self, job_id: int) -> list[int]:
        """The numbers of the nodes a job runs on (its node list expanded), in order."""
        names = sh("scontrol", "show", "hostnames", self.job(job_id)["NodeList"], env=self.env).stdout.split()
        return [int(name.removeprefix("n")) for name in names]

    @staticmethod
    def _wait(condition, timeout: float, what: str) -> None:
        wait_until(condition, what, timeout)


def wait_until(condition, what: str, timeout: float = 240) -> float:
    """Poll `condition` until it holds (or raise TimeoutError naming `what`); when it held
    (time.perf_counter)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m tests.cluster", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start a cluster and print the SLURM_CONF to export; "
                                        "Ctrl-C tears it down")
    up.add_argument("nodes", metavar="NODES", type=positive_int, help="how many nodes (n1, n2, ...)")
    up.add_argument("dir", metavar="DIR", type=Path,
                    help="where everything the cluster writes lives; outside /tmp, which each "
                         "node has its own of")
    args = parser.parse_args(argv)
    reason = missing()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    # Ctrl-C or SIGTERM tear the cluster down (also when started in the background, where a
    # shell leaves SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    cluster = Cluster(args.dir.resolve(), args.nodes)
    try:
        cluster.up()
        print(f"export SLURM_CONF={cluster.conf}   # Ctrl-C tears the cluster down", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
