"""One GPU, one short session (issue 33): what the OpenWebText configs do on an H200, measured
through the trainer's own step (`Trainer.build_engine`, `Trainer.train_step`) in at most 300 s,
start-up included:

- each family's flagship config (configs/owt) at its own micro-batch, with its own ZeRO,
  precision and bucket settings, one process, on synthetic tokens of the real vocabulary:
  tokens/s, MFU, peak memory; with `model.compile` as the config sets it and the other way for
  the configs whose model allows it (all of them: EBT's set the first-order energy gradient);
- which SDPA kernel each run's attention took (the profiler's record of the op the dispatcher
  picked) next to what `pretrain.models.sdpa` predicts (`pretrain.config.gpu_attention`);
- EBT-S2's memory at its micro-batch with the replay store filled, against `pretrain.plan`'s
  figure for one GPU (eagerly, as the plan counts it);
- EBT's second-order numerics at paper depth (12 layers, T=1024): loss and every gradient in
  bf16 against a float32 reference.

    python -m bench.gpu [--out DIR] [--budget-s 300] [--part N] [--only TEXT ...] [--dry-run]
    python -m bench.gpu --device cpu --tiny --out DIR    # the same code path on tiny flavors (CI)
    bench/gpu.sh [ARGS]                                  # installs carried wheels first if needed
    bench/gpu.sh --dry-run [ARGS]                        # the plan and the wheels it needs; no GPU

The cases, in order of value (`case_plan`), are packed into parts whose caps fit the budget
(`parts`): `--part N` runs part N's cases, each sure to get its whole cap and free to use what
the part's earlier cases left unused (a first compile may take longer on one machine than on
another), then the later parts' on the time left. One worker process runs them in turn, each
under a time cap that an alarm signal enforces inside it. This process schedules and reports: a hang inside a
CUDA call or a compile, which no signal handler reaches, or a crash of the worker still leaves a
report, because this process kills a worker that overruns a case's cap, reports that case, and
starts another worker for the cases after it while the budget allows. DIR/gpu.json and
DIR/gpu.md are rewritten as each case starts and ends; a case that runs out of memory or fails
keeps what it measured, and the next one runs. Ctrl-C, or a scheduler's SIGTERM or SIGUSR1,
stops the worker too, reports the cases left as stopped, and exits with 128 + the signal's
number.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from bench.gpu_cases import REPO, Case, Settings, case_cap, on_alarm, run_case
from bench.gpu_report import GIB, markdown, summary_line, write_reports
from common.cli import (STOP_SIGNALS, ArgumentParser, Stopped, positive_int, run_command, signals_held,
                        stop_signals_raising)
from common.fileio import markdown_table

RESULT = "BENCH-RESULT "
"""Prefix of the worker's protocol lines on stdout; anything else goes to the log."""
GPT2_VOCAB = 50257
"""The real vocabulary (the models pad it to 50304); synthetic tokens are drawn from it."""

FLAGSHIPS = {
    "configs/owt/gpt_124m.yaml": "gpt-tiny",
    "configs/owt/ebt_s1_small.yaml": "ebt-tiny",
    "configs/owt/nrgpt_ff2w_90m.yaml": "nrgpt-tiny",
    "configs/owt/gpt_rec_85m.yaml": "gpt_rec-tiny",
    "configs/owt/transformer_pp_small.yaml": "transformer_pp-tiny",
}
"""Each family's flagship config -> the tiny flavor of its family that --tiny trains instead, in
order of value: the three with MFU targets first, then the baselines."""
ATTENTION_PROBE = ("configs/owt/nrgpt_ff2w_126m.yaml", "nrgpt-tiny")
"""The config whose attention kernel matters most (NRGPT's full heads, head dim 1024, beyond
flash), trained without compilation, and its tiny flavor."""
MEMORY_PROBE = ("configs/owt/ebt_s2_small.yaml", "ebt-s2-tiny")
"""The config whose memory is measured with its replay store filled, and its tiny flavor. It runs
eagerly: `pretrain.plan` counts the eager step's activations, and compiling S2's graphs (one per
step count and batch size) would take more than the probe's cap."""
BF16_CHECK = {"gpu": ("ebt-s1-small", 2, 1024), "tiny": ("ebt-tiny", 2, 64)}
"""(flavor, micro-batch, T) of the bf16 check: paper depth (12 layers) and context on the GPU."""
COMPILE_BACKEND = {"gpu": "inductor", "tiny": "aot_eager"}
"""`model.compile` of the compiled runs; on a CPU, inductor's C++ builds would take minutes, so
--tiny traces the same way (TorchDynamo, AOTAutograd) without generating code."""
CASE_CAPS_S = {
    "gpu": {"memory": 60.0, "bf16_check": 40.0, "train": 40.0, "compiled": 80.0},
    "tiny": {"memory": 60.0, "bf16_check": 60.0, "train": 60.0, "compiled": 60.0},
}
"""Time cap of one case (engine build, compilation, warmup, timed steps) by what it runs. A
compiled case's inductor compiles two graphs (forward, backward) and transformer_pp's a third,
11-13 s each on a cold cache (docs/benchmarks.md). EBT-S1's graph is larger (on the 2-core
CPU, at its 12 layers, inductor took 160 s for it, 65 s of that tracing and lowering, which a GPU
host runs too): whether 80 s holds its compile on a GPU is one of the things the run finds out,
and as part 1's last case it may also take what the cases before it leave. At these caps every
flagship as configured fits two 300 s runs (`parts`). --tiny's compiled EBT traces in about 14 s
on an idle 2-core CPU: 60 s leaves a loaded host twice that and more, and one cap for every tiny
case keeps its parts in the plan's order."""
BUDGET_S = {"gpu": 300.0, "tiny": 150.0}
"""Default wall-clock budget of a whole run, start-up included."""
STARTUP_S = 90.0
"""How long a worker may take to import torch and DeepSpeed and set up the device."""
MIN_CASE_S = 5.0
"""A case is not started with less time than this left in the budget."""
MIN_START_S = 20.0
"""A worker is not started with less time than this left in the budget: about its start-up."""
HANG_GRACE_S = 15.0
"""How long past a case's cap the worker may stay silent before it is killed as hung."""
WORKER_GRACE_S = 10.0
"""How long a worker that is told to stop gets before it is killed. Not killed at once, because
on a CPU a worker may be building DeepSpeed's communication op, and a build killed outright
leaves its lock file behind: every later build then waits on it forever."""
REPORT_RESERVE_S = WORKER_GRACE_S + 10.0
"""Kept from the budget after the worker's last case: slack for its last answer, stopping it
and writing the reports. The worker is killed WORKER_GRACE_S + 2 s before the budget ends."""


def case_plan(tiny: bool) -> list[Case]:
    """The run's cases in order of value, which is the order they run in: the memory probe
    first (nothing else has touched the device yet), the bf16 check, each flagship config as it
    is set, the attention probe, then each flagship the other way (compiled or not: the
    comparison). A budget too short for every cap cuts from the end (`schedule`). Training cases
    are named by their config file."""
    from pretrain.config import load_config, typed_model_overrides
    from pretrain.models import model_class, resolve

    scale = "tiny" if tiny else "gpu"
    caps, backend = CASE_CAPS_S[scale], COMPILE_BACKEND[scale]

    def shrink(flavor: str) -> list[str]:
        if not tiny:
            return []
        return [f"model.flavor={flavor}", "data.seq_len=64", "train.device=auto", "train.precision=bf16"]

    probe_config, probe_tiny = MEMORY_PROBE
    attention_config, attention_tiny = ATTENTION_PROBE
    flavor, micro_batch, seq_len = BF16_CHECK[scale]
    as_set, the_other_way = [], []
    for config, tiny_flavor in FLAGSHIPS.items():
        cfg = load_config(REPO / config)
        own = cfg.model.compile if cfg.model.compile == "off" or not tiny else backend
        settings = ["off"]  # and the config's own setting, or else the compiler
        model_config = resolve(cfg.model.flavor, typed_model_overrides(cfg))
        if model_class(model_config).compile_refusal(model_config) is None:
            settings.append(own if own != "off" else backend)
        for setting in settings:
            case = Case(f"{Path(config).stem} compile={setting}{' (config)' if setting == own else ''}", "train",
                        caps["train" if setting == "off" else "compiled"], config,
                        shrink(tiny_flavor) + [f"model.compile={setting}"])
            (as_set if setting == own else the_other_way).append(case)
    return [Case(f"{Path(probe_config).stem} replay store filled (compile=off)", "train", caps["memory"],
                 probe_config, shrink(probe_tiny) + ["model.compile=off"], fill_replay_store=True),
            Case(f"{flavor} bf16 vs fp32", "bf16_check", caps["bf16_check"], flavor=flavor,
                 micro_batch=micro_batch, seq_len=seq_len),
            *as_set,
            Case(f"{Path(attention_config).stem} attention (compile=off)", "train", caps["train"], attention_config,
                 shrink(attention_tiny) + ["model.compile=off"]),
            *the_other_way]


def parts(cases: list[Case], budget_s: float) -> list[list[Case]]:
    """`cases` in runs of `budget_s` each: every case goes to the first run with room for its cap
    beside the worker's start-up (MIN_START_S) and the reports' reserve, so each run is sure to
    give each of its cases its whole cap, and the most valuable cases come first. A case whose
    cap is more than a run leaves (a budget too short) makes a part alone, and gets the time left."""
    room = budget_s - MIN_START_S - REPORT_RESERVE_S
    packed: list[list[Case]] = []
    for case in cases:
        run = next((run for run in packed if sum(c.cap_s for c in run) + case.cap_s <= room), None)
        if run is None:
            packed.append(run := [])
        run.append(case)
    return packed


def describe_plan(packed: list[list[Case]], budget_s: float) -> str:
    """The dry run's account: each part's cases in order with their caps."""
    rows = [{"part": n, "case": case.name, "cap s": case.cap_s}
            for n, run in enumerate(packed, 1) for case in run]
    return (f"{sum(map(len, packed))} cases in {len(packed)} part(s) of a {budget_s:.0f} s budget each "
            f"({MIN_START_S:.0f} s for the worker's start-up and {REPORT_RESERVE_S:.0f} s for the reports "
            f"kept): `--part N` gives each of part N's cases its whole cap and what the part's earlier "
            f"cases left unused, then runs the later parts' cases on the time left.\n\n"
            + markdown_table(rows, {"cap s": ".0f"}))


def environment(device: str) -> dict:
    import deepspeed
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "device": f"cpu ({platform.machine()})", "cuda": torch.version.cuda}
    if device == "cuda":
        sdpa = torch.backends.cuda
        env.update(device=torch.cuda.get_device_name(),
                   capability=".".join(map(str, torch.cuda.get_device_capability())),
                   cudnn=torch.backends.cudnn.version(),
                   memory_gib=torch.cuda.get_device_properties(0).total_memory / GIB,
                   sdpa_enabled={"flash": sdpa.flash_sdp_enabled(), "cudnn": sdpa.cudnn_sdp_enabled(),
                                 "memory-efficient": sdpa.mem_efficient_sdp_enabled(),
                                 "math": sdpa.math_sdp_enabled()})
    return env


def imported() -> dict[str, list[str]]:
    """What this process has imported: the repository's modules, and the other top-level packages
    (outside the standard library), for tests/test_bench_gpu.py's check of the GPU machine's
    packages."""
    repository = ("common", "data_pipeline", "pretrain", "bench")
    names = [name for name, module in list(sys.modules.items()) if module is not None]
    top = {name.partition(".")[0] for name in names}
    return {"repository": sorted(n for n in names if n.partition(".")[0] in repository),
            "packages": sorted(t for t in top - set(repository) - sys.stdlib_module_names if not t.startswith("_"))}


def worker() -> int:
    """Run the cases given on stdin (JSON) in order; protocol lines on stdout: the environment,
    then per case one when it starts, one with its result and what has been imported. A stop
    signal ends it with the case it was running reported as stopped (under Slurm the whole job
    gets the scheduler's SIGTERM, this process too)."""
    spec = json.loads(sys.stdin.read())
    settings = Settings(**spec["settings"])
    case = None
    try:
        with stop_signals_raising():
            import deepspeed
            import torch
            from pretrain.training.engine import distributed_env

            if settings.device == "cpu":
                torch.set_num_threads(1)  # tiny models on a shared CPU: one thread wastes least
            distributed_env()
            deepspeed.init_distributed(verbose=False)
            emit({"environment": environment(settings.device)})
            signal.signal(signal.SIGALRM, on_alarm)
            for raw in spec["cases"]:
                case = Case(**raw)
                left = settings.deadline - time.monotonic()
                if left < MIN_CASE_S:
                    emit({"case": case.name, "status": "skipped", "error": "run budget spent"})
                    continue
                cap_s = case_cap(case, left)
                emit({"start": case.name, "cap_s": cap_s})
                started = time.perf_counter()
                emit({"case": case.name, **run_case(case, settings, cap_s)})
                emit({"imported": imported()})  # after each case: a worker that dies later has said it
                case = None
    except (Stopped, KeyboardInterrupt) as e:  # the trainer raises KeyboardInterrupt for Ctrl-C
        signum = getattr(e, "signum", signal.SIGINT)
        if case is not None:
            emit({"case": case.name, "seconds": time.perf_counter() - started, "status": "stopped",
                  "error": f"stopped by {signal.Signals(signum).name}"})
        return 128 + signum
    return 0


def emit(record: dict) -> None:
    print(RESULT + json.dumps(record), flush=True)


# ---------------------------------------------------------------------------------------------
# Scheduling and reports (the parent process)


def run_worker(cases: list[Case], settings: Settings, deadline: float, log,
               hang_grace_s: float = HANG_GRACE_S) -> Iterator[dict]:
    """Run `cases` in one worker, yielding its records as they arrive. The worker is killed when
    it stays silent past the running case's cap + `hang_grace_s` (or STARTUP_S while it starts),
    or at `deadline` (monotonic); then, or when it dies, a record for the case it was running
    says why, and the cases after it are left unreported for another worker, unless the worker
    was stopped by a signal or ended between cases (then each gets the same reason). The worker
    runs in a session of its own, which the terminal's Ctrl-C does not reach: it is stopped also
    when this generator is closed early or a stop signal interrupts it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if settings.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)  # the worker is a world of its own
    with signals_held():  # a stop now would leave a worker that nothing kills
        proc = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--worker"], cwd=REPO, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    killed_because = None
    try:
        proc.stdin.write(json.dumps({"settings": dataclasses.asdict(settings),
                                     "cases": [dataclasses.asdict(c) for c in cases]}))
        proc.stdin.close()
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        tail, unreported, running, ready = [], [c.name for c in cases], None, False
        silent_until = time.monotonic() + STARTUP_S
        while True:  # to the end of its output: what it imported comes after its last case
            wait = min(silent_until, deadline) - time.monotonic()
            try:
                line = lines.get(timeout=max(0.0, wait))
            except queue.Empty:
                killed_because = ("run budget spent" if time.monotonic() >= deadline else
                                  f"no answer {hang_grace_s:.0f} s past its time cap: worker killed" if running else
                                  f"no answer {hang_grace_s:.0f} s after its last one: worker killed" if ready else
                                  f"worker did not start within {STARTUP_S:.0f} s: killed")
                break
            if line is None:
                break
            if not line.startswith(RESULT):
                log.write(line)
                tail = (tail + [line.strip()])[-5:]
                continue
            record = json.loads(line[len(RESULT):])
            ready = True
            if "start" in record:
                running = record["start"]
                silent_until = time.monotonic() + record["cap_s"] + hang_grace_s
            else:
                if "case" in record:
                    unreported.remove(record["case"])
                    running = None
                silent_until = time.monotonic() + hang_grace_s
            yield record
    finally:
        stop_worker(proc)
        log.flush()
    stopped_by = {128 + s: s.name for s in STOP_SIGNALS}.get(proc.returncode)
    if killed_because:
        status = "timeout" if running else "skipped" if killed_because == "run budget spent" else "crashed"
        reason = killed_because
    elif stopped_by:
        status, reason = "stopped", f"worker stopped by {stopped_by}"
    else:
        status, reason = "crashed", f"worker exited with code {proc.returncode}: {tail[-1] if tail else 'no output'}"
    if running:
        yield {"case": running, "status": status, "error": reason[:300]}
        unreported.remove(running)
        if not stopped_by or killed_because:
            return  # another worker takes the cases after it
    for name in unreported:
        yield {"case": name, "status": "stopped" if stopped_by and not killed_because else status,
               "error": reason[:300]}


def stop_worker(proc: subprocess.Popen) -> None:
    """End a worker still running: SIGTERM to its process group (and SIGCONT, should it be
    stopped), SIGKILL after WORKER_GRACE_S."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGCONT)
        try:
            proc.wait(timeout=WORKER_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny flavors (small vocabulary, T=64): a smoke test")
    parser.add_argument("--out", default="bench/out/gpu", help="directory for gpu.json, gpu.md and the worker's log")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the whole run (default 300 s; 150 s with --tiny)")
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="run only cases whose name contains one of these")
    parser.add_argument("--part", type=positive_int, default=1,
                        help="run this part of the plan first (default 1; --dry-run lists them)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (default: by device name)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the parts of the plan, their cases in order and caps; run nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()

    start, wall_start = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
    if args.device == "cpu" and not args.tiny:
        print("error: the paper-size cases need a GPU; on a CPU use --device cpu --tiny", file=sys.stderr)
        return 2
    tiny = args.tiny
    plan = case_plan(tiny)  # imports torch (not CUDA's context: the worker makes that)
    if args.only:
        plan = [c for c in plan if any(text in c.name for text in args.only)]
    if not plan:
        print("error: --only matches no case", file=sys.stderr)
        return 2
    budget = args.budget_s or BUDGET_S["tiny" if tiny else "gpu"]
    packed = parts(plan, budget)
    if args.dry_run:
        print(describe_plan(packed, budget), end="")
        return 0
    if args.part > len(packed):
        print(f"error: --part {args.part}: the plan has {len(packed)} part(s) at a {budget:.0f} s budget",
              file=sys.stderr)
        return 2
    chosen = packed[args.part - 1]
    plan = [dataclasses.replace(case, kept_for_later_s=sum(c.cap_s for c in chosen[n + 1:]))
            for n, case in enumerate(chosen)] + [case for run in packed[args.part:] for case in run]
    if args.device == "cuda" and not _has_cuda():
        print("error: no CUDA device is visible; use --device cpu --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    deadline = start + budget - REPORT_RESERVE_S
    settings = Settings(device=args.device, vocab_size=512 if tiny else GPT2_VOCAB, warmup=2,
                        steps=2 if tiny else 10, peak_tflops=args.peak_tflops, deadline=deadline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {c.name: {"case": c.name, "kind": c.kind, "status": "pending"} for c in plan}
    report = {"mode": ("tiny " if tiny else "") + args.device, "device": args.device,
              "date": wall_start.strftime("%Y-%m-%d %H:%M UTC"), "vocab_size": settings.vocab_size,
              "budget_s": budget, "elapsed_s": 0.0, "warmup_steps": settings.warmup, "timed_steps": settings.steps,
              "command": "python -m bench.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": {}, "imported": {}, "cases": list(results.values())}

    def update(record: dict) -> None:
        if "environment" in record:
            report["environment"] = report["environment"] or record["environment"]
        elif "imported" in record:
            for key, names in record["imported"].items():
                report["imported"][key] = sorted(set(report["imported"].get(key, [])) | set(names))
        elif "start" in record:
            results[record["start"]].update(status="running", cap_s=record["cap_s"])
            print(f"[{time.monotonic() - start:5.0f} s] {record['start']}", flush=True)
        else:
            results[record["case"]].update(record)
            print(f"    {summary_line(results[record['case']])}", flush=True)
        report["elapsed_s"] = time.monotonic() - start
        write_reports(out, report)

    try:
        with stop_signals_raising(), open(out / "gpu_worker.log", "w") as log:
            pending = plan
            while pending:
                if deadline - time.monotonic() < MIN_START_S:
                    for case in pending:
                        results[case.name].update(status="skipped", error="run budget spent")
                    break
                hard_deadline = start + budget - WORKER_GRACE_S - 2
                with contextlib.closing(run_worker(pending, settings, hard_deadline, log)) as records:
                    for record in records:
                        update(record)
                pending = [c for c in pending if results[c.name]["status"] == "pending"]
    except Stopped as e:
        name = signal.Signals(e.signum).name
        for r in results.values():
            if r["status"] in ("pending", "running"):
                r.update(status="stopped", error=f"stopped by {name}")
        report["elapsed_s"] = time.monotonic() - start
        write_reports(out, report)
        print(f"error: stopped by {name}; {out / 'gpu.json'} and gpu.md report the cases finished before it",
              file=sys.stderr)
        return 128 + e.signum
    report["elapsed_s"] = time.monotonic() - start
    write_reports(out, report)
    print(f"\n{markdown(report)}\nwritten: {out / 'gpu.json'}, {out / 'gpu.md'}")
    return 0


def _has_cuda() -> bool:
    """Whether torch sees a GPU: counting devices initialises the driver, no context or memory."""
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    run_command(main)
