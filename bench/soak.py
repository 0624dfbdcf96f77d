"""Soak: a tiny NRGPT trained by 2 processes under launch/torchrun.sh for a long while,
checkpointing often with `checkpoint.keep=2`, sampled every minute: each rank's resident memory
(the trainer and its data workers), the run directory's size and the tokens/s of the latest log
interval. Prints the samples and each figure's growth per hour (a least-squares slope over the
samples after the first); a leak shows as memory or disk growing without bound. Memory per
rank is given twice: the trainer process's own RSS, and the PSS of the trainer with every process
under it (its data loader workers are forked from it and share its pages, which RSS would count
once per process).

    python -m bench.soak [--minutes 20] [--every 60] [--out soak.json] [key=value ...]

The run starts afresh under a run name of its own in a temporary output root, and ends with a
SIGTERM to the launcher (the trainers checkpoint and exit with 75). docs/benchmarks.md records it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.elastic import tree_bytes
from common.cli import ArgumentParser, run_command

REPO = Path(__file__).resolve().parent.parent
TOKENS_PER_S = re.compile(r"^step (\d+)/\d+ .*\| ([\d,]+) tok/s", re.M)


def rank_memory_mib(launcher_pid: int) -> dict[int, tuple[float, float]]:
    """rank -> (RSS of its trainer process, PSS of the trainer and every process under it: data
    loader workers, the resource tracker), in MiB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError):
            continue

    def tree(pid: int) -> list[int]:
        return [pid] + [p for child in children.get(pid, []) for p in tree(child)]

    def rank_of(pid: int) -> int | None:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)

    memory: dict[int, tuple[float, float]] = {}
    todo = [launcher_pid]
    while todo:  # down to the first process of each rank: the trainer
        pid = todo.pop()
        rank = rank_of(pid)
        if rank is None:
            todo += children.get(pid, [])
        else:
            pss_kib = sum(_kib(p, "smaps_rollup", "Pss") for p in tree(pid))
            memory[rank] = (_kib(pid, "status", "VmRSS") / 1024, pss_kib / 1024)
    return memory


def _kib(pid: int, file: str, field: str) -> int:
    try:
        text = Path(f"/proc/{pid}/{file}").read_text()
    except OSError:
        return 0
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else 0


def slope_per_hour(times_s: list[float], values: list[float]) -> float:
    """Least-squares slope of `values` against time, per hour."""
    n = len(times_s)
    if n < 2:
        return float("nan")
    mean_t, mean_v = sum(times_s) / n, sum(values) / n
    var = sum((t - mean_t) ** 2 for t in times_s)
    return 3600 * sum((t - mean_t) * (v - mean_v) for t, v in zip(times_s, values)) / var


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long to train")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=None, help="also write the samples and slopes as JSON")
    parser.add_argument("overrides", nargs="*",
                        help="trainer key=value overrides, e.g. data.path=DIR of a small dataset: its epochs "
                             "end sooner, and the loader forks its data workers anew at each epoch")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="soak-"))
    run_dir, log = root / "runs" / "soak", root / "soak.log"
    env = {**os.environ, "NPROC_PER_NODE": "2", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        ["bash", "launch/torchrun.sh", "configs/tiny/nrgpt.yaml", "run_name=soak", f"output_root={root / 'runs'}",
         "train.max_steps=100000000", "train.log_interval=10", "checkpoint.interval=50", "checkpoint.keep=2",
         "eval.interval=500", *args.overrides],
        cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    samples, start = [], time.monotonic()
    try:
        while time.monotonic() - start < args.minutes * 60:
            time.sleep(args.every)
            if launcher.poll() is not None:
                raise SystemExit(f"error: the soak run ended early (exit {launcher.returncode}); see {log}")
            logged = TOKENS_PER_S.findall(log.read_text(errors="replace"))
            sample = {"t_s": round(time.monotonic() - start, 1), "step": int(logged[-1][0]) if logged else 0,
                      "tokens_per_s": float(logged[-1][1].replace(",", "")) if logged else 0.0,
                      "memory_mib": {rank: [round(rss, 1), round(pss, 1)]
                                     for rank, (rss, pss) in sorted(rank_memory_mib(launcher.pid).items())},
                      "run_dir_mib": round(tree_bytes(run_dir) / 2**20, 2) if run_dir.exists() else 0.0}
            samples.append(sample)
            print(json.dumps(sample), flush=True)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)  # the trainers checkpoint and exit with 75
        launcher.wait(timeout=600)

    steady = samples[1:]  # the first minute holds start-up (imports, the dataset, the first compile)
    times = [s["t_s"] for s in steady]
    growth = {"run_dir_mib_per_h": slope_per_hour(times, [s["run_dir_mib"] for s in steady]),
              "tokens_per_s_per_h": slope_per_hour(times, [s["tokens_per_s"] for s in steady])}
    for rank in steady[0]["memory_mib"] if steady else []:
        growth[f"rank{rank}_trainer_rss_mib_per_h"] = slope_per_hour(times, [s["memory_mib"][rank][0] for s in steady])
        growth[f"rank{rank}_pss_mib_per_h"] = slope_per_hour(times, [s["memory_mib"][rank][1] for s in steady])
    print(f"{len(samples)} samples over {args.minutes:g} min, steps {samples[0]['step']}-{samples[-1]['step']}; "
          f"launcher exit {launcher.returncode}")
    for name, value in growth.items():
        print(f"{name}: {value:+.2f}")
    if args.out:
        args.out.write_text(json.dumps({"samples": samples, "growth_per_hour": growth}, indent=1))


if __name__ == "__main__":
    run_command(main)
