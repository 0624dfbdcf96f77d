"""`python -m pretrain.plan --config C --gpus N [--gpu h100-80gb|h200|a100-80gb] [--micro-batch M]
[--json] [key.sub=value ...]`

What one GPU holds when the config trains on N GPUs, before anything runs: parameters, gradients
and optimizer states for the config's ZeRO stage, the activations of one micro-batch, buffers
(DeepSpeed's gradient reduce bucket, EBT's replay store) and a margin; the micro-batch and
gradient accumulation the trainer would choose; tokens per step, FLOPs per token and a step-time
range at 30-50% of the GPU's peak; whether it fits, and (without --micro-batch) the largest
micro-batch that would.

The plan is `pretrain.training.planner`'s."""
from __future__ import annotations

import dataclasses
import json
import sys

from common.cli import ArgumentParser, positive_int, run_command
from pretrain.config import ConfigError, RunConfig, batch_split, describe_batch_split, load_config
from pretrain.training.planner import FRAGMENTATION, GIB, GPUS, MFU_RANGE, RESERVED_BYTES, Plan, make_plan

def describe(plan: Plan, cfg: RunConfig) -> str:
    """The plan as a readable table."""
    def gib(size: int) -> str:
        return f"{size / GIB:8.2f}"

    p = plan.parts
    lines = [
        f"{plan.config_path} on {plan.gpus} x {plan.gpu} ({GPUS[plan.gpu].name}, "
        f"{plan.gpu_memory_bytes / GIB:.1f} GiB), {plan.precision}, ZeRO-{plan.zero_stage}"
        f"{' with optimizer offload' if cfg.zero.offload_optimizer else ''}",
        f"model: {plan.flavor} ({plan.family}), {plan.n_params / 1e6:.1f}M parameters, vocabulary "
        f"{plan.vocab_size} ({plan.vocab_source}), activation checkpointing {plan.activation_checkpointing}",
        # the trainer's own words, which name the cap when the micro-batch asked for is too large
        f"{describe_batch_split(cfg, plan.gpus)}; {plan.tokens_per_step:,} tokens per step",
        "",
        "per GPU                  GiB",
        f"  parameters        {gib(p.parameters)}",
        f"  gradients         {gib(p.gradients)}",
        f"  optimizer states  {gib(p.optimizer_states)}",
        f"  activations       {gib(p.activations)}   (one micro-batch of {plan.micro_batch_size}, measured)",
        f"  buffers           {gib(p.buffers)}   (gradient reduce bucket; EBT's replay store)",
        f"  margin            {gib(p.margin)}   ({RESERVED_BYTES / GIB:.1f} GiB outside torch + "
        f"{FRAGMENTATION:.0%} of the tensors)",
        f"  total             {gib(p.total)}   of {plan.gpu_memory_bytes / GIB:.2f}: "
        f"{'fits' if plan.fits else 'does NOT fit'}",
        "",
    ]
    if plan.largest_micro_batch_that_fits is not None:
        largest = plan.largest_micro_batch_that_fits
        if largest == 0:
            lines.append("largest micro-batch that fits: none (one sequence is already too much)")
        else:
            capped = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, micro_batch_size=largest))
            trainer = batch_split(capped, plan.gpus)
            lines.append(f"largest micro-batch that fits: {largest} (of {plan.per_process_batch} sequences per GPU "
                         f"per step; with data.micro_batch_size={largest} the trainer uses "
                         f"{trainer.micro_batch_size} x {trainer.accumulation_steps} at {plan.gpus} GPU(s))")
    lines.append(f"FLOPs per token: {plan.flops_per_token:.3e} (training, model FLOPs)")
    if plan.step_time_s is None:
        lines.append(f"step time: no tensor-core peak for {plan.precision}")
    else:
        fast, slow = plan.step_time_s
        scale, unit = duration_unit(fast)
        lines.append(f"step time: {fast * scale:.3g}-{slow * scale:.3g} {unit} at "
                     f"{MFU_RANGE[0]:.0%}-{MFU_RANGE[1]:.0%} of "
                     f"{plan.peak_tflops:g} TFLOP/s per GPU")
    return "\n".join(lines)


def duration_unit(seconds: float) -> tuple[float, str]:
    """(factor, unit) that show `seconds` as a number of at least 1 (a tiny config's steps take
    microseconds on a GPU, which seconds would print as 0.000)."""
    for scale, unit in ((1, "s"), (1e3, "ms"), (1e6, "µs")):
        if seconds * scale >= 1:
            return scale, unit
    return 1e9, "ns"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pretrain.plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", required=True, help="YAML run config (configs/...)")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs the run will have (all nodes)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100-80gb", help="the kind of GPU (default h100-80gb)")
    parser.add_argument("--micro-batch", type=positive_int, metavar="M",
                        help="plan with data.micro_batch_size=M (default: the config's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, values parsed as YAML (e.g. model.activation_checkpointing=block)")
    args = parser.parse_args(argv)
    from data_pipeline.errors import DataError

    try:
        given = [] if args.micro_batch is None else [f"data.micro_batch_size={args.micro_batch}"]
        cfg = load_config(args.config, args.overrides + given)
        plan = make_plan(args.config, cfg, args.gpus, args.gpu, find_largest=args.micro_batch is None)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_json()) if args.json else describe(plan, cfg))
    return 0


if __name__ == "__main__":
    run_command(main)
