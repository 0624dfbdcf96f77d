"""EBT S2's replay store on CPU: training with compact stores (the top-k probabilities of each
stored candidate with their ids, the rest of the mass spread evenly) against the exact store
(whole fp32 logits), side by side over the same steps.

ebt-s2-tiny on the tiny EBT config's data (bundled Shakespeare, GPT-2 BPE: V = 50304, T = 64),
one process, a batch of 4 (+2 replayed rows) per step. Per seed, every store trains from the
same initial weights on the same batches with the same random draws, so the runs differ only
through what the store gives back to the replayed rows.

1. Per store: bytes per stored row (T positions), S2 training loss (mean of the last quarter
   of the steps) and val loss at the end, each as the mean over seeds and the mean paired
   difference to the exact store (with the spread of that difference over seeds, and for scale
   the spread of the exact store's own losses over seeds); and the store of ebt-s2-small
   (configs/owt/ebt_s2_small.yaml: 192 rows of T = 1024, V = 50304) per rank.
2. What a compact store keeps: the share of each stored candidate's probability mass in its
   top k (the exact runs' stores at the end), and the S2 loss of replayed rows restarted from
   the compact store against the exact one (same model, rows and noise: the store's effect
   alone, without the runs' divergence).

    python -m bench.replay [--steps 60] [--seeds 3] [--top-k 64 1024] [--threads 2]
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

import torch

from bench.models import print_table
from common.cli import ArgumentParser, run_command
from data_pipeline.loader import build_loader
from data_pipeline.prepare import ensure_prepared
from pretrain.config import load_config, model_config
from pretrain.models import build, resolve
from pretrain.models.replay import ReplayStore, replay_store_bytes
from pretrain.training.engine import keep_freed_host_memory
from pretrain.training.optim import build_optimizer, lr_factor, param_groups, set_lr

CONFIG = "configs/tiny/ebt.yaml"
S2 = ["model.flavor=ebt-s2-tiny", "optimizer.decay=all", "optimizer.weight_decay=0.01",
      "data.micro_batch_size=4", "train.global_batch_size=4"]
"""The tiny EBT config with the S2 recipe's flavor and decay set, one process, 4 rows a step."""
VAL_BATCHES = 8
PROBED_TOP_K = (16, 64, 256, 1024, 4096)
"""The k of part 2, whichever stores were trained."""


def batches(data_dir: str, split: str, count: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `count` micro-batches of a split in the loader's order for `seed`."""
    batches = iter(build_loader(data_dir, split, micro_batch_size=size, seed=seed, shuffle=split == "train",
                                num_workers=0))
    taken = list(itertools.islice(batches, count))
    batches.close()
    return taken


def train(cfg, config, seed: int, train_batches, val_batches) -> dict:
    """One run: the S2 training losses per step, the val loss at the end and the final model."""
    torch.manual_seed(seed)
    model = build(config).train()
    groups, infos = param_groups(model, cfg.optimizer)
    optimizer = build_optimizer(groups, cfg.optimizer, cfg.zero, on_gpu=False)
    schedule = replace(cfg.schedule, warmup_steps=max(1, len(train_batches) // 6))
    losses = []
    for step, (inputs, targets) in enumerate(train_batches):
        set_lr(optimizer, infos, cfg.optimizer.lr * lr_factor(step, schedule, cfg.optimizer.lr, len(train_batches)))
        torch.manual_seed(seed * 100_003 + step)  # the same draws for every store
        loss = model(inputs, targets).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        val = statistics.fmean(model(inputs, targets).loss.item() for inputs, targets in val_batches)
    return {"train": losses, "val": val, "model": model}


def kept_mass(store: ReplayStore, top_ks: tuple[int, ...]) -> dict[int, float]:
    """Mean share of a stored candidate's probability mass in its top k, over stored positions."""
    slots = torch.tensor(store.youngest_first())
    length = int(store.tensors["lengths"][slots[0]])
    top = store.candidates(slots, length).softmax(-1).topk(max(top_ks), dim=-1).values
    return {k: top[..., :k].sum(-1).mean().item() for k in top_ks}


def replayed_loss_change(model, top_ks: tuple[int, ...], rows: int = 8) -> dict[int, float]:
    """|S2 loss of `rows` stored rows restarted from a compact store - from the exact store|,
    relative, with the model, rows and random draws of a training step held fixed."""
    store = model.replay_store
    slots = torch.tensor(store.youngest_first()[:rows])
    length = int(store.tensors["lengths"][slots[0]])
    idx, targets = store.tensors["tokens"][slots, :length], store.tensors["targets"][slots, :length]
    exact = store.candidates(slots, length)
    model.train()

    def loss(candidate):
        torch.manual_seed(0)
        return model.descent(idx, candidate, model.config.n_steps, targets=targets,
                             alpha_scale=model.sample_alpha_scale(rows, length, idx.device),
                             noise_std=model.config.langevin_noise_std).loss_per_step[-1].item()

    reference = loss(exact)
    changes = {}
    for k in top_ks:
        compact = ReplayStore(replace(model.config, replay_top_k=k))
        compact.store(idx, targets, exact)
        changes[k] = abs(loss(compact.candidates(torch.arange(len(slots)), length)) - reference) / reference
    return changes


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--top-k", type=int, nargs="+", default=[64, 1024], help="compact stores trained")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_host_memory()
    cfg = load_config(CONFIG, S2)
    data = cfg.data
    manifest = ensure_prepared(data.path, data.source, seq_len=data.seq_len, tokenizer=data.tokenizer,
                               val_fraction=data.val_fraction)
    base = model_config(cfg, manifest["vocab_size"])
    stores = [0, *args.top_k]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ebt-s2-tiny, V={base.vocab_size}, "
          f"T={base.block_size}, {args.steps} steps of {data.micro_batch_size} rows, {args.seeds} seeds\n")

    runs = {}
    for seed in range(args.seeds):
        train_batches = batches(data.path, "train", args.steps, data.micro_batch_size, seed)
        val_batches = batches(data.path, "val", VAL_BATCHES, data.micro_batch_size, seed)
        for k in stores:
            runs[k, seed] = train(cfg, replace(base, replay_top_k=k), seed, train_batches, val_batches)

    tail = max(1, args.steps // 4)

    def train_loss(k, seed):
        return statistics.fmean(runs[k, seed]["train"][-tail:])

    def paired(metric, k):
        """(mean, spread over seeds) of metric(k, seed) - metric(exact, seed)."""
        diffs = [metric(k, seed) - metric(0, seed) for seed in range(args.seeds)]
        return statistics.fmean(diffs), statistics.pstdev(diffs)

    def val_loss(k, seed):
        return runs[k, seed]["val"]

    small = resolve("ebt-s2-small", {})
    rows = []
    for k in stores:
        config = replace(base, replay_top_k=k)
        cells = [("exact (fp32 logits)" if k == 0 else f"top-{k}"),
                 f"{replay_store_bytes(config) / config.replay_buffer_size:,.0f}"]
        for metric in (train_loss, val_loss):
            values = [metric(k, seed) for seed in range(args.seeds)]
            if k == 0:
                cells += [f"{statistics.fmean(values):.4f}", f"(seeds: ±{statistics.pstdev(values):.4f})"]
            else:
                mean, spread = paired(metric, k)
                cells += [f"{statistics.fmean(values):.4f}", f"{mean:+.4f} ± {spread:.4f}"]
        cells.append(f"{replay_store_bytes(replace(small, replay_top_k=k)) / 1e9:.2f}")
        rows.append(tuple(cells))
    print(f"1. Training with each store (train loss: mean of the last {tail} steps; differences paired by seed)")
    print_table(("store", "bytes/row", "train loss", "vs exact", "val loss", "vs exact",
                 "ebt-s2-small GB/rank"), rows)

    masses = [kept_mass(runs[0, seed]["model"].replay_store, PROBED_TOP_K) for seed in range(args.seeds)]
    changes = [replayed_loss_change(runs[0, seed]["model"], PROBED_TOP_K) for seed in range(args.seeds)]
    print("2. What a compact store keeps (exact runs' final stores, mean over seeds)")
    print_table(("k", "probability mass in the top k", "replayed rows' S2 loss, |relative change|"),
                [(k, f"{statistics.fmean(m[k] for m in masses):.4f}",
                  f"{statistics.fmean(c[k] for c in changes):.2e}") for k in PROBED_TOP_K])


if __name__ == "__main__":
    run_command(main)
