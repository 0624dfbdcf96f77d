"""What resuming on another world size or ZeRO stage costs, measured side by side in one process
(one rank, CPU): writing a checkpoint, loading it as saved, converting it once to DeepSpeed's
universal format, and loading it through that form; plus the disk the universal copy takes.

    python -m bench.elastic [--flavor gpt-124m] [--stage 2] [--rounds 3]

The model takes one AdamW step on random tokens first, so the optimizer state is real. Each
round writes a fresh checkpoint and times the four operations on it; the script prints the
medians and their ratios to the save. docs/benchmarks.md records them."""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from common.cli import ArgumentParser, run_command


def tree_bytes(path: Path) -> int:
    """Bytes under `path`, each hard-linked file once."""
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.elastic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="gpt-124m")
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage (1-3)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import deepspeed

    from pretrain.config import load_config
    from pretrain.config.validation import validate
    from pretrain.training import checkpoint
    from pretrain.training.checkpoint.layout import UNIVERSAL
    from pretrain.training.engine import distributed_env
    from pretrain.training.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    try:
        config_file = work / "bench.yaml"
        config_file.write_text(yaml.safe_dump({
            "output_root": str(work), "run_name": "run", "model": {"flavor": args.flavor},
            "data": {"path": str(work / "unused"), "seq_len": args.seq_len, "micro_batch_size": 1},
            "train": {"max_steps": 1, "global_batch_size": 1}, "zero": {"stage": args.stage}}))
        cfg = load_config(config_file)
        validate(cfg, world_size=1, has_gpu=False)
        distributed_env()
        deepspeed.init_distributed(verbose=False)
        trainer = Trainer(cfg)
        trainer.build_engine(dataset_vocab_size=50257)  # the dataset is never read
        engine = trainer.engine
        tokens = torch.randint(0, 50257, (1, args.seq_len + 1))
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]).loss)
        engine.step()

        times = {"save": [], "load as saved": [], "convert to universal (once)": [], "load universal": []}
        sizes = {}
        for round_ in range(args.rounds):
            step = round_ + 1
            manager = trainer.checkpoints
            tag_dir = manager.ckpt_dir / checkpoint.tag_for(step)
            times["save"].append(timed(lambda: manager.save(engine, step, {}, {}, data=None)))
            times["load as saved"].append(timed(lambda: checkpoint.load_engine_state(engine, tag_dir, False)))
            times["convert to universal (once)"].append(timed(lambda: checkpoint.ensure_universal(tag_dir)))
            times["load universal"].append(timed(lambda: checkpoint.load_engine_state(engine, tag_dir, True)))
            sizes = {"checkpoint": tree_bytes(tag_dir) - tree_bytes(tag_dir / UNIVERSAL),
                     "universal copy": tree_bytes(tag_dir / UNIVERSAL)}
        trainer.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.flavor}, ZeRO-{args.stage}, 1 rank, {args.rounds} rounds (medians)")
    save = statistics.median(times["save"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:30s} {median:8.2f} s   {median / save:5.2f} x save")
    for name, size in sizes.items():
        print(f"  {name:30s} {size / 1e9:8.2f} GB")


if __name__ == "__main__":
    run_command(main)
