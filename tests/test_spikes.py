"""The spike guard's rule (`optim.SpikeGuard`) and its veto without ZeRO; the run under ZeRO-2
on 2 processes, with exact resume, is in test_train.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import trainer_runs as runs
from pretrain.config import TrainSection
from pretrain.models import FAMILIES
from pretrain.training.optim import SpikeGuard
from pretrain.training.summary import TrainState


def judged(guard: SpikeGuard, state: TrainState, loss: float, grad_norm: float) -> bool:
    guard.arm(state, loss)
    guard.veto(grad_norm)
    return guard.settle()


def history() -> TrainState:
    """Four updates: losses with mean 1.0, gradient norms with mean 2.0, both of standard
    deviation 0.163, so that 3 of them above the mean is 1.49 and 2.49."""
    return TrainState(recent_losses=[1.0, 1.2, 0.8, 1.0], recent_grad_norms=[2.0, 2.2, 1.8, 2.0])


def test_a_spike_is_sigmas_above_the_rolling_mean_of_loss_or_gradient_norm():
    guard, state = SpikeGuard(window=4, sigmas=3.0), TrainState()
    for loss, norm in zip(history().recent_losses, history().recent_grad_norms):
        assert not judged(guard, state, 100 * loss, 100 * norm)  # fewer than 4 before each: not judged
    assert state.recent_losses == [100.0, 120.0, 80.0, 100.0] and state.spike_skips == 0
    assert not judged(guard, history(), 1.45, 2.0) and not judged(guard, history(), 1.0, 2.45)
    assert not judged(guard, history(), 0.1, 0.1)  # far below is no spike
    state = history()
    assert judged(guard, state, 1.55, 2.0) and state.spike_skips == 1  # the loss alone
    assert state.recent_losses == [1.2, 0.8, 1.0, 1.55] and state.recent_grad_norms == [2.2, 1.8, 2.0, 2.0]
    state = history()
    assert judged(guard, state, 1.0, 2.55) and state.spike_skips == 1  # the gradient norm alone


def test_the_verdict_is_the_updates_and_an_unjudged_update_is_not_recorded():
    """ZeRO steps its inner optimizer once per parameter group; an update that is never judged
    (non-finite, skipped before the guard is asked, or a guard that is off) leaves no trace."""
    guard, state = SpikeGuard(window=2, sigmas=1.0), TrainState(recent_losses=[1.0, 1.1], recent_grad_norms=[1.0, 1.1])
    guard.arm(state, 5.0)
    assert guard.veto(1.0) and guard.veto(1.0)  # asked twice in one update: one verdict
    assert guard.settle() and state.spike_skips == 1
    guard.arm(state, 1.0)
    assert not guard.settle() and state.recent_losses == [1.1, 5.0] and state.spike_skips == 1


@pytest.mark.parametrize("skip_spikes, family, on", [("auto", "nrgpt", True), ("auto", "gpt", False),
                                                     ("on", "ebt", True), ("off", "nrgpt", False)])
def test_the_guard_is_on_by_default_for_nrgpt(skip_spikes, family, on):
    assert SpikeGuard.for_run(TrainSection(skip_spikes=skip_spikes), FAMILIES[family]).on == on


def test_without_zero_the_guarded_adamw_vetoes_the_spike(tmp_path):
    """ZeRO stage 0 on one process: the trainer's own AdamW asks the guard (GPT: on by request)."""
    name = "spike-stage0"
    result = runs.train_here(["model.flavor=gpt-tiny", "zero.stage=0", f"run_name={name}", "train.skip_spikes=on",
                              "train.spike_window=4", "fault.spike_loss_steps=[7]", "checkpoint.interval=1",
                              "checkpoint.keep=20"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 7: loss " in result.stdout and ": a spike, update skipped on all ranks" in result.stdout
    summary = json.loads((runs.run_dir(name) / "summary.json").read_text())
    assert summary["spike_skips"] == 1 and summary["skipped_steps"] == 0
    # the console's step lines after it count the skipped update by its cause
    last_step_line = [line for line in result.stdout.splitlines() if line.startswith("step ") and " | " in line][-1]
    assert "| skipped 1 (non-finite 0, spikes 1) |" in last_step_line, last_step_line
    before, after, later = (weights(runs.run_dir(name) / "ckpt" / f"step_{step:08d}") for step in (6, 7, 8))
    assert all(torch.equal(before[k], after[k]) for k in before), "the spike was applied"
    assert not all(torch.equal(after[k], later[k]) for k in after), "the next update was not applied"


def weights(tag: Path) -> dict[str, torch.Tensor]:
    return torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
