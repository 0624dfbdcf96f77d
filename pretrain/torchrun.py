"""torchrun, reporting a failed launch the way the trainer does: in one line, with its exit code.

    python -m pretrain.torchrun [torchrun options] -m pretrain.train --config ... [key=value ...]

`launch/torchrun.sh` runs this instead of plain torchrun. It is torchrun itself (the same
options, rendezvous, signal forwarding and worker restarts), with three changes for the way the
trainer fails:

- The trainer's ranks already print one `error: ...` line (rank 0) and exit with a meaningful
  code (2 config/data, 1 training error, 75 checkpoint saved after a signal, 130 Ctrl-C twice),
  so torchrun's own 40-line ChildFailedError report is left out, and this process exits with the
  trainer's code instead of torchrun's 1. Every rank writes its code and error line to
  PRETRAIN_EXIT_DIR as it exits; an error that only another rank than rank 0 met (so nobody
  printed it) is printed here, as the last line, and so is a lost peer: the line of a rank that
  failed by itself, where this node has one, rather than that of a rank it left waiting in a
  collective.
- When a worker fails, the others get FAILED_PEER_GRACE_S to end by themselves and are then
  killed. torchrun would send them SIGTERM and wait 30 s (fixed, whatever --shutdown-timeout
  says), which helps nobody here: a rank waiting for the dead one in a collective (or in the
  store, while DeepSpeed creates its groups) is inside C++ and runs no signal handler, and one
  that does run it takes the signal for a scheduler's stop and saves or reports that, for a job
  that cannot go on without the dead rank anyway. A worker that exits with 75 has not failed:
  after a stop signal every rank saves its part of the checkpoint and exits with 75, and rank 0
  last, as it completes the checkpoint and prunes the old ones after the others have gone
  (seconds to minutes for large checkpoints on a network file system). Then nobody is killed or
  signalled: torchrun learns of the exits once every worker has ended.
- torchrun's log lines are kept back and shown only when a worker died without saying why
  (killed by a signal, or exited without writing its code).
- In-job restarts (`--max-restarts=N`): a worker that crashed (killed by a signal, such as the
  kernel's OOM killer, or exited without reporting), hung (the trainer's watchdog, exit
  EXIT_HUNG) or lost its peer is restarted with the whole group, which resumes from the newest
  complete checkpoint; one line per restart names the rank, host and cause. A failure that a
  restart would meet again is not restarted: bad input (2), a training error (1 with its own
  line), a stop (75, 130). Each start of the workers gets a namespace in torchrun's store that
  every node agrees on (ATTEMPT_VARIABLE; `engine.init_distributed`). When the restarts are used
  up, one last line says so."""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common.cli import ATTEMPT_VARIABLE, EXIT_DIR_VARIABLE
from pretrain.training.engine import LOST_PEER_PREFIX
from pretrain.training.stopping import EXIT_PREEMPTED
from pretrain.training.watchdog import EXIT_HUNG

FAILED_PEER_GRACE_S = 5.0
"""After a worker failed, how long the others have to end by themselves (a rank that met the
same error prints and records it in milliseconds) before they are killed."""
ATTEMPT_AGREEMENT_S = 900.0
"""How long an agent waits for the first node's agent to name a new attempt after a restart (as
long as torchrun's own rendezvous waits for nodes to join)."""


class Restarts:
    """What the launcher's agent did about failed workers, for the launcher's last line."""

    def __init__(self):
        self.stopped: set[int] = set()
        """pids of workers the agent killed because another one had failed."""
        self.failure: tuple[str, bool] | None = None
        """The latest failure: its description (rank, pid, host, cause) and whether a restart
        would meet it again."""
        self.made = 0
        self.allowed = 0


class _Held(logging.Handler):
    """Keeps torchrun's log records to show only if the failure needs them."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def read_exit_files(directory: Path) -> dict[int, tuple[int, str]]:
    """Global rank -> (exit code, error line) of the ranks of this node that wrote theirs."""
    reports = {}
    for path in directory.iterdir():
        code, line = path.read_text().split("\n", 1)
        reports[int(path.name)] = (int(code), line)
    return reports


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    held = _Held()
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(held)
    elastic.propagate = False
    restarts = Restarts()
    # torchrun builds its agent from this name and offers no other way to choose it
    launcher.LocalElasticAgent = _agent_stopping_failed_groups(restarts)
    with tempfile.TemporaryDirectory(prefix="pretrain-torchrun-") as tmp:
        os.environ[EXIT_DIR_VARIABLE] = tmp
        failure = None
        try:
            torchrun_main(argv)
            torchrun_code = 0
        except ChildFailedError as e:
            failure, torchrun_code = e, 1
        except SignalException as e:  # torchrun was signalled; its workers had the grace period
            failure, torchrun_code = e, 128 + int(e.sigval)
        reports = read_exit_files(Path(tmp))
    if failure is None:
        return reports[min(reports)][0] if reports else 0
    failed = {rank: report for rank, report in reports.items() if report[0] != 0}
    if isinstance(failure, ChildFailedError) and restarts.allowed and restarts.failure and not restarts.failure[1]:
        # a failure that restarts were for, and none is left: say so last
        code = failed[min(failed)][0] if failed else torchrun_code
        print(f"error: torchrun: {restarts.failure[0]}, and the {restarts.allowed} in-job restart(s) "
              f"allowed (--max-restarts) are used up: the job ends with exit code {code}", file=sys.stderr)
        return code
    if failed:
        # a rank that lost its peer (in a collective) only tells of another's failure: name that
        # one where this node saw it
        causes = {rank: report for rank, report in failed.items()
                  if not report[1].startswith(LOST_PEER_PREFIX)} or failed
        code, line = causes[min(causes)]
        # rank 0 prints its own line, a lost peer aside (left to this launcher)
        printed_by_rank_0 = reports.get(0, (0, ""))[1] == line and not line.startswith(LOST_PEER_PREFIX)
        if line and not printed_by_rank_0:
            print(line, file=sys.stderr)
        return code
    # the trainer did not say how it ended: show what torchrun knows
    for record in held.records:
        print(held.format(record), file=sys.stderr)
    print(f"error: torchrun: {_describe(failure, restarts.stopped)}", file=sys.stderr)
    return torchrun_code


def _agent_stopping_failed_groups(restarts: Restarts):
    """torchrun's agent, stopping the rest of a node's workers within FAILED_PEER_GRACE_S of one
    failing (see the module doc; the pids it had to kill go into `restarts.stopped`), restarting
    only failures that a restart can get past, saying so, and giving each start of the workers
    a store namespace of its own."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class StopsFailedGroups(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            pids = list(self._pcontext.pids().values()) if self._pcontext is not None else []
            ended = [_exit_status(pid) for pid in pids]
            if EXIT_PREEMPTED in ended and None in ended and all(code in (None, 0, EXIT_PREEMPTED) for code in ended):
                # torchrun would take an exit with 75 for a failure and stop the rest, rank 0
                # among them, while it completes the checkpoint and prunes the old ones
                return RunResult(state=WorkerState.HEALTHY)
            if any(code not in (None, 0) for code in ended):
                deadline = time.monotonic() + FAILED_PEER_GRACE_S
                while time.monotonic() < deadline and any(_exit_status(pid) is None for pid in pids):
                    time.sleep(0.05)
                for pid in pids:
                    if _exit_status(pid) is None:
                        restarts.stopped.add(pid)
                        # each worker leads a session of its own: its data loader workers go too
                        os.killpg(pid, signal.SIGKILL)
            # torchrun's own monitoring then finds every worker ended and sends nothing
            result = super()._monitor_workers(worker_group)
            restarts.allowed = worker_group.spec.max_restarts
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
                restarts.failure = _failure(result.failures, read_exit_files(Path(os.environ[EXIT_DIR_VARIABLE])),
                                            restarts.stopped)
                if restarts.failure[1]:
                    self._remaining_restarts = 0  # it would fail the same way again
            return result

        def _restart_workers(self, worker_group):
            if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and restarts.failure:
                restarts.made = worker_group.spec.max_restarts - self._remaining_restarts
                print(f"torchrun: {restarts.failure[0]}; restarting this node's ranks from the newest complete "
                      f"checkpoint (restart {restarts.made} of {worker_group.spec.max_restarts})",
                      file=sys.stderr, flush=True)
                for report in Path(os.environ[EXIT_DIR_VARIABLE]).iterdir():  # the next attempt's codes only
                    report.unlink()
            super()._restart_workers(worker_group)

        def _rendezvous(self, worker_group):
            super()._rendezvous(worker_group)
            os.environ[ATTEMPT_VARIABLE] = _agree_on_attempt(worker_group.store, worker_group.group_rank,
                                                             os.environ.get(ATTEMPT_VARIABLE))

    return StopsFailedGroups


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1}
"""The signals launch/torchrun.sh has torchrun forward to the ranks: a user's or a scheduler's stop."""


def _failure(failures: dict, reports: dict[int, tuple[int, str]], stopped: set[int]) -> tuple[str, bool]:
    """The failure that stopped a node's workers (global rank -> torchrun's ProcessFailure, with
    the ranks' own exit reports) as (description, final): its first rank that was not killed
    by this launcher and did not merely lose its peer, and whether a restart would meet the same
    failure again (bad input, a training error, a stop)."""
    causes = {rank: f for rank, f in failures.items() if f.pid not in stopped} or failures
    lost_peer = {rank for rank in causes if reports.get(rank, (0, ""))[1].startswith(LOST_PEER_PREFIX)}
    rank = min(causes, key=lambda r: (r in lost_peer, causes[r].timestamp, r))
    first, (code, line) = causes[rank], reports.get(rank, (None, ""))
    # A rank stopped by a stop signal (a Ctrl-C or a scheduler's, even one that came before it
    # could report it) was stopped, not crashed: a restart is for crashes.
    stopped_by_signal = any(-f.exitcode in STOP_SIGNALS or f.exitcode - 128 in STOP_SIGNALS for f in causes.values())
    final = stopped_by_signal or any(reports.get(r, (0, ""))[0] not in (0, EXIT_HUNG) and r not in lost_peer
                                     and r in reports for r in causes)
    if rank in lost_peer:  # what the rank said of its peer, without its advice to rerun
        how = ": " + line.removeprefix("error: ").split(";")[0]
    elif code == EXIT_HUNG:
        how = "hung: its watchdog ended it (its output has every thread's stack)"
    elif code is None:
        how = (f"died of {first.signal_name()}" if first.exitcode < 0 else
               f"exited with code {first.exitcode} without reporting an error")
    else:
        how = ": " + (line.removeprefix("error: ") or f"exited with code {code}")
    return f"rank {rank} (pid {first.pid}) on {socket.gethostname()} {how}", final


def _agree_on_attempt(store, group_rank: int, previous: str | None) -> str:
    """A name for this start of the workers that every node's agent agrees on: the first node's
    agent draws it after the rendezvous; the others wait until they read one they have not used
    (torchrun's static rendezvous keeps one store across restarts, so the previous name is still
    there until the first node's agent replaces it)."""
    key = "pretrain/attempt"
    if group_rank == 0:
        attempt = uuid.uuid4().hex
        store.set(key, attempt)
        return attempt
    deadline = time.monotonic() + ATTEMPT_AGREEMENT_S
    while (attempt := store.get(key).decode()) == previous:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the first node's agent named no new attempt within {ATTEMPT_AGREEMENT_S:g} s "
                               "of a restart")
        time.sleep(0.1)
    return attempt


def _exit_status(pid: int) -> int | None:
    """How worker `pid` ended (its exit code, or minus the signal that killed it), None while it
    runs. It is left for torchrun to collect (WNOWAIT); one torchrun collected already ended well
    (torchrun stops the others as soon as it collects a failure)."""
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 0
    if ended is None:
        return None
    return ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status


def _describe(failure: Exception, stopped: set[int]) -> str:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(failure, ChildFailedError):
        # the workers this launcher stopped did not fail of their own accord
        causes = {rank: f for rank, f in failure.failures.items() if f.pid not in stopped} or failure.failures
        rank = min(causes, key=lambda r: (causes[r].timestamp, r))
        first = causes[rank]
        how = f"died of {first.signal_name()}" if first.exitcode < 0 else f"exited with code {first.exitcode}"
        return (f"rank {rank} (pid {first.pid} on {socket.gethostname()}) {how} without reporting an "
                "error; its own output above says more")
    return f"stopped by signal {failure.sigval} before the trainers reported how they ended"


if __name__ == "__main__":
    sys.exit(main())
