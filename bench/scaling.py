"""Costs that decide how a CPU sweep should be run, measured side by side in one run.

    python -m bench.scaling [--rounds 5]

threads  one training step (forward, backward, AdamW) of a ListOps-size `gpt_rec` (width 32,
         5 steps, micro-batch 32 x 128) with 1 and with 2 intra-op threads, alternating in each
         round. On a busy 2-core machine 2 threads can be far slower than 1 (OpenMP threads spin
         waiting for descheduled peers); `threads_per_process: 1` in a sweep follows from this.
         Both wall-clock and CPU time per step are printed: the CPU time shows the spinning.
fit      `fit_power_law` with 1000 bootstrap resamples, for 6, 20 and 60 runs (what
         `python -m pretrain.scaling fit` does per group and law, twice: E free and E = 0).
joint    `fit_joint_law` (L(N, D), Huber, variable projection) with the fit command's default 500
         resamples, for 12 and 36 runs, side by side with one resample at a time (the
         resamples batched as rows of weights vs a loop of single fits).
Medians over the rounds; the load average is printed because the threads ratio depends on it.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from common.cli import ArgumentParser, run_command
from pretrain import models
from pretrain.scaling.fit import fit_power_law
from pretrain.scaling.joint import JointLaw, fit_joint_law


def step_cost(model, optimizer, batch, threads: int, steps: int = 5) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per training step with `threads` intra-op threads."""
    torch.set_num_threads(threads)
    model(batch, batch).loss.backward()  # warm up this thread count
    optimizer.zero_grad()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        model(batch, batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    print(f"load average before: {' '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"on {os.cpu_count()} cores")
    torch.manual_seed(0)
    model = models.build(models.resolve("gpt_rec-listops-w32", {"vocab_size": 20}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 20, (32, 128))
    costs = {1: [], 2: []}
    for _ in range(args.rounds):
        for threads in costs:
            costs[threads].append(step_cost(model, optimizer, batch, threads))
    print("threads  wall ms/step  cpu ms/step")
    for threads, samples in costs.items():
        wall = statistics.median(s[0] for s in samples) * 1e3
        cpu = statistics.median(s[1] for s in samples) * 1e3
        print(f"{threads:>7d}  {wall:>12.1f}  {cpu:>11.1f}")
    ratio = statistics.median(b[0] / a[0] for a, b in zip(costs[1], costs[2]))
    print(f"wall time 2 threads / 1 thread: {ratio:.2f} (median over {args.rounds} rounds)\n")

    print("runs  fit + 1000 bootstrap resamples (s)")
    rng = np.random.default_rng(0)
    for n in (6, 20, 60):
        x = np.geomspace(1e4, 1e8, n)
        y = (1.7 + 400 * x**-0.34) * (1 + 0.005 * rng.standard_normal(n))
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            fit_power_law(x, y)
            times.append(time.perf_counter() - start)
        print(f"{n:>4d}  {statistics.median(times):.3f}")

    print("\nruns  joint law + 500 resamples: batched (s)  one at a time (s)  ratio")
    law = JointLaw(1.8, 60.0, 0.35, 300.0, 0.30)
    for n_runs in (12, 36):
        n = np.geomspace(1e4, 1e6, n_runs)
        d = np.geomspace(1e8, 1e6, n_runs) * rng.uniform(0.5, 2.0, n_runs)
        loss = law(n, d) * np.exp(0.005 * rng.standard_normal(n_runs))
        batched, single = [], []
        for _ in range(max(1, args.rounds // 2)):
            start = time.perf_counter()
            fit_joint_law(n, d, loss, n_bootstrap=500)
            batched.append(time.perf_counter() - start)
            start = time.perf_counter()
            for seed in range(500):  # the same work, one resample per call
                idx = np.random.default_rng(seed).integers(0, n_runs, n_runs)
                if len(np.unique(n[idx])) < 3:
                    continue  # as the batched bootstrap redraws such resamples
                fit_joint_law(n[idx], d[idx], loss[idx], n_bootstrap=0)
            single.append(time.perf_counter() - start)
        b, s1 = statistics.median(batched), statistics.median(single)
        print(f"{n_runs:>4d}  {b:>36.2f}  {s1:>17.2f}  {s1 / b:5.1f}")


if __name__ == "__main__":
    run_command(main)
