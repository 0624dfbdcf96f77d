"""A resume that changes the run's length (a finished run rerun with a larger train.max_steps):
one console line with the old and new length and the learning rate before and after, the
schedule's choice (`schedule.on_length_change`: planned afresh, or continuing from where the run
stands, which later resumes reproduce), the change in summary.json, and the scaling fits leaving
such a run out. The schedule's arithmetic is tested as a pure function; the rest on real tiny runs
of the trainer's command line, in this process (see `trainer_runs.train_here`)."""
from __future__ import annotations

import json
import math
from functools import cache

import pytest

import trainer_runs as runs
from pretrain.config import ConfigError, ScheduleSection, load_config
from pretrain.config.validation import validate
from pretrain.scaling.registry import load_registry
from pretrain.scaling.report import collect_points
from pretrain.training.optim import length_change_note, lr_factor
from pretrain.training.summary import LengthChange, RunRecord


@pytest.mark.parametrize("kind", ["cosine", "exponential"])
def test_continue_goes_on_from_where_the_run_stands_to_min_lr_at_the_new_end(kind):
    schedule = ScheduleSection(kind=kind, warmup_steps=10, min_lr=0.01)
    planned = [lr_factor(s, schedule, 1.0, 60) for s in range(60)]
    extended = [LengthChange(step=30, from_steps=60, to_steps=120, schedule="continue")]
    factors = [lr_factor(s, schedule, 1.0, 120, extended) for s in range(130)]
    assert factors[:30] == planned[:30]  # the updates taken before the change keep their LRs
    # no jump at the change: the next update moves no more than the planned schedule's steepest step
    steepest = max(a - b for a, b in zip(planned[10:], planned[11:]))
    assert 0 < factors[29] - factors[30] <= steepest
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert factors[119] == pytest.approx(0.01) and factors[129] == pytest.approx(0.01)  # min_lr at the new end, held

    # recompute (the default) is the schedule planned afresh for 120 steps: a jump back up
    recomputed = [LengthChange(step=30, from_steps=60, to_steps=120, schedule="recompute")]
    assert [lr_factor(s, schedule, 1.0, 120, recomputed) for s in range(30, 120)] == \
        [lr_factor(s, schedule, 1.0, 120) for s in range(30, 120)]
    assert lr_factor(30, schedule, 1.0, 120, recomputed) > factors[29] + steepest

    # a second change continues from the first's schedule; one during the warmup lets it finish
    twice = [*extended, LengthChange(step=90, from_steps=120, to_steps=200, schedule="continue")]
    again = [lr_factor(s, schedule, 1.0, 200, twice) for s in range(200)]
    assert again[:90] == factors[:90] and 0 < again[89] - again[90] <= steepest
    assert again[199] == pytest.approx(0.01)
    early = [LengthChange(step=5, from_steps=60, to_steps=120, schedule="continue")]
    assert [lr_factor(s, schedule, 1.0, 120, early) for s in range(120)] == \
        pytest.approx([lr_factor(s, schedule, 1.0, 120) for s in range(120)])


def test_a_length_change_leaves_a_schedule_that_does_not_depend_on_the_length_as_it_is():
    for schedule in (ScheduleSection(kind="cosine", decay_steps=40, min_lr=0.1), ScheduleSection(kind="constant")):
        for how in ("recompute", "continue"):
            change = [LengthChange(step=30, from_steps=60, to_steps=120, schedule=how)]
            assert [lr_factor(s, schedule, 1.0, 120, change) for s in range(120)] == \
                [lr_factor(s, schedule, 1.0, 60) for s in range(120)]


def test_a_run_shortened_to_a_length_it_has_reached_ends_there():
    schedule = ScheduleSection(kind="cosine", warmup_steps=10, min_lr=0.01)
    note = length_change_note([LengthChange(step=60, from_steps=120, to_steps=50, schedule="recompute")],
                              schedule, lr=1.0)
    assert note == (f"the run's length changes at step 60: 120 -> 50 steps; learning rate "
                    f"{lr_factor(59, schedule, 1.0, 120):.2e} at step 60, where the run now ends; summary.json "
                    "records the change, and the scaling fits leave the run out")


def test_a_bad_on_length_change_is_one_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("data: {path: some/dataset, seq_len: 64, micro_batch_size: 4}\n"
                      "train: {max_steps: 10, global_batch_size: 8}\n")
    with pytest.raises(ConfigError) as err:
        validate(load_config(config, ["schedule.on_length_change=extend"]), world_size=1, has_gpu=False)
    assert str(err.value) == "schedule.on_length_change='extend': must be 'recompute' or 'continue'"


FINISHED = "length-finished"
"""A run of 6 steps with checkpoints at 3 and 6, which the runs below change the length of."""
SIX_STEPS = ["train.max_steps=6", "checkpoint.interval=3", "eval.interval=0", "eval.sample_tokens=0"]


@cache
def finished_run() -> None:
    result = runs.train_here([*SIX_STEPS, f"run_name={FINISHED}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((runs.run_dir(FINISHED) / "summary.json").read_text())["length_changes"] == []


def summary(name: str) -> dict:
    return json.loads((runs.run_dir(name) / "summary.json").read_text())


def test_a_finished_run_rerun_longer_says_so_and_records_it():
    """The issue's case: the finished 6-step run rerun with train.max_steps=10 (the default
    schedule.on_length_change=recompute plans the cosine afresh for 10 steps: the LR jumps from
    min_lr back up), one line saying so, and summary.json recording the change."""
    finished_run()
    before = runs.scalars(FINISHED, "train/lr")
    result = runs.train_here([*SIX_STEPS, "train.max_steps=10", f"run_name={FINISHED}"])
    assert result.returncode == 0, result.stderr[-3000:]
    lrs = runs.scalars(FINISHED, "train/lr")
    assert lrs[6] == before[6] == pytest.approx(3e-4) and lrs[7] == pytest.approx(1.13e-3, rel=1e-2)
    assert ("the run's length changes at step 6: 6 -> 10 steps; learning rate 3.00e-04 at step 6 -> "
            "1.13e-03 at step 7 (the schedule planned afresh for 10 steps; schedule.on_length_change=continue "
            "would go on from where the run stands); summary.json records the change, and the scaling fits "
            "leave the run out") in result.stdout.splitlines()
    record = summary(FINISHED)
    assert record["steps"] == 10
    assert record["length_changes"] == [{"step": 6, "from_steps": 6, "to_steps": 10, "schedule": "recompute"}]


def test_continue_keeps_the_schedule_continuous_and_a_later_resume_exact():
    """The 6-step run extended from its step-3 checkpoint (in its decay) to 9 steps with
    schedule.on_length_change=continue: the LR goes on down from where it stood to min_lr at step
    9. A resume of the extended run from its step-6 checkpoint takes the recorded schedule (with
    on_length_change back at its default), no second change, and logs the same LRs and losses."""
    finished_run()
    extended, resumed = "length-continued", "length-continued-resumed"
    nine_steps = [*SIX_STEPS, "train.max_steps=9"]
    result = runs.train_here([*nine_steps, "schedule.on_length_change=continue", f"run_name={extended}",
                              f"resume={runs.run_dir(FINISHED) / 'ckpt' / 'step_00000003'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    lrs, stood_at = runs.scalars(extended, "train/lr"), runs.scalars(FINISHED, "train/lr")[3]
    # a cosine from the LR at step 3 down to min_lr at step 9
    assert lrs == pytest.approx({s: 3e-4 + (stood_at - 3e-4) * 0.5 * (1 + math.cos(math.pi * (s - 3) / 6))
                                 for s in range(4, 10)})
    assert ("the run's length changes at step 3: 6 -> 9 steps; learning rate 2.60e-03 at step 3 -> 2.45e-03 at "
            "step 4 (schedule.on_length_change=continue: the schedule goes on from where the run stands)"
            ) in result.stdout
    assert summary(extended)["length_changes"] == [{"step": 3, "from_steps": 6, "to_steps": 9, "schedule": "continue"}]

    again = runs.train_here([*nine_steps, f"run_name={resumed}",
                             f"resume={runs.run_dir(extended) / 'ckpt' / 'step_00000006'}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run's length changes" not in again.stdout
    assert runs.scalars(resumed, "train/lr") == {s: lrs[s] for s in range(7, 10)}
    losses = runs.scalars(extended, "train/loss")
    assert runs.scalars(resumed, "train/loss") == {s: losses[s] for s in range(7, 10)}
    assert summary(resumed)["length_changes"] == summary(extended)["length_changes"]


def test_a_reload_after_nonfinite_updates_keeps_the_changed_schedule():
    """A 3-step run extended in place to 6 steps (continuing at min_lr, where it stood), whose
    first two updates after the change are non-finite: it reloads its newest checkpoint, written
    before the change, and keeps the change and its schedule."""
    name = "length-reloaded"
    common = ["checkpoint.interval=3", "eval.interval=0", "eval.sample_tokens=0", f"run_name={name}"]
    first = runs.train_here([*common, "train.max_steps=3"])
    assert first.returncode == 0, first.stderr[-3000:]
    result = runs.train_here([*common, "train.max_steps=6", "schedule.on_length_change=continue",
                              "fault.nan_loss_steps=[4, 5]", "train.max_consecutive_skips=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reloading step_00000003" in result.stdout
    lrs = runs.scalars(name, "train/lr")
    assert [lrs[s] for s in range(3, 7)] == pytest.approx([3e-4] * 4)
    assert summary(name)["length_changes"] == [{"step": 3, "from_steps": 3, "to_steps": 6, "schedule": "continue"}]


def test_the_scaling_fits_leave_a_run_whose_length_changed_out(tmp_path):
    def record(name: str, changes: list[LengthChange]) -> RunRecord:
        return RunRecord(run_name=name, family="gpt", flavor="gpt-tiny", params=2000, non_embedding_params=1000,
                         tokens_seen=10**6, train_flops=6e9, final_train_loss=3.0, best_val_loss=3.1,
                         final_val_loss=3.2, wall_time_s=1.0, hardware="cpu", world_size=1, steps=120,
                         length_changes=changes)

    planned, extended = tmp_path / "planned", tmp_path / "extended"
    for run_dir, changes in ((planned, []), (extended, [LengthChange(60, 60, 120, "recompute")])):
        run_dir.mkdir()
        record(run_dir.name, changes).save(run_dir)
    registry = load_registry([tmp_path])
    assert dict(registry.records)[extended].length_changes == [LengthChange(60, 60, 120, "recompute")]
    groups, skipped = collect_points(registry, "best_val_loss")
    assert [point.run_name for point in groups["gpt"]] == ["planned"]
    assert skipped == [f"length changed on resuming (at step 60: 60 -> 120 steps) in {extended}: not a run "
                       "planned at 120 steps, skipped"]
    # a summary.json from before length changes were recorded reads as a planned run
    data = json.loads((planned / "summary.json").read_text())
    del data["length_changes"]
    assert RunRecord.from_dict(data).length_changes == []
