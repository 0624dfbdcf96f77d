"""`summary.json`: what a finished run reports about itself, written by the trainer and read by
the scaling code (and anything else that compares runs)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.fileio import atomic_write_text

SUMMARY_FILE = "summary.json"


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
        return atomic_write_text(Path(run_dir) / SUMMARY_FILE,
                                 json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


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
