"""Evaluation during training: val loss and perplexity, bits per byte, EBT's thinking curve (val
loss after 1..N inference steps), the descent's scalars of `eval.dynamics`, a short generated
text sample, and the downstream tasks of `eval.downstream` (`evaluate_downstream`).

Every rank runs the same calls (under ZeRO-3 a forward pass gathers parameters collectively),
and evaluation draws its random numbers from a fixed seed inside a forked RNG, so it neither
changes the training run's random streams nor depends on when it happens."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from itertools import cycle, islice
from typing import Callable

import torch
import torch.distributed as dist

from pretrain.config import DownstreamSection, EvalSection
from pretrain.models import family_spec
from pretrain.models.probes import never_rising, rank_correlation, read_out_each_step, state_energies


DEPTH_READOUT_BUDGET = 0.05
"""`eval.dynamics`: the depth curve's extra LM heads cost at most this share of the forward FLOPs
of an evaluation (gpt_rec and NRGPT read out at every `stride`-th position to stay under it)."""
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
    dynamics: dict[str, float] | None = None
    """`eval.dynamics`: the descent's scalars (`DescentProbe`); None when off or without a descent."""

    def scalars(self) -> dict[str, float]:
        values = {"eval/loss": self.loss, "eval/ppl": math.exp(min(self.loss, 50.0))}
        if self.loss_mean_steps is not None:
            values["eval/loss_mean_steps"] = self.loss_mean_steps
            values["eval/langevin_noise_std"] = self.langevin_noise_std
        if self.bpb is not None:
            values["eval/bpb"] = self.bpb
        for k, loss in enumerate(self.think_losses or [], start=1):
            values[f"eval/think_loss/step_{k:02d}"] = loss
        values.update({f"eval/dynamics/{name}": value for name, value in (self.dynamics or {}).items()})
        return values

    def line(self) -> str:
        """The figures for the console."""
        line = f"val loss {self.loss:.4f}, ppl {math.exp(min(self.loss, 50)):.2f}"
        if self.bpb is not None:
            line += f", {self.bpb:.4f} bits/byte"
        if self.think_losses:
            line += ", thinking curve " + " ".join(f"{x:.3f}" for x in self.think_losses)
        return line


def bits_per_byte(loss_nats: float, tokens: int, utf8_bytes: int) -> float:
    """Mean loss over `tokens` (nats per token) as bits per byte of the text they encode."""
    return loss_nats * tokens / math.log(2) / utf8_bytes


class DescentProbe:
    """`eval.dynamics`: the descent's cheap scalars, measured on the first val micro-batch of
    each process (the same tokens at every evaluation) inside the evaluation's own forward or
    thinking, then reduced over the processes:

    - gpt_rec and NRGPT: `depth_loss/step_SS`, the loss when reading out after step s (early
      exit at a fixed depth), at every `stride`-th position, the stride keeping the extra LM
      heads under DEPTH_READOUT_BUDGET of the evaluation's forward FLOPs;
    - NRGPT: `monotone_fraction`, the share of tokens whose own energy never rises after the
      first step (the energies cost about half a step each);
    - EBT: `energy_loss_spearman`, the rank correlation of a token's final energy with its loss
      after the trained steps (or eval.think_steps if fewer), averaged over the processes.

    `pretrain.dynamics` measures these, and more, over many batches after training."""

    def __init__(self, model: torch.nn.Module, seq_len: int, batches: int):
        self.model, self.spec = model, family_spec(model.config)
        self.totals: torch.Tensor | None = None
        if not self.spec.thinks:
            extra = model.config.n_steps * model.readout_flops(training=False)  # a token read out at every step
            budget = DEPTH_READOUT_BUDGET * batches * model.flops_per_token(seq_len, training=False)
            stride = math.ceil(extra / budget)
            self.positions = slice(stride - 1, None, stride)

    @staticmethod
    def applies(model: torch.nn.Module, settings: EvalSection) -> bool:
        return settings.dynamics and family_spec(model.config).descends

    def forward(self, engine, inputs: torch.Tensor, targets: torch.Tensor):
        """The evaluation's forward of a gpt_rec or NRGPT model, read out after every step."""
        with_energies = self.spec.step_energies
        with read_out_each_step(self.model, targets, self.positions) as record:
            out = engine(inputs, targets, return_energies=with_energies)
        read = targets[:, self.positions] != -1
        totals = [(losses * read).sum() for losses in record["losses"]] + [read.sum()]
        if with_energies:
            valid = targets != -1
            energies = state_energies(out.diagnostics["_token_energy"], record)[:, valid]
            totals += [never_rising(energies, min(1, self.model.config.n_steps - 1)).sum(), valid.sum()]
        self.totals = torch.stack(totals).double()
        return out

    def think(self, thought, targets: torch.Tensor) -> None:
        """An EBT's thinking on the batch (`think` with targets): the rank correlation."""
        after = min(self.model.config.n_steps, thought.token_losses.size(0))
        valid = targets != -1
        self.totals = rank_correlation(thought.energies[after][valid], thought.token_losses[after - 1][valid]
                                       ).view(1).to(targets.device)

    def scalars(self) -> dict[str, float]:
        """The scalars over every process (a collective: every rank calls it)."""
        dist.all_reduce(self.totals)
        if self.spec.thinks:
            return {"energy_loss_spearman": float(self.totals[0]) / dist.get_world_size()}
        steps = self.model.config.n_steps
        values = self.totals.tolist()
        scalars = {f"depth_loss/step_{s:02d}": values[s - 1] / max(values[steps], 1) for s in range(1, steps + 1)}
        if self.spec.step_energies:
            scalars["monotone_fraction"] = values[steps + 1] / max(values[steps + 2], 1)
        return scalars


@torch.no_grad()
def evaluate(engine, val_loader, settings: EvalSection, device: torch.device, seed: int,
             manifest: dict) -> EvalResult:
    """Evaluate on `settings.batches` val micro-batches per rank (cycling a short split) of the
    dataset `manifest` describes: its tokenizer decodes the sample (any id the model can produce)
    and gives each token's UTF-8 bytes, for bits per byte."""
    from data_pipeline.tokenizer import decode, decode_padded, token_byte_lengths

    def text(ids: list[int]) -> str:
        return decode_padded(lambda run: decode(manifest, run), ids, manifest["vocab_size"])

    byte_lengths = token_byte_lengths(manifest)
    token_bytes = None if byte_lengths is None else torch.from_numpy(byte_lengths).to(device)
    model = engine.module
    thinks = family_spec(model.config).thinks
    devices = [device.index or 0] if device.type == "cuda" else []
    engine.eval()
    # A thinking model's evaluation draws its noise from generators it seeds per call, so that
    # it is reproducible; in a compiled graph (the descent's Langevin noise) inductor would draw
    # its own random numbers instead, and the eval forward would be another graph to compile:
    # compiled, it evaluates eagerly (as its `think` calls run anyway), so its evaluation is the
    # eager one's
    eagerly = thinks and engine.is_compiled
    try:
        with (torch.random.fork_rng(devices=devices),
              torch.compiler.set_stance("force_eager") if eagerly else contextlib.nullcontext()):
            torch.manual_seed(seed)
            # on the device: NCCL reduces only device tensors, and no host sync per batch
            # loss, then for EBT the mean over steps and the thinking curve
            totals = torch.zeros(1 + (1 + settings.think_steps if thinks else 0), dtype=torch.float64,
                                 device=device)
            target_bytes = torch.zeros(1, dtype=torch.float64, device=device)
            first_inputs = probe = None
            for inputs, targets in islice(cycle(val_loader), settings.batches):
                inputs, targets = inputs.to(device), targets.to(device)
                probing = first_inputs is None and DescentProbe.applies(model, settings)
                if probing:
                    probe = DescentProbe(model, inputs.size(1), settings.batches)
                first_inputs = inputs if first_inputs is None else first_inputs
                if token_bytes is not None:
                    target_bytes += token_bytes[targets].sum()
                out = probe.forward(engine, inputs, targets) if probing and not thinks else engine(inputs, targets)
                totals[0] += out.loss.double()
                if thinks:
                    totals[1] += out.diagnostics["loss_per_step"].double().mean()
                    thought = model.think(inputs, steps=settings.think_steps, targets=targets)
                    totals[2:] += thought.loss_per_step.double()
                    if probing:
                        probe.think(thought, targets)
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
                sample = text(prompt[0].tolist()) + PROMPT_END + text(ids[0, prompt.size(1):].tolist())
    finally:
        engine.train()
    dynamics = None if probe is None else probe.scalars()
    if not thinks:
        return EvalResult(loss=means[0], think_losses=None, sample=sample, bpb=bpb, dynamics=dynamics)
    return EvalResult(loss=means[0], think_losses=means[2:], sample=sample, loss_mean_steps=means[1],
                      langevin_noise_std=model.eval_noise_std(), bpb=bpb, dynamics=dynamics)


def evaluate_downstream(model: torch.nn.Module, settings: DownstreamSection, manifest: dict, step: int,
                        final: bool, log: Callable[[int, dict[str, float]], None]) -> dict[str, float]:
    """Downstream evaluation inside a training run (`eval.downstream`): when due at `step`,
    evaluate `model` (the training module; its train/eval mode is kept) on the first `limit`
    documents of each task, the same ones every time, on every rank with identical calls
    (ZeRO-3's forward gathers parameters collectively); `log(step, scalars)` (the scalars the
    command writes) and return them. Otherwise {}."""
    if not settings.tasks or not (final or (settings.interval > 0 and step % settings.interval == 0)):
        return {}
    from data_pipeline.tokenizer import tokenizer_from_spec
    from pretrain.downstream import harness
    from pretrain.downstream.adapter import HarnessModel  # imports lm-eval: only when used

    adapter = HarnessModel(model, tokenizer_from_spec(manifest), batch_size=settings.batch_size,
                           split_over_ranks=False, progress=False)
    values = harness.scalars(harness.run(adapter, settings.tasks, settings.limit))
    log(step, values)
    return values
