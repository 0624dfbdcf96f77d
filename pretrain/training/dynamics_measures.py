"""The measurements, figures and report of `python -m pretrain.dynamics` (see its doc): what a
trained recurrent or energy-based model's descent does, step by step, on given batches."""
from __future__ import annotations

from itertools import cycle, islice

import numpy as np
import torch
import torch.nn as nn

from common.fileio import markdown_table
from pretrain.models import family_spec
from pretrain.models.blocks import token_losses
from pretrain.models.descent_plumbing import energy_settled
from pretrain.models.probes import (after_each_step, never_rising, rank_correlation, read_out_each_step,
                                    relative_update, state_energies)
from pretrain.training.metrics import pyplot

DEFAULT_TOLERANCES = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
TRAJECTORY_SAMPLE = 48
"""Tokens whose energy trajectories the NRGPT figure draws."""
DECILES = 10
REPORT = "dynamics.json"
BATCHES_USED = ("The batches are the first {batches} of the {split} split in order, as one process reads them: "
                "the trainer's eval/loss of a 1-process run. On N processes the trainer averaged eval.batches "
                "batches of each process's own share, other windows, so its val loss differs a little; "
                "--batches sets how many are read here.")
"""Which batches the report measured (item of the report and the console), since a run's logged
val loss covers other windows when it trained on several processes."""
NRGPT_TRANSIENT = 1
"""`--transient`'s default: NRGPT's energy may rise in its first step."""


class DynamicsError(ValueError):
    """Bad input to the dynamics command; the message is one line."""


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def evaluation_batches(data_dir: str, split: str, batch_size: int, batches: int, seed: int,
                       device: torch.device) -> Batches:
    """The first `batches` micro-batches of `split` in order, cycling a short split: the batches
    the trainer's evaluation reads (`pretrain.training.evaluation.evaluate`)."""
    from data_pipeline.loader import build_loader

    loader = build_loader(data_dir, split, micro_batch_size=batch_size, seed=seed, shuffle=False,
                          num_workers=0, repeat=False)
    return [(inputs.to(device), targets.to(device)) for inputs, targets in islice(cycle(loader), batches)]


# --- recurrent families ---------------------------------------------------------------------

@torch.no_grad()
def fixed_depth(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward, read out after every step. Per token, [steps, B, T]: `losses` after steps
    1..S, `updates` (relative update of steps 1..S); NRGPT also `energies` [S + 1, B, T], each
    token's own energy at the states 0..S. `loss`: the forward's own loss."""
    with_energies = family_spec(model.config).step_energies
    with read_out_each_step(model, targets) as record:
        out = model(inputs, targets, return_energies=with_energies)
    measured = {"loss": out.loss, "losses": torch.stack(record["losses"]),
                "updates": torch.stack(record["updates"])}
    if with_energies:
        measured["energies"] = state_energies(out.diagnostics["_token_energy"], record)
    return measured


@torch.no_grad()
def adaptive_exit(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                  tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss [B, T], steps taken [B, T]) when each token exits after the step whose
    relative update is under `tolerance` (every token takes at least one step). An exited
    token's state stays as it was after its last step, and the steps it no longer takes still
    recompute its keys from that frozen state, so later tokens keep attending to it; its stop
    depends on its own updates only, and those on the tokens before it: nothing leaks back from
    later positions. Tolerance 0 is the ordinary forward."""
    exit_state: dict[str, torch.Tensor] = {}

    def freeze(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        if not exit_state:
            exit_state["running"] = torch.ones(before.shape[:2], dtype=torch.bool, device=before.device)
            exit_state["steps"] = torch.zeros(before.shape[:2], dtype=torch.long, device=before.device)
        running = exit_state["running"]
        exit_state["steps"] += running
        exit_state["running"] = running & (relative_update(before, after) >= tolerance)
        return torch.where(running.unsqueeze(-1), after, before)

    with after_each_step(model, freeze):
        logits = model(inputs).logits
    return token_losses(logits, targets), exit_state["steps"]


def quartile_rows(values: torch.Tensor, first: int, key: str) -> list[dict]:
    """Per row of `values` [K, N] (row i named `key` first + i): mean and quartiles over N."""
    quartiles = torch.quantile(values.double(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64), dim=1)
    return [{key: first + i, "mean": float(row.double().mean()), "q25": float(q25), "median": float(q50),
             "q75": float(q75)} for i, (row, q25, q50, q75) in enumerate(zip(values, *quartiles))]


def adaptive_row(tolerance: float, losses: list[torch.Tensor], steps: list[torch.Tensor]) -> dict:
    steps_all = torch.cat(steps)
    return {"tolerance": tolerance, "mean_steps": float(steps_all.double().mean()),
            "max_steps": int(steps_all.max()), "loss": float(torch.cat(losses).double().mean())}


def recurrent_dynamics(model: nn.Module, batches: Batches, tolerances: list[float], transient: int) -> dict:
    """The report's measurements of a gpt_rec or NRGPT model on `batches` (see the module doc);
    per-token figures over the tokens with a target (not -1)."""
    per_token: dict[str, list[torch.Tensor]] = {}
    adaptive: dict[float, tuple[list, list]] = {t: ([], []) for t in tolerances}
    forward_losses = []
    for inputs, targets in batches:
        valid = targets != -1
        measured = fixed_depth(model, inputs, targets)
        forward_losses.append(float(measured.pop("loss")))
        for name, values in measured.items():
            per_token.setdefault(name, []).append(values[:, valid].float().cpu())
        for tolerance in tolerances:
            losses, steps = adaptive_exit(model, inputs, targets, tolerance)
            adaptive[tolerance][0].append(losses[valid].cpu())
            adaptive[tolerance][1].append(steps[valid].cpu())
    tokens = {name: torch.cat(values, dim=1) for name, values in per_token.items()}
    report = {"loss": float(np.mean(forward_losses)), "tokens": tokens["losses"].size(1),
              "depth_curve": [{"steps": s + 1, "loss": float(row.double().mean())}
                              for s, row in enumerate(tokens["losses"])],
              "update_norm": [float(row.double().mean()) for row in tokens["updates"]],
              "adaptive": [adaptive_row(t, *adaptive[t]) for t in tolerances]}
    if "energies" in tokens:
        report["energy_per_step"] = quartile_rows(tokens["energies"], 0, "state")
        report["monotone_fraction"] = float(never_rising(tokens["energies"], transient).double().mean())
        report["monotone_after_steps"] = transient
        sample = torch.randperm(tokens["energies"].size(1), generator=torch.Generator().manual_seed(0))
        report["_trajectories"] = tokens["energies"][:, sample[:TRAJECTORY_SAMPLE]]
    return report


# --- EBT --------------------------------------------------------------------------------------

def stopped_steps(entering: torch.Tensor, tolerance: float) -> torch.Tensor:
    """[B, R] steps each position takes in a descent that stops it once its energy settles
    (`EBT.think` with stop_tolerance), from the energies [S, B, R] entering each step of the
    fixed S-step descent: EBT's positions never see each other's candidates, so a position's
    stopped descent is its fixed-step trajectory cut at its first settled step."""
    settled = energy_settled(entering[:-1], entering[1:], tolerance)  # after steps 1..S-1
    return torch.where(settled.any(dim=0), settled.int().argmax(dim=0) + 1, entering.size(0))


def ebt_dynamics(model: nn.Module, batches: Batches, tolerances: list[float], max_steps: int) -> dict:
    """The report's measurements of an EBT on `batches` (see the module doc): at the trained
    step count its final energies against its losses per token; the thinking curve up to
    `max_steps`; per tolerance, the descent of at most `max_steps` that stops per token (read
    off the fixed descent's per-token energies and losses: one descent for every tolerance)."""
    energies, losses, forward_losses, curves = [], [], [], []
    adaptive: dict[float, tuple[list, list]] = {t: ([], []) for t in tolerances}
    for inputs, targets in batches:
        valid = targets != -1
        trained = model.think(inputs, targets=targets)
        forward_losses.append(float(trained.loss_per_step[-1]))
        energies.append(trained.energies[-1][valid].float().cpu())
        losses.append(token_losses(trained.logits, targets)[valid].cpu())
        longest = model.think(inputs, steps=max_steps, targets=targets)
        curves.append(longest.loss_per_step.double().cpu())
        for tolerance in tolerances:
            steps = stopped_steps(longest.energies[:max_steps], tolerance)
            stopped_losses = longest.token_losses.gather(0, (steps - 1).unsqueeze(0)).squeeze(0)
            adaptive[tolerance][0].append(stopped_losses[valid].cpu())
            adaptive[tolerance][1].append(steps[valid].cpu())
    energy, loss = torch.cat(energies).numpy(), torch.cat(losses).double().numpy()
    order = np.argsort(energy, kind="stable")
    deciles = []
    for number, chunk in enumerate(np.array_split(order, DECILES), start=1):
        if chunk.size:
            deciles.append({"decile": number, "energy_from": float(energy[chunk].min()),
                            "energy_to": float(energy[chunk].max()), "loss": float(loss[chunk].mean()),
                            "tokens": int(chunk.size)})
    curve = torch.stack(curves).mean(dim=0)
    return {"loss": float(np.mean(forward_losses)), "tokens": int(loss.size),
            "n_steps": model.config.n_steps, "max_think_steps": max_steps,
            "energy_loss_spearman": float(rank_correlation(torch.from_numpy(energy), torch.from_numpy(loss))),
            "energy_deciles": deciles,
            "thinking_curve": [{"steps": k + 1, "loss": float(x)} for k, x in enumerate(curve)],
            "adaptive": [adaptive_row(t, *adaptive[t]) for t in tolerances],
            "_energy_loss": (energy, loss)}


# --- figures, TensorBoard, Markdown ----------------------------------------------------------

def _step_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="both")


def _adaptive_points(ax, rows: list[dict]) -> None:
    ax.scatter([r["mean_steps"] for r in rows], [r["loss"] for r in rows], color="C3", zorder=3,
               label="exit per token (tolerance)")
    for r in rows:
        ax.annotate(f"{r['tolerance']:g}", (r["mean_steps"], r["loss"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")


def recurrent_figures(report: dict, family: str) -> dict:
    """File stem -> figure: depth curve (with the adaptive exits), update norms, and for NRGPT
    the energy trajectories."""
    plt = pyplot()
    figures = {}
    fig, ax = plt.subplots(figsize=(5, 3.6))
    depth = report["depth_curve"]
    ax.plot([r["steps"] for r in depth], [r["loss"] for r in depth], marker="o", label="read out after step s")
    _adaptive_points(ax, report["adaptive"])
    ax.set(xlabel="steps (mean steps for the per-token exit)", ylabel="loss", title=f"{family}: early exit")
    _step_axis(ax)
    ax.legend(fontsize=8)
    figures["depth_curve"] = fig
    fig, ax = plt.subplots(figsize=(5, 3.6))
    steps = range(1, len(report["update_norm"]) + 1)
    ax.plot(steps, report["update_norm"], marker="o")
    ax.set(xlabel="step s", ylabel="mean ||x_s - x_(s-1)|| / ||x_(s-1)||", yscale="log",
           title=f"{family}: relative update per step")
    _step_axis(ax)
    figures["update_norms"] = fig
    if "energy_per_step" in report:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        rows = report["energy_per_step"]
        states = [r["state"] for r in rows]
        ax.plot(states, report["_trajectories"].numpy(), color="0.6", linewidth=0.6, alpha=0.6)
        ax.fill_between(states, [r["q25"] for r in rows], [r["q75"] for r in rows], color="C0", alpha=0.25,
                        label="quartiles")
        ax.plot(states, [r["mean"] for r in rows], color="C0", linewidth=2, label="mean")
        ax.set(xlabel="state s (after s steps)", ylabel="token's own energy",
               title=f"nrgpt: energies ({report['monotone_fraction']:.0%} monotone after step "
                     f"{report['monotone_after_steps']})")
        _step_axis(ax)
        ax.legend(fontsize=8)
        figures["energy_trajectories"] = fig
    return figures


def ebt_figures(report: dict) -> dict:
    """File stem -> figure: final energy against loss (hexbin); the adaptive descent against the
    thinking curve, and its loss and steps per tolerance."""
    plt = pyplot()
    energy, loss = report["_energy_loss"]
    fig, ax = plt.subplots(figsize=(5, 3.8))
    cells = ax.hexbin(energy, loss, gridsize=40, mincnt=1, bins="log", cmap="viridis")
    fig.colorbar(cells, ax=ax, label="tokens")
    ax.set(xlabel=f"final energy (after {report['n_steps']} steps)", ylabel="token loss",
           title=f"ebt: energy vs loss (Spearman {report['energy_loss_spearman']:.3f})")
    figures = {"energy_vs_loss": fig}
    fig, (ax_steps, ax_tol) = plt.subplots(1, 2, figsize=(10, 3.6))
    curve = report["thinking_curve"]
    ax_steps.plot([r["steps"] for r in curve], [r["loss"] for r in curve], marker="o", label="fixed steps")
    ax_steps.axvline(report["n_steps"], color="0.5", linestyle=":", label="trained steps")
    _adaptive_points(ax_steps, report["adaptive"])
    ax_steps.set(xlabel="steps (mean steps for the per-token stop)", ylabel="loss", title="ebt: thinking")
    _step_axis(ax_steps)
    ax_steps.legend(fontsize=8)
    rows = report["adaptive"]
    positions = range(len(rows))
    ax_tol.plot(positions, [r["loss"] for r in rows], marker="o", color="C0")
    ax_tol.set(xlabel="tolerance (relative energy change)", ylabel="loss", title="ebt: stop per token")
    ax_tol.set_xticks(list(positions), [f"{r['tolerance']:g}" for r in rows], fontsize=7)
    ax_tol.grid(alpha=0.3)
    ax_mean = ax_tol.twinx()
    ax_mean.plot(positions, [r["mean_steps"] for r in rows], marker="s", color="C1")
    ax_mean.set_ylabel("mean steps", color="C1")
    fig.tight_layout()
    figures["adaptive"] = fig
    return figures


def scalars(report: dict) -> dict[str, float]:
    """The report's figures as TensorBoard tags `dynamics/...` (curves as one tag per step, like
    the models' per-step diagnostics)."""
    values = {"dynamics/loss": report["loss"]}
    for row in report.get("depth_curve", []):
        values[f"dynamics/depth_loss/step_{row['steps']:02d}"] = row["loss"]
    for s, value in enumerate(report.get("update_norm", []), start=1):
        values[f"dynamics/update_norm/step_{s:02d}"] = value
    for row in report.get("energy_per_step", []):
        for stat in ("mean", "q25", "median", "q75"):
            values[f"dynamics/energy_{stat}/step_{row['state']:02d}"] = row[stat]
    for row in report.get("thinking_curve", []):
        values[f"dynamics/think_loss/step_{row['steps']:02d}"] = row["loss"]
    for row in report.get("energy_deciles", []):
        values[f"dynamics/energy_decile_loss/decile_{row['decile']:02d}"] = row["loss"]
    for key in ("monotone_fraction", "energy_loss_spearman"):
        if key in report:
            values[f"dynamics/{key}"] = report[key]
    for row in report["adaptive"]:
        for stat in ("loss", "mean_steps"):
            values[f"dynamics/adaptive/tol_{row['tolerance']:g}/{stat}"] = row[stat]
    return values


def markdown(report: dict, figure_names: list[str]) -> str:
    lines = [f"# Descent dynamics of {report['flavor']} at step {report['step']}", "",
             f"Source `{report['source']}`; {report['tokens']} {report['split']} tokens "
             f"({report['batches']} batches of {report['batch_size']}); loss {report['loss']:.4f}.", "",
             BATCHES_USED.format(batches=report["batches"], split=report["split"]), ""]
    if "depth_curve" in report:
        lines += ["Loss when reading out after step s, and mean relative update of step s:", "",
                  markdown_table([{"steps": r["steps"], "loss": r["loss"], "update_norm": u}
                                  for r, u in zip(report["depth_curve"], report["update_norm"])],
                                 {"loss": ".4f", "update_norm": ".4g"})]
    if "energy_per_step" in report:
        lines += ["Each token's own energy at state s (after s steps); "
                  f"{report['monotone_fraction']:.1%} of the tokens never rise after step "
                  f"{report['monotone_after_steps']}:", "",
                  markdown_table(report["energy_per_step"], {k: ".4g" for k in ("mean", "q25", "median", "q75")})]
    if "thinking_curve" in report:
        lines += [f"Trained with {report['n_steps']} steps. Spearman correlation of final energy and token "
                  f"loss: {report['energy_loss_spearman']:.3f}. Loss per decile of final energy:", "",
                  markdown_table(report["energy_deciles"], {"energy_from": ".4g", "energy_to": ".4g", "loss": ".4f"}),
                  "Thinking curve (loss after k steps):", "",
                  markdown_table(report["thinking_curve"], {"loss": ".4f"})]
    criterion = "relative update" if "depth_curve" in report else "relative energy change"
    lines += [f"Exit per token once its {criterion} is under the tolerance:", "",
              markdown_table(report["adaptive"], {"tolerance": "g", "mean_steps": ".2f", "loss": ".4f"})]
    lines += [f"![{name}]({name}.png)" for name in figure_names]
    return "\n".join(lines) + "\n"


# --- the command ------------------------------------------------------------------------------
