"""Sweep definitions: expansion into run configs, validation, the Slurm array."""
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from pretrain.scaling import sweep as sweeps
from pretrain.scaling.__main__ import main
from pretrain.scaling.launch import write_slurm_array
from pretrain.scaling.registry import RunRecord, load_registry

BASE = {"data": {"path": "checkpoints/datasets/x", "micro_batch_size": 4, "seq_len": 32},
        "train": {"max_steps": 100, "global_batch_size": 8},
        "optimizer": {"lr": 1e-3},
        "model": {"flavor": "gpt-tiny", "overrides": {"dropout": 0.0}}}


def _sweep_file(tmp_path, data_path=None, **changes):
    base = tmp_path / "base.yaml"
    base_config = {**BASE, "data": {**BASE["data"], "path": data_path or BASE["data"]["path"]}}
    base.write_text(yaml.safe_dump(base_config))
    spec = {"name": "sw", "base_config": str(base), "output_root": str(tmp_path / "out"),
            "overrides": {"train.global_batch_size": 16},
            "families": {"gpt": {"flavor": "gpt-tiny"},
                         "gpt_rec": {"flavor": "gpt_rec-tiny",
                                     "overrides": {"optimizer.lr": 3e-3}}},
            "sizes": {"w32": {"n_embd": 32}, "w64": {"n_embd": 64}},
            "tokens": {"fixed": [1e5, 2e5]}}
    spec.update(changes)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_expansion_is_the_full_product_sharing_everything_but_the_cell(tmp_path):
    sweep = sweeps.load_sweep(_sweep_file(tmp_path))
    runs = sweeps.expand(sweep)
    assert [r.run_name for r in runs] == [
        f"sw-{g}-{s}-{b}" for g in ("gpt", "gpt_rec") for s in ("w32", "w64")
        for b in ("t100k", "t200k")]
    for run in runs:
        c = run.config
        assert c["run_name"] == run.run_name and c["output_root"] == str(tmp_path / "out" / "sw")
        assert c["model"]["flavor"] == {"gpt": "gpt-tiny", "gpt_rec": "gpt_rec-tiny"}[run.group]
        assert c["model"]["overrides"] == {"dropout": 0.0, "n_embd": int(run.size[1:])}
        assert c["train"]["max_tokens"] == {"t100k": 100000, "t200k": 200000}[run.budget]
        assert c["train"]["max_steps"] is None  # the token budget alone ends the run
        assert c["train"]["global_batch_size"] == 16
        assert {k: c["data"][k] for k in BASE["data"]} == {**BASE["data"], "path": c["data"]["path"]}
        assert c["optimizer"]["lr"] == (3e-3 if run.group == "gpt_rec" else 1e-3)
    # N is the model's own non-embedding count: it grows ~4x from width 32 to 64.
    n = {(r.group, r.size): r.non_embedding_params for r in runs}
    assert 3.5 < n[("gpt", "w64")] / n[("gpt", "w32")] < 4.5
    assert n[("gpt", "w32")] != n[("gpt_rec", "w32")]


def test_tokens_per_parameter_budget_and_warmup_share(tmp_path):
    families = {"deep": {"flavor": "gpt-tiny", "overrides": {"model.overrides.n_layer": 4}},
                "shallow": {"flavor": "gpt-tiny"}}
    path = _sweep_file(tmp_path, tokens={"per_param": [20]}, warmup_fraction=0.1,
                       families=families)
    runs = sweeps.expand(sweeps.load_sweep(path))
    for run in runs:
        assert run.budget == "x20"
        assert run.max_tokens == round(20 * run.non_embedding_params)
        steps = -(-run.max_tokens // (16 * 32))  # global batch 16 x seq_len 32
        assert run.config["schedule"]["warmup_steps"] == round(0.1 * steps) > 0
    # N counts the model as configured, family overrides included: 4 layers vs gpt-tiny's 2.
    n = {(r.group, r.size): r.non_embedding_params for r in runs}
    assert 1.9 < n[("deep", "w32")] / n[("shallow", "w32")] < 2.1


@pytest.mark.parametrize("change, message", [
    ({"tokens": {"fixed": [1e5], "per_param": [20]}}, "exactly one of"),
    ({"tokens": {"fixed": [-1]}}, "positive"),
    ({"sizes": {"w32": 32}}, "sizes.w32 must be a mapping, got 32"),
    ({"families": {"gpt": {"flavour": "gpt-tiny"}}}, "unknown key families.gpt.flavour (did you mean families.gpt.flavor?)"),
    ({"nproc_per_node": "two"}, "nproc_per_node must be an integer, got 'two'"),
    ({"base_config": "no/such.yaml"}, "trainer config not found: no/such.yaml"),
    ({"families": {"gpt": {"flavor": "gpt-huge"}}}, "unknown model flavor 'gpt-huge'"),
    ({"sizes": {"w": {"n_embdd": 8}}}, "'n_embdd' is not a field"),
    ({"overrides": {"train.lrr": 1}}, "sw, gpt w32: unknown key train.lrr"),
    # every run is checked before any starts: here the second budget of each cell is too small
    ({"tokens": {"fixed": [1e5, 10]}}, "sweep sw, run sw-gpt-w32-t10: the budget of 10 tokens is less than one "
                                       "optimizer step (512 tokens: train.global_batch_size 16 x data.seq_len 32)"),
    ({"tokens": {"per_param": [20, 0.001]}}, "run sw-gpt-w32-x0.001: the budget of 25 tokens is less than one"),
    ({"overrides": {"train.global_batch_size": 16, "schedule.warmup_steps": 300}},
     "sweep sw, run sw-gpt-w32-t100k: train.max_tokens=100000 (196 steps of 512 tokens) ends the run before "
     "schedule.warmup_steps=300"),
    # and as the trainer will check it at launch, at the launch's world size
    ({"families": {"ebt": {"flavor": "ebt-tiny", "overrides": {"model.compile": "inductor"}}}},
     "sweep sw, run sw-ebt-w32-t100k (1 process): model.compile='inductor': flavor ebt-tiny: its energy "
     "gradient (energy_gradient='autograd') differentiates inside the forward"),
    ({"nproc_per_node": 3}, "sweep sw, run sw-gpt-w32-t100k (3 processes): train.global_batch_size=16: 3 "
                            "processes cannot share it evenly"),
])
def test_bad_sweeps_are_one_line_errors(tmp_path, change, message, capsys):
    path = _sweep_file(tmp_path, **change)
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_configs_index_and_slurm_array(tmp_path, tiny_dataset, capsys):
    # A job array, or a local launch, needs its datasets (this config names no source to
    # prepare one from): one line, nothing submitted or started.
    for launch in (["--slurm"], []):
        assert main(["run", str(_sweep_file(tmp_path)), *launch]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "dataset checkpoints/datasets/x is not prepared" in err
        assert "python -m data_pipeline.prepare --out checkpoints/datasets/x" in err
        assert not (tmp_path / "out").exists()
    path = _sweep_file(tmp_path, tiny_dataset)
    assert main(["run", str(path), "--dry-run"]) == 0
    sweep = sweeps.load_sweep(path)
    runs = sweeps.expand(sweep)
    for run in runs:
        written = yaml.safe_load((sweep.directory / "configs" / f"{run.run_name}.yaml").read_text())
        assert written == run.config
    index = json.loads((sweep.directory / "sweep.json").read_text())
    assert index["runs"]["sw-gpt_rec-w64-t200k"]["group"] == "gpt_rec"

    # A finished run is skipped by the next launch and grouped by its sweep label.
    done = runs[0]
    run_dir = sweep.directory / done.run_name
    run_dir.mkdir()
    RunRecord(done.run_name, "some_family", "gpt-tiny", 1, done.non_embedding_params, 1, 1.0,
              3.0, 3.0, 3.0, 1.0, "cpu", 1, 1).save(run_dir)
    registry = load_registry([sweep.directory])
    assert registry.group_of(*registry.records[0]) == "gpt"  # the sweep's label wins
    capsys.readouterr()
    assert main(["run", str(path), "--slurm"]) == 0
    assert "1 finished, 7 to run" in capsys.readouterr().out
    lines = (sweep.directory / "slurm_runs.txt").read_text().splitlines()
    assert lines == [str(sweep.directory / "configs" / f"{r.run_name}.yaml") for r in runs[1:]]
    submit = (sweep.directory / "submit.sh").read_text()
    assert "--array=0-6 " in submit and submit.rstrip().endswith(
        f"launch/slurm.sbatch {sweep.directory / 'slurm_runs.txt'}")
    assert subprocess.run(["bash", "-n", str(sweep.directory / "submit.sh")]).returncode == 0
    assert write_slurm_array(sweep, []) is None
    # A job array is checked at its jobs' world size: 3 nodes of 8 GPUs cannot share a batch of
    # 16, which 8 processes (one node) could. Nothing is written over the last array.
    capsys.readouterr()
    assert main(["run", str(path), "--slurm", "slurm.nodes=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(24 processes): train.global_batch_size=16: 24 processes cannot" in err
    assert (sweep.directory / "submit.sh").read_text() == submit


def test_flops_budgets_and_axes(tmp_path, tiny_dataset, capsys):
    """A compute budget becomes each model's token budget by its own training FLOPs per token
    (the trainer's accounting, readout included); an axis repeats every run, and the runs that
    differ only in it share a cell."""
    from pretrain import models
    from pretrain.config import load_config, model_config

    path = _sweep_file(tmp_path, tiny_dataset, tokens={}, flops=[4e10, 1.2e11],
                       axes={"optimizer.lr": [1e-3, 3e-3]}, warmup_fraction=0.1)
    assert main(["run", str(path), "--dry-run"]) == 0
    sweep = sweeps.load_sweep(path)
    runs = sweeps.expand(sweep)
    assert len(runs) == 2 * 2 * 2 * 2  # groups x sizes x budgets x learning rates
    tokens_per_step = 16 * 32
    for run in runs:
        cfg = load_config(sweep.directory / "configs" / f"{run.run_name}.yaml")
        model = models.build(model_config(cfg, 50257))
        flops_per_token = model.flops_per_token(32, training=True)
        assert run.flops_per_token == flops_per_token
        steps = run.max_tokens / tokens_per_step
        assert steps == round(run.flops_budget / (flops_per_token * tokens_per_step)) >= 1
        # Whole steps, the nearest to C: the compute is C within half a step.
        assert abs(run.max_tokens * flops_per_token - run.flops_budget) <= \
            0.5 * tokens_per_step * flops_per_token
        assert cfg.optimizer.lr == run.axes["optimizer.lr"]
        assert cfg.schedule.warmup_steps == round(0.1 * steps)
        assert run.run_name == f"{run.cell}-lr{run.axes['optimizer.lr']:g}"
    # Wider models get fewer tokens at the same compute.
    tokens = {(r.group, r.size, r.budget): r.max_tokens for r in runs}
    assert tokens[("gpt", "w64", "c40G")] < tokens[("gpt", "w32", "c40G")]
    index = json.loads((sweep.directory / "sweep.json").read_text())["runs"]
    entry = index["sw-gpt-w32-c120G-lr0.003"]
    assert entry["cell"] == "sw-gpt-w32-c120G" and entry["axes"] == {"optimizer.lr": 0.003}
    assert entry["flops_budget"] == 1.2e11


def test_command_line_overrides_of_a_sweep(tmp_path, tiny_dataset, capsys):
    path = _sweep_file(tmp_path, tiny_dataset)
    assert main(["run", str(path), "--dry-run", "name=other", "tokens.fixed=[5.0e4]",
                 "families.gpt_rec.overrides.optimizer.lr=5e-3", "train.log_interval=3",
                 "sizes.w32.n_embd=16", "axes.optimizer.weight_decay=[0.0, 0.1]"]) == 0
    runs = sweeps.expand(sweeps.load_sweep(path, [
        "name=other", "tokens.fixed=[5.0e4]", "families.gpt_rec.overrides.optimizer.lr=5e-3",
        "train.log_interval=3", "sizes.w32.n_embd=16", "axes.optimizer.weight_decay=[0.0, 0.1]"]))
    assert {r.run_name.split("-")[0] for r in runs} == {"other"}
    assert {r.max_tokens for r in runs} == {50000}
    assert {r.config["train"]["log_interval"] for r in runs} == {3}
    assert {r.config["optimizer"]["lr"] for r in runs if r.group == "gpt_rec"} == {5e-3}
    assert {r.config["model"]["overrides"]["n_embd"] for r in runs if r.size == "w32"} == {16}
    assert sorted({r.axes["optimizer.weight_decay"] for r in runs}) == [0.0, 0.1]
    assert (tmp_path / "out" / "other" / "sweep.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["axes.optimizer.lrr=[1e-3]"], "unknown key optimizer.lrr"),
    (["axes.train.max_tokens=[1000]"], "train.max_tokens is set by the sweep itself"),
    (["flops=[1.0e5]"], "flops budget 1e+05 is too small for one optimizer step (512 tokens"),
    (["slurm.tme=1"], "slurm.tme: unknown key 'tme'"),
    (["nproc_per_node"], "not of the form key.sub=value"),
    (["train.lrr=1"], "unknown key train.lrr"),
])
def test_bad_budgets_axes_and_overrides_are_one_line_errors(tmp_path, tiny_dataset, args,
                                                            message, capsys):
    path = _sweep_file(tmp_path, tiny_dataset)
    extra = ["tokens={}"] if any(a.startswith("flops") for a in args) else []
    assert main(["run", str(path), "--dry-run", *extra, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_help_names_an_existing_sweep(capsys):
    import re

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    cited = re.findall(r"configs/scaling/\S+\.yaml", capsys.readouterr().out)
    assert cited and all(Path(p).is_file() for p in cited)


@pytest.fixture(scope="module")
def char_shakespeare(tmp_path_factory) -> str:
    """The IsoFLOP study's dataset (all bundled plays, characters), prepared once."""
    from data_pipeline.prepare import ensure_prepared
    from pretrain.config import load_config

    data = load_config("configs/scaling/base/isoflop.yaml").data
    path = str(tmp_path_factory.mktemp("isoflop") / "shakespeare-char")
    ensure_prepared(path, data.source, seq_len=data.seq_len, tokenizer=data.tokenizer,
                    val_fraction=data.val_fraction)
    return path


def test_isoflop_study_plans_runs_that_fit_its_design(char_shakespeare, tmp_path):
    """The shipped IsoFLOP study: 4 families, each budget 5 sizes one step further up the
    ladder; every run's compute is its budget within half a step, its warmup 5% of its own
    steps; the readout is at most 25% of any model's FLOPs; no run sees more than 4 epochs."""
    from data_pipeline.packing import read_manifest
    from pretrain.config import from_dict, model_config
    from pretrain.scaling.experiments import isoflop

    sweep = sweeps.load_sweep(isoflop.SWEEP, [f"output_root={tmp_path}", f"data.path={char_shakespeare}"])
    windows = {group: isoflop.size_windows(sweep, group) for group in sweep.families}
    for group, by_budget in windows.items():
        ladder = list(sweep.families[group].sizes or sweep.sizes)
        assert [by_budget[c] for c in sorted(by_budget)] == [ladder[i:i + 5] for i in range(3)]
    manifest = read_manifest(char_shakespeare)
    train_tokens = manifest["splits"]["train"]["tokens"]
    runs = [isoflop.one_run(sweep, group, size, budget, {isoflop.LR_AXIS: 4e-3})
            for group, by_budget in windows.items() for budget, sizes in by_budget.items() for size in sizes]
    passes_the_trainers_checks(sweep, runs)
    assert {r.group for r in runs} == {"gpt", "nrgpt", "ebt", "transformer_pp"} and len(runs) == 60
    for run in runs:
        cfg = from_dict(run.config)
        step_flops = run.flops_per_token * cfg.tokens_per_step
        assert abs(run.max_tokens * run.flops_per_token - run.flops_budget) <= step_flops / 2
        assert cfg.optimizer.lr == 4e-3 and cfg.schedule.decay_steps is None
        assert cfg.schedule.warmup_steps == round(0.05 * cfg.total_steps) > 0
        width = cfg.model.overrides["n_embd"]
        readout = 6 * width * model_config(cfg, manifest["vocab_size"]).vocab_size
        assert readout / run.flops_per_token <= 0.25, run.run_name
        assert run.max_tokens <= 4 * train_tokens, run.run_name
    # An EBT token costs several Transformer++ tokens at the same width (descent and its backward).
    fpt = {(r.group, r.size): r.flops_per_token for r in runs}
    assert 3 < fpt[("ebt", "w48")] / fpt[("transformer_pp", "w48")] < 6


def test_a_learning_rate_grid_widens_beyond_a_best_on_its_edge():
    from pretrain.scaling.experiments.isoflop import widened

    assert widened({2e-3: 1.5, 4e-3: 1.4, 8e-3: 1.6}) is None
    assert widened({2e-3: 1.3, 4e-3: 1.4, 8e-3: 1.6}) == [1e-3, 2e-3, 4e-3, 8e-3]
    assert widened({2e-3: 1.7, 4e-3: 1.4, 8e-3: 1.3}) == [2e-3, 4e-3, 8e-3, 1.6e-2]
    assert widened({2e-3: float("inf"), 4e-3: 1.4, 8e-3: float("inf")}) is None  # diverged edges


SHIPPED_SWEEPS = sorted((Path(__file__).resolve().parent.parent / "configs" / "scaling").glob("*.yaml"))


def passes_the_trainers_checks(sweep: sweeps.Sweep, runs: list[sweeps.RunSpec]) -> None:
    """The checks `run` makes before any run starts (`check_runs`): a GPU sweep's at the world
    size of its Slurm job, another's at that of its local runs."""
    sweeps.check_runs(sweep, runs, slurm=runs[0].config["train"]["device"] == "cuda")


@pytest.mark.parametrize("path", SHIPPED_SWEEPS, ids=lambda p: p.name)
def test_every_run_of_a_shipped_sweep_passes_the_trainers_checks(path):
    """A sweep that the trainer refuses run by run fails at each launch, hours into a queue: the
    OpenWebText EBT sweep compiled EBT-S1 (from its Transformer++ base config) with the double
    backward, which validation refuses, in all nine EBT runs."""
    sweep = sweeps.load_sweep(path)
    if sweep.flops:
        pytest.skip("compute budgets need the prepared dataset: test_isoflop_study_plans_runs_that_fit_its_design checks it")
    passes_the_trainers_checks(sweep, sweeps.expand(sweep))


def test_the_smallest_run_of_the_committed_table_reruns_from_its_row(char_shakespeare, tmp_path):
    """docs/isoflop_runs.csv is enough to re-run a run: its smallest (least compute, then least
    wall time), trained again from the study's base config and its row's overrides alone, ends
    within 1% of the final val loss the table records."""
    import csv
    import json
    import os
    import shlex
    import subprocess
    import sys

    from pretrain.scaling.experiments import isoflop

    repo = Path(__file__).resolve().parent.parent
    rows = list(csv.DictReader((repo / isoflop.RUN_TABLE).open()))
    row = min(rows, key=lambda r: (float(r["budget_flops"]), float(r["wall_s"])))
    command = [sys.executable, "-m", "pretrain.train", "--config", sweeps.load_sweep(isoflop.SWEEP).base_config,
               *shlex.split(row["overrides"]), f"data.path={char_shakespeare}", "run_name=replay",
               f"output_root={tmp_path}"]
    done = subprocess.run(command, cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert summary["tokens_seen"] == int(row["tokens"])
    assert summary["final_val_loss"] == pytest.approx(float(row["final_val_loss"]), rel=0.01)
