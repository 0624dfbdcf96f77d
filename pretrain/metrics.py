"""Telemetry of a run: TensorBoard event files under `RUN_DIR/tb/`, one compact console line
per log interval, and a progress bar with ETA. Only rank 0 writes; on other ranks every method
is a no-op, so the training loop calls them unconditionally."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary
from tqdm import tqdm


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def diagnostic_scalars(diagnostics: dict[str, torch.Tensor]) -> dict[str, float]:
    """A model's diagnostics as TensorBoard scalars: 0-d tensors as `model/<key>`, 1-d tensors as
    one tag per recurrent/descent step `model/<key>/step_03`. Keys starting with "_" hold bulky
    per-token data and are skipped."""
    scalars = {}
    for key, value in diagnostics.items():
        if key.startswith("_"):
            continue
        value = value.detach().float().cpu()
        if value.ndim == 0:
            scalars[f"model/{key}"] = value.item()
        elif value.ndim == 1:
            scalars.update({f"model/{key}/step_{i:02d}": v for i, v in enumerate(value.tolist())})
    return scalars


class Metrics:
    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, start_step: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self.start_step = start_step
        self.start_time = time.perf_counter()
        if not enabled:
            return
        # purge_step hides the points an interrupted run logged after the checkpoint we resume
        # from (or all of them when it left no checkpoint)
        self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not sys.stderr.isatty())

    def hparams(self, config: dict, metric_tags: list[str]) -> None:
        """Register the run's hyperparameters (flattened config) with TensorBoard's hparams plugin."""
        if not self.enabled:
            return
        values = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                  for k, v in flatten(config).items()}
        for summary in hparams_summary(values, {tag: math.nan for tag in metric_tags}):
            self.writer.file_writer.add_summary(summary)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.enabled:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            # TensorBoard renders text as Markdown: keep line breaks and spacing as written
            self.writer.add_text(tag, "    " + text.replace("\n", "\n    "), step)

    def eta_s(self, step: int) -> float:
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start_time
        return elapsed / done * (self.total_steps - step) if done > 0 else math.nan

    def console(self, step: int, values: dict[str, float]) -> None:
        """One compact line: step, loss, LR, grad norm, throughput, step time, data wait, ETA."""
        if not self.enabled:
            return
        parts = [f"step {step}/{self.total_steps}"]
        if "train/loss" in values:
            parts.append(f"loss {values['train/loss']:.4f}")
        parts += [f"lr {values['train/lr']:.2e}",
                  f"gnorm {values.get('train/grad_norm', math.nan):.3f}",
                  f"{values['train/tokens_per_s']:,.0f} tok/s",
                  f"{values['train/step_time_s'] * 1e3:.0f} ms/step",
                  f"wait {values['train/data_wait_frac']:.0%}",
                  f"skipped {values['train/skipped_steps']:.0f}",
                  f"eta {format_duration(self.eta_s(step))}"]
        self.print(" | ".join(p for p in parts if p))

    def print(self, line: str) -> None:
        if self.enabled:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()

    def advance(self, steps: int = 1) -> None:
        if self.enabled:
            self.bar.update(steps)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.writer.close()


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
