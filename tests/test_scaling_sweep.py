"""Sweep definitions: expansion into run configs, validation, the Slurm array."""
import json
import subprocess

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
    ({"sizes": {"w32": 32}}, "sizes.w32: expected a mapping"),
    ({"families": {"gpt": {"flavour": "gpt-tiny"}}}, "unknown key 'flavour'"),
    ({"nproc_per_node": "two"}, "nproc_per_node: expected int"),
    ({"base_config": "no/such.yaml"}, "trainer config not found: no/such.yaml"),
    ({"families": {"gpt": {"flavor": "gpt-huge"}}}, "unknown model flavor 'gpt-huge'"),
    ({"sizes": {"w": {"n_embdd": 8}}}, "'n_embdd' is not a field"),
    ({"overrides": {"train.lrr": 1}}, "sw, gpt w32: unknown key train.lrr"),
])
def test_bad_sweeps_are_one_line_errors(tmp_path, change, message, capsys):
    path = _sweep_file(tmp_path, **change)
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_configs_index_and_slurm_array(tmp_path, tiny_dataset, capsys):
    # A job array needs its datasets prepared: one line, nothing submitted.
    assert main(["run", str(_sweep_file(tmp_path)), "--slurm"]) == 2
    assert "dataset checkpoints/datasets/x is not prepared" in capsys.readouterr().err
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
