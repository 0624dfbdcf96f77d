"""Evaluation during training: val loss and perplexity, bits per byte, EBT's thinking curve (val
loss after 1..N inference steps), and a short generated text sample.

Every rank runs the same calls (under ZeRO-3 a forward pass gathers parameters collectively),
and evaluation draws its random numbers from a fixed seed inside a forked RNG, so it neither
changes the training run's random streams nor depends on when it happens."""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import cycle, islice

import torch
import torch.distributed as dist

from pretrain.config import EvalSection


PROMPT_END = " \u27e8generated\u27e9 "
"""Marks where the logged sample's prompt (from the val data) ends and the model's text begins."""


@dataclass
class EvalResult:
    loss: float
    """Mean next-token cross entropy over the evaluated val tokens of all ranks (EBT: of the
    final candidate, the model's prediction)."""
    think_losses: list[float] | None
    """EBT: val loss after 1, 2, ..., think_steps inference steps; None for other families."""
    sample: str | None
    """Prompt, PROMPT_END, generated continuation (rank 0's view; identical on every rank)."""
    loss_mean_steps: float | None = None
    """EBT: the cross entropy after each of the n_steps eval steps, averaged over the steps
    (the S1 training objective, which the released code logs as its validation loss)."""
    langevin_noise_std: float | None = None
    """EBT: std of the Langevin noise the eval descent added (0: none)."""
    bpb: float | None = None
    """`loss` in bits per UTF-8 byte of the evaluated target tokens' text, comparable across
    tokenizers; None without a byte table (e.g. ListOps)."""

    def scalars(self) -> dict[str, float]:
        values = {"eval/loss": self.loss, "eval/ppl": math.exp(min(self.loss, 50.0))}
        if self.loss_mean_steps is not None:
            values["eval/loss_mean_steps"] = self.loss_mean_steps
            values["eval/langevin_noise_std"] = self.langevin_noise_std
        if self.bpb is not None:
            values["eval/bpb"] = self.bpb
        for k, loss in enumerate(self.think_losses or [], start=1):
            values[f"eval/think_loss/step_{k:02d}"] = loss
        return values


def decode_padded(decode, ids: list[int], vocab_size: int) -> str:
    """Text of `ids`, where ids from the model's padding of the vocabulary (>= the tokenizer's
    `vocab_size`; a barely trained model samples them) show as U+FFFD."""
    pieces, run = [], []
    for i in ids + [vocab_size]:
        if i < vocab_size:
            run.append(i)
            continue
        if run:
            pieces.append(decode(run))
            run = []
        pieces.append("\ufffd")
    return "".join(pieces[:-1])


def bits_per_byte(loss_nats: float, tokens: int, utf8_bytes: int) -> float:
    """Mean loss over `tokens` (nats per token) as bits per byte of the text they encode."""
    return loss_nats * tokens / math.log(2) / utf8_bytes


@torch.no_grad()
def evaluate(engine, val_loader, settings: EvalSection, device: torch.device, seed: int,
             decode, token_bytes: torch.Tensor | None = None) -> EvalResult:
    """Evaluate on `settings.batches` val micro-batches per rank (cycling a short split).
    `decode(ids) -> str` turns token ids (any id the model can produce) into text;
    `token_bytes` [vocab] holds the UTF-8 bytes of each token id's text, for bits per byte."""
    model = engine.module
    thinks = hasattr(model, "think")
    devices = [device.index or 0] if device.type == "cuda" else []
    engine.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            # on the device: NCCL reduces only device tensors, and no host sync per batch
            # loss, then for EBT the mean over steps and the thinking curve
            totals = torch.zeros(1 + (1 + settings.think_steps if thinks else 0), dtype=torch.float64,
                                 device=device)
            target_bytes = torch.zeros(1, dtype=torch.float64, device=device)
            first_inputs = None
            for inputs, targets in islice(cycle(val_loader), settings.batches):
                inputs, targets = inputs.to(device), targets.to(device)
                first_inputs = inputs if first_inputs is None else first_inputs
                if token_bytes is not None:
                    target_bytes += token_bytes[targets].sum()
                out = engine(inputs, targets)
                totals[0] += out.loss.double()
                if thinks:
                    totals[1] += out.diagnostics["loss_per_step"].double().mean()
                    curve = model.think(inputs, steps=settings.think_steps, targets=targets).loss_per_step
                    totals[2:] += curve.double()
            dist.all_reduce(totals)
            dist.all_reduce(target_bytes)
            means = (totals / (settings.batches * dist.get_world_size())).tolist()
            bpb = None
            if token_bytes is not None and target_bytes.item() > 0:
                tokens = settings.batches * dist.get_world_size() * first_inputs.numel()
                bpb = bits_per_byte(means[0], tokens, int(target_bytes.item()))
            sample = None
            if settings.sample_tokens > 0:
                prompt = first_inputs[:1, : max(1, first_inputs.size(1) // 4)].contiguous()
                dist.broadcast(prompt, src=0)  # one prompt, so every rank makes the same calls
                ids = model.generate(prompt, settings.sample_tokens,
                                     temperature=settings.sample_temperature)
                sample = (decode(prompt[0].tolist()) + PROMPT_END
                          + decode(ids[0, prompt.size(1):].tolist()))
    finally:
        engine.train()
    if not thinks:
        return EvalResult(loss=means[0], think_losses=None, sample=sample, bpb=bpb)
    return EvalResult(loss=means[0], think_losses=means[2:], sample=sample, loss_mean_steps=means[1],
                      langevin_noise_std=model.eval_noise_std(), bpb=bpb)
