"""A run's record of itself: its progress while it trains (`TrainState`, in every checkpoint) and,
once finished, `summary.json` (`RunRecord`), written by the trainer and read by the scaling code
(and anything else that compares runs)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from common.fileio import atomic_write_text
from pretrain.config import LengthChangeSchedule
from pretrain.config.typed import read_typed

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class LengthChange:
    """A resume that changed the run's length (`train.max_steps` or `train.max_tokens`, or the
    global batch under a token budget): the run was not planned at the length it ends with."""

    step: int
    """Optimizer steps taken when the length changed."""
    from_steps: int
    """The run's length before, in optimizer steps."""
    to_steps: int
    """Its length after."""
    schedule: LengthChangeSchedule
    """How the learning rate went on (`schedule.on_length_change` at that resume): "recompute"
    (the schedule planned afresh for `to_steps`) or "continue" (a decay from the learning rate
    the run stood at to `schedule.min_lr` at `to_steps`)."""

    def describe(self) -> str:
        return f"at step {self.step}: {self.from_steps} -> {self.to_steps} steps"


@dataclass
class TrainState:
    """Progress of a run, saved in every checkpoint's client state (the data position is the
    loader's own state, saved next to it)."""

    step: int = 0
    """Optimizer steps taken (skipped ones included: their data was consumed)."""
    tokens_seen: int = 0
    """Training tokens consumed by all ranks."""
    skipped_steps: int = 0
    """Updates skipped because a loss or the gradient norm was not finite."""
    reloads: int = 0
    """Reloads of the last good checkpoint after repeated non-finite updates."""
    spike_skips: int = 0
    """Updates skipped as loss or gradient-norm spikes (`train.skip_spikes`)."""
    recent_losses: list[float] = field(default_factory=list)
    """Losses of the latest updates (up to `train.spike_window`): the spike statistics."""
    recent_grad_norms: list[float] = field(default_factory=list)
    """Their gradient norms before clipping."""
    last_train_loss: float | None = None
    """Mean training loss of the latest applied step."""
    last_val_loss: float | None = None
    """Validation loss of the latest evaluation."""
    best_val_loss: float | None = None
    """Lowest validation loss so far."""
    think_losses: list[float] | None = None
    """EBT: val loss after 1..N inference steps at the latest evaluation."""
    dynamics: dict[str, float] | None = None
    """`eval.dynamics`: the descent's scalars at the latest evaluation."""
    wall_time_s: float = 0.0
    """Seconds spent in this run up to the latest checkpoint, summed over resumed segments."""
    total_steps: int | None = None
    """The run's length in optimizer steps that its learning-rate schedule plans for (None in
    checkpoints from before it was recorded): a resume to another length is a `LengthChange`."""
    length_changes: list[LengthChange] = field(default_factory=list)
    """The resumes that changed the run's length, in order; the schedule is a function of the
    step and of these (`optim.lr_factor`), so that every later resume takes the same LRs."""

    def record_eval(self, val_loss: float, think_losses: list[float] | None,
                    dynamics: dict[str, float] | None = None) -> None:
        self.last_val_loss = val_loss
        self.best_val_loss = val_loss if self.best_val_loss is None else min(self.best_val_loss, val_loss)
        self.think_losses, self.dynamics = think_losses, dynamics

    @classmethod
    def from_saved(cls, saved: dict) -> TrainState:
        """The state as a checkpoint holds it (keys of older versions that are gone ignored)."""
        names = {f.name for f in fields(cls)}
        state = cls(**{k: v for k, v in saved.items() if k in names})
        state.length_changes = [LengthChange(**change) for change in state.length_changes]
        return state


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
    length_changes: list[LengthChange] = field(default_factory=list)
    """Resumes that changed the run's length: empty for a run planned at the length it ran."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Any further keys of summary.json, kept as read (e.g. the EBT thinking curve)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "summary") -> RunRecord:
        """Validate and convert a parsed summary; a missing key or wrong type is a ValueError
        naming the key and `source`; keys beyond the fields go into `extra` as read."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        record = read_typed(cls, {k: v for k, v in data.items() if k in known}, lambda key: source)
        return dataclasses.replace(record, extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(data.pop("extra"))
        return data

    def save(self, run_dir: str | Path) -> Path:
        """Write `run_dir/summary.json` atomically (a reader never sees half a file)."""
        return atomic_write_text(Path(run_dir) / SUMMARY_FILE,
                                 json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
