"""What the experiments share: training a sweep and evaluating each run once, loading a
trained run, held-out losses and the result files."""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import torch

from common.fileio import atomic_write_text, read_json
from pretrain.scaling import launch
from pretrain.scaling.plots import pyplot
from pretrain.scaling.registry import RunRecord
from pretrain.scaling.sweep import RunSpec, Sweep, load_sweep

EVAL_FILE = "experiment_eval.json"
MODEL_FILE = "model.safetensors"


@dataclass
class FinishedRun:
    spec: RunSpec
    record: RunRecord
    """The run's summary.json."""
    directory: Path
    evaluation: dict[str, Any]
    """What the experiment's evaluation returned for this run."""


def train_and_evaluate(path: str, key: str, evaluate: Callable[[RunSpec, Path], dict[str, Any]],
                       overrides: list[str] = ()) -> tuple[Sweep, list[FinishedRun]]:
    """Train the sweep's runs (`overrides` applied to it), `parallel_runs` at a time, then
    evaluate each finished run once (with the code it was trained with) unless
    RUN_DIR/experiment_eval.json already holds `key`."""
    sweep = load_sweep(path, overrides)
    if sweep.threads_per_process is not None:  # the evaluation here runs like the runs did
        torch.set_num_threads(sweep.threads_per_process)
    finished = []
    for run in train_sweep(sweep, lambda run: run.non_embedding_params):
        run_dir = sweep.directory / run.run_name
        summary = read_json(run_dir / "summary.json")
        evaluation = cached(run_dir, key, lambda: evaluate(run, run_dir))
        finished.append(FinishedRun(run, RunRecord.from_dict(summary, str(run_dir)), run_dir,
                                    evaluation))
    return sweep, finished


def train_sweep(sweep: Sweep, cost: Callable[[RunSpec], float]) -> list[RunSpec]:
    """Train the sweep's unfinished runs, `parallel_runs` at a time, cheapest by `cost` first (so
    every group advances together and the costly runs come last); its runs in that order, or
    SweepFailed when one did not finish (a rerun resumes)."""
    planned = sorted(launch.plan(sweep, "prepare"), key=lambda item: cost(item[0]))
    rc = launch.run_locally(sweep, planned)
    if rc != 0:
        raise launch.SweepFailed(f"sweep {sweep.name} did not finish (exit code {rc}); rerun "
                                 "the same command to resume it")
    return [run for run, _ in planned]


def trained_model(run_dir: Path) -> torch.nn.Module:
    """The run's final weights in eval mode (exported once to RUN_DIR/model.safetensors)."""
    from pretrain.export import export, load

    path = run_dir / MODEL_FILE
    if not path.is_file():
        export(run_dir, path)
    return load(path).eval()


def scalar_curve(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar the run logged to RUN_DIR/tb, in step order (values written
    for one step in the order written)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return sorted(((e.step, e.value) for e in events.Scalars(tag)), key=lambda point: point[0])


def cached(run_dir: Path, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`compute()` once per run and key; kept in RUN_DIR/experiment_eval.json, so rerunning an
    experiment only evaluates runs it has not evaluated yet."""
    path = run_dir / EVAL_FILE
    results = read_json(path) if path.is_file() else {}
    if key not in results:
        results[key] = compute()
        atomic_write_text(path, json.dumps(results, indent=2) + "\n")
    return results[key]


@torch.no_grad()
def mean_loss(model: torch.nn.Module, data_dir: str, split: str, batches: int,
              micro_batch_size: int) -> float:
    """Mean next-token loss of `model` over the first `batches` micro-batches of `split` in a
    fixed shuffled order (the same windows for every model)."""
    from data_pipeline.loader import build_loader

    loader = build_loader(data_dir, split, micro_batch_size=micro_batch_size, seed=0,
                          shuffle=True, num_workers=0)
    losses = [model(inputs, targets).loss.item() for inputs, targets in islice(loader, batches)]
    return sum(losses) / len(losses)


def write_results(directory: Path, name: str, markdown: str, rows: list[dict[str, Any]],
                  figure) -> Path:
    """DIRECTORY/results/<name>.{md,csv,png} (DIRECTORY: the sweep's); returns the folder."""
    out = directory / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    (out / f"{name}.csv").write_text(buffer.getvalue())
    figure.savefig(out / f"{name}.png", dpi=80)
    pyplot().close(figure)
    print(markdown)
    print(f"wrote {out}/{name}.md, {name}.csv, {name}.png")
    return out
