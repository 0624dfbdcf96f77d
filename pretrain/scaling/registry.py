"""The run registry: one `summary.json` record per finished run, found by walking directories.

A directory is a run directory when it holds `summary.json` (finished) or `config.yaml`
(started: the trainer writes the resolved config first). Started runs without a summary are
reported as missing, never silently dropped, and unreadable summaries are reported as invalid.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
SWEEP_FILE = "sweep.json"
"""Written by a sweep next to its run directories: run name -> the sweep cell it belongs to."""


@dataclass(frozen=True)
class RunRecord:
    """What the scaling fits need from one finished run (the fields of `summary.json`)."""

    run_name: str
    """Name of the run directory."""
    family: str
    """Model family (`gpt`, `gpt_rec`, `nrgpt`, `ebt`, `transformer_pp`)."""
    flavor: str
    """Registered flavor the run started from (its overrides are in the run's config.yaml)."""
    params: int
    """Total trainable parameters."""
    non_embedding_params: int
    """Parameters without the token/position embeddings: the N of the scaling laws."""
    tokens_seen: int
    """Training tokens consumed (global, all ranks): the D of the scaling laws."""
    train_flops: float
    """Training FLOPs: the model's own FLOPs per token (training=True) times tokens_seen."""
    final_train_loss: float
    """Training loss at the last optimizer step."""
    best_val_loss: float | None
    """Lowest validation loss over the run's evaluations (None when it never evaluated)."""
    final_val_loss: float | None
    """Validation loss at the end of the run."""
    wall_time_s: float
    """Wall-clock seconds of training (summed over resumed segments)."""
    hardware: str
    """Device description, e.g. `cpu` or `NVIDIA H100 80GB HBM3`."""
    world_size: int
    """Number of training processes."""
    steps: int
    """Optimizer steps taken."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Any further keys of summary.json, kept as read (e.g. the EBT thinking curve)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "summary") -> RunRecord:
        """Validate and convert a parsed summary; a missing key or wrong type is a ValueError
        naming the key and `source`."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            if f.name not in data:
                raise ValueError(f"{source}: missing key {f.name!r}")
            values[f.name] = _check_type(f.name, data[f.name], f.type, source)
        known = {f.name for f in dataclasses.fields(cls)}
        values["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(data.pop("extra"))
        return data

    def save(self, run_dir: str | Path) -> Path:
        """Write `run_dir/summary.json` atomically (a reader never sees half a file)."""
        path = Path(run_dir) / SUMMARY_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path


def _check_type(name: str, value: Any, annotation: str, source: str) -> Any:
    optional = annotation.endswith("| None")
    base = annotation.removesuffix("| None").strip()
    if value is None and optional:
        return None
    # bool is an int subclass in Python; a boolean loss or count is a corrupt record.
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
    }[base]
    if not ok:
        raise ValueError(f"{source}: key {name!r} should be {annotation}, got {value!r}")
    return float(value) if base == "float" else value


@dataclass
class Registry:
    """The runs found under some directories."""

    records: list[tuple[Path, RunRecord]]
    """(run directory, record) of every finished run, sorted by directory."""
    missing: list[Path]
    """Run directories without summary.json (unfinished, crashed or still running)."""
    invalid: list[tuple[Path, str]]
    """Run directories whose summary.json could not be read, with the reason."""
    groups: dict[Path, str] = field(default_factory=dict)
    """Run directory -> the sweep's group label, for runs that a sweep launched."""

    def group_of(self, run_dir: Path, record: RunRecord) -> str:
        """The label runs are compared under: the sweep's family label, else the model family."""
        return self.groups.get(run_dir, record.family)

    def problems(self) -> list[str]:
        """One line per run that is listed but skipped."""
        lines = [f"missing summary.json (unfinished?): {d}" for d in self.missing]
        lines += [f"invalid summary.json, skipped: {d}: {why}" for d, why in self.invalid]
        return lines


def find_run_dirs(root: Path) -> list[Path]:
    """Run directories at or below `root`; their own subdirectories are not searched."""
    if (root / SUMMARY_FILE).is_file() or (root / CONFIG_FILE).is_file():
        return [root]
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        found += find_run_dirs(child)
    return found


def load_registry(paths: list[str | Path]) -> Registry:
    """Read every run below `paths`. A path that does not exist is a ValueError."""
    run_dirs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise ValueError(f"not a directory: {path}")
        run_dirs += [d for d in find_run_dirs(path) if d not in run_dirs]
    registry = Registry(records=[], missing=[], invalid=[])
    sweep_cells: dict[Path, dict[str, Any]] = {}
    for run_dir in run_dirs:
        summary = run_dir / SUMMARY_FILE
        if not summary.is_file():
            registry.missing.append(run_dir)
            continue
        try:
            record = RunRecord.from_dict(json.loads(summary.read_text()), str(summary))
        except (ValueError, json.JSONDecodeError) as err:
            registry.invalid.append((run_dir, str(err)))
            continue
        registry.records.append((run_dir, record))
        if run_dir.parent not in sweep_cells:
            sweep_cells[run_dir.parent] = _sweep_cells(run_dir.parent)
        sweep_cell = sweep_cells[run_dir.parent].get(run_dir.name)
        if sweep_cell is not None:
            registry.groups[run_dir] = sweep_cell["group"]
    return registry


def _sweep_cells(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    path = sweep_dir / SWEEP_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())["runs"]
