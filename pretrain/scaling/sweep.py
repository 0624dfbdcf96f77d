"""Sweep definitions (`configs/scaling/*.yaml`) and their expansion into run configs.

A sweep is families x sizes x token budgets. Every run starts from the same trainer config
(data, tokenizer, batch, schedule shape) and differs only in `model.flavor`,
`model.overrides` and `train.max_tokens`, so the runs compare like for like; FLOPs are
counted by each model's own `flops_per_token` in the trainer's summary.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretrain.fileio import atomic_write_text
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
    """GPUs per node."""
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
    tokens: TokenBudget
    """Token budgets."""
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


@dataclass(frozen=True)
class RunSpec:
    """One cell of the sweep."""

    run_name: str
    group: str
    size: str
    budget: str
    """Budget label, e.g. `t200k` (fixed) or `x20` (20 tokens per parameter)."""
    non_embedding_params: int
    max_tokens: int
    config: dict[str, Any]
    """The complete, resolved trainer config (`pretrain.config.to_dict` form)."""


def load_sweep(path: str | Path) -> Sweep:
    """Parse a sweep YAML; unknown keys and wrong types are ValueErrors naming key and file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})".replace("\n", " ")) from None
    sweep = _typed(Sweep, raw, str(path))
    if not sweep.families:
        raise ValueError(f"{path}: families: give at least one group")
    budgets = sweep.tokens
    if bool(budgets.fixed) == bool(budgets.per_param):
        raise ValueError(f"{path}: tokens: give exactly one of 'fixed' or 'per_param'")
    if min(budgets.fixed + budgets.per_param) <= 0:
        raise ValueError(f"{path}: tokens: budgets must be positive")
    if sweep.warmup_fraction is not None and not 0 <= sweep.warmup_fraction < 1:
        raise ValueError(f"{path}: warmup_fraction must be in [0, 1)")
    if sweep.threads_per_process is not None and sweep.threads_per_process < 1:
        raise ValueError(f"{path}: threads_per_process must be at least 1")
    if sweep.nproc_per_node < 1 or sweep.slurm.nodes < 1 or sweep.slurm.gpus_per_node < 1:
        raise ValueError(f"{path}: process, node and GPU counts must be at least 1")
    if sweep.slurm.max_parallel < 0:
        raise ValueError(f"{path}: slurm: max_parallel must be >= 0")
    if any(not sizes for sizes in [sweep.sizes] + [f.sizes for f in sweep.families.values()
                                                   if f.sizes is not None]):
        raise ValueError(f"{path}: sizes: give at least one size")
    return sweep


def _typed(tp: Any, value: Any, where: str) -> Any:
    """`value` (parsed YAML) checked against the type annotation `tp`, dataclasses built."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _typed(tp, value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(fields)})")
        for name, f in fields.items():
            if name not in value and f.default is f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}: missing key {name!r}")
        return tp(**{k: _typed(hints[k], v, f"{where}: {k}") for k, v in value.items()})
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return {k: _typed(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return [_typed(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    # YAML reads 2e5 as a string (no dot); accept numeric strings where a number is expected.
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    ok = isinstance(value, tp) and not isinstance(value, bool) or (
        tp is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return float(value) if tp is float else value


def non_embedding_params(flavor: str, model_overrides: dict[str, Any]) -> int:
    """N of a flavor with overrides, counted on the meta device (no memory, no init cost)."""
    import torch

    from pretrain import models

    config = models.resolve(flavor, model_overrides)
    with torch.device("meta"):
        model = models.build(config)
    return int(model.num_params(non_embedding=True))


def expand(sweep: Sweep) -> list[RunSpec]:
    """Every run of the sweep, in a stable order (group, size, budget). Each run's config is
    the trainer's own `load_config(base, overrides)`, so it is checked as the trainer checks it."""
    from pretrain.config import ConfigError, load_config, to_dict

    runs = []
    for group, spec in sweep.families.items():
        base = spec.config or sweep.base_config
        if not Path(base).is_file():
            raise ValueError(f"sweep {sweep.name}: trainer config not found: {base}")
        for size, model_overrides in (spec.sizes or sweep.sizes).items():
            cell = {**sweep.overrides, **spec.overrides, "output_root": str(sweep.directory),
                    "model.flavor": spec.flavor, "train.max_steps": None}
            cell.update({f"model.overrides.{k}": v for k, v in model_overrides.items()})
            try:
                # JSON is YAML: the trainer parses each value back to what it was here.
                cfg = load_config(base, [f"{k}={json.dumps(v)}" for k, v in cell.items()])
            except ConfigError as err:
                # The sweep's values reach the trainer as overrides, which it calls "command line".
                reason = str(err).removeprefix("command line: ")
                raise ValueError(f"sweep {sweep.name}, {group} {size}: {reason}") from None
            n_params = non_embedding_params(cfg.model.flavor, cfg.model.overrides)
            budgets = [(f"t{_compact(t)}", int(t)) for t in sweep.tokens.fixed]
            budgets += [(f"x{_compact(r)}", round(r * n_params)) for r in sweep.tokens.per_param]
            for budget, max_tokens in budgets:
                cfg.run_name = f"{sweep.name}-{group}-{size}-{budget}"
                cfg.train.max_tokens = max_tokens
                if sweep.warmup_fraction is not None:
                    cfg.schedule.warmup_steps = round(sweep.warmup_fraction * cfg.total_steps)
                runs.append(RunSpec(cfg.run_name, group, size, budget, n_params, max_tokens,
                                    to_dict(cfg)))
    names = [r.run_name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"sweep {sweep.name}: two cells share a run name; make labels unique")
    return runs


def _compact(value: float) -> str:
    """2e5 -> '200k', 1.5e6 -> '1.5M', 20 -> '20'."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def write_run_configs(sweep: Sweep, runs: list[RunSpec]) -> list[Path]:
    """Write each run's trainer YAML under SWEEP_DIR/configs/ and the sweep's cell index
    (`sweep.json`, read by the registry to group runs); return the config paths."""
    config_dir = sweep.directory / "configs"
    config_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in runs:
        path = config_dir / f"{run.run_name}.yaml"
        atomic_write_text(path, yaml.safe_dump(run.config, sort_keys=False))
        paths.append(path)
    index = {"sweep": sweep.name,
             "runs": {r.run_name: {"group": r.group, "size": r.size, "budget": r.budget,
                                   "non_embedding_params": r.non_embedding_params,
                                   "max_tokens": r.max_tokens} for r in runs}}
    atomic_write_text(sweep.directory / SWEEP_FILE, json.dumps(index, indent=2) + "\n")
    return paths


def is_finished(sweep: Sweep, run: RunSpec) -> bool:
    return (sweep.directory / run.run_name / SUMMARY_FILE).is_file()


