"""The run registry: one `summary.json` record per finished run, found by walking directories.

A directory is a run directory when it holds `summary.json` (finished) or `config.yaml`
(started: the trainer writes the resolved config first). Started runs without a summary are
reported as missing, never silently dropped, and unreadable summaries are reported as invalid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.fileio import read_json
from pretrain.training.summary import SUMMARY_FILE, RunRecord

CONFIG_FILE = "config.yaml"
SWEEP_FILE = "sweep.json"
"""Written by a sweep next to its run directories: run name -> the sweep cell it belongs to."""


@dataclass
class Registry:
    """The runs found under some directories."""

    records: list[tuple[Path, RunRecord]]
    """(run directory, record) of every finished run, sorted by directory."""
    missing: list[Path]
    """Run directories without summary.json (unfinished, crashed or still running)."""
    invalid: list[tuple[Path, str]]
    """Run directories whose summary.json could not be read, with the reason."""
    cells: dict[Path, dict[str, Any]] = field(default_factory=dict)
    """Run directory -> its entry in the sweep's `sweep.json` (group, size, budget, cell, axis
    values, compute budget), for runs that a sweep launched."""

    def group_of(self, run_dir: Path, record: RunRecord) -> str:
        """The label runs are compared under: the sweep's family label, else the model family."""
        return self.cells.get(run_dir, {}).get("group", record.family)

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
            record = RunRecord.from_dict(read_json(summary), str(summary))
        except ValueError as err:
            registry.invalid.append((run_dir, str(err)))
            continue
        registry.records.append((run_dir, record))
        if run_dir.parent not in sweep_cells:
            sweep_cells[run_dir.parent] = _sweep_cells(run_dir.parent)
        sweep_cell = sweep_cells[run_dir.parent].get(run_dir.name)
        if sweep_cell is not None:
            registry.cells[run_dir] = sweep_cell
    return registry


def _sweep_cells(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    path = sweep_dir / SWEEP_FILE
    if not path.is_file():
        return {}
    return read_json(path)["runs"]
