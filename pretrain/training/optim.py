"""Optimizer parameter groups and learning-rate schedules.

Groups: parameters with weight decay (`decay`), without (`no_decay`: what the decay set
`optimizer.decay` exempts, see `config.DECAY_SETS`), and one group per learning-rate multiplier (the
model's `lr_multipliers()` such as EBT's alpha, and `optimizer.lr_multipliers` patterns).

The schedule is a pure function of the optimizer step, applied by the training loop before
every step; it has no state beyond the step count and the resumes that changed the run's length,
which checkpoints hold."""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from pretrain.config import DECAY_SETS, ConfigError, OptimizerSection, ScheduleSection, TrainSection, ZeroSection
from pretrain.models import FamilySpec
from pretrain.training.summary import LengthChange, TrainState


def undecayed_names(model: nn.Module, decay_set: str) -> set[str]:
    """Names of the parameters `decay_set` (a key of DECAY_SETS) trains without weight decay."""
    exempt = model.never_decayed_names()
    if decay_set == "matrices":
        return exempt | model.no_weight_decay_names()
    if decay_set == "nanogpt":
        return exempt | {name for name, p in model.named_parameters() if p.ndim < 2}
    if decay_set == "all":
        return exempt
    raise ValueError(f"unknown decay set {decay_set!r}: one of {', '.join(DECAY_SETS)}")


@dataclass
class GroupInfo:
    name: str
    """Label of the group (TensorBoard tag `train/lr/<name>`)."""
    lr_mult: float
    """Factor on the scheduled learning rate."""


def param_groups(model: nn.Module, opt: OptimizerSection) -> tuple[list[dict], list[GroupInfo]]:
    """Torch optimizer groups (`params`, `weight_decay`, `lr`) and their names/multipliers, in
    the same order. A multiplier group holding both decayed and undecayed parameters is split."""
    no_decay = undecayed_names(model, opt.decay)
    source = {name: (name, mult) for name, mult in model.lr_multipliers().items()}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for pattern, mult in opt.lr_multipliers.items():
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise ConfigError(f"optimizer.lr_multipliers: pattern {pattern!r} matches no parameter")
        source.update({name: (pattern, mult) for name in matched})

    buckets: dict[tuple[str | None, bool], list[nn.Parameter]] = {}
    multipliers: dict[str | None, float] = {None: 1.0}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        label, mult = source.get(name, (None, 1.0))
        multipliers[label] = mult
        buckets.setdefault((label, name not in no_decay), []).append(p)

    groups, infos = [], []
    for (label, decay), params in buckets.items():
        if label is None:
            group_name = "decay" if decay else "no_decay"
        elif (label, not decay) in buckets:
            group_name = f"{label}/{'decay' if decay else 'no_decay'}"
        else:
            group_name = label
        mult = multipliers[label]
        groups.append({"params": params, "weight_decay": opt.weight_decay if decay else 0.0,
                       "lr": opt.lr * mult})
        infos.append(GroupInfo(group_name, mult))
    return groups, infos


class SpikeGuard:
    """Skips an update whose loss or gradient norm before clipping is a spike: more than
    `sigmas` standard deviations above the mean of the last `window` updates' (OLMo-core's rule
    for its skip-step optimizers). Every judged update joins the statistics, skipped or not, so
    that a lasting change of level stops counting as a spike after a while. The statistics live
    in the run's `TrainState`, which checkpoints hold: a resumed run judges as the uninterrupted
    one would.

    The trainer `arm`s the guard with the update's loss (the mean over ranks) before the
    optimizer step, the step asks `veto` once the gradient norm is known and before anything is
    applied (ZeRO asks once per parameter group: the verdict is the update's), and `settle`
    records the update. A non-finite update, which the optimizers skip before asking, is neither
    judged nor recorded; nor is any update of a guard that is off (never `install`ed)."""

    def __init__(self, window: int, sigmas: float, on: bool = True):
        self.window, self.sigmas, self.on = window, sigmas, on
        self.state, self.loss, self.grad_norm, self.verdict = TrainState(), math.nan, math.nan, None

    @classmethod
    def for_run(cls, train: TrainSection, family: FamilySpec) -> SpikeGuard:
        on = train.skip_spikes == "on" or (train.skip_spikes == "auto" and family.skips_spikes)
        return cls(train.spike_window, train.spike_sigmas, on)

    def install(self, engine) -> None:
        """Give the guard its say over each update of the DeepSpeed `engine` (when it is on),
        between the gradient norm and the update: the ZeRO optimizers compute the global norm
        before clipping, then step their inner optimizer (torch's AdamW, or DeepSpeed's CPU
        Adam), which is skipped on a veto; without ZeRO, `GuardedAdamW` asks itself."""
        if not self.on:
            return
        wrapper = engine.optimizer
        inner = getattr(wrapper, "optimizer", wrapper)
        if isinstance(inner, GuardedAdamW):
            inner.guard = self
            return
        apply_update = inner.step

        def step(*args, **kwargs):
            return None if self.veto(float(wrapper._global_grad_norm)) else apply_update(*args, **kwargs)
        inner.step = step

    def arm(self, state: TrainState, loss: float) -> None:
        self.state, self.loss, self.verdict = state, loss, None

    def spike(self, history: list[float], value: float) -> bool:
        if len(history) < self.window:
            return False
        mean = sum(history) / len(history)
        std = math.sqrt(sum((x - mean) ** 2 for x in history) / (len(history) - 1))
        return value > mean + self.sigmas * std

    def veto(self, grad_norm: float) -> bool:
        if self.verdict is None:
            self.grad_norm = grad_norm
            self.verdict = (self.spike(self.state.recent_losses, self.loss)
                            or self.spike(self.state.recent_grad_norms, grad_norm))
        return self.verdict

    def settle(self) -> bool:
        """Record the armed update (if it was judged); whether it was skipped as a spike."""
        if self.verdict is None:
            return False
        state = self.state
        for history, value in ((state.recent_losses, self.loss), (state.recent_grad_norms, self.grad_norm)):
            history.append(value)
            del history[:-self.window]
        state.spike_skips += self.verdict
        return self.verdict


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that clips the global gradient norm itself and skips its update when that norm is
    not finite, for training without ZeRO: DeepSpeed then applies whatever gradients it has,
    while the ZeRO optimizers clip and skip on their own. It reports like them (`overflow`,
    `_global_grad_norm`, read by the DeepSpeed engine). The gradients are all-reduced before the
    step, so every rank takes the same decision."""

    def __init__(self, groups: list[dict], max_grad_norm: float, **kwargs):
        super().__init__(groups, **kwargs)
        self.max_grad_norm = max_grad_norm
        self.overflow = False
        self._global_grad_norm = None
        self.guard: SpikeGuard | None = None
        """Set by `SpikeGuard.install`."""

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        self._global_grad_norm = norm.item()
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow or (self.guard is not None and self.guard.veto(self._global_grad_norm)):
            return None
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        return super().step(closure)


def build_optimizer(groups: list[dict], opt: OptimizerSection, zero: ZeroSection,
                    on_gpu: bool) -> torch.optim.Optimizer:
    """AdamW: DeepSpeed's CPU Adam when the optimizer step is offloaded to the CPU (DeepSpeed
    refuses other optimizers with ZeRO-Offload), the guarded AdamW without ZeRO (stage 0),
    torch's AdamW under the ZeRO optimizers, which step it on their flat fp32 partitions.
    torch's AdamW uses its fused kernel when `optimizer.fused` says so (default: on GPU)."""
    kwargs = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    if zero.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    kwargs["fused"] = on_gpu if opt.fused is None else opt.fused
    if zero.stage == 0:
        return GuardedAdamW(groups, max_grad_norm=opt.grad_clip, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_factor(step: int, schedule: ScheduleSection, lr: float, total_steps: int,
              length_changes: Sequence[LengthChange] = ()) -> float:
    """Learning rate of optimizer step `step` (0-based) relative to the peak `lr`: linear warmup
    over the first `warmup_steps` updates, then the decay, which reaches `min_lr` at update
    `decay_steps` (default: the last one) and holds it.

    `total_steps` is the run's length now; `length_changes` the resumes that changed it
    (`TrainState.length_changes`, in order). An update before the first change follows the
    schedule planned for the length the run had then; one after a change follows what that
    change recorded: "recompute", the schedule planned for the new length; "continue", a decay
    of the same kind from the factor of the change's last update (or of the warmup's end) to
    `min_lr` at the new end. With `decay_steps`, the length does not enter the schedule, so a
    change leaves it as it is."""
    update = step + 1
    if update <= schedule.warmup_steps:
        return update / schedule.warmup_steps
    floor = schedule.min_lr / lr
    changes = list(length_changes)
    while changes and changes[-1].step >= update:  # made after this update: it ran under the length before
        total_steps = changes.pop().from_steps
    latest = changes[-1] if changes else None
    # the schedule planned for a length (with `decay_steps`, whatever the length)
    if latest is None or latest.schedule == "recompute" or schedule.decay_steps:
        end = schedule.decay_steps or total_steps
        progress = min(1.0, (update - schedule.warmup_steps) / max(1, end - schedule.warmup_steps))
        return _decayed(1.0, floor, progress, schedule.kind)
    # a change during the warmup lets it finish (the warmup does not depend on the length)
    start = max(latest.step, schedule.warmup_steps)
    start_factor = lr_factor(start - 1, schedule, lr, latest.from_steps, changes[:-1])
    progress = min(1.0, (update - start) / max(1, latest.to_steps - start))
    return _decayed(start_factor, floor, progress, schedule.kind)


def _decayed(start: float, floor: float, progress: float, kind: str) -> float:
    """The factor `progress` (0 to 1) of the way through a decay of `kind` from `start` to `floor`."""
    if kind == "cosine":
        return floor + (start - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "exponential":
        return start * (floor / start) ** progress
    return start


def length_change_note(length_changes: Sequence[LengthChange], schedule: ScheduleSection, lr: float) -> str:
    """The console line of the resume that made the last of `length_changes`: the run's length
    before and after, and its learning rate at the last update taken and at the next one."""
    *earlier, change = length_changes
    step, end = change.step, change.to_steps
    before = lr * lr_factor(step - 1, schedule, lr, change.from_steps, earlier)
    line = f"the run's length changes {change.describe()}; learning rate {before:.2e} at step {step}"
    if end <= step:
        line += ", where the run now ends"
    else:
        after = lr * lr_factor(step, schedule, lr, end, length_changes)
        how = ("schedule.on_length_change=continue: the schedule goes on from where the run stands"
               if change.schedule == "continue" else
               f"the schedule planned afresh for {end} steps; schedule.on_length_change=continue would go "
               "on from where the run stands")
        line += f" -> {after:.2e} at step {step + 1} ({how})"
    return line + "; summary.json records the change, and the scaling fits leave the run out"


def set_lr(optimizer: torch.optim.Optimizer, infos: list[GroupInfo], lr: float) -> dict[str, float]:
    """Set every group's learning rate to `lr` x its multiplier; returns name -> LR."""
    for group, info in zip(optimizer.param_groups, infos, strict=True):
        group["lr"] = lr * info.lr_mult
    return {info.name: lr * info.lr_mult for info in infos}
