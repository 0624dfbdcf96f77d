"""Sweep definitions (`configs/scaling/*.yaml`) and their expansion into run configs.

A sweep is families x sizes x budgets x axes. A budget is a number of training tokens, a
number of tokens per parameter, or a compute budget C in training FLOPs, which each run turns
into tokens with its model's own `flops_per_token(seq_len, training=True)` (the accounting of
the trainer's MFU and summary). Axes (e.g. `optimizer.lr`) repeat every run for each of their
values; the runs that differ only in axis values form one cell, of which the fits use the best.
Every run starts from the same trainer config (data, tokenizer, batch, schedule shape) and
differs only in `model.flavor`, `model.overrides`, `train.max_tokens` and the axis keys, so
the runs compare like for like.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.fileio import atomic_write_text, read_json
from pretrain.config.typed import load_yaml, parse_override, read_typed
from pretrain.scaling.registry import SUMMARY_FILE, SWEEP_FILE


@dataclass
class FamilySpec:
    """One compared group: a flavor plus what sets it apart."""

    flavor: str
    """Registered model flavor every size of this group starts from."""
    config: str | None = None
    """Trainer YAML for this group instead of the sweep's `base_config` (keep data and schedule
    the same; e.g. to change only the learning rate)."""
    sizes: dict[str, dict[str, Any]] | None = None
    """Size label -> model overrides, replacing the sweep's `sizes` for this group (for
    families whose width knobs differ)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted trainer keys applied to this group only (e.g. `optimizer.lr: 1.0e-3`)."""


@dataclass
class TokenBudget:
    """Training tokens per run: a list of fixed budgets or of tokens-per-parameter ratios."""

    fixed: list[float] = field(default_factory=list)
    """Budgets in tokens, the same for every size (e.g. [2e5, 4e5])."""
    per_param: list[float] = field(default_factory=list)
    """Budgets as multiples of the non-embedding parameter count (Chinchilla used ~20)."""


@dataclass
class SlurmSpec:
    """Options of the generated job array (`run --slurm`)."""

    nodes: int = 1
    """Nodes per run."""
    gpus_per_node: int = 8
    """GPUs per node (`--gpus-per-node`); 0 asks for none, for CPU nodes (a GPU request makes
    Slurm refuse the job where nodes have none)."""
    procs_per_node: int = 0
    """Processes per node (launch/slurm.sbatch's PROCS_PER_NODE); 0: one per GPU, or one on a
    node without GPUs."""
    cpus_per_task: int = 0
    """CPUs of a node's one task, its trainers and loader workers (`--cpus-per-task`); 0: not
    given, the CPUs the job gets on the node."""
    time: str = "24:00:00"
    """Time limit per array task (runs resume after preemption or timeout)."""
    max_parallel: int = 0
    """Most array tasks running at once (0: no limit)."""
    extra_args: list[str] = field(default_factory=list)
    """Further sbatch arguments, e.g. ["--partition=gpu", "--account=proj"]."""


@dataclass
class Sweep:
    """A scaling sweep."""

    name: str
    """Sweep name: the runs' directory is OUTPUT_ROOT/NAME/ and run names start with it."""
    base_config: str
    """Trainer YAML all runs start from (path relative to the repository root)."""
    families: dict[str, FamilySpec]
    """Group label (what the fits compare, e.g. `gpt`, `nrgpt_ff1`) -> its spec."""
    tokens: TokenBudget = field(default_factory=TokenBudget)
    """Token budgets (or give `flops`)."""
    flops: list[float] = field(default_factory=list)
    """Compute budgets C in training FLOPs, instead of `tokens`: each run trains
    C / flops_per_token tokens of its model (the trainer's FLOP accounting: inner loops and
    second-order work included), rounded to whole optimizer steps."""
    axes: dict[str, list[Any]] = field(default_factory=dict)
    """Dotted trainer key -> values (e.g. `optimizer.lr: [1.0e-3, 3.0e-3]`): every run is
    repeated for each combination; runs differing only in these keys form one cell, and the
    fits use each cell's best run."""
    sizes: dict[str, dict[str, Any]] = field(default_factory=lambda: {"base": {}})
    """Size label -> `model.overrides` entries (e.g. `w32: {n_embd: 32}`); shared by groups."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted trainer keys applied to every run (e.g. `train.global_batch_size: 16`)."""
    output_root: str = "checkpoints/scaling"
    """Where the sweep's directory goes."""
    warmup_fraction: float | None = None
    """Share of each run's optimizer steps spent in linear warmup (sets
    `schedule.warmup_steps`), so runs with different budgets share the schedule's shape; None
    keeps the base config's warmup_steps."""
    parallel_runs: int = 1
    """Local runs trained at the same time (`run` without --slurm); with more than one, each
    run's output goes to SWEEP_DIR/logs/RUN.log. On a CPU machine: one per free core, with
    `threads_per_process: 1`."""
    nproc_per_node: int = 1
    """Processes per local run (`run` without --slurm): 1 runs the trainer directly, more
    runs it under torchrun."""
    threads_per_process: int | None = None
    """OMP_NUM_THREADS of each local run (None: inherited). 1 suits tiny models on a small or
    shared CPU machine: with more threads than free cores, OpenMP threads spin waiting for
    descheduled ones (a tiny run measured 10-20x slower with 2 threads on 2 busy cores)."""
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    """Job array options."""

    @property
    def directory(self) -> Path:
        return Path(self.output_root) / self.name

    def world_size(self, slurm: bool) -> int:
        """Trainer processes of each run: with `slurm`, its job's nodes times their processes
        (counted as launch/slurm.sbatch counts them); else `nproc_per_node`, a local launch."""
        if not slurm:
            return self.nproc_per_node
        return self.slurm.nodes * (self.slurm.procs_per_node or self.slurm.gpus_per_node or 1)


@dataclass(frozen=True)
class RunSpec:
    """One cell of the sweep."""

    run_name: str
    group: str
    size: str
    budget: str
    """Budget label, e.g. `t200k` (fixed), `x20` (20 tokens per parameter) or `c3e+11` (FLOPs)."""
    non_embedding_params: int
    max_tokens: int
    config: dict[str, Any]
    """The complete, resolved trainer config (`pretrain.config.to_dict` form)."""
    cell: str
    """The run name without the axis values: runs of one cell differ only in axis keys."""
    axes: dict[str, Any] = field(default_factory=dict)
    """Axis key -> this run's value."""
    flops_budget: float | None = None
    """The compute budget C the run's token budget was derived from (None: a token budget)."""
    flops_per_token: float | None = None
    """The model's training FLOPs per token at the run's seq_len (known when the dataset is)."""


SET_BY_SWEEP = ("run_name", "output_root", "model.flavor", "train.max_tokens", "train.max_steps")
"""Trainer keys every run gets from the sweep itself: not allowed as axes."""


def load_sweep(path: str | Path, overrides: list[str] = ()) -> Sweep:
    """Parse a sweep YAML and `key.sub=value` overrides of it (see `apply_overrides`); unknown
    keys and wrong types are ValueErrors naming key and file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep file not found: {path}")
    if path.is_dir():
        raise ValueError(f"sweep file is a directory: {path}")
    raw = load_yaml(path.read_text(), str(path))
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping of keys to values")
    where = str(path) if not overrides else f"{path} with {' '.join(overrides)}"
    sweep = read_typed(Sweep, apply_overrides(raw, overrides), lambda key: where)
    if not sweep.families:
        raise ValueError(f"{path}: families: give at least one group")
    budgets = sweep.tokens
    if sum(map(bool, (budgets.fixed, budgets.per_param, sweep.flops))) != 1:
        raise ValueError(f"{path}: give exactly one of the budgets 'tokens: {{fixed: ...}}', "
                         "'tokens: {per_param: ...}' or 'flops'")
    if min(budgets.fixed + budgets.per_param + sweep.flops) <= 0:
        raise ValueError(f"{path}: budgets must be positive")
    for key, values in sweep.axes.items():
        if not values:
            raise ValueError(f"{path}: axes: {key}: give at least one value")
        if key in SET_BY_SWEEP:
            raise ValueError(f"{path}: axes: {key} is set by the sweep itself; "
                             "use sizes or budgets")
    if sweep.parallel_runs < 1:
        raise ValueError(f"{path}: parallel_runs must be at least 1")
    if sweep.warmup_fraction is not None and not 0 <= sweep.warmup_fraction < 1:
        raise ValueError(f"{path}: warmup_fraction must be in [0, 1)")
    if sweep.threads_per_process is not None and sweep.threads_per_process < 1:
        raise ValueError(f"{path}: threads_per_process must be at least 1")
    if sweep.nproc_per_node < 1 or sweep.slurm.nodes < 1:
        raise ValueError(f"{path}: process and node counts must be at least 1")
    if min(sweep.slurm.gpus_per_node, sweep.slurm.procs_per_node, sweep.slurm.cpus_per_task) < 0:
        raise ValueError(f"{path}: slurm: gpus_per_node, procs_per_node and cpus_per_task must be >= 0")
    if sweep.slurm.max_parallel < 0:
        raise ValueError(f"{path}: slurm: max_parallel must be >= 0")
    if any(not sizes for sizes in [sweep.sizes] + [f.sizes for f in sweep.families.values()
                                                   if f.sizes is not None]):
        raise ValueError(f"{path}: sizes: give at least one size")
    return sweep


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`raw` (a parsed sweep) with `key.sub=value` items applied, values parsed as YAML scalars
    as the trainer parses its overrides (text that is not YAML stays text). A key
    whose first part is a sweep field sets that field (`flops=[1e11,3e11]`, `slurm.time=4:00:00`,
    `families.gpt.overrides.optimizer.lr=1e-3`); any other key is a trainer key for every run
    (`train.global_batch_size=16`: an entry of `overrides`)."""
    raw = dict(raw)
    sweep_fields = {f.name for f in dataclasses.fields(Sweep)}
    for item in overrides:
        key, value = parse_override(item)
        parts = key.split(".")
        if parts[0] not in sweep_fields:
            parts = ["overrides", key]
        _set(raw, parts, value, Sweep, key)
    return raw


def _set(node: dict[str, Any], parts: list[str], value: Any, tp: Any, key: str) -> None:
    """Set `parts` in the mapping `node`, guided by the type `tp` it parses to: the keys of a
    `dict[str, Any]` (trainer keys) may themselves hold dots."""
    head, rest = parts[0], parts[1:]
    tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp) \
        if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    if dataclasses.is_dataclass(tp):
        child_tp = typing.get_type_hints(tp).get(head)
        if child_tp is None:
            raise ValueError(f"command line: {key}: unknown key {head!r}")
    elif typing.get_origin(tp) is dict:
        child_tp = typing.get_args(tp)[1]
        if child_tp is Any or typing.get_origin(child_tp) is list:
            head, rest = ".".join(parts), []
    else:
        raise ValueError(f"command line: {key}: {head!r} is inside a value, not a section")
    if not rest:
        node[head] = value
        return
    child = node.get(head)
    child = dict(child) if isinstance(child, dict) else {}
    node[head] = child
    _set(child, rest, value, child_tp, key)


def model_figures(cfg, dataset_vocab_size: int | None) -> tuple[int, float | None]:
    """(N, training FLOPs per token at the run's seq_len) of the model the trainer will build,
    counted on the meta device (no memory, no init cost); FLOPs per token need the dataset's
    vocabulary (the readout's share), None without it."""
    import torch

    from pretrain import models
    from pretrain.config import model_config

    vocab = dataset_vocab_size or models.resolve(cfg.model.flavor).vocab_size
    with torch.device("meta"):
        model = models.build(model_config(cfg, vocab))
    n_params = int(model.num_params(non_embedding=True))
    if dataset_vocab_size is None:
        return n_params, None
    return n_params, float(model.flops_per_token(cfg.data.seq_len, training=True))


def dataset_manifest(data, datasets: str, where: str) -> dict | None:
    """The manifest of a run's dataset (see DATASETS); a dataset for another seq_len, or one
    that is required and absent, is a ValueError naming it."""
    from data_pipeline.prepare import ensure_prepared, existing_manifest

    if datasets == "prepare" and data.source:
        print(f"{where}: preparing dataset {data.path} (if not done yet)", flush=True)
        manifest = ensure_prepared(data.path, data.source, seq_len=data.seq_len,
                                   tokenizer=data.tokenizer, val_fraction=data.val_fraction)
    else:
        manifest = existing_manifest(data.path)
    if manifest is None:
        if datasets == "peek":
            return None
        hint = ("" if data.source else " and its config names no data.source to prepare it "
                "from; prepare it with python -m data_pipeline.prepare --out " + data.path)
        raise ValueError(f"{where}: dataset {data.path} is not prepared (no manifest.json)"
                         f"{hint}")
    if manifest["seq_len"] != data.seq_len:
        raise ValueError(f"{where}: data.seq_len={data.seq_len}, but the dataset at {data.path} "
                         f"has windows for seq_len={manifest['seq_len']}")
    return manifest


def expand(sweep: Sweep, datasets: str = "peek") -> list[RunSpec]:
    """Every run of the sweep, in a stable order (group, size, axis values, budget). Each run's
    config is the trainer's own `load_config(base, overrides)`, so it is read as the trainer
    reads it (`check_runs` makes the trainer's checks at a launch's world size). `datasets`: see
    DATASETS; compute budgets need the manifest (the vocabulary sets the readout's FLOPs), so
    with `flops` every dataset is checked."""
    from pretrain.config import to_dict

    if sweep.flops and datasets == "peek":
        datasets = "check"
    manifests: dict[str, dict | None] = {}
    runs = []
    axis_keys = list(sweep.axes)
    for group, spec in sweep.families.items():
        base = spec.config or sweep.base_config
        if not Path(base).is_file():
            raise ValueError(f"sweep {sweep.name}: trainer config not found: {base}")
        for size, model_overrides in (spec.sizes or sweep.sizes).items():
            for axis_values in itertools.product(*sweep.axes.values()):
                where = f"sweep {sweep.name}, {group} {size}"
                values = dict(zip(axis_keys, axis_values))
                cfg = _run_config(base, {
                    **sweep.overrides, **spec.overrides, **values,
                    "output_root": str(sweep.directory), "model.flavor": spec.flavor,
                    "train.max_steps": None,
                    **{f"model.overrides.{k}": v for k, v in model_overrides.items()}}, where)
                if cfg.data.path not in manifests:
                    manifests[cfg.data.path] = dataset_manifest(cfg.data, datasets, where)
                manifest = manifests[cfg.data.path]
                n_params, flops_per_token = model_figures(
                    cfg, manifest["vocab_size"] if manifest else None)
                suffix = "".join(f"-{k.rsplit('.', 1)[-1]}{_label(v)}" for k, v in values.items())
                for budget, max_tokens, flops_budget in _budgets(sweep, cfg, n_params,
                                                                flops_per_token, where):
                    cell = f"{sweep.name}-{group}-{size}-{budget}"
                    cfg.run_name = cell + suffix
                    cfg.train.max_tokens = max_tokens
                    if sweep.warmup_fraction is not None:
                        cfg.schedule.warmup_steps = round(sweep.warmup_fraction * cfg.total_steps)
                    _check_run_length(cfg, f"sweep {sweep.name}, run {cfg.run_name}")
                    runs.append(RunSpec(cfg.run_name, group, size, budget, n_params, max_tokens,
                                        to_dict(cfg), cell, values, flops_budget,
                                        flops_per_token))
    names = [r.run_name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"sweep {sweep.name}: two cells share a run name; make labels unique")
    return runs


def check_runs(sweep: Sweep, runs: list[RunSpec], slurm: bool) -> None:
    """Refuse the sweep if the trainer would refuse one of its runs at launch (`validate`, at the
    world size of a `slurm` job or of a local launch): a job array's refused run would fail hours
    into the queue, a local sweep's after the runs before it. A run may train on a GPU where
    it says so (`train.device: cuda`), where the job asks for GPUs, or locally where one is."""
    import torch

    from pretrain.config import ConfigError, from_dict
    from pretrain.config.validation import validate

    world_size = sweep.world_size(slurm)
    gpu_nodes = sweep.slurm.gpus_per_node > 0 if slurm else torch.cuda.is_available()
    for run in runs:
        cfg = from_dict(run.config)
        has_gpu = cfg.train.device == "cuda" or gpu_nodes
        try:
            validate(cfg, world_size, has_gpu, cautions=False)
        except ConfigError as err:
            raise ValueError(f"sweep {sweep.name}, run {run.run_name} ({world_size} process"
                             f"{'es' * (world_size != 1)}): {err}") from None


def _run_config(base: str, overrides: dict[str, Any], where: str):
    from pretrain.config import ConfigError, load_config

    try:
        # JSON is YAML: the trainer parses each value back to what it was here.
        return load_config(base, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    except ConfigError as err:
        # The sweep's values reach the trainer as overrides, which it calls "command line".
        raise ValueError(f"{where}: {str(err).removeprefix('command line: ')}") from None


def _check_run_length(cfg, where: str) -> None:
    """Refuse a generated run that would not train as asked: a token budget below one optimizer
    step (the trainer would still take a whole step), or one that ends before its warmup does
    (the learning rate would never peak). `expand` checks every run before any starts."""
    from pretrain.config.validation import short_warmup

    if cfg.train.max_tokens < cfg.tokens_per_step:
        raise ValueError(f"{where}: the budget of {cfg.train.max_tokens:,} tokens is less than one optimizer "
                         f"step ({cfg.tokens_per_step:,} tokens: train.global_batch_size "
                         f"{cfg.train.global_batch_size} x data.seq_len {cfg.data.seq_len}); raise the "
                         "budget or lower the global batch")
    warmup = short_warmup(cfg)
    if warmup:
        raise ValueError(f"{where}: {warmup}, or set the sweep's warmup_fraction")


def _budgets(sweep: Sweep, cfg, n_params: int, flops_per_token: float | None, where: str
             ) -> list[tuple[str, int, float | None]]:
    """(label, max_tokens, compute budget or None) of each budget of the sweep for one run."""
    budgets = [(f"t{_compact(t)}", int(t), None) for t in sweep.tokens.fixed]
    budgets += [(f"x{_compact(r)}", round(r * n_params), None) for r in sweep.tokens.per_param]
    step_flops = flops_per_token * cfg.tokens_per_step if sweep.flops else 0.0
    for flops in sweep.flops:
        if flops < step_flops:
            raise ValueError(f"{where}: flops budget {flops:.3g} is too small for one optimizer "
                             f"step ({cfg.tokens_per_step} tokens x {flops_per_token:.4g} "
                             f"FLOPs/token = {step_flops:.3g} FLOPs)")
        # Whole optimizer steps, the nearest to C: the run's compute is C within half a step.
        steps = round(flops / step_flops)
        budgets.append((f"c{_compact(flops)}", steps * cfg.tokens_per_step, flops))
    return budgets


def _label(value: Any) -> str:
    """An axis value as it appears in run names: 0.003 -> '0.003', 1e-05 -> '1e-05'."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _compact(value: float) -> str:
    """2e5 -> '200k', 1.5e6 -> '1.5M', 20 -> '20'."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def write_run_configs(sweep: Sweep, runs: list[RunSpec]) -> list[Path]:
    """Write each run's trainer YAML under SWEEP_DIR/configs/ and add the runs to the sweep's
    cell index (`sweep.json`, read by the registry to group runs); return the config paths."""
    config_dir = sweep.directory / "configs"
    config_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in runs:
        path = config_dir / f"{run.run_name}.yaml"
        atomic_write_text(path, yaml.safe_dump(run.config, sort_keys=False))
        paths.append(path)
    # Entries of runs from an earlier definition of the sweep stay (e.g. a learning rate added
    # later for one family): their runs are on disk, and their cells must stay their cells.
    index_path = sweep.directory / SWEEP_FILE
    known = read_json(index_path)["runs"] if index_path.is_file() else {}
    index = {"sweep": sweep.name,
             "runs": known | {r.run_name: {"group": r.group, "size": r.size, "budget": r.budget,
                                   "cell": r.cell, "axes": r.axes,
                                   "non_embedding_params": r.non_embedding_params,
                                   "max_tokens": r.max_tokens, "flops_budget": r.flops_budget,
                                   "flops_per_token": r.flops_per_token} for r in runs}}
    atomic_write_text(index_path, json.dumps(index, indent=2) + "\n")
    return paths


def is_finished(sweep: Sweep, run: RunSpec) -> bool:
    return (sweep.directory / run.run_name / SUMMARY_FILE).is_file()


