"""Model benchmarks on CPU, every figure measured side by side in one run.

1. Training cost (forward + backward) per token of each family at equal width, as a ratio to
   gpt_rec next to the ratio of their analytic FLOPs (`flops_per_token`).
2. EBT's S1 training step (2 descent steps) relative to a Transformer++ step of the same
   backbone: with observed-stream reuse, without it, and with step conditioning.
3. Peak memory of a training step with and without activation checkpointing at 2, 4, 8 steps.
4. With `--compile`, instead: the training step of each family that the OpenWebText configs
   compile, torch.compile (inductor) against eager, and NRGPT's at its released 6 steps; next
   to each, the share of its eager step spent in GEMM and attention kernels (the floor of
   compiled / eager, since inductor calls those kernels as they are), and the fp32 GEMM
   throughput of the BLAS library against oneDNN's on this CPU (which sets that share).

    python -m bench.models [--width 256 --heads 4 --seq-len 256 --batch 4 --steps 4 --rounds 10] [--compile]

Contenders are timed in one process, interleaved round by round, and the minimum over rounds
is kept. Time is the process's CPU time with one intra-op thread by default (`--threads`): on a
shared machine wall-clock time mostly measures the other jobs, while CPU time of a single
thread measures the work done, which is what the FLOP ratios are compared against."""
from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from bench.memory import peak_allocated_bytes
from common.cli import ArgumentParser, run_command
from pretrain.models import build, resolve
from pretrain.training.engine import compiled_cpu_kernel_settings


@dataclass
class Contender:
    label: str
    flavor: str
    overrides: dict = field(default_factory=dict)


def build_contender(contender: Contender, args) -> torch.nn.Module:
    shape = dict(vocab_size=args.vocab, block_size=args.seq_len, n_embd=args.width, n_head=args.heads)
    torch.manual_seed(0)
    return build(resolve(contender.flavor, {**shape, **contender.overrides})).train()


def train_step(model, idx):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(idx, torch.roll(idx, -1, dims=1)).loss.backward()


def seconds_per_round(models: dict, idx, rounds: int, step=train_step) -> dict[str, list[float]]:
    """The CPU time of one `step(model, idx)` (by default a forward + backward) in each of
    `rounds` rounds, contenders interleaved, after a warm-up step of each."""
    for model in models.values():
        step(model, idx)
    seconds = {label: [] for label in models}
    for _ in range(rounds):
        for label, model in models.items():
            start = time.process_time()
            step(model, idx)
            seconds[label].append(time.process_time() - start)
    return seconds


def seconds_per_step(models: dict, idx, rounds: int, step=train_step) -> dict[str, float]:
    """Minimum over `rounds` of `seconds_per_round`."""
    return {label: min(times) for label, times in seconds_per_round(models, idx, rounds, step).items()}


def print_table(header: tuple, rows: list[tuple]) -> None:
    table = [tuple(map(str, header))] + [tuple(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))
    print()


def family_costs(args, idx) -> None:
    S = args.steps
    contenders = [
        Contender("gpt_rec", "gpt_rec-tiny", {"n_steps": S}),
        Contender("gpt", "gpt-tiny", {"n_layer": S}),
        Contender("nrgpt (released: full heads, ff2w, eta full)", "nrgpt-tiny", {"n_steps": S}),
        Contender("nrgpt lowrank, exact", "nrgpt-tiny",
                  {"n_steps": S, "attention": "lowrank", "grad_mode": "exact"}),
        Contender("nrgpt full, exact", "nrgpt-tiny", {"n_steps": S, "grad_mode": "exact"}),
        Contender("transformer_pp", "transformer_pp-tiny", {"n_layer": S}),
        Contender("ebt S1 (2 descent steps)", "ebt-tiny", {"n_layer": S}),
    ]
    models = {c.label: build_contender(c, args) for c in contenders}
    seconds = seconds_per_step(models, idx, args.rounds)
    flops = {label: model.flops_per_token(args.seq_len) for label, model in models.items()}
    base = contenders[0].label
    rows = []
    for label in models:
        measured, analytic = seconds[label] / seconds[base], flops[label] / flops[base]
        rows.append((label, f"{seconds[label] * 1e3:.1f}", f"{seconds[label] / idx.numel() * 1e6:.1f}",
                     f"{flops[label] / 1e6:.2f}", f"{measured:.2f}", f"{analytic:.2f}",
                     f"{measured / analytic:.2f}"))
    print(f"1. Training step cost at D={args.width}, {args.heads} heads, T={args.seq_len}, "
          f"B={args.batch}, V={args.vocab}, {S} steps / layers (EBT and Transformer++: {S} layers)")
    print_table(("family", "ms/step", "us/token", "analytic MFLOP/token", "time / gpt_rec",
                 "FLOPs / gpt_rec", "measured / analytic"), rows)


def ebt_costs(args, idx) -> None:
    layers = {"n_layer": args.steps}
    contenders = [
        Contender("transformer_pp", "transformer_pp-tiny", layers),
        Contender("ebt S1, observed stream reused", "ebt-tiny",
                  {**layers, "n_steps": 2, "time_embed": False, "reuse_observed_stream": True}),
        Contender("ebt S1, observed stream recomputed", "ebt-tiny",
                  {**layers, "n_steps": 2, "time_embed": False, "reuse_observed_stream": False}),
        Contender("ebt S1, step conditioning (time_embed)", "ebt-tiny",
                  {**layers, "n_steps": 2, "time_embed": True, "reuse_observed_stream": False}),
    ]
    models = {c.label: build_contender(c, args) for c in contenders}
    seconds = seconds_per_step(models, idx, args.rounds)
    base = contenders[0].label
    rows = [(label, f"{seconds[label] * 1e3:.1f}", f"{seconds[label] / seconds[base]:.2f}",
             f"{model.flops_per_token(args.seq_len) / models[base].flops_per_token(args.seq_len):.2f}")
            for label, model in models.items()]
    print(f"2. EBT S1 training step vs Transformer++ ({args.steps} layers, same shapes as above); "
          "targets: <= 5x with reuse, <= 7x with step conditioning (paper's estimate 6.66x)")
    print_table(("contender", "ms/step", "time / transformer_pp", "FLOPs / transformer_pp"), rows)


def memory_costs(args, idx) -> None:
    families = [("gpt_rec", "gpt_rec-tiny"), ("nrgpt", "nrgpt-tiny"), ("ebt S1", "ebt-tiny")]
    rows = []
    for label, flavor in families:
        peaks = {}
        for checkpointing in ("off", "step"):
            for n_steps in (2, 4, 8):
                overrides = {"n_steps": n_steps, "activation_checkpointing": checkpointing}
                if flavor.startswith("ebt"):
                    overrides["n_layer"] = args.steps
                model = build_contender(Contender(label, flavor, overrides), args)
                peaks[checkpointing, n_steps] = peak_allocated_bytes(lambda: train_step(model, idx))
        for checkpointing in ("off", "step"):
            mb = [peaks[checkpointing, n] / 2**20 for n in (2, 4, 8)]
            rows.append((label, checkpointing, *(f"{m:.1f}" for m in mb), f"{mb[2] / mb[0]:.2f}"))
    print("3. Peak memory of a training step (MiB, allocator timeline), same shapes as above; "
          "target: checkpointed 8 steps <= 1.3x 2 steps")
    print_table(("family", "checkpointing", "2 steps", "4 steps", "8 steps", "8 / 2"), rows)


LIBRARY_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product")
"""ATen ops that inductor does not generate but calls as extern kernels (GEMMs, SDPA's fused
attention forward and backward); prefixes of the profiler's op names."""


def cpu_time_split(model, idx, steps: int = 3, step=train_step) -> dict[str, float]:
    """Shares of the CPU time of `steps` calls of `step` (a training step by default; the
    profiler's self times): in `LIBRARY_KERNELS`, in the other ATen ops, and the rest: Python,
    autograd's and a compiled step's wrappers, and inductor's generated kernels (no ATen ops)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(model, idx)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    library = sum(e.self_cpu_time_total for e in events if e.key.startswith(LIBRARY_KERNELS))
    aten = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::"))
    return {"library": library / total, "other aten": (aten - library) / total, "rest": 1 - aten / total}


def library_kernel_share(model, idx, steps: int = 3) -> float:
    """Share of the CPU time of eager training steps spent in `LIBRARY_KERNELS`: compiling the
    step can fuse only the rest, so compiled / eager cannot fall below this share."""
    return cpu_time_split(model, idx, steps)["library"]


def gemm_gflops(args) -> tuple[float, float]:
    """fp32 GFLOP/s of one [B T, D] x [D, 4 D] product (the FF's shape) through torch's BLAS
    (what eager and compiled steps both call) and through oneDNN, which picks its kernels by the
    CPU's instruction sets alone. On some non-Intel CPUs the BLAS library runs AVX2 code where
    oneDNN runs AVX-512: GEMMs then take a larger share of every step."""
    x, weight = torch.randn(args.batch * args.seq_len, args.width), torch.randn(4 * args.width, args.width)
    bias = torch.zeros(4 * args.width)
    products = {"blas": lambda: torch.nn.functional.linear(x, weight, bias),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")}
    seconds = seconds_per_step(products, None, rounds=20, step=lambda product, _: product())
    flops = 2 * x.shape[0] * x.shape[1] * weight.shape[0]
    return flops / seconds["blas"] / 1e9, flops / seconds["onednn"] / 1e9


def compile_costs(args, idx) -> None:
    S = args.steps
    released = {"dropout_placement": "attention"}  # the OpenWebText configs' (dropout 0)
    contenders = [
        Contender("gpt_rec", "gpt_rec-tiny", {"n_steps": S}),
        Contender("gpt", "gpt-tiny", {"n_layer": S}),
        Contender("nrgpt (released: full heads, ff2w, eta full)", "nrgpt-tiny", {"n_steps": S, **released}),
        Contender("transformer_pp", "transformer_pp-tiny", {"n_layer": S}),
        Contender("nrgpt released, 6 steps", "nrgpt-tiny", {"n_steps": 6, **released}),
    ]
    compiled_cpu_kernel_settings()  # as a compiled CPU run of the trainer
    models, compile_seconds = {}, {}
    for contender in contenders:
        eager = build_contender(contender, args)
        compiled = copy.deepcopy(eager)
        compiled.compile(backend="inductor", fullgraph=True)
        start = time.perf_counter()
        train_step(compiled, idx)
        compile_seconds[contender.label] = time.perf_counter() - start
        models[contender.label, "eager"], models[contender.label, "compiled"] = eager, compiled
    seconds = seconds_per_step(models, idx, args.rounds)
    floors = {c.label: library_kernel_share(models[c.label, "eager"], idx) for c in contenders}
    rows = [(c.label, f"{seconds[c.label, 'eager'] * 1e3:.1f}", f"{seconds[c.label, 'compiled'] * 1e3:.1f}",
             f"{seconds[c.label, 'compiled'] / seconds[c.label, 'eager']:.2f}", f"{floors[c.label]:.2f}",
             f"{compile_seconds[c.label]:.0f}")
            for c in contenders]
    print(f"4. Training step, torch.compile (inductor) vs eager, D={args.width}, {args.heads} heads, "
          f"T={args.seq_len}, B={args.batch}, V={args.vocab}, {S} steps / layers unless named; "
          "target: NRGPT at 6 steps compiled <= 0.8x eager")
    print_table(("family", "eager ms/step", "compiled ms/step", "compiled / eager",
                 "GEMM + attention share of eager (floor)", "first step s (wall)"), rows)
    blas, onednn = gemm_gflops(args)
    print(f"fp32 GEMM [{args.batch * args.seq_len}, {args.width}] x [{args.width}, {4 * args.width}]: "
          f"{blas:.0f} GFLOP/s through torch's BLAS, {onednn:.0f} through oneDNN")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape and timing options of the model benchmarks (this one and bench.ebt)."""
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="recurrent steps / layers")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--only", choices=("families", "ebt", "memory"), default=None)
    parser.add_argument("--compile", action="store_true",
                        help="instead of sections 1-3: compiled (inductor) vs eager training steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    if args.compile:
        compile_costs(args, idx)
        return
    sections = {"families": family_costs, "ebt": ebt_costs, "memory": memory_costs}
    for name, section in sections.items():
        if args.only in (None, name):
            section(args, idx)


if __name__ == "__main__":
    run_command(main)
