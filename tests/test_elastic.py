"""Resuming on another world size, ZeRO stage or global batch, on one CPU machine (gloo,
loopback, at most 2 processes).

One chain of real runs, every run compared with the uninterrupted 2-process ZeRO-2 run `ref`:

    ref      2 processes, ZeRO-2, steps 1-32 (checkpoints every 8 steps)
    zero3    2 processes, ZeRO-3, from ref's step 8       ZeRO stage 2 -> 3
    to1      1 process,   ZeRO-2, from zero3's step 16    world 2 -> 1 and ZeRO 3 -> 2, a micro-batch
                                                          of at most 3 (the trainer takes 2)
    to2      2 processes, ZeRO-2, from to1's step 24      world 1 -> 2
    batch4   2 processes, global batch 4, from ref's step 8

The runs of one launch share their processes (tests/elastic_worker.py, which also records the
windows each run trained on); a launch per world size makes three. Two nodes preempted through
their torchrun agents are tests/test_cluster.py's, on real namespace nodes.

What "the same loss" means after a change of world size or ZeRO stage: the first resumed step
sees the same weights, optimizer state and sample set as the uninterrupted run, but its
micro-batches group the samples differently and the gradients are summed in another order, so
the loss may differ in the last float32 bits, and such differences then propagate: within
1e-6 (relative) at the first step, 1e-5 over the rest. A lost or wrongly mapped optimizer
state moves the loss by more than 1e-4 within two steps.
"""
from __future__ import annotations

import collections
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import trainer_runs as runs

N_STEPS, INTERVAL = 32, 8
SETTINGS = [f"train.max_steps={N_STEPS}", f"checkpoint.interval={INTERVAL}", "model.flavor=gpt-tiny"]
"""Every run of this file (the base config is trainer_runs': 2 x 2 ranks x 2 = 8 sequences)."""
WORKER = Path(__file__).resolve().parent / "elastic_worker.py"
RESUMED = {"zero3": ("ref", INTERVAL), "to1": ("zero3", 2 * INTERVAL), "to2": ("to1", 3 * INTERVAL)}
"""Resumed run -> (the run and step it starts from)."""


def resume_from(name: str, step: int) -> str:
    return f"resume={runs.run_dir(name)}/ckpt/step_{step:08d}"


@dataclass
class Chain:
    output: str
    """stdout and stderr of all launches."""
    records: dict[str, list[dict]]
    """run -> what each rank's worker recorded (exit code, ConfigError, windows)."""

    def windows(self, name: str, steps=None) -> dict[int, list[tuple]]:
        """step -> sorted windows the run trained on in that step (all ranks)."""
        by_step = collections.defaultdict(list)
        for record in self.records[name]:
            for step, window in record["windows"]:
                if steps is None or step in steps:
                    by_step[step].append(tuple(window))
        return {step: sorted(windows) for step, windows in by_step.items()}


def launch(nproc: int, plan: list[tuple[str, list[str]]]) -> str:
    plan_file = runs.workspace() / f"elastic-plan-{plan[0][0]}.json"
    plan_file.write_text(json.dumps({"config": str(runs.base_config_file()), "runs": [
        {"overrides": [*SETTINGS, f"run_name={name}", *extra], "record": str(record_path(name))}
        for name, extra in plan]}))
    script = [str(WORKER), str(plan_file)]
    command = runs.torchrun_command(script, nproc) if nproc > 1 else [runs.PYTHON, *script]
    result = subprocess.run(command, env=runs.child_env(), cwd=runs.REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout + result.stderr


def record_path(name: str) -> Path:
    return runs.workspace() / f"elastic-record-{name}"


@pytest.fixture(scope="module")
def elastic() -> Chain:
    output = launch(2, [("ref", []),
                        ("zero3", ["zero.stage=3", resume_from(*RESUMED["zero3"])]),
                        ("batch4", ["train.global_batch_size=4", resume_from("ref", INTERVAL)]),
                        ("zero0", ["zero.stage=0", resume_from("ref", INTERVAL)])])
    output += launch(1, [("to1", [resume_from(*RESUMED["to1"]), "data.micro_batch_size=3"])])
    output += launch(2, [("to2", [resume_from(*RESUMED["to2"])])])
    records = {}
    for name in ("ref", "zero3", "batch4", "zero0", "to1", "to2"):
        files = sorted(runs.workspace().glob(f"{record_path(name).name}.rank*.json"))
        records[name] = [json.loads(f.read_text()) for f in files]
    return Chain(output, records)


def test_samples_continue_across_world_size_and_stage_changes(elastic):
    """Each step of the resumed runs trains on exactly the windows the uninterrupted run used
    in that step, so the run stitched from ref, zero3, to1 and to2 consumed the same set, with
    no window twice."""
    reference = elastic.windows("ref")
    assert sorted(reference) == list(range(1, N_STEPS + 1))
    assert all(len(windows) == 8 for windows in reference.values())
    stitched = elastic.windows("ref", range(1, INTERVAL + 1))
    for name, (_, start) in RESUMED.items():
        resumed = elastic.windows(name)
        assert sorted(resumed) == list(range(start + 1, N_STEPS + 1)), name
        for step, windows in resumed.items():
            assert windows == reference[step], f"{name}, step {step}: other windows than ref's"
        stitched.update(elastic.windows(name, range(start + 1, start + INTERVAL + 1)))
    everything = [w for step in sorted(stitched) for w in stitched[step]]
    assert sorted(stitched) == list(range(1, N_STEPS + 1))
    assert len(set(everything)) == len(everything) == 8 * N_STEPS, "a window was trained on twice"
    assert sorted(everything) == sorted(w for windows in reference.values() for w in windows)


def test_the_micro_batch_adapts_to_the_world_size_and_the_global_batch_stays(elastic):
    assert "global batch 8 = micro-batch 2 x 2 process(es) x 2 accumulation step(s)\n" in elastic.output
    assert ("global batch 8 = micro-batch 2 x 1 process(es) x 4 accumulation step(s) "
            "(data.micro_batch_size=3 is the most; 8 sequences per process split evenly into "
            "micro-batches of 2)\n") in elastic.output


def test_training_continues_from_the_same_loss(elastic):
    reference = runs.scalars("ref", "train/loss")
    assert reference[N_STEPS] < reference[1] - 0.3  # the runs learn
    for name, (_, start) in RESUMED.items():
        losses = runs.scalars(name, "train/loss")
        assert sorted(losses) == list(range(start + 1, N_STEPS + 1))
        first = start + 1
        assert losses[first] == pytest.approx(reference[first], rel=1e-6), name
        for step in losses:
            assert losses[step] == pytest.approx(reference[step], rel=1e-5), f"{name}, step {step}"


def test_layout_changes_are_converted_once_and_logged(elastic):
    for name, (source, step) in RESUMED.items():
        tag_dir = runs.run_dir(source) / "ckpt" / f"step_{step:08d}"
        assert (tag_dir / "universal" / "zero").is_dir()
        assert elastic.output.count(f"converting {tag_dir} to DeepSpeed's universal") == 1, name
    assert ("checkpoint of 2 process(es) with ZeRO-2 resumed on 2 with ZeRO-3: model and optimizer "
            "state through its universal form\n") in elastic.output
    assert ("checkpoint of 2 process(es) with ZeRO-3 resumed on 1 with ZeRO-2: model and optimizer "
            "state through its universal form; the data continues at sample 128 of epoch 0 of the "
            "same order; each rank's random streams are derived from (seed, rank, step)") in elastic.output
    assert "checkpoint of 1 process(es) with ZeRO-2 resumed on 2 with ZeRO-2" in elastic.output
    summary = json.loads((runs.run_dir("to2") / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == N_STEPS
    assert summary["tokens_seen"] == N_STEPS * 8 * 32


def test_changing_to_zero_stage_0_fails_before_any_work(elastic):
    errors = {record["error"] for record in elastic.records["zero0"]}
    tag_dir = runs.run_dir("ref") / "ckpt" / f"step_{INTERVAL:08d}"
    assert errors == {f"zero.stage=0: checkpoint {tag_dir} holds ZeRO-2 shards, which only a ZeRO "
                      "optimizer loads; resume it with zero.stage=1, 2 or 3 (on any number of "
                      "processes: the shards are converted automatically)"}
    assert not runs.run_dir("zero0").exists()


def test_global_batch_change_continues_the_data_and_the_schedule(elastic):
    """Resumed at step 8 with a global batch of 4 instead of 8: the steps that follow take the
    windows that came next, in the same order (two new steps = one step of ref), and the
    learning rate stays the function of the step it was."""
    reference, halved = elastic.windows("ref"), elastic.windows("batch4")
    assert sorted(halved) == list(range(INTERVAL + 1, N_STEPS + 1))
    for i, step in enumerate(range(INTERVAL + 1, N_STEPS + 1, 2)):
        assert sorted(halved[step] + halved[step + 1]) == reference[INTERVAL + 1 + i], step
    lrs, reference_lrs = runs.scalars("batch4", "train/lr/decay"), runs.scalars("ref", "train/lr/decay")
    assert [lrs[s] for s in sorted(lrs)] == [reference_lrs[s] for s in sorted(lrs)]
    assert ("global batch changed from 8 to 4 sequences at step 8: the data continues at sample 64 of "
            "epoch 0 of the same order (no sample repeated or skipped); the learning-rate schedule "
            f"stays a function of the step, not rescaled for the batch; the run ends at step {N_STEPS}"
            ) in elastic.output
    assert {record["code"] for record in elastic.records["batch4"]} == {0}


def test_token_budget_after_a_global_batch_change():
    """200 tokens of a 320-token budget seen at step 5: at 8 x 4 = 32 tokens per step, the 120
    left take 4 more steps (the last one partly over), so the run ends at step 9."""
    from pretrain.config import load_config

    cfg = load_config(runs.base_config_file(), ["train.max_steps=null", "train.max_tokens=320",
                                                "data.seq_len=4"])
    assert cfg.total_steps == cfg.total_steps_after(step=0, tokens_seen=0) == 10
    assert cfg.total_steps_after(step=5, tokens_seen=200) == 9
    assert cfg.total_steps_after(step=12, tokens_seen=400) == 12  # budget spent: stop now


@pytest.mark.parametrize("saved, now, expected", [
    ((2, 2), (2, 2), False), ((2, 2), (1, 2), True), ((2, 1), (2, 3), True), ((2, 3), (4, 3), True),
    ((2, 0), (1, 0), False), ((2, 0), (2, 1), "saved without ZeRO"), ((1, 3), (1, 0), "holds ZeRO-3")])
def test_which_checkpoints_go_through_the_universal_form(tmp_path, saved, now, expected):
    """(world size, ZeRO stage) saved -> now: ZeRO shards need the universal form for any change;
    stage 0 loads at any world size; a change to or from stage 0 is refused."""
    from pretrain.training import checkpoint

    tag_dir = tmp_path / "step_00000004"
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            checkpoint.needs_universal(*saved, *now, tag_dir)
    else:
        assert checkpoint.needs_universal(*saved, *now, tag_dir) is expected
