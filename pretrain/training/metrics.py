"""Telemetry of a run: what a step reports (`StepResult`), throughput accounting (`Throughput`:
tokens/s, TFLOP/s, MFU, data wait, memory), TensorBoard event files under `RUN_DIR/tb/`, one
compact console line per log interval, and a progress bar with ETA. Only rank 0 writes; on
other ranks every `Metrics` method is a no-op, so the training loop calls them unconditionally."""
from __future__ import annotations

import contextlib
import math
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary
from tqdm import tqdm

from common.fileio import write_failure_reason
from pretrain.training.flops import achieved_tflops, mfu
from pretrain.training.summary import TrainState


@dataclass
class StepResult:
    """What one optimizer step reports to the loop."""

    loss: float
    """Mean training loss over every rank's micro-batches (non-finite ones counted as 0)."""
    nonfinite: bool
    """The update was skipped: a loss or the gradient norm was not finite on some rank."""
    spike: bool
    """The update was skipped as a loss or gradient-norm spike (`optim.SpikeGuard`)."""
    lr: float
    """Base learning rate of the step."""
    lrs: dict[str, float]
    """Learning rate per parameter group that differs from the base (name -> LR)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None when the update was skipped)."""
    diagnostics: dict[str, float]
    """The model's diagnostic scalars (filled on log steps, rank 0)."""
    stop: bool
    """Some rank was asked to stop (preemption signal or Ctrl-C): save and exit."""
    time_s: float
    """Wall time of the step."""
    data_wait_s: float
    """Part of `time_s` spent waiting for batches."""
    tokens: int
    """Training tokens of the step, all ranks."""
    rank_times: list[float] = field(default_factory=list)
    """On log steps: every rank's computation time, then every rank's data wait, in seconds, up
    to the step's last backward (its own part of the step: `stragglers`); empty otherwise."""


class Throughput:
    """Step times, tokens and data wait accumulated over the current log interval and over the
    process's session, turned into tokens/s, TFLOP/s, MFU and memory figures."""

    def __init__(self, flops_per_token: float, world_size: int, peak_tflops: float | None, on_gpu: bool):
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak_tflops, self.on_gpu = peak_tflops, on_gpu
        self.session_time_s = 0.0
        self.session_tokens = 0
        self.reset_interval()

    def reset_interval(self) -> None:
        self.steps, self.time_s, self.tokens, self.data_wait_s = 0, 0.0, 0, 0.0

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.time_s += result.time_s
        self.tokens += result.tokens
        self.data_wait_s += result.data_wait_s
        self.session_time_s += result.time_s
        self.session_tokens += result.tokens

    def figures(self) -> dict[str, float]:
        """The current interval's averages as `train/...` scalars (benchmarks read them too)."""
        tokens_per_s = self.tokens / self.time_s
        figures = {"train/tokens_per_s": tokens_per_s,
                   "train/step_time_s": self.time_s / self.steps,
                   "train/data_wait_frac": self.data_wait_s / self.time_s,
                   "train/tflops": achieved_tflops(self.flops_per_token, tokens_per_s),
                   "train/peak_mem_gb": peak_memory_gb(self.on_gpu)}
        if self.peak_tflops:
            figures["train/mfu"] = mfu(self.flops_per_token, tokens_per_s, self.world_size, self.peak_tflops)
        return figures

    def session_tokens_per_s(self) -> float:
        return self.session_tokens / max(self.session_time_s, 1e-9)


def peak_memory_gb(on_gpu: bool) -> float:
    """Peak GPU memory allocated, or on CPU the process's peak resident set."""
    if on_gpu:
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def diagnostic_scalars(diagnostics: dict[str, torch.Tensor], family: str) -> dict[str, float]:
    """A model's diagnostics as TensorBoard scalars: 0-d tensors as `model/<family>/<key>`, 1-d
    tensors as one tag per recurrent/descent step `model/<family>/<key>/step_03`. The family is
    in the tag because the same name means different things (NRGPT's energy is the recurrent
    block's, EBT's the candidate prediction's): runs of several families compared in one
    TensorBoard keep them in separate charts. Keys starting with "_" hold bulky per-token data
    and are skipped."""
    scalars = {}
    for key, value in diagnostics.items():
        if key.startswith("_"):
            continue
        value = value.detach().float().cpu()
        if value.ndim == 0:
            scalars[f"model/{family}/{key}"] = value.item()
        elif value.ndim == 1:
            scalars.update({f"model/{family}/{key}/step_{i:02d}": v for i, v in enumerate(value.tolist())})
    return scalars


def _leave_tensorboard_write_errors_to_metrics() -> None:
    """TensorBoard writes in a thread of its own, which on a failed write (a full disk) keeps the
    error for the writer's next call and also raises it, for Python to print its traceback;
    `Metrics` reports that error in one line when the writer passes it on, so the thread's
    OSErrors are not printed (every other exception of every thread still is)."""
    try:  # a private class of tensorboard's (pinned in requirements.txt)
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another version: its thread's traceback is printed, nothing worse
        return
    previous = threading.excepthook
    if getattr(previous, "leaves_tensorboard_write_errors", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.leaves_tensorboard_write_errors = True
    threading.excepthook = hook


class Metrics:
    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, start_step: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self.start_step = start_step
        self.start_time = time.perf_counter()
        self.tb_dir = run_dir / "tb"
        self.writer: SummaryWriter | None = None
        """TensorBoard's writer; None off rank 0, and once a write failed (`_tensorboard`)."""
        if not enabled:
            return
        _leave_tensorboard_write_errors_to_metrics()
        # purge_step hides the points an interrupted run logged after the checkpoint we resume
        # from (or all of them when it left no checkpoint)
        self._tensorboard(lambda _: setattr(self, "writer", SummaryWriter(str(self.tb_dir), purge_step=start_step + 1)),
                          opening=True)
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not sys.stderr.isatty())

    def _tensorboard(self, write: Callable[[SummaryWriter | None], object], opening: bool = False) -> None:
        """write(writer) while TensorBoard is on. A write that fails (a full disk) turns it off for
        the rest of the session, with one warning, rather than ending the run: only rank 0 writes
        these logs, and a rank that raised would leave the others waiting for it in the next
        collective. The run goes on; its checkpoints hold its state, and a save that does not fit
        either stops the run on every rank alike."""
        if self.writer is None and not opening:
            return
        try:
            write(self.writer)
        except OSError as e:
            writer, self.writer = self.writer, None
            if writer is not None:
                with contextlib.suppress(OSError):  # it flushes what failed to write, and fails again
                    writer.close()
            print(f"warning: TensorBoard logs not written to {self.tb_dir} ({write_failure_reason(e, self.tb_dir)}); "
                  "training goes on without them until the run is restarted", file=sys.stderr, flush=True)

    def hparams(self, config: dict, metric_tags: list[str]) -> None:
        """Register the run's hyperparameters (flattened config) with TensorBoard's hparams plugin."""
        values = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                  for k, v in flatten(config).items()}

        def write(writer: SummaryWriter) -> None:
            for summary in hparams_summary(values, {tag: math.nan for tag in metric_tags}):
                writer.file_writer.add_summary(summary)

        self._tensorboard(write)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        def write(writer: SummaryWriter) -> None:
            for tag, value in values.items():
                writer.add_scalar(tag, value, step)

        self._tensorboard(write)

    def text(self, step: int, tag: str, text: str) -> None:
        # TensorBoard renders text as Markdown: keep line breaks and spacing as written
        self._tensorboard(lambda writer: writer.add_text(tag, "    " + text.replace("\n", "\n    "), step))

    def eta_s(self, step: int) -> float:
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start_time
        return elapsed / done * (self.total_steps - step) if done > 0 else math.nan

    def log_step(self, step: int, result: StepResult, throughput: Throughput, state: TrainState) -> None:
        """TensorBoard scalars and the console line of the step just taken; throughput figures
        are averages over the steps since the previous log point (whose interval this ends)."""
        values = {"train/lr": result.lr, **{"train/lr/" + name: lr for name, lr in result.lrs.items()}}
        if not result.nonfinite:
            values["train/loss"] = result.loss
        if result.grad_norm is not None:
            values["train/grad_norm"] = result.grad_norm
        values.update({"train/tokens_seen": state.tokens_seen, **throughput.figures(),
                       "train/skipped_steps": state.skipped_steps, "train/spike_skips": state.spike_skips,
                       **result.diagnostics})
        throughput.reset_interval()
        self.scalars(step, values)
        self.console(step, values)

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
                  skipped_updates(values['train/skipped_steps'], values['train/spike_skips']),
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
            self._tensorboard(lambda writer: writer.close())
            self.writer = None


def skipped_updates(nonfinite: float, spikes: float) -> str:
    """The console's count of skipped updates, by cause (summary.json and TensorBoard keep the two
    counts apart: `skipped_steps` are the non-finite ones)."""
    return f"skipped {nonfinite + spikes:.0f} (non-finite {nonfinite:.0f}, spikes {spikes:.0f})"


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def append_to_tensorboard(tb_dir: Path, step: int, scalars: dict[str, float],
                          images: dict[str, Path] | None = None) -> None:
    """Add scalars and PNG figures (tag -> file) at `step` to the TensorBoard logs in `tb_dir`,
    beside what is there: a run's results measured after training (downstream tasks, dynamics)."""
    import matplotlib.image

    with SummaryWriter(str(tb_dir)) as writer:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        for tag, path in (images or {}).items():
            writer.add_image(tag, matplotlib.image.imread(path)[..., :3], step, dataformats="HWC")


def pyplot():
    """matplotlib.pyplot on the file-only backend (no display needed), for the figures of
    `pretrain.dynamics` and the scaling reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
