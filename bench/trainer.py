"""Trainer overhead, measured side by side in one process (one rank, CPU):

- a bare PyTorch loop (forward, backward, global-norm clipping, AdamW) on the same model and
  the same in-memory batches, against the trainer's own `Trainer.train_step` under DeepSpeed
  ZeRO stages 0-3: their ratio is what the engine and the loop's bookkeeping cost;
- a checkpoint save and load (DeepSpeed shards + the trainer's state) in units of a step.

    python -m bench.trainer [--flavor gpt-mini] [--steps 30]

Prints the figures and ratios; docs/benchmarks.md records them."""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent


def bare_step_times(model_config, batches, lr: float, clip: float, steps: int) -> list[float]:
    from pretrain.models import build

    torch.manual_seed(0)
    model = build(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    times = []
    for i in range(steps):
        inputs, targets = batches[i % len(batches)]
        start = time.perf_counter()
        loss = model(inputs, targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the trainer syncs once per step too
        times.append(time.perf_counter() - start)
    return times


def trainer(config_file: Path, overrides: list[str]):
    from pretrain.config import load_config, validate
    from pretrain.train import Trainer

    cfg = load_config(config_file, overrides)
    validate(cfg, world_size=1, has_gpu=False)
    run = Trainer(cfg)
    run.setup()
    return run


def trainer_step_times(run, batches, steps: int) -> list[float]:
    run.batches = iter(batches * (steps // len(batches) + 1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run.train_step(log_now=False)
        run.state.step += 1
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()

    from data_pipeline.loader import build_loader
    from data_pipeline.prepare import prepare

    work = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        data = work / "data"
        prepare("shakespeare", str(data), seq_len=args.seq_len, val_fraction=0.05, tokenizer="char",
                max_docs=80, num_proc=1)
        config = {"output_root": str(work / "runs"), "model": {"flavor": args.flavor},
                  "data": {"path": str(data), "seq_len": args.seq_len, "micro_batch_size": args.micro_batch,
                           "num_workers": 0},
                  "optimizer": {"lr": 1e-3, "grad_clip": 1.0}, "schedule": {"kind": "constant"},
                  "train": {"max_steps": 10**6, "global_batch_size": args.micro_batch},
                  "checkpoint": {"keep": 1}}
        config_file = work / "bench.yaml"
        config_file.write_text(yaml.safe_dump(config))
        loader = build_loader(str(data), "train", micro_batch_size=args.micro_batch, seed=0, num_workers=0)
        batches = [batch for batch, _ in zip(loader, range(8))]
        warmup = 5

        runs = {stage: trainer(config_file, [f"zero.stage={stage}", f"run_name=zero{stage}"])
                for stage in (0, 1, 2, 3)}
        model_config = runs[0].model_config
        tokens = args.micro_batch * args.seq_len
        results = {}
        for _ in range(2):  # interleave the contenders, keep each one's best round
            median = statistics.median(bare_step_times(model_config, batches, 1e-3, 1.0, args.steps + warmup)[warmup:])
            results["bare PyTorch loop"] = min(results.get("bare PyTorch loop", median), median)
            for stage, run in runs.items():
                name = f"trainer, ZeRO-{stage}"
                median = statistics.median(trainer_step_times(run, batches, args.steps + warmup)[warmup:])
                results[name] = min(results.get(name, median), median)

        bare = results["bare PyTorch loop"]
        print(f"{args.flavor}: {runs[0].params / 1e6:.2f}M params, {tokens} tokens per step, "
              f"{args.steps} steps (median of each, best of 2 interleaved rounds), 1 process, fp32")
        print(f"{'loop':<22}{'ms/step':>10}{'tokens/s':>12}{'vs bare':>10}")
        for name, seconds in results.items():
            print(f"{name:<22}{seconds * 1e3:>10.1f}{tokens / seconds:>12,.0f}{bare / seconds:>10.2f}")

        run = runs[2]
        start = time.perf_counter()
        run.save()
        save = time.perf_counter() - start
        tag = run.ckpt_dir / f"step_{run.state.step:08d}"
        size = sum(p.stat().st_size for p in tag.iterdir())
        start = time.perf_counter()
        run._load(tag)
        load = time.perf_counter() - start
        step = results["trainer, ZeRO-2"]
        print(f"checkpoint (ZeRO-2, {size / 1e6:.1f} MB): save {save * 1e3:.0f} ms = {save / step:.1f} steps, "
              f"load {load * 1e3:.0f} ms = {load / step:.1f} steps")
        for run in runs.values():
            run.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
