"""Mixed precision at paper depth: fp32, pure bf16 and bf16 under autocast, side by side.

Three families at the papers' depth and narrow widths, on character-level Shakespeare (T = 64):
NRGPT with 12 descent steps (D = 64, 2 full heads), EBT S1 and EBT S2 with 12 layers (D = 64,
4 heads). For each, in each `train.precision`:

- fp32;
- bf16: DeepSpeed's bf16 mode, the whole model in bf16 (weights, residual stream, NRGPT's
  recurrent state, EBT's observed stream; the candidate and the losses stay float32);
- bf16-autocast: fp32 weights and optimizer, the forward under torch.autocast (DeepSpeed's
  torch_autocast), as the authors' nanoGPT-style code trains;

1. gradients: one batch's gradients at the initial weights against float64, as the relative
   error ||g - g64|| / ||g64|| of each parameter group (EBT: its descent with the recipe's
   steps, without Langevin noise or replay, whose draws would differ between dtypes);
2. training: `--seeds` runs of `--steps` steps (EBT: `--ebt-steps`, each 5-6x an NRGPT step
   on the CPU) through the real trainer (one process, ZeRO-2, batches of 4 x 64 characters)
   and the val loss at the end (`eval.batches` 8).

    python -m bench.precision [--steps 200] [--ebt-steps 40] [--seeds 3] [--families nrgpt ebt_s1 ebt_s2]
                              [--skip-training]

Prints the tables; docs/benchmarks.md records them."""
from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.models import print_table
from common.cli import ArgumentParser, run_command
from pretrain.config import load_config, model_config
from pretrain.config.precision import precisions
from pretrain.models import build

REPO = Path(__file__).resolve().parent.parent
PRECISIONS = ("fp32", "bf16", "bf16-autocast")
"""The training precisions compared (fp16 would need a GPU)."""
DATA = ["data.source=shakespeare", "data.tokenizer=char", "data.seq_len=64", "data.val_fraction=0.05",
        "data.micro_batch_size=4", "train.global_batch_size=4"]
EBT_DEPTH = ["model.overrides.n_layer=12", "model.overrides.n_embd=64", "model.overrides.n_head=4"]
FAMILIES = {
    "nrgpt": ("configs/tiny/nrgpt.yaml", ["model.overrides.n_embd=64", "model.overrides.n_head=2",
                                          "model.overrides.n_steps=12"]),
    "ebt_s1": ("configs/tiny/ebt.yaml", EBT_DEPTH),
    "ebt_s2": ("configs/tiny/ebt.yaml", ["model.flavor=ebt-s2-tiny", *EBT_DEPTH]),
}
"""Family -> (tiny config, overrides to paper depth at D = 64)."""
GROUPS = {
    "embeddings": ("wte", "wpe", "tok_embeddings", "candidate_embedding", "time_embeddings"),
    "attention": ("attn.", "attention."),
    "mlp/energy": ("ff.", "feed_forward.", "s_ff", "eta."),
    "norms": ("norm", "ln_f"),
    "head": ("lm_head", "energy_head", "alpha"),
}
"""Parameter group -> name fragments (the first group with a match wins; NRGPT's s_ff and eta
go with its feed-forward energy, EBT's alpha with its energy head)."""


BF16_GRADIENT_ERRORS = {
    "nrgpt": {"embeddings": 1.42e-2, "attention": 1.27e-2, "mlp/energy": 1.06e-2, "norms": 1.33e-2, "head": 8.4e-3},
    "ebt_s1": {"embeddings": 4.3e-3, "attention": 7.2e-3, "mlp/energy": 6.5e-3, "norms": 4.8e-3, "head": 3.7e-3},
    "ebt_s2": {"embeddings": 5.4e-3, "attention": 7.7e-3, "mlp/energy": 7.6e-3, "norms": 5.0e-3, "head": 3.6e-3},
}
"""What this benchmark measured in pure bf16 (`train.precision=bf16`), 2026-12-03: per family
and parameter group, ||g - g64|| / ||g64|| at the initial weights, mean over seeds 1-3
(docs/benchmarks.md, "Mixed precision at paper depth", has the whole table). `bench.gpu` sets
its bf16 check's tolerance from these."""


def group_of(name: str) -> str:
    return next(group for group, parts in GROUPS.items() if any(part in name for part in parts))


def run_config(root: Path, family: str, seed: int, extra: list[str] = ()):
    config, overrides = FAMILIES[family]
    return config, [f"output_root={root}", f"data.path={root / 'shakespeare-char-64'}", *DATA, *overrides,
                    f"seed={seed}", *extra]


def loss_of(model, idx: torch.Tensor, targets: torch.Tensor, candidate: torch.Tensor | None,
            alpha_scale: torch.Tensor | None) -> torch.Tensor:
    """The training loss of one batch: NRGPT's forward; EBT's descent from a given candidate
    with a given step-size factor and no Langevin noise (the model's own draws would differ
    between dtypes)."""
    if candidate is None:
        return model(idx, targets).loss
    return model.descent(idx, candidate, model.config.n_steps, targets=targets, alpha_scale=alpha_scale,
                         learning=True).loss


def group_gradients(model, precision: str, batch, candidate, alpha_scale) -> dict[str, torch.Tensor]:
    """Per group, the concatenated float64 gradients of one batch's loss in `precision` (a
    training precision's name, or "fp64" for the reference; the weights of `model` being the
    master weights)."""
    model = copy.deepcopy(model)
    reference = precision == "fp64"
    training = None if reference else precisions()[precision]
    model.to(torch.float64 if reference else training.param_dtype)  # as DeepSpeed casts the module
    idx, targets = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not reference and training.autocast):
        wide_candidate = None if candidate is None else candidate.to(torch.float64 if reference else torch.float32)
        loss = loss_of(model, idx, targets, wide_candidate, alpha_scale)
    loss.float().backward()
    grads: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads.setdefault(group_of(name), []).append(p.grad.double().flatten())
    return {group: torch.cat(parts) for group, parts in grads.items()}


def gradient_errors(root: Path, family: str, seed: int) -> dict[str, dict[str, float]]:
    """precision -> group -> ||g - g64|| / ||g64|| at the initial weights of `seed`."""
    # here, not at the top: bench.gpu reads this module's figures where the data pipeline's
    # packages are not installed
    from bench.replay import batches
    from data_pipeline.prepare import ensure_prepared

    config, overrides = run_config(root, family, seed)
    cfg = load_config(REPO / config, overrides)
    manifest = ensure_prepared(cfg.data.path, cfg.data.source, seq_len=cfg.data.seq_len,
                               tokenizer=cfg.data.tokenizer, val_fraction=cfg.data.val_fraction)
    torch.manual_seed(seed)
    model = build(model_config(cfg, manifest["vocab_size"])).train()
    batch = batches(cfg.data.path, "train", 1, cfg.data.micro_batch_size, seed)[0]
    candidate = alpha_scale = None
    if family.startswith("ebt"):
        B, T = batch[0].shape
        candidate = model.initial_candidate(B, T, batch[0].device, seeded=True)
        alpha_scale = model.sample_alpha_scale(B, T, batch[0].device)
    reference = group_gradients(model, "fp64", batch, candidate, alpha_scale)
    errors = {}
    for precision in PRECISIONS:
        grads = group_gradients(model, precision, batch, candidate, alpha_scale)
        errors[precision] = {group: float((grads[group] - g64).norm() / g64.norm())
                             for group, g64 in reference.items()}
    return errors


def train(root: Path, family: str, precision: str, seed: int, steps: int) -> dict:
    """One run through the trainer; its val loss at the end and seconds per step."""
    name = f"{family}-{precision}-{seed}"
    config, overrides = run_config(root, family, seed, [
        f"run_name={name}", f"train.precision={precision}", f"train.max_steps={steps}",
        f"train.log_interval={steps}", f"eval.interval={steps}", "eval.batches=8", "eval.sample_tokens=0",
        "checkpoint.interval=0", "zero.stage=2"])
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pretrain.train", "--config", config, *overrides],
                            cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((root / name / "summary.json").read_text())
    return {"val_loss": summary["final_val_loss"], "skipped": summary["skipped_steps"],
            "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.precision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per NRGPT run")
    parser.add_argument("--ebt-steps", type=int, default=40, help="training steps per EBT run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--families", nargs="+", choices=tuple(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--skip-training", action="store_true", help="only the gradients against float64")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = []
        for family in args.families:
            per_seed = [gradient_errors(root, family, seed) for seed in range(1, args.seeds + 1)]
            for precision in PRECISIONS:
                groups = [group for group in GROUPS if group in per_seed[0][precision]]
                rows.append((family, precision, *(f"{statistics.mean(e[precision][g] for e in per_seed):.2e}"
                                                  for g in groups)))
            print(f"gradients against float64, mean over {args.seeds} seeds ({family}: groups "
                  f"{', '.join(groups)})", flush=True)
            print_table(("family", "precision", *groups), rows[-len(PRECISIONS):])
        if args.skip_training:
            return 0
        print(f"val loss after {args.steps} (NRGPT) or {args.ebt_steps} (EBT) steps of 4 x 64 characters", flush=True)
        header = ("family", "precision", *(f"seed {s}" for s in range(1, args.seeds + 1)), "mean", "s/run", "skipped")
        rows = []
        for family in args.families:
            for precision in PRECISIONS:
                steps = args.ebt_steps if family.startswith("ebt") else args.steps
                runs = [train(root, family, precision, seed, steps) for seed in range(1, args.seeds + 1)]
                losses = [r["val_loss"] for r in runs]
                rows.append((family, precision, *(f"{v:.4f}" for v in losses), f"{statistics.mean(losses):.4f}",
                             f"{statistics.mean(r['wall_s'] for r in runs):.0f}", sum(r["skipped"] for r in runs)))
                print("  ".join(map(str, rows[-1])), flush=True)
        print()
        print_table(header, rows)
    return 0


if __name__ == "__main__":
    run_command(main)
