"""Evaluation during training: val loss and perplexity, bits per byte, EBT's thinking curve (val
loss after 1..N inference steps), the descent's scalars of `eval.dynamics`, a short generated
text sample, and the downstream tasks of `eval.downstream` (`evaluate_downstream`). As a command, downstream
evaluation of a trained model on lm-evaluation-harness (pretrain.downstream), offline:

    python -m pretrain.evaluate RUN_DIR [--checkpoint TAG] --tasks core|nrgpt_paper|ebt_paper|NAME,...
        [--limit N] [--think-steps 1,2,4] [--best-of K] [--think-until TOL] [--batch-size B] [--out FILE]

prints a Markdown table, writes the results JSON (default RUN_DIR/downstream/<tag>.json) and the
scalars `downstream/<task>/<metric>` into the run's TensorBoard at the checkpoint's step. Under
torchrun the documents are split over the ranks; the numbers equal a one-process run's. EBT's
`--think-until TOL` stops each position's descent once a step changed its energy by less than TOL
times the energy (each --think-steps then the most it takes) and reports the mean steps per
scored token, per task in the rows and over all tasks on stderr.

Every rank runs the same calls (under ZeRO-3 a forward pass gathers parameters collectively),
and evaluation draws its random numbers from a fixed seed inside a forked RNG, so it neither
changes the training run's random streams nor depends on when it happens."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from itertools import cycle, islice
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from common.cli import ArgumentParser, positive_int, run_command
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
    try:
        with torch.random.fork_rng(devices=devices):
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


# --- the downstream command ------------------------------------------------------------------

def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (a relative change of the energy), got {text}")
    return value


def _step_list(text: str) -> list[int]:
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated step counts, got {text!r}") from None
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"step counts must be >= 1, got {text!r}")
    return steps


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m pretrain.evaluate",
                            description="Downstream evaluation of a trained model on lm-evaluation-harness, offline.")
    parser.add_argument("source", help="run directory, checkpoint directory or exported .safetensors file")
    parser.add_argument("--checkpoint", help="checkpoint of the run directory: a tag (step_00001000) or a step")
    parser.add_argument("--tasks", required=True, help="suites (core, nrgpt_paper, ebt_paper) and/or task names, comma-separated")
    parser.add_argument("--limit", type=positive_int, help="documents per task (the first N); default all")
    parser.add_argument("--think-steps", type=_step_list, help="EBT: evaluate at each of these inference step counts")
    parser.add_argument("--best-of", type=positive_int, default=1, help="EBT: noise samples per position (lowest energy kept)")
    parser.add_argument("--think-until", type=_tolerance, metavar="TOL",
                        help="EBT: stop a position's descent once a step changes its energy by less than TOL "
                        "times the energy (--think-steps is then the most it takes)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: this rank's GPU if there is one)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and activations")
    parser.add_argument("--reference", help="owt_generation: the model (run, checkpoint or export) whose "
                        "perplexity of the continuations is reported")
    parser.add_argument("--out", help="results JSON (default: RUN_DIR/downstream/<tag>.json, or next to an export)")
    return parser.parse_args(argv)


def _device(requested: str | None):
    from pretrain.training.engine import training_device
    from pretrain.training.trained import inference_device

    if requested:
        return inference_device(requested)
    return training_device("auto", int(os.environ.get("LOCAL_RANK", "0")))


def run_dir_of(checkpoint_or_file: Path) -> Path | None:
    """The run directory a checkpoint belongs to (RUN/ckpt/<tag>); None for an export."""
    if checkpoint_or_file.is_dir() and checkpoint_or_file.parent.name == "ckpt":
        return checkpoint_or_file.parent.parent
    return None


def results_file(checkpoint_or_file: Path) -> Path:
    """Where the command writes its results JSON without --out: RUN_DIR/downstream/<tag>.json
    for a run's checkpoint (the model card of an export shows it), next to an export otherwise."""
    run_dir = run_dir_of(checkpoint_or_file)
    if run_dir is None:
        return checkpoint_or_file.with_suffix(".downstream.json")
    return run_dir / "downstream" / f"{checkpoint_or_file.name}.json"


def _load_text_model(source: Path, device, dtype: str):
    from pretrain.downstream.adapter import TEXT_TOKENIZERS
    from pretrain.models.weights import LoadError
    from pretrain.training.trained import load_trained

    trained = load_trained(source, device=device, dtype=dtype)
    kind = (trained.manifest or {}).get("tokenizer")
    if kind not in TEXT_TOKENIZERS:
        raise LoadError(f"{source}: its tokenizer ({kind or 'unknown: no data manifest'}) cannot "
                        "serve text tasks; they need a GPT-2 BPE model")
    return trained


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from data_pipeline.errors import DataError
    from pretrain.downstream import generation, harness
    from pretrain.downstream.adapter import HarnessModel
    from pretrain.downstream.data import DataMissing, data_root
    from pretrain.training import checkpoint
    from pretrain.training.engine import keep_freed_host_memory
    from common.fileio import atomic_write_text
    from pretrain.models.weights import LoadError

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        names = harness.parse_tasks(args.tasks)
        data_root()
        source = Path(args.source)
        if args.checkpoint:
            tag = checkpoint.tag_for(int(args.checkpoint)) if args.checkpoint.isdigit() else args.checkpoint
            source = source / "ckpt" / tag
            if not checkpoint.is_complete(source):
                raise LoadError(f"{args.source}: no complete checkpoint {tag}")
        device = _device(args.device)
        if device.type == "cpu":
            keep_freed_host_memory()  # each scoring batch's logits would otherwise be fresh pages
        if world_size > 1 and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        trained = _load_text_model(source, device, args.dtype)
        thinking = args.think_steps or args.best_of != 1 or args.think_until is not None
        if thinking and not trained.spec.thinks:
            raise LoadError(f"--think-steps/--best-of/--think-until: a {trained.family} model does not think "
                            "(EBT only)")
        prompts = reference = None
        if harness.wants_generation(names):
            data_path = trained.run_config.get("data", {}).get("path")
            if not data_path or not (Path(data_path) / "manifest.json").is_file():
                raise LoadError(f"{generation.TASK}: the run's validation data ({data_path}) is not there "
                                "to take prompts from")
            prompts = generation.validation_prompts(data_path, args.limit or 64)
            if args.reference:
                reference = HarnessModel(_load_text_model(Path(args.reference), device, args.dtype).model,
                                         trained.tokenizer, batch_size=args.batch_size, split_over_ranks=False)
    except (harness.TaskError, DataMissing, LoadError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    rows, continuations, thinking_lines = [], [], []
    for steps in args.think_steps or [None]:
        model = HarnessModel(trained.model, trained.tokenizer, batch_size=args.batch_size,
                             think_steps=steps, best_of=args.best_of, think_until=args.think_until)
        rows += harness.run(model, names, args.limit) or []
        generated = None if prompts is None else generation.generation_quality(model, prompts, reference)
        if args.think_until is not None:
            step_counts = model.step_counts()  # on every rank: a collective
            overall = harness.pooled_steps(step_counts, step_counts)
            cap = steps or trained.model_config.n_steps
            thinking_lines.append(f"thinking until the energy changes by less than {args.think_until:g}, at most "
                                  f"{cap} steps: {overall.mean or 0:.2f} descent steps per scored token on "
                                  f"average, at most {overall.most}")
        if generated is not None:
            for row in generated[0]:
                row.think_steps, row.best_of = steps, args.best_of
                if args.think_until is not None:  # generation's own requests count under ""
                    row.think_until, row.mean_steps = args.think_until, harness.pooled_steps(step_counts, [""]).mean
            rows += generated[0]
            continuations.append({"think_steps": steps, "continuations": generated[1]})
    if world_size > 1 and dist.get_rank() != 0:
        return 0
    run_dir = run_dir_of(trained.source)
    out = Path(args.out) if args.out else results_file(trained.source)
    report = {"source": str(trained.source), "flavor": trained.flavor, "family": trained.family,
              "step": trained.step, "tasks": names, "limit": args.limit, "dtype": args.dtype,
              "world_size": world_size, "rows": harness.rows_as_dicts(rows)}
    if continuations:
        report.update(reference=args.reference, generations=continuations)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=2) + "\n")
    if run_dir is not None:
        from pretrain.training.metrics import append_to_tensorboard

        append_to_tensorboard(run_dir / "tb", trained.step, harness.scalars(rows))
    print(harness.table(rows), end="")
    for line in thinking_lines:
        print(line, file=sys.stderr)
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_command(main)
