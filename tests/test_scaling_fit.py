"""Scaling fits: recovery of known exponents, the registry, the fit command's outputs."""
import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.scaling.__main__ import main
from pretrain.scaling.fit import TooFewPoints, fit_power_law, rate_difference
from pretrain.scaling.registry import RunRecord, load_registry

ALPHA_TOLERANCE = 0.1
"""Relative error allowed on a recovered exponent with 12 points and 0.5% noise."""


# Laws whose reducible part A x^-alpha spans from about the size of E down to a few percent of
# it over the x range, as in real sweeps (a reducible part lost in the noise pins nothing).
@pytest.mark.parametrize("E, A, alpha, lo, hi", [
    (1.7, 400.0, 0.34, 1e5, 1e9),      # L(N)-like
    (2.3, 80.0, 0.12, 1e12, 1e18),     # L(C)-like: small exponent over 6 decades
    (0.8, 4000.0, 0.55, 1e6, 1e10),
])
def test_fit_recovers_known_power_law(E, A, alpha, lo, hi):
    covered = 0
    for seed in range(4):
        rng = np.random.default_rng(seed)
        x = np.geomspace(lo, hi, 12)
        y = (E + A * x**-alpha) * (1 + 0.005 * rng.standard_normal(x.size))
        fit = fit_power_law(x, y, n_bootstrap=300, seed=seed)
        assert abs(fit.law.alpha - alpha) <= ALPHA_TOLERANCE * alpha
        assert abs(fit.law.E - E) <= 0.05 * E
        covered += fit.ci["alpha"][0] <= alpha <= fit.ci["alpha"][1]
        assert fit.ci["alpha"][0] < fit.law.alpha < fit.ci["alpha"][1]
    assert covered >= 3  # nominal 95% intervals: at most one miss in four


def test_pure_power_law_and_rate_difference():
    x = np.geomspace(1e6, 1e9, 8)
    rng = np.random.default_rng(1)
    noise = lambda: 1 + 0.003 * rng.standard_normal(x.size)  # noqa: E731
    base = fit_power_law(x, 50 * x**-0.2 * noise(), irreducible=False, n_bootstrap=300)
    other = fit_power_law(x, 80 * x**-0.25 * noise(), irreducible=False, n_bootstrap=300)
    assert base.law.E == 0 and abs(base.law.alpha - 0.2) < 0.01
    value, (lo, hi) = rate_difference(other, base)
    assert abs(value - 0.25) < 0.05 and lo < 0.25 < hi


def test_exact_fit_has_no_interval_and_too_few_points_is_an_error():
    fit = fit_power_law([1e3, 1e4, 1e5], [3.0, 2.5, 2.2])
    assert fit.n_points == 3 and all(math.isnan(v) for v in fit.ci["alpha"])
    with pytest.raises(TooFewPoints, match="2 distinct point"):
        fit_power_law([1e3, 1e4, 1e4], [3.0, 2.5, 2.4])
    with pytest.raises(ValueError, match="positive"):
        fit_power_law([1e3, 1e4, 1e5], [3.0, -2.5, 2.2])


def test_three_points_that_call_for_a_negative_E_are_not_called_exact(tmp_path, capsys):
    """L = -1 + 5 N^-0.1 at three sizes: the clamped law (E = 0) misses the points, and the
    fit command says so (notes, plot label) instead of calling it an exact fit."""
    x = np.array([1e3, 1e4, 1e5])
    loss = -1 + 5 * x**-0.1
    fit = fit_power_law(x, loss)
    assert fit.E_clamped and fit.law.E == 0
    misses = np.sqrt(np.mean(((loss - fit.law(x)) / loss) ** 2))
    assert fit.residual == pytest.approx(misses) and fit.residual > 0.01
    exact = fit_power_law(x, [3.0, 2.5, 2.2])
    assert not exact.E_clamped and exact.residual < 1e-5

    for n, value in zip(x, loss):
        _write_run(tmp_path / "runs", _record(f"gpt-{int(n)}", "gpt", int(n), 10**8, float(value)))
    assert main(["fit", str(tmp_path / "runs"), "--out", str(tmp_path / "fit"), "--bootstrap", "0"]) == 0
    rows = {r["law"]: r for r in csv.DictReader((tmp_path / "fit" / "fits.csv").open())}
    for law in ("L(N)", "L(C)"):
        notes = rows[law]["notes"]
        assert float(rows[law]["E"]) == 0 and "exact" not in notes, notes
        assert f"E clamped at 0 (the points call for a negative E): relative RMS residual {misses:.2%}" in notes
    assert "exact" not in (tmp_path / "fit" / "fits.md").read_text()
    assert "exact" not in capsys.readouterr().out


def _record(name, family, n, tokens, loss, **kw):
    values = dict(run_name=name, family=family, flavor=f"{family}-tiny", params=n + 1000,
                  non_embedding_params=n, tokens_seen=tokens, train_flops=6.0 * n * tokens,
                  final_train_loss=loss * 0.95, best_val_loss=loss, final_val_loss=loss * 1.01,
                  wall_time_s=1.5, hardware="cpu", world_size=2, steps=10)
    values.update(kw)
    return RunRecord(**values)


def _write_run(root, record):
    run_dir = root / record.run_name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("run_name: x\n")
    record.save(run_dir)
    return run_dir


def test_registry_round_trip_lists_missing_and_invalid(tmp_path):
    record = _record("a", "gpt", 1000, 10**6, 3.2, extra={"think_loss": [3.3, 3.1]})
    _write_run(tmp_path / "sweep", record)
    (tmp_path / "sweep" / "unfinished" / "ckpt").mkdir(parents=True)
    (tmp_path / "sweep" / "unfinished" / "config.yaml").write_text("run_name: unfinished\n")
    bad = tmp_path / "sweep" / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text(json.dumps({"run_name": "bad", "family": "gpt"}))
    registry = load_registry([tmp_path])
    assert [r for _, r in registry.records] == [record]
    assert registry.records[0][1].extra == {"think_loss": [3.3, 3.1]}
    assert registry.missing == [tmp_path / "sweep" / "unfinished"]
    assert [d for d, _ in registry.invalid] == [bad]
    assert "missing key flavor" in registry.invalid[0][1]
    with pytest.raises(ValueError, match="not a directory"):
        load_registry([tmp_path / "nope"])


def test_record_type_errors_name_the_key():
    data = _record("a", "gpt", 1000, 10**6, 3.2).to_dict()
    data["tokens_seen"] = "many"
    with pytest.raises(ValueError, match="tokens_seen must be an integer, got 'many'"):
        RunRecord.from_dict(data, "x/summary.json")
    data["tokens_seen"] = 5
    data["best_val_loss"] = None  # optional
    assert RunRecord.from_dict(data).best_val_loss is None


# Two synthetic families with known laws in N (at a fixed token budget) and hence in C.
TRUTH = {"gpt": (1.5, 60.0, 0.30), "nrgpt": (1.6, 90.0, 0.36)}
SIZES = np.geomspace(2e4, 2e7, 7).astype(int)
TOKENS = 10**8


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    rng = np.random.default_rng(0)
    for family, (E, A, alpha) in TRUTH.items():
        for n in SIZES:
            loss = (E + A * n**-alpha) * (1 + 0.003 * rng.standard_normal())
            _write_run(root, _record(f"{family}-{n}", family, int(n), TOKENS, float(loss)))
    # One family with two runs: a message, not a crash.
    for n in SIZES[:2]:
        _write_run(root, _record(f"ebt-{n}", "ebt", int(n), TOKENS, 4.0))
    (root / "crashed").mkdir()
    (root / "crashed" / "config.yaml").write_text("run_name: crashed\n")
    out = tmp_path_factory.mktemp("fit") / "out"
    return root, out


def test_fit_command_outputs_and_tensorboard(fitted, capsys):
    root, out = fitted
    assert main(["fit", str(root), "--out", str(out), "--bootstrap", "200"]) == 0
    printed = capsys.readouterr().out
    assert "missing summary.json" in printed and "crashed" in printed
    assert "ebt L(N): too few points" in printed

    rows = {(r["group"], r["law"]): r for r in csv.DictReader((out / "fits.csv").open())}
    for family, (_, _, alpha) in TRUTH.items():
        row = rows[(family, "L(N)")]
        assert abs(float(row["alpha"]) - alpha) <= ALPHA_TOLERANCE * alpha
        assert float(row["alpha_lo"]) <= alpha <= float(row["alpha_hi"])
        # At a fixed budget C = 6 N D, so L(C) has the same exponent.
        assert abs(float(rows[(family, "L(C)")]["alpha"]) - alpha) <= ALPHA_TOLERANCE * alpha
        assert "not varied" in rows[(family, "L(D)")]["notes"]
    assert float(rows[("gpt", "L(N)")]["slope_vs_baseline"]) == 0.0
    slopes = {f: float(rows[(f, "L(N)")]["slope"]) for f in TRUTH}
    assert float(rows[("nrgpt", "L(N)")]["slope_vs_baseline"]) == pytest.approx(
        (slopes["nrgpt"] - slopes["gpt"]) / slopes["gpt"])
    assert rows[("ebt", "L(N)")]["alpha"] == "" and "too few" in rows[("ebt", "L(N)")]["notes"]
    assert "| nrgpt | L(N) | 7 |" in (out / "fits.md").read_text()
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    tb_runs = tensorboard_runs(out / "tb")
    # No run named "." (nothing written into tb/ itself); the figures in a run of their own;
    # every fitted point an HParams session naming N, C and D, its metric the run's own.
    assert "." not in tb_runs and "figures" in tb_runs
    figures = tb_runs["figures"]
    assert any("loss vs N, C and D" in tag for tag in figures.Tags()["images"])
    assert any("loss vs training FLOPs C" in tag for tag in figures.Tags()["images"])
    assert not figures.Tags()["scalars"]  # no curves against a pseudo-step
    sessions = {name.removeprefix("points/"): acc for name, acc in tb_runs.items() if name.startswith("points/")}
    by_group = {}
    for name, acc in sessions.items():
        by_group.setdefault(hparams_of(acc)["group"], {})[name] = acc
    assert {g: len(s) for g, s in by_group.items()} == {**{f: len(SIZES) for f in TRUTH}, "ebt": 2}
    name, acc = next(iter(by_group["gpt"].items()))
    session = hparams_of(acc)
    assert {"parameters N", "training FLOPs C", "log10 parameters N", "log10 training FLOPs C"} <= set(session)
    assert math.log10(session["parameters N"]) == pytest.approx(session["log10 parameters N"])
    assert session["parameters N"] == int(name.rsplit("-", 1)[1])
    assert [e.step for e in acc.Scalars("point/best_val_loss")] == [0]


def tensorboard_runs(tb: Path) -> dict:
    """TensorBoard run name (the directory of its event files, relative to `tb`) -> its events."""
    runs = {}
    for events in sorted(tb.rglob("events.out.tfevents.*")):
        name = str(events.parent.relative_to(tb))
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
        acc.Reload()
        runs[name] = acc
    return runs


def hparams_of(acc) -> dict:
    """The hyperparameter values of the HParams session in `acc`'s run."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: (v.number_value if v.HasField("number_value") else v.string_value) for k, v in info.hparams.items()}


def test_fit_command_bad_input(tmp_path, capsys):
    assert main(["fit", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("run_name: run\n")
    assert main(["fit", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no finished runs" in err
    assert not (tmp_path / "out").exists()


# A compute-budget sweep with a learning-rate axis, written as the sweep runner writes it:
# gpt follows a known joint law; nrgpt is gpt with every token worth K of gpt's (a known
# compute-equivalent gain of K). The learning rate costs loss away from its optimum, which
# sits inside the grid for gpt and at its top for nrgpt (flagged: it may lie beyond).
from pretrain.scaling.allocation import FlopsModel, optimal_allocation  # noqa: E402
from pretrain.scaling.joint import JointLaw  # noqa: E402

GPT_LAW = JointLaw(E=1.8, A=60.0, alpha=0.35, B=300.0, beta=0.30)
K = 2.0
NRGPT_LAW = JointLaw(GPT_LAW.E, GPT_LAW.A, GPT_LAW.alpha, GPT_LAW.B * K**-GPT_LAW.beta,
                     GPT_LAW.beta)
BUDGETS = [1e11, 1e12, 1e13]
LRS = [1e-3, 3e-3, 1e-2]
BEST_LR = {"gpt": 3e-3, "nrgpt": 1e-2}


def _sweep_runs(root):
    sweep_dir = root / "iso"
    index = {}
    rng = np.random.default_rng(7)
    for family, law in (("gpt", GPT_LAW), ("nrgpt", NRGPT_LAW)):
        for c in BUDGETS:
            n_opt = optimal_allocation(law, FlopsModel(math.log(6), 1.0), [c], (1e4, 1e6))[0][0]
            for n in (n_opt * np.geomspace(1 / 8, 8, 5)).astype(int):
                cell = f"iso-{family}-n{n}-c{c:.0e}"
                d = int(c / (6 * n))
                for lr in LRS:
                    penalty = 1 + 0.02 * math.log(lr / BEST_LR[family]) ** 2
                    loss = float(law(n, d) * penalty * math.exp(0.003 * rng.standard_normal()))
                    name = f"{cell}-lr{lr:g}"
                    _write_run(sweep_dir, _record(
                        name, family, int(n), d, loss, train_flops=6.0 * n * d,
                        extra={"flops_per_token": 6.0 * n, "eval": {"acc": 1 / loss}}))
                    index[name] = {"group": family, "size": f"n{n}", "budget": f"c{c:.0e}",
                                   "cell": cell, "axes": {"optimizer.lr": lr},
                                   "flops_budget": c, "flops_per_token": 6.0 * n}
    (sweep_dir / "sweep.json").write_text(json.dumps({"sweep": "iso", "runs": index}))
    return sweep_dir


def test_compute_sweep_fit_isoflop_joint_gain_and_learning_rates(tmp_path, capsys):
    sweep_dir = _sweep_runs(tmp_path)
    assert main(["fit", str(sweep_dir), "--bootstrap", "40"]) == 0
    out = sweep_dir / "fit"  # the default: next to the sweep's runs
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # like every other directory
    text = (out / "fits.md").read_text()
    for section in ("Axes (e.g. learning rate)", "IsoFLOP parabolas", "Joint law",
                    "Compute-equivalent gain"):
        assert section in text

    # The learning-rate curves: nrgpt's best is the top of the grid in every cell (flagged),
    # gpt's inside it.
    assert "15 of 30 cells have their best value on the edge" in text
    # The fits use each cell's best run: the minimum over the axis.
    rows = list(csv.DictReader((out / "isoflop.csv").open()))
    assert len(rows) == 6 and all(r["inside"] == "True" for r in rows)
    for r in rows:
        law = GPT_LAW if r["group"] == "gpt" else NRGPT_LAW
        n_true = optimal_allocation(law, FlopsModel(math.log(6), 1.0), [float(r["budget"])],
                                    (1e4, 1e6))[0][0]
        assert float(r["n_opt"]) == pytest.approx(n_true, rel=0.3)
    (joint_gpt,) = [r for r in csv.DictReader((out / "joint.csv").open()) if r["group"] == "gpt"]
    assert float(joint_gpt["alpha"]) == pytest.approx(GPT_LAW.alpha, rel=0.15)
    assert float(joint_gpt["beta"]) == pytest.approx(GPT_LAW.beta, rel=0.15)
    # C = 6ND: N* ~ C^(beta / (alpha + beta)), D* ~ C^(alpha / (alpha + beta)).
    assert float(joint_gpt["n_opt_exponent"]) == pytest.approx(0.30 / 0.65, abs=0.06)
    assert float(joint_gpt["n_opt_exponent"]) + float(joint_gpt["d_opt_exponent"]) == \
        pytest.approx(1.0, abs=0.01)
    gains = list(csv.DictReader((out / "gains.csv").open()))
    assert {(g["group"], g["baseline"]) for g in gains} == {("nrgpt", "gpt")}
    middle = gains[len(gains) // 2]
    assert float(middle["gain"]) == pytest.approx(K, rel=0.3)
    assert float(middle["gain_lo"]) < K < float(middle["gain_hi"])
    for name in ("isoflop", "gain", "axes", "compute"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"

    images = tensorboard_runs(out / "tb")["figures"].Tags()["images"]
    for title in ("IsoFLOP: loss vs parameters N", "gain vs C", "loss vs learning rate"):
        assert any(title in tag for tag in images), (title, images)

    # Any recorded metric: a score where higher is better is fitted as 1 - score.
    capsys.readouterr()
    assert main(["fit", str(sweep_dir), "--metric", "eval.acc", "--higher-is-better",
                 "--bootstrap", "0", "--out", str(tmp_path / "acc")]) == 0
    assert "eval.acc, as 1 - metric" in (tmp_path / "acc" / "fits.md").read_text()
    assert main(["fit", str(sweep_dir), "--metric", "eval.nope",
                 "--out", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run has a usable eval.nope" in err
    assert not (tmp_path / "nope").exists()
