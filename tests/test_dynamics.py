"""`python -m pretrain.dynamics`: the descent measured on tiny trained runs of each family (in this
process, see `trainer_runs.train_here`), and its per-token exits on models built here.

The report's last depth point is the trainer's own val loss; NRGPT's energies descend
monotonically in the case of the paper's Proposition 2.1 (eta = c diag(gamma), small c); a
per-token exit at tolerance 0 is the fixed-step model and at a huge tolerance one step; and a
token's exit depends on nothing after it."""
from __future__ import annotations

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainer_runs as runs
from numerics import assert_rounding_close
from pretrain.models import build, resolve
from pretrain.models.blocks import token_losses
from pretrain.models.probes import rank_correlation
from pretrain.training.dynamics_measures import (adaptive_exit, ebt_dynamics, fixed_depth, recurrent_dynamics,
                                                 stopped_steps)
from pretrain.training.evaluation import DescentProbe

STEPS = 4
FLAVORS = {"nrgpt": "nrgpt-tiny", "gpt_rec": "gpt_rec-tiny", "ebt": "ebt-tiny"}
TOLERANCES = "0,0.01,0.1,1e9"
HUGE = 1e9


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """family -> (run name, report) of a tiny run trained for STEPS steps (evaluated at the end)
    and the dynamics command on it."""
    out = tmp_path_factory.mktemp("dynamics")
    results = {}
    for family, flavor in FLAVORS.items():
        name = f"dynamics-{family}"
        trained = runs.train_here([f"model.flavor={flavor}", f"run_name={name}", "zero.stage=0",
                                   f"train.max_steps={STEPS}", f"eval.interval={STEPS}",
                                   f"checkpoint.interval={STEPS}"])
        assert trained.returncode == 0, trained.stderr[-3000:]
        command = runs.command_here("pretrain.dynamics", [str(runs.run_dir(name)), "--out", str(out / family),
                                                          "--tolerances", TOLERANCES])
        assert command.returncode == 0, command.stderr[-3000:]
        results[family] = (name, out / family, json.loads((out / family / "dynamics.json").read_text()),
                           command.stdout)
    return results


def check_adaptive(report: dict, fixed_losses: list[float], most_steps: int) -> None:
    """Rows per tolerance; tolerance 0 is the fixed-step model at its most steps, a huge one is
    one step; mean steps fall as the tolerance grows."""
    rows = {row["tolerance"]: row for row in report["adaptive"]}
    assert list(rows) == [float(t) for t in TOLERANCES.split(",")]
    assert rows[0.0]["mean_steps"] == rows[0.0]["max_steps"] == most_steps
    assert_rounding_close(torch.tensor(rows[0.0]["loss"]), torch.tensor(fixed_losses[-1]))
    assert rows[HUGE]["mean_steps"] == rows[HUGE]["max_steps"] == 1
    assert_rounding_close(torch.tensor(rows[HUGE]["loss"]), torch.tensor(fixed_losses[0]))
    means = [row["mean_steps"] for row in report["adaptive"]]
    assert means == sorted(means, reverse=True) and all(1 <= m <= most_steps for m in means)


def check_outputs(name: str, out, report: dict, figures: list[str]) -> None:
    """The trainer's val loss equals the report's; PNGs, Markdown; scalars and figures in the
    run's TensorBoard at the checkpoint's step."""
    assert report["step"] == STEPS and report["split"] == "val" and report["tokens"] == 2 * 2 * 32
    val_loss = runs.scalars(name, "eval/loss")[STEPS]
    assert_rounding_close(torch.tensor(report["loss"]), torch.tensor(val_loss))
    for figure in figures:
        assert (out / f"{figure}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| tolerance |" in (out / "dynamics.md").read_text()
    events = EventAccumulator(str(runs.run_dir(name) / "tb"), size_guidance={"images": 0}).Reload()
    assert {f"dynamics/{figure}" for figure in figures} <= set(events.Tags()["images"])
    assert runs.scalars(name, "dynamics/loss") == {STEPS: pytest.approx(report["loss"])}


@pytest.mark.parametrize("family", ["nrgpt", "gpt_rec"])
def test_recurrent_report(reports, family):
    name, out, report, _ = reports[family]
    n_steps = resolve(FLAVORS[family], {}).n_steps
    depth = [row["loss"] for row in report["depth_curve"]]
    assert [row["steps"] for row in report["depth_curve"]] == list(range(1, n_steps + 1))
    # the last readout is the model's prediction: its loss is the trainer's val loss
    assert_rounding_close(torch.tensor(depth[-1]), torch.tensor(report["loss"]))
    assert len(report["update_norm"]) == n_steps and all(0 < u < 100 for u in report["update_norm"])
    check_adaptive(report, depth, n_steps)
    figures = ["depth_curve", "update_norms"]
    if family == "nrgpt":
        energies = report["energy_per_step"]
        assert [row["state"] for row in energies] == list(range(n_steps + 1))
        assert all(row["q25"] <= row["median"] <= row["q75"] for row in energies)
        assert 0 <= report["monotone_fraction"] <= 1 and report["monotone_after_steps"] == 1
        figures.append("energy_trajectories")
    else:
        assert "energy_per_step" not in report
    check_outputs(name, out, report, figures)
    assert runs.scalars(name, f"dynamics/depth_loss/step_{n_steps:02d}") == {STEPS: pytest.approx(depth[-1])}


def test_ebt_report(reports):
    name, out, report, _ = reports["ebt"]
    n_steps = resolve("ebt-tiny", {}).n_steps
    assert report["n_steps"] == n_steps and report["max_think_steps"] == 4 * n_steps
    curve = [row["loss"] for row in report["thinking_curve"]]
    assert len(curve) == 4 * n_steps
    # the thinking curve at the trained steps is the model's eval loss
    assert_rounding_close(torch.tensor(curve[n_steps - 1]), torch.tensor(report["loss"]))
    assert -1 <= report["energy_loss_spearman"] <= 1
    deciles = report["energy_deciles"]
    assert [row["decile"] for row in deciles] == list(range(1, 11))
    assert sum(row["tokens"] for row in deciles) == report["tokens"]
    assert all(a["energy_to"] <= b["energy_from"] for a, b in zip(deciles, deciles[1:]))
    check_adaptive(report, curve, 4 * n_steps)
    check_outputs(name, out, report, ["energy_vs_loss", "adaptive"])


def proposition_model(scale: float):
    """An NRGPT in the case of Proposition 2.1: exact gradients, eta = c diag(gamma) with gamma
    learnable (here drawn in [0.5, 2]), weights large enough for a visible landscape."""
    torch.manual_seed(0)
    model = build(resolve("nrgpt-tiny", {"grad_mode": "exact", "eta": "diag_gamma", "learnable_gamma": True,
                                         "eta_init": scale, "n_steps": 8, "init_std": 0.3})).eval()
    with torch.no_grad():
        model.block.norm.weight.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(1))
    return model


def test_monotone_fraction_is_one_in_the_propositions_case():
    """Single-token sequences (each token's energy is its own alone): every token's energy
    descends at every step for a small c, and not for a large one."""
    idx = torch.randint(0, 512, (64, 1), generator=torch.Generator().manual_seed(1))
    small = recurrent_dynamics(proposition_model(0.01), [(idx, idx)], [0.0], transient=0)
    assert small["monotone_fraction"] == 1.0
    means = [row["mean"] for row in small["energy_per_step"]]
    assert means == sorted(means, reverse=True) and means[-1] < means[0]
    large = recurrent_dynamics(proposition_model(10.0), [(idx, idx)], [0.0], transient=0)
    assert large["monotone_fraction"] < 1.0


def changed_later(model, length: int = 20, at: int = 12):
    """Two batches that differ from position `at` on only."""
    idx = torch.randint(0, model.config.vocab_size, (3, length), generator=torch.Generator().manual_seed(5))
    other = idx.clone()
    other[:, at] = (other[:, at] + 1) % model.config.vocab_size
    return idx, other, at


@pytest.mark.parametrize("flavor", ["nrgpt-tiny", "gpt_rec-tiny"])
def test_recurrent_exit_has_no_leakage(flavor):
    """A token's exit step and loss depend on nothing after it, at a tolerance where the exit
    steps differ between tokens; and tolerance 0 is the plain forward."""
    torch.manual_seed(0)
    model = build(resolve(flavor, {"n_steps": 6})).eval()
    idx, other, at = changed_later(model)
    updates = fixed_depth(model, idx, idx)["updates"]
    tolerance = float(updates.median())
    losses, steps = adaptive_exit(model, idx, idx, tolerance)
    other_losses, other_steps = adaptive_exit(model, other, idx, tolerance)
    assert len(steps.unique()) > 1
    assert torch.equal(steps[:, :at], other_steps[:, :at])
    assert_rounding_close(other_losses[:, :at], losses[:, :at])
    assert not torch.equal(other_losses[:, at:], losses[:, at:])
    plain, plain_steps = adaptive_exit(model, idx, idx, 0.0)
    assert torch.equal(plain, token_losses(model(idx).logits, idx))
    assert (plain_steps == 6).all()


def test_ebt_stop_has_no_leakage_and_its_limits():
    """EBT's per-position stop: positions before a changed token keep their steps and
    predictions; a position stopped after k steps predicts as the k-step descent, and as the
    command reads it off the fixed descent; tolerance 0 is the fixed-step descent exactly, a
    huge one stops after one."""
    torch.manual_seed(0)
    model = build(resolve("ebt-tiny", {})).eval()
    idx, other, at = changed_later(model)
    stopped = model.think(idx, steps=6, targets=idx, stop_tolerance=0.05)
    other_stopped = model.think(other, steps=6, stop_tolerance=0.05)
    assert len(stopped.steps_taken.unique()) > 1
    assert torch.equal(stopped.steps_taken[:, :at], other_stopped.steps_taken[:, :at])
    assert_rounding_close(other_stopped.logits[:, :at], stopped.logits[:, :at])
    for k in stopped.steps_taken.unique().tolist():  # a stopped position predicts as k steps do
        where = stopped.steps_taken == k
        assert_rounding_close(stopped.logits[where], model.think(idx, steps=k).logits[where])
    fixed = model.think(idx, steps=6, targets=idx)
    # the command reads every tolerance's stops off the fixed descent: the same steps and losses
    steps = stopped_steps(fixed.energies[:6], 0.05)
    assert torch.equal(steps, stopped.steps_taken)
    assert_rounding_close(fixed.token_losses.gather(0, steps.unsqueeze(0) - 1)[0], stopped.token_losses[-1])
    zero = model.think(idx, steps=6, targets=idx, stop_tolerance=0.0)
    assert torch.equal(zero.logits, fixed.logits) and torch.equal(zero.loss_per_step, fixed.loss_per_step)
    assert (zero.steps_taken == 6).all()
    huge = model.think(idx, steps=6, targets=idx, stop_tolerance=HUGE)
    assert (huge.steps_taken == 1).all()
    assert torch.equal(huge.logits, model.think(idx, steps=1).logits)


def test_the_ebt_measurements_are_autograds_with_the_first_order_gradient():
    """The command's EBT measurements through EBTConfig.energy_gradient first_order: the same
    weights (float64) give the double backward's losses, thinking curve and per-token stops."""
    reports = []
    for path in ("autograd", "first_order"):
        torch.manual_seed(0)
        model = build(resolve("ebt-tiny", {"energy_gradient": path})).double().eval()
        idx, _, _ = changed_later(model)
        reports.append(ebt_dynamics(model, [(idx[:, :-1], idx[:, 1:])], [0.0, 0.05], max_steps=6))
    autograd, first_order = reports
    assert {row["tolerance"]: row["mean_steps"] for row in first_order["adaptive"]} == \
        {row["tolerance"]: row["mean_steps"] for row in autograd["adaptive"]}
    assert 1 < first_order["adaptive"][1]["mean_steps"] < 6  # tokens stopped after different step counts
    for got, expected in ((first_order["loss"], autograd["loss"]),
                          *((a["loss"], b["loss"]) for a, b in zip(first_order["thinking_curve"], autograd["thinking_curve"])),
                          *((a["loss"], b["loss"]) for a, b in zip(first_order["adaptive"], autograd["adaptive"]))):
        assert got == pytest.approx(expected, abs=1e-10, rel=0)
    # the energies are kept in float32 by the command
    assert_rounding_close(torch.from_numpy(first_order["_energy_loss"][0]), torch.from_numpy(autograd["_energy_loss"][0]))


@pytest.mark.parametrize("family", list(FLAVORS))
def test_the_console_shows_the_tables_and_which_batches(reports, family):
    """The command printed only the path of dynamics.json, and nothing said which batches it read
    (a 2-process run's val loss covers other windows than one process reads)."""
    _, out, report, stdout = reports[family]
    written = (out / "dynamics.md").read_text()
    assert stdout == "\n".join(line for line in written.splitlines() if not line.startswith("![")) + "\n"
    assert "| tolerance |" in stdout
    used = ("The batches are the first 2 of the val split in order, as one process reads them: the trainer's "
            "eval/loss of a 1-process run. On N processes the trainer averaged eval.batches batches of each "
            "process's own share")
    assert used in stdout and used in written and report["batches"] == 2


def prepared_char_dataset(path, seq_len: int, val_fraction: float):
    from data_pipeline.prepare import prepare

    prepare("shakespeare", str(path), seq_len=seq_len, val_fraction=val_fraction, tokenizer="char",
            max_docs=20, num_proc=1, progress_bar=False)
    return path


def test_bad_input_is_one_line_and_writes_nothing(reports, tmp_path):
    name = reports["nrgpt"][0]
    longer = prepared_char_dataset(tmp_path / "longer", seq_len=64, val_fraction=0.0)
    no_val = prepared_char_dataset(tmp_path / "no-val", seq_len=32, val_fraction=0.0)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    cases = [([str(tmp_path / "nothing-here")], "no such run directory"),
             (["--tolerances", "0,-1"], "--tolerances"),
             (["--split", "nosuch"], "no split 'nosuch'"),
             (["--transient", "3"], "--transient must be in [0, 2]"),
             (["--max-think-steps", "4"], "EBT models only"),
             (["--data", str(longer), "--split", "train"], f"the dataset at {longer} has windows of 64 tokens, longer than the "
                                       "model's context of 32; give --data a dataset prepared with --seq-len 32"),
             (["--data", str(no_val)], f"the dataset at {no_val} has no val split (a val split needs a "
                                       "--val-fraction above 0 when preparing); give --split train, or --data"),
             ([str(runs.run_dir(reports["ebt"][0])), "--transient", "1"], "--transient applies to NRGPT models only"),
             ([str(runs.run_dir(reports["gpt_rec"][0])), "--transient", "1"], "--transient applies to NRGPT")]
    for extra, message in cases:
        source = [] if extra[0].startswith("/") else [str(runs.run_dir(name))]
        result = runs.command_here("pretrain.dynamics", [*source, *extra, "--out", str(tmp_path / "out")])
        assert result.returncode == 2, (extra, result.stderr)
        assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1
        assert not (tmp_path / "out").exists()
    result = runs.command_here("pretrain.dynamics", [str(runs.run_dir(name)), "--out", str(foreign)])
    assert result.returncode == 2 and "not an empty directory" in result.stderr
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    # a new directory in the run's ckpt/ or tb/, which the trainer prunes (a step_N one is removed
    # before step N is saved): refused as the export refuses it, and nothing is written
    run_dir = runs.run_dir(name)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    for out in (run_dir / "ckpt" / "step_00000099", run_dir / "tb" / "dynamics"):
        result = runs.command_here("pretrain.dynamics", [str(run_dir), "--out", str(out)])
        assert result.returncode == 2 and result.stderr == (
            f"error: --out {out} lies in {out.parent}, which the training run manages; choose a path outside it\n")
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


# --- the in-training scalars (`eval.dynamics`) ------------------------------------------------

@pytest.fixture
def one_process_group(tmp_path):
    """A one-process gloo group: the probe reduces its sums over the processes."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_rank_correlation_is_spearmans_with_ties():
    from scipy.stats import spearmanr

    generator = torch.Generator().manual_seed(3)
    x = torch.randint(0, 7, (300,), generator=generator).double()  # many ties
    y = x + torch.randint(0, 4, (300,), generator=generator).double()
    expected = spearmanr(x.numpy(), y.numpy()).statistic
    assert_rounding_close(rank_correlation(x, y), torch.tensor(expected, dtype=torch.float64))
    assert float(rank_correlation(x, torch.ones(300))) == 0.0


@pytest.mark.parametrize("flavor", ["nrgpt-tiny", "gpt_rec-tiny"])
def test_the_probe_in_the_evaluation_measures_what_the_command_does(one_process_group, flavor):
    """With every position read out (many eval batches: a stride of 1), the probe's depth curve
    and monotone fraction on a batch are the command's on it, its last point is the forward's
    loss, and the forward is unchanged; with one batch it reads out a strided subset."""
    torch.manual_seed(0)
    model = build(resolve(flavor, {"n_steps": 4})).eval()
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    targets = idx.roll(-1, 1)
    targets[0, -3:] = -1  # ignored targets are left out
    probe = DescentProbe(model, idx.size(1), batches=10**6)
    assert probe.positions == slice(0, None, 1)
    with torch.no_grad():
        out = probe.forward(model, idx, targets)
        assert torch.equal(out.loss, model(idx, targets).loss)
        report = recurrent_dynamics(model, [(idx, targets)], [0.0], transient=1)
    scalars = probe.scalars()
    depth = [scalars[f"depth_loss/step_{s:02d}"] for s in range(1, 5)]
    assert_rounding_close(torch.tensor(depth), torch.tensor([row["loss"] for row in report["depth_curve"]]),
                          rounded_in=torch.float32)
    assert_rounding_close(torch.tensor(depth[-1]), out.loss)
    if flavor.startswith("nrgpt"):
        assert scalars["monotone_fraction"] == report["monotone_fraction"]
    else:
        assert "monotone_fraction" not in scalars
    strided = DescentProbe(model, idx.size(1), batches=1)
    stride = strided.positions.step
    assert stride > 1 and strided.positions.start == stride - 1
    with torch.no_grad():
        strided.forward(model, idx, targets)
    read = targets[:, stride - 1::stride]
    expected = token_losses(model(idx).logits[:, stride - 1::stride], read)[read != -1].double().mean()
    assert_rounding_close(torch.tensor(strided.scalars()["depth_loss/step_04"], dtype=torch.float64), expected,
                          rounded_in=torch.float32)


def test_the_probe_of_an_ebt_is_the_commands_rank_correlation(one_process_group):
    """From the evaluation's thinking (eval.think_steps beyond the trained steps), the energy-loss
    rank correlation after the trained steps, as the command computes it on the same batch."""
    torch.manual_seed(0)
    model = build(resolve("ebt-tiny", {})).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    probe = DescentProbe(model, idx.size(1), batches=1)
    probe.think(model.think(idx, steps=model.config.n_steps + 2, targets=idx), idx)
    report = ebt_dynamics(model, [(idx, idx)], [0.0], max_steps=model.config.n_steps)
    assert_rounding_close(torch.tensor(probe.scalars()["energy_loss_spearman"], dtype=torch.float64),
                          torch.tensor(report["energy_loss_spearman"], dtype=torch.float64), rounded_in=torch.float32)
