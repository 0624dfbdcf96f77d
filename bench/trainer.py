"""Trainer overhead, measured side by side in one process (one rank, CPU):

- a bare PyTorch loop (forward, backward, global-norm clipping, AdamW) on the same model and
  the same in-memory batches, against the trainer's own `Trainer.train_step` under DeepSpeed
  ZeRO stages 0-3: their ratio is what the engine and the loop's bookkeeping cost;
- a checkpoint save and load (DeepSpeed shards + the trainer's state) in units of a step.

    python -m bench.trainer [--flavor gpt-mini] [--steps 30]

Prints the figures and ratios; docs/benchmarks.md records them."""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from common.cli import ArgumentParser, run_command

REPO = Path(__file__).resolve().parent.parent


class BareLoop:
    """The reference: forward, backward, global-norm clipping and AdamW, nothing else."""

    def __init__(self, model_config, batches, lr: float, clip: float):
        from pretrain.models import build

        torch.manual_seed(0)
        self.model = build(model_config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        self.batches, self.clip, self.i = batches, clip, 0

    def step(self) -> None:
        inputs, targets = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = self.model(inputs, targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # the trainer syncs once per step too


class TrainerLoop:
    """The trainer's own step (`Trainer.train_step`) on the same in-memory batches."""

    def __init__(self, config_file: Path, overrides: list[str], batches):
        from pretrain.config import load_config
        from pretrain.config.validation import validate
        from pretrain.training.trainer import Trainer

        cfg = load_config(config_file, overrides)
        validate(cfg, world_size=1, has_gpu=False)
        self.run = Trainer(cfg)
        self.run.setup()
        self.run.batches = (batch for _ in range(10**9) for batch in batches)

    def step(self) -> None:
        self.run.train_step(log_now=False)
        self.run.state.step += 1


def side_by_side(contenders: dict, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each contender, taking their steps in turn so that the load
    of a shared machine falls on all of them alike."""
    times = {name: [] for name in contenders}
    for i in range(warmup + steps):
        for name, loop in contenders.items():
            start = time.perf_counter()
            loop.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    # one thread: on a shared machine, intra-op threads that wait for busy cores dominate
    torch.set_num_threads(1)

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

        trainers = {stage: TrainerLoop(config_file, [f"zero.stage={stage}", f"run_name=zero{stage}"], batches)
                    for stage in (0, 1, 2, 3)}
        first = trainers[0].run
        contenders = {"bare PyTorch loop": BareLoop(first.model_config, batches, 1e-3, 1.0),
                      **{f"trainer, ZeRO-{stage}": loop for stage, loop in trainers.items()}}
        results = side_by_side(contenders, args.steps, warmup=3)
        tokens = args.micro_batch * args.seq_len
        bare = results["bare PyTorch loop"]
        print(f"{args.flavor}: {first.params / 1e6:.2f}M params, {tokens} tokens per step, median of "
              f"{args.steps} steps each (contenders in turn), 1 process, 1 thread, fp32")
        print(f"{'loop':<22}{'ms/step':>10}{'tokens/s':>12}{'vs bare':>10}")
        for name, seconds in results.items():
            print(f"{name:<22}{seconds * 1e3:>10.1f}{tokens / seconds:>12,.0f}{bare / seconds:>10.2f}")

        run = trainers[2].run
        start = time.perf_counter()
        run.save()
        save = time.perf_counter() - start
        tag = run.checkpoints.ckpt_dir / f"step_{run.state.step:08d}"
        size = sum(p.stat().st_size for p in tag.iterdir())
        start = time.perf_counter()
        run.checkpoints.reload_newest(run.engine)  # checksums verified, as on a resume
        load = time.perf_counter() - start
        step = results["trainer, ZeRO-2"]
        print(f"checkpoint (ZeRO-2, {size / 1e6:.1f} MB): save {save * 1e3:.0f} ms = {save / step:.2f} steps, "
              f"load {load * 1e3:.0f} ms = {load / step:.2f} steps")
        for loop in trainers.values():
            loop.run.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    run_command(main)
