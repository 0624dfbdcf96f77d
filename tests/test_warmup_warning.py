"""A run whose budget ends before its warmup does never trains at `optimizer.lr`: the trainer's
checks say so in a warning (rank 0 only), and a scaling sweep refuses to generate such a run
(tests/test_scaling_sweep.py). They also warn when eval.dynamics is on for a family without a
descent."""
from __future__ import annotations

import trainer_runs as runs
from pretrain.config import load_config
from pretrain.config.validation import validate


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


def test_check_warns_when_the_budget_ends_before_the_warmup():
    """The base test config warms up over 2 steps of 256 tokens to lr 3e-3."""
    cases = [(["train.max_steps=1"], "warning: train.max_steps=1 ends the run before schedule.warmup_steps=2: "
              "the learning rate peaks at 0.0015, never reaching optimizer.lr=0.003; set schedule.warmup_steps "
              "to at most 1"),
             (["train.max_steps=null", "train.max_tokens=200"], "warning: train.max_tokens=200 (1 step of 256 "
              "tokens) ends the run before schedule.warmup_steps=2"),
             (["train.max_steps=null", "train.max_tokens=257"], None)]  # 2 steps: the peak is reached
    for budget, expected in cases:
        # the base config's eval.dynamics has nothing to measure on its gpt: a warning of its own
        result = runs.train_here(["--check", "eval.dynamics=false", *budget])
        assert result.returncode == 0, result.stderr[-3000:]
        found = warnings(result.stderr)
        assert (len(found) == 1 and found[0].startswith(expected)) if expected else found == [], result.stderr


def test_only_rank_0_warns(monkeypatch, capsys):
    cfg = load_config(runs.base_config_file(), ["train.max_steps=1"])
    for rank, warned in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        validate(cfg, world_size=2, has_gpu=False)
        assert bool(warnings(capsys.readouterr().err)) == warned


def test_check_says_when_eval_dynamics_has_nothing_to_measure():
    """gpt has no descent: eval.dynamics=true used to train with no dynamics scalars and no word."""
    for flavor, warned in (("gpt-tiny", True), ("nrgpt-tiny", False)):
        result = runs.train_here(["--check", f"model.flavor={flavor}", "eval.dynamics=true"])
        assert result.returncode == 0, result.stderr[-3000:]
        found = warnings(result.stderr)
        if warned:
            assert len(found) == 1 and found[0].startswith(
                "warning: eval.dynamics=true: a gpt model has no descent to measure, so this run logs no "
                "eval/dynamics scalars and summary.json's dynamics stays null"), result.stderr
        else:
            assert found == [], result.stderr
