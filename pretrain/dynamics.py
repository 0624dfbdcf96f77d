"""The descent measured: what happens inside the steps of a trained recurrent or energy-based
model (the NRGPT and EBT papers' claims about it), on a split of its training data.

    python -m pretrain.dynamics RUN_DIR|CHECKPOINT|EXPORT --out DIR [--batches N] [--split val]
        [--batch-size B] [--tolerances 0,0.01,...] [--transient K] [--max-think-steps N]
        [--data DATA_DIR] [--device cpu|cuda] [--dtype fp32|bf16]

writes DIR/dynamics.json, DIR/dynamics.md and PNG figures (DIR is replaced whole, and only if it
is empty or a previous output), and for a run or one of its checkpoints the same scalars and
figures into the run's TensorBoard at the checkpoint's step (`dynamics/...`).

- gpt_rec and nrgpt: the loss when reading out after each step (early exit at a fixed depth),
  the mean relative update per step, and the loss of an exit per token once its relative update
  falls under each tolerance; NRGPT also each token's own energy at every state (mean and
  quartiles) and the share of tokens whose energy never rises after the first K steps.
- ebt: the rank correlation of a token's final energy with its loss, the loss per decile of
  final energy, the thinking curve up to --max-think-steps, and the loss of a descent that stops
  per token once a step changes its energy by less than each tolerance (relative).

The evaluated batches are those of the trainer's evaluation (the split in order, the run's
micro-batch and eval.batches by default), so the loss after the last step is its val loss.
Bad input is one line on stderr (`error: ...`) and exit status 2, with nothing written."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import ArgumentParser, run_command
from common.fileio import atomic_directory, atomic_write_text
from pretrain.config import DataSection, EvalSection
from pretrain.models.probes import descending_families
from pretrain.models.weights import LoadError
from pretrain.training.dynamics_measures import (DEFAULT_TOLERANCES, NRGPT_TRANSIENT, REPORT, DynamicsError,
                                                 ebt_dynamics, ebt_figures, evaluation_batches, markdown,
                                                 recurrent_dynamics, recurrent_figures, scalars)
from pretrain.training.metrics import append_to_tensorboard, pyplot
from pretrain.training.trained import DTYPES, TrainedModel, inside_trainer_directory, load_trained, run_dir_of

@dataclass
class Settings:
    """What the command measures, resolved from its options and the run's config."""

    data_dir: str
    split: str
    batch_size: int
    batches: int
    seed: int
    tolerances: list[float]
    transient: int
    max_think_steps: int | None


def tolerance_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise DynamicsError(f"--tolerances {text!r}: expected numbers separated by commas, e.g. 0,0.01,0.1") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise DynamicsError(f"--tolerances {text!r}: each tolerance must be a finite number >= 0")
    return values


def check_options(args) -> list[float]:
    """The options' ranges, before anything is loaded; the tolerances."""
    out = Path(args.out)
    inside = inside_trainer_directory(out)
    if inside is not None:
        raise DynamicsError(f"--out {out} {inside}")
    # the output directory is replaced whole: only an empty one or a previous output may be
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / REPORT).is_file())):
        raise DynamicsError(f"--out {out} exists and is not an empty directory or a previous output of "
                            "this command (which it replaces whole); choose a new directory")
    for name in ("batches", "batch_size", "max_think_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DynamicsError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return tolerance_list(args.tolerances)


def resolve_settings(args, trained: TrainedModel, tolerances: list[float]) -> Settings:
    """The options, with the run's data, micro-batch and eval batches where not given."""
    spec = trained.spec
    if not spec.descends:
        raise DynamicsError(f"{args.source} is a {trained.family} model: the descent dynamics apply to "
                            f"{', '.join(descending_families())}")
    run_config = trained.run_config
    data, evaluation = run_config.get("data", {}), run_config.get("eval", {})
    data_dir = args.data or data.get("path")
    if not data_dir or not (Path(data_dir) / "manifest.json").is_file():
        raise DynamicsError(f"the run's data ({data_dir or 'not recorded'}) is not there: give --data DIR, "
                            "a dataset prepared with the run's tokenizer and sequence length")
    check_dataset(str(data_dir), args.split, trained.model_config.block_size)
    settings = Settings(data_dir=str(data_dir), split=args.split,
                        batch_size=args.batch_size or data.get("micro_batch_size", DataSection.micro_batch_size),
                        batches=args.batches or evaluation.get("batches", EvalSection.batches),
                        seed=run_config.get("seed", 0), tolerances=tolerances,
                        transient=NRGPT_TRANSIENT if args.transient is None else args.transient,
                        max_think_steps=None)
    n_steps = trained.model_config.n_steps
    if spec.thinks:
        settings.max_think_steps = args.max_think_steps or 4 * n_steps
    elif args.max_think_steps is not None:
        raise DynamicsError("--max-think-steps applies to EBT models only")
    if not spec.step_energies and args.transient is not None:
        raise DynamicsError(f"--transient applies to NRGPT models only (a {trained.family} model has no "
                            "energy per token to rise)")
    if spec.step_energies and not 0 <= settings.transient < n_steps:
        raise DynamicsError(f"--transient must be in [0, {n_steps - 1}] (the model takes {n_steps} steps), "
                            f"got {settings.transient}")
    return settings


def check_dataset(data_dir: str, split: str, context: int) -> None:
    """A dataset the model can read: windows that fit its context, and some in `split`."""
    from data_pipeline.packing import read_manifest

    manifest = read_manifest(data_dir)
    if manifest["seq_len"] > context:
        raise DynamicsError(f"the dataset at {data_dir} has windows of {manifest['seq_len']} tokens, longer than "
                            f"the model's context of {context}; give --data a dataset prepared with "
                            f"--seq-len {context} or less")
    if split in manifest["splits"] and manifest["splits"][split].get("windows", 0) == 0:  # no split: the loader says
        others = [name for name, entry in manifest["splits"].items() if entry.get("windows", 0)]
        raise DynamicsError(f"the dataset at {data_dir} has no {split} split (a val split needs a --val-fraction "
                            f"above 0 when preparing); give --split {' or '.join(others) or 'train'}, or --data "
                            "a dataset that has one")


def measure(trained: TrainedModel, settings: Settings, device: torch.device) -> dict:
    """The report (before its figures): the source, the settings and the family's measurements."""
    batches = evaluation_batches(settings.data_dir, settings.split, settings.batch_size, settings.batches,
                                 settings.seed, device)
    if trained.spec.thinks:
        measured = ebt_dynamics(trained.model, batches, settings.tolerances, settings.max_think_steps)
    else:
        measured = recurrent_dynamics(trained.model, batches, settings.tolerances, settings.transient)
    return {"source": str(trained.source), "flavor": trained.flavor, "family": trained.family,
            "step": trained.step, "data": settings.data_dir, "split": settings.split,
            "batches": settings.batches, "batch_size": settings.batch_size, **measured}


def dynamics(args) -> tuple[Path, str]:
    """Measure, write the output directory; (its path, the report's tables for the console)."""
    tolerances = check_options(args)
    trained = load_trained(args.source, device=args.device, dtype=args.dtype)
    settings = resolve_settings(args, trained, tolerances)
    report = measure(trained, settings, torch.device(args.device))
    figures = ebt_figures(report) if trained.spec.thinks else recurrent_figures(report, trained.family)
    plt = pyplot()
    out = Path(args.out)
    with atomic_directory(out) as staging:
        for name, figure in figures.items():
            figure.savefig(staging / f"{name}.png", dpi=110, bbox_inches="tight")
            plt.close(figure)
        public = {key: value for key, value in report.items() if not key.startswith("_")}
        atomic_write_text(staging / REPORT, json.dumps(public, indent=2) + "\n")
        atomic_write_text(staging / "dynamics.md", markdown(public, list(figures)))
    run_dir = run_dir_of(trained.source)
    if run_dir is not None:
        append_to_tensorboard(run_dir / "tb", trained.step, scalars(public),
                              {f"dynamics/{name}": out / f"{name}.png" for name in figures})
    return out, markdown(public, [])


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pretrain.dynamics", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="run directory (its newest complete checkpoint), one checkpoint, or an export")
    parser.add_argument("--out", required=True,
                        help="output directory (replaced whole: new, empty or a previous output)")
    parser.add_argument("--split", default="val", help="split of the dataset to evaluate on (default val)")
    parser.add_argument("--batches", type=int, help="micro-batches to evaluate (default: the run's eval.batches)")
    parser.add_argument("--batch-size", type=int, help="sequences per batch (default: the run's data.micro_batch_size)")
    parser.add_argument("--data", help="prepared dataset to read (default: the run's data.path)")
    parser.add_argument("--tolerances", default=",".join(f"{t:g}" for t in DEFAULT_TOLERANCES),
                        help="exit tolerances, comma-separated (relative update; EBT: relative energy change)")
    parser.add_argument("--transient", type=int,
                        help=f"NRGPT: steps before which the energy may rise (monotone fraction); "
                             f"default {NRGPT_TRANSIENT}")
    parser.add_argument("--max-think-steps", type=int, help="EBT: most descent steps (default 4 x the trained ones)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    from data_pipeline.errors import DataError

    try:
        out, tables = dynamics(args)
    except (DynamicsError, LoadError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tables, end="")
    print(f"dynamics: {out / REPORT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_command(main)
