"""The host syncs of one optimizer step: the calls that make the host wait for the device (a
value read back, a host-built tensor copied over), counted in a real training step of EBT's S2
recipe (random step counts, replay store, ZeRO-2, spike guard on), against the list that
docs/design.md explains ("One optimizer step, one sync"). A new sync fails this test.

On the CPU every tensor is on the host, so the calls are counted where they would wait on a GPU:
by the Python methods that read a tensor's value (`item`, `tolist`, `bool()`, `float()`, ...),
`nonzero` (its size is data), and tensors built from host data with a `device` (a copy the host
waits for). Syncs inside a kernel's C++ code (boolean-mask indexing, say) are not seen here."""
from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch

import trainer_runs as runs
from pretrain.training.trainer import Trainer

READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__", "__index__")
"""Tensor methods that return a tensor's value (or a size that depends on it) to the host."""

EXPECTED = {
    # the trainer's per-step decisions: the step's loss, non-finite count and stop flag, all-reduced
    ("tolist", "pretrain/training/trainer.py", "train_step"): 1,
    # the step's gradient norm for its record (DeepSpeed has just waited for it)
    ("__float__", "pretrain/training/trainer.py", "train_step"): 1,
    # the spike guard's verdict, once the norm is known and before the update: ZeRO asks once per
    # parameter group (here 1: optimizer.decay=all leaves S2's fixed alpha a buffer)
    ("__float__", "pretrain/training/optim.py", "step"): 1,
    # DeepSpeed's ZeRO-2: the gradient norm (per group) checked for inf/NaN, for the overflow skip and clipping
    ("__bool__", "deepspeed/runtime/utils.py", "is_invalid_grad_norm"): 2,
    ("tensor", "deepspeed/runtime/utils.py", "mask_nan_or_inf_with_val_inplace"): 1,
    # CPU only: unfused AdamW reads its step counter, a host tensor (fused AdamW, the GPU default, does not)
    ("item", "torch/optim/optimizer.py", "_get_value"): 1,
}
"""(call, file, function) -> calls in one optimizer step of `S2_RUN` (4 micro-steps)."""

S2_RUN = ["model.flavor=ebt-s2-tiny", "model.overrides.replay_top_k=8", "optimizer.decay=all", "zero.stage=2",
          "train.skip_spikes=on", "train.max_steps=3", "train.log_interval=100", "run_name=host-syncs"]
"""On the test config in one process: 2 sequences per micro-batch, 4 micro-steps per step."""


def call_site() -> tuple[str, str]:
    """(file, function) of the caller of a patched call: repository-relative, after
    site-packages for installed packages, else as it is."""
    frame = traceback.extract_stack(limit=3)[0]
    path = Path(frame.filename)
    if "site-packages" in path.parts:
        return "/".join(path.parts[path.parts.index("site-packages") + 1:]), frame.name
    return (path.relative_to(runs.REPO).as_posix() if path.is_relative_to(runs.REPO) else str(path)), frame.name


def count_syncs(monkeypatch, counts: collections.Counter) -> list:
    """Patch the calls that sync so that each adds its call site to `counts` while the returned
    list is not empty."""
    counting = []

    def counted(name, original, only_with_device=False):
        def call(*args, **kwargs):
            if counting and (not only_with_device or kwargs.get("device") is not None):
                counts[(name, *call_site())] += 1
            return original(*args, **kwargs)
        return call

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", counted("nonzero", torch.nonzero))
    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, counted(name, getattr(torch, name), only_with_device=True))
    return counting


def test_one_training_step_makes_only_the_listed_host_syncs(monkeypatch):
    counts = collections.Counter()
    counting = count_syncs(monkeypatch, counts)
    train_step = Trainer.train_step

    def step_two_counted(self, log_now):
        # step 2: the replay store has rows to replay (stored in step 1), and it is not a log step
        if self.state.step == 1:
            counting.append(True)
        try:
            return train_step(self, log_now)
        finally:
            counting.clear()

    monkeypatch.setattr(Trainer, "train_step", step_two_counted)
    result = runs.train_here(S2_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert dict(counts) == EXPECTED, "\n".join(
        f"{site}: {counts.get(site, 0)} calls, listed {EXPECTED.get(site, 0)}"
        for site in sorted(counts.keys() | EXPECTED.keys()) if counts.get(site, 0) != EXPECTED.get(site, 0))
