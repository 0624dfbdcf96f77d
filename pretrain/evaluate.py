"""Downstream evaluation of a trained model on lm-evaluation-harness (pretrain.downstream),
offline:

    python -m pretrain.evaluate RUN_DIR [--checkpoint TAG] --tasks core|nrgpt_paper|ebt_paper|NAME,...
        [--limit N] [--think-steps 1,2,4] [--best-of K] [--think-until TOL] [--batch-size B] [--out FILE]

prints a Markdown table, writes the results JSON (default RUN_DIR/downstream/<tag>.json) and the
scalars `downstream/<task>/<metric>` into the run's TensorBoard at the checkpoint's step. Under
torchrun the documents are split over the ranks; the numbers equal a one-process run's. EBT's
`--think-until TOL` stops each position's descent once a step changed its energy by less than TOL
times the energy (each --think-steps then the most it takes) and reports the mean steps per
scored token, per task in the rows and over all tasks on stderr. (The evaluation inside a
training run is `pretrain.training.evaluation`.)"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common.cli import ArgumentParser, positive_int, run_command


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
    from pretrain.training.trained import refuse_url, results_file, run_dir_of
    from common.fileio import atomic_write_text
    from pretrain.models.weights import LoadError

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        names = harness.parse_tasks(args.tasks)
        data_root()
        refuse_url(args.source)
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
    if world_size > 1:
        # The collectives are over: the ranks tear the group down together, as the trainer does,
        # rather than at the interpreter's exit, where a rank whose peer had already gone once
        # aborted in gloo's threads ("terminate called without an active exception")
        rank = dist.get_rank()
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
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
