"""Running lm-evaluation-harness on a model of this project, offline, and reading its results
back as rows (task, metric, value, standard error, documents).

Tasks: the YAMLs of `tasks/` (lm-eval's `include_path`), next to the few stock task folders
they point at local data; a name is a suite (`core`, `nrgpt_paper`, `ebt_paper`), a group in
them (`mmlu_5shot`) or a task in them (`hellaswag`, `mmlu_astronomy`, `gsm8k_gold`, ...).
Besides lm-eval's own metrics every scored task reports `bpb`, the bits per UTF-8 byte of the
gold answer (mean over documents): unlike per-token figures it compares models with different
tokenizers."""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from pretrain.models.common import StepCount

TASKS_DIR = Path(__file__).parent / "tasks"
STOCK_TASK_DIRS = ("hellaswag", "arc", "piqa", "winogrande", "lambada", "mmlu/default")
"""The folders of lm-eval's own tasks that `tasks/` refers to (indexing all of them takes ~30 s)."""
SUITES = ("core", "nrgpt_paper", "ebt_paper")
NRGPT_SUBSET = ("mmlu_high_school_computer_science", "mmlu_astronomy")
"""The NRGPT authors' MMLU subset: 100 + 152 = 252 questions."""
NRGPT_SUBSET_NAME = "mmlu_nrgpt_subset"
NRGPT_SUBSET_NOTE = ("NRGPT authors' subset, 252 questions: its standard error is ~2.8 points "
                     "at 25-30% accuracy")
GENERATION_TASK = "owt_generation"
"""Generation quality on the run's validation prompts (pretrain.downstream.generation), part of
`nrgpt_paper`; not an lm-eval task, so the command runs it (training does not)."""
HUB_OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


class TaskError(ValueError):
    """A task name that is not offered; the message lists the known ones."""


@dataclass
class Row:
    task: str
    """Task or group name (lm-eval's, e.g. hellaswag, mmlu_5shot)."""
    metric: str
    """lm-eval's metric name (acc, acc_norm, perplexity, ...) or bpb."""
    value: float
    stderr: float | None
    """Standard error of `value` as lm-eval computes it (None where it has none)."""
    docs: int
    """Documents scored."""
    think_steps: int | None = None
    """EBT: inference steps the values were measured at (None: the model's default)."""
    best_of: int = 1
    """EBT: noise samples per position, the lowest final energy kept."""
    think_until: float | None = None
    """EBT: each position's descent stopped once a step changed its energy by less than this
    fraction of it (think_steps the most it took); None: every position took think_steps."""
    mean_steps: float | None = None
    """EBT with think_until: descent steps per scored token (generation: per generated token),
    on average over the task's documents."""
    note: str = ""


# --- the catalogue of task names ------------------------------------------------------------

class _PlainLoader(yaml.SafeLoader):
    """Reads the task YAMLs without resolving lm-eval's `!function` tags (no lm-eval import)."""


_PlainLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


@dataclass(frozen=True)
class Catalogue:
    specs: dict[str, Any]
    """Name -> what lm-eval loads for it: a registered group/task name, or a member's config."""
    members: dict[str, list[str]]
    """Group name -> the names it contains (recursively through nested groups)."""


def _read_catalogue(load) -> Catalogue:
    specs: dict[str, Any] = {}
    direct: dict[str, list[str]] = {}
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        cfg = load(path)
        if "group" not in cfg:
            specs.setdefault(cfg["task"], cfg["task"])
            continue
        group = cfg["group"]
        specs[group] = group
        shared = {k: v for k, v in cfg.items() if k not in ("group", "task", "aggregate_metric_list", "metadata")}
        direct[group] = []
        for member in cfg["task"]:
            if isinstance(member, str):
                name = member
            elif "group" in member:
                name = member["group"]
            else:
                name = member["task"]
                specs.setdefault(name, {**shared, **member})
            direct[group].append(name)

    def expand(name: str) -> list[str]:
        return [name] + [m for child in direct.get(name, []) for m in expand(child)]

    members = {group: expand(group)[1:] for group in direct}
    specs[NRGPT_SUBSET_NAME] = NRGPT_SUBSET_NAME
    members[NRGPT_SUBSET_NAME] = list(NRGPT_SUBSET)
    specs[GENERATION_TASK] = GENERATION_TASK
    members["nrgpt_paper"].append(GENERATION_TASK)
    return Catalogue(specs, members)


@functools.cache
def _plain_catalogue() -> Catalogue:
    """The catalogue read without importing lm-eval (for checking names)."""
    return _read_catalogue(lambda p: yaml.load(p.read_text(), Loader=_PlainLoader))


def known_tasks() -> list[str]:
    """Every name `parse_tasks` accepts."""
    return sorted(_plain_catalogue().specs)


@functools.cache
def _catalogue() -> Catalogue:
    from lm_eval.tasks._yaml_loader import load_yaml

    return _read_catalogue(lambda p: load_yaml(p, resolve_func=True))


def check_tasks(names: list[str]) -> None:
    unknown = [n for n in names if n not in known_tasks()]
    if unknown:
        suites = [n for n in known_tasks() if n in SUITES]
        subjects = [n for n in known_tasks() if n.startswith("mmlu_") and n not in ("mmlu_5shot", NRGPT_SUBSET_NAME)]
        others = [n for n in known_tasks() if n not in SUITES and n not in subjects]
        raise TaskError(f"unknown task {', '.join(map(repr, unknown))}: known are the suites "
                        f"{', '.join(suites)}, the tasks {', '.join(others)} and mmlu_<subject> "
                        "for each of the 57 MMLU subjects")


def parse_tasks(text: str) -> list[str]:
    """`core,hellaswag` -> the names, checked (a TaskError lists the known ones)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise TaskError("no task given: name a suite (core, nrgpt_paper, ebt_paper) or tasks")
    check_tasks(names)
    return names


def wants_generation(names: list[str]) -> bool:
    members = _plain_catalogue().members
    return any(n == GENERATION_TASK or GENERATION_TASK in members.get(n, []) for n in names)


def lm_eval_specs(names: list[str]) -> list[Any]:
    """What lm-eval loads for `names`: groups by name, and the single tasks (inside a group
    named `tasks`, the form in which lm-eval applies a member's overrides), each task once."""
    catalogue = _catalogue()
    groups = [n for n in dict.fromkeys(names) if n in catalogue.members and n != NRGPT_SUBSET_NAME]
    covered = {m for g in groups for m in catalogue.members[g]}
    groups = [g for g in groups if g not in covered]
    singles: list[str] = []
    for name in names:
        for leaf in catalogue.members.get(name, [name]) if name == NRGPT_SUBSET_NAME else [name]:
            if leaf not in covered and leaf not in groups and leaf not in singles and leaf != GENERATION_TASK:
                singles.append(leaf)
    specs: list[Any] = list(groups)
    if singles:
        specs.append({"group": "tasks", "task": [catalogue.specs[s] for s in singles]})
    return specs


@functools.cache
def task_manager():
    """One lm-eval TaskManager per process over our YAMLs and the stock folders they use."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    stock = Path(lm_eval.__file__).parent / "tasks"
    paths = [str(stock / d) for d in STOCK_TASK_DIRS] + [str(TASKS_DIR)]
    return TaskManager(include_path=paths, include_defaults=False)


# --- running ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _isolated():
    """lm-eval seeds Python's, NumPy's and torch's global RNGs and prints to stdout: keep the
    caller's random streams (a training run's) and stdout (the results table) untouched, and
    never reach the hub."""
    py_state, np_state = random.getstate(), np.random.get_state()
    saved_env = {k: os.environ.get(k) for k in HUB_OFFLINE}
    os.environ.update(HUB_OFFLINE)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # bootstrap standard errors in-process
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with torch.random.fork_rng(devices=devices), contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(adapter, names: list[str], limit: int | None, bootstrap_iters: int = 1000) -> list[Row] | None:
    """Evaluate `adapter` (a HarnessModel) on the tasks `names`, the first `limit` documents of
    each (all when None). Returns the rows on rank 0 (None on the other ranks)."""
    from lm_eval.evaluator import simple_evaluate

    specs = lm_eval_specs(names)
    if not specs:
        return [] if adapter.rank == 0 else None
    with _isolated():
        results = simple_evaluate(model=adapter, tasks=specs, limit=limit,
                                  task_manager=task_manager(), log_samples=True,
                                  bootstrap_iters=bootstrap_iters, verbosity="ERROR")
    steps = None if adapter.think_until is None else adapter.step_counts()  # on every rank: a collective
    if results is None:
        return None
    rows = _rows(results, subset=NRGPT_SUBSET_NAME in names or "nrgpt_paper" in names)
    for row in rows:
        row.think_steps, row.best_of = adapter.think_steps, adapter.best_of
        if steps is not None:
            leaves = NRGPT_SUBSET if row.task == NRGPT_SUBSET_NAME else _leaves(results, row.task)
            row.think_until, row.mean_steps = adapter.think_until, pooled_steps(steps, leaves).mean
    return rows


def pooled_steps(steps: dict[str, StepCount], tasks) -> StepCount:
    """The counts of `tasks` in `steps` (task -> count, `HarnessModel.step_counts`) as one."""
    pooled = StepCount()
    for task in tasks:
        if task in steps:
            pooled.merge(steps[task])
    return pooled


def _leaves(results: dict, name: str) -> list[str]:
    children = results.get("group_subtasks", {}).get(name)
    if children is None:
        return [name]
    return [leaf for child in children for leaf in _leaves(results, child)]


def _answer_bits_per_byte(sample: dict) -> float | None:
    """Bits per byte of the gold answer of one logged document (None: no single gold answer)."""
    target = sample["target"]
    arguments, responses = sample["arguments"], sample["filtered_resps"]
    if len(arguments) == 1:
        gold = 0
    elif isinstance(target, int) and 0 <= target < len(arguments):
        gold = target
    else:
        return None
    loglikelihood = responses[gold][0]
    n_bytes = len(arguments[gold][1].encode("utf-8"))
    return -loglikelihood / (math.log(2) * n_bytes) if n_bytes else None


def _mean_row(task: str, metric: str, values: list[float], note: str = "") -> Row | None:
    from lm_eval.api.metrics import mean_stderr

    values = [v for v in values if v is not None]
    if not values:
        return None
    stderr = mean_stderr(values) if len(values) > 1 else None
    return Row(task, metric, float(np.mean(values)), stderr, len(values), note=note)


def _rows(results: dict, subset: bool) -> list[Row]:
    """lm-eval's metrics, the answers' bits per byte (tasks, and groups with a score of their
    own), and with `subset` the NRGPT authors' MMLU subset."""
    samples = results.get("samples", {})
    rows = []
    for name, metrics in results["results"].items():
        leaves = _leaves(results, name)
        docs = sum(results["n-samples"].get(leaf, {}).get("effective", 0) for leaf in leaves)
        for key, value in metrics.items():
            metric, _, _filter = key.partition(",")
            if not _filter or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{_filter}")
            rows.append(Row(name, metric, float(value),
                            float(stderr) if isinstance(stderr, (int, float)) else None, docs))
        if name in results.get("group_subtasks", {}) and not any("," in key for key in metrics):
            continue  # a group that only collects tasks (its bits per byte would mix them)
        bpb = _mean_row(name, "bpb", [_answer_bits_per_byte(s) for leaf in leaves for s in samples.get(leaf, [])])
        if bpb is not None:
            rows.append(bpb)
    if subset and all(subject in samples for subject in NRGPT_SUBSET):
        accuracy = [s["acc"] for subject in NRGPT_SUBSET for s in samples[subject]]
        rows.append(_mean_row(NRGPT_SUBSET_NAME, "acc", accuracy, note=NRGPT_SUBSET_NOTE))
    return rows


def summary_rows(rows: list[Row]) -> list[Row]:
    """The rows worth a table line: groups and top-level tasks (MMLU's 57 subjects stay in the
    JSON), the wrapper group `tasks` left out."""
    shown = []
    for row in rows:
        if row.task == "tasks" or (row.task.startswith("mmlu_") and row.task not in ("mmlu_5shot", NRGPT_SUBSET_NAME)):
            continue
        shown.append(row)
    return shown


def table(rows: list[Row]) -> str:
    from common.fileio import markdown_table

    thinking = any(r.think_steps is not None or r.best_of != 1 or r.think_until is not None for r in rows)
    adaptive = any(r.think_until is not None for r in rows)
    lines = []
    for r in summary_rows(rows):
        line = {"task": r.task, "metric": r.metric}
        if thinking:
            # None: the model's own number of steps (a row of --best-of or --think-until alone)
            line.update({"think steps": "default" if r.think_steps is None else r.think_steps, "best of": r.best_of})
        if adaptive:
            line.update({"think until": "" if r.think_until is None else f"{r.think_until:g}",
                         "mean steps": "" if r.mean_steps is None else f"{r.mean_steps:.2f}"})
        line.update({"value": f"{r.value:.4f}", "stderr": "" if r.stderr is None else f"{r.stderr:.4f}",
                     "docs": r.docs, "note": r.note})
        lines.append(line)
    return markdown_table(lines)


def scalar_tag(row: Row) -> str:
    """TensorBoard tag `downstream/<task>/<metric>`, the metric suffixed with `_think<k>` (and
    `_best<n>`, `_until<tol>`) when EBT's inference options were set."""
    metric = row.metric
    if row.think_steps is not None:
        metric += f"_think{row.think_steps}"
    if row.best_of != 1:
        metric += f"_best{row.best_of}"
    if row.think_until is not None:
        metric += f"_until{row.think_until:g}"
    return f"downstream/{row.task}/{metric}"


def scalars(rows: list[Row]) -> dict[str, float]:
    return {scalar_tag(r): r.value for r in summary_rows(rows)}


def rows_as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
