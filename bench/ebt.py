"""EBT benchmarks on CPU, beside `bench.models` (which times EBT's training step against
Transformer++ and measures checkpointing memory):

1. The analytic FLOP count (`flops_per_token`) against the FLOPs the step actually executes
   (torch's FlopCounterMode, attention through SDPA's math backend so that it is counted).
2. Inference ("thinking"): a `think` call of 1, 2 and 4 descent steps against a Transformer++
   forward of the same backbone, measured and analytic.
3. Memory kept per descent step with step checkpointing, in units of one candidate tensor
   [B, T, V] (the step's input, which the recurrence must keep: the floor is 1).
4. Launches (`--launches`, this section alone): ATen ops per S1 training step (ebt-s1-small's
   options at the given shape) with the CPU's 4 attention row chunks and the GPU's choice, the
   energy gradient by autograd's double backward and first order (`EBTConfig.energy_gradient`),
   and the CPU time and peak memory of each. A GPU step of these models is bound by its
   launches, not its FLOPs.
5. Compiled (`--compile`, this section alone): the same S1 step compiled by inductor (first-order
   energy gradient, the only one torch.compile takes) against eager with either gradient: CPU
   time per interleaved round, kernels per step, peak memory, and where the eager and the
   compiled step spend their time: in GEMMs (the floor of compiled / eager: inductor calls those
   kernels as they are), in other ATen ops (the compiled step's fallbacks), and the rest.
   `--recipe s2` times ebt-s2-small's options instead: 2-3 descent steps drawn per step as the
   trainer draws them, and the replay store (which runs eagerly around the compiled descent).
6. The compile cache (`--compile-cache`, this section alone): the wall time of the first compiled
   S1 step in a fresh process with an empty inductor cache, as a requeued job on another node
   starts: from nothing (twice, before and after), and after loading the compile cache the
   first process saved (`pretrain.training.engine.load_compile_cache`, as the trainer does).

    python -m bench.ebt [--width 256 --heads 4 --seq-len 256 --batch 4 --steps 4 --rounds 10] [--launches | --compile [--recipe s2] | --compile-cache]
"""
from __future__ import annotations

import collections
import copy
import functools
import multiprocessing
import os
import re
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from bench.memory import peak_allocated_bytes
from bench.models import (Contender, add_shape_arguments, build_contender, cpu_time_split, print_table,
                          seconds_per_round, seconds_per_step, train_step)
from common.cli import ArgumentParser, run_command
from pretrain.models.ebt_attention import CPU_CHUNKS, default_chunks
from pretrain.training.engine import compiled_cpu_kernel_settings, load_compile_cache, save_compile_cache

BASELINE = Contender("transformer_pp", "transformer_pp-tiny")
TRAINING = [
    BASELINE,
    Contender("ebt S1, observed stream reused", "ebt-tiny"),
    Contender("ebt S1, step conditioning", "ebt-tiny", {"time_embed": True, "reuse_observed_stream": False}),
    Contender("ebt S2, 3 steps, last-step graph", "ebt-s2-tiny", {"min_steps": 0, "replay_buffer_size": 0}),
]


class AtenOps(TorchDispatchMode):
    """Counts the ATen ops run while active, as they reach the kernels (after autograd and the
    composite ops' decomposition), the backward's included: `total`, and `kernels`, those that
    are not views (each launches at least one kernel on a GPU)."""

    def __init__(self):
        super().__init__()
        self.per_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.per_op[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.per_op.values())

    @property
    def kernels(self) -> int:
        return sum(n for func, n in self.per_op.items() if not func.is_view)


def build_model(contender: Contender, args, **overrides) -> torch.nn.Module:
    return build_contender(Contender(contender.label, contender.flavor,
                                     {"n_layer": args.steps, **contender.overrides, **overrides}), args)


def executed_flops(args, idx) -> None:
    rows = []
    for contender in TRAINING:
        model = build_model(contender, args)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            train_step(model, idx)
        executed = counter.get_total_flops() / idx.numel()
        analytic = model.flops_per_token(args.seq_len)
        rows.append((contender.label, f"{executed / 1e6:.2f}", f"{analytic / 1e6:.2f}",
                     f"{executed / analytic:.3f}"))
    print("1. Training step FLOPs per token: executed (FlopCounterMode) vs flops_per_token")
    print_table(("contender", "executed MFLOP", "analytic MFLOP", "executed / analytic"), rows)


def thinking_costs(args, idx) -> None:
    models = {"transformer_pp forward": build_model(BASELINE, args).eval()}
    for steps in (1, 2, 4):
        models[f"ebt think, {steps} step(s)"] = build_model(TRAINING[1], args, n_steps=steps).eval()

    def infer(model, tokens):
        with torch.no_grad():
            if hasattr(model, "think"):
                model.think(tokens)
            else:
                model(tokens)

    seconds = seconds_per_step(models, idx, args.rounds, step=infer)
    base = "transformer_pp forward"
    rows = [(label, f"{seconds[label] * 1e3:.1f}", f"{seconds[label] / seconds[base]:.2f}",
             f"{model.flops_per_token(args.seq_len, training=False) / models[base].flops_per_token(args.seq_len, training=False):.2f}")
            for label, model in models.items()]
    print("2. Inference with thinking (observed stream reused), CPU time of one call")
    print_table(("contender", "ms", "time / forward", "FLOPs / forward"), rows)


def checkpointed_growth(args, idx) -> None:
    peaks = {}
    for n_steps in (2, 8):
        model = build_model(TRAINING[1], args, n_steps=n_steps, activation_checkpointing="step")
        peaks[n_steps] = peak_allocated_bytes(lambda: train_step(model, idx))
    candidate = idx.numel() * args.vocab * 4
    growth = (peaks[8] - peaks[2]) / 6 / candidate
    print(f"3. Step-checkpointed S1: peak {peaks[2] / 2**20:.1f} MiB at 2 steps, {peaks[8] / 2**20:.1f} MiB "
          f"at 8; kept per extra step: {growth:.2f} candidate tensors of {candidate / 2**20:.1f} MiB\n")


def launches(args, idx) -> None:
    s1 = Contender("ebt S1", "ebt-s1-small")
    gpu_chunks = default_chunks(torch.device("cuda"))
    models = {f"{gradient}, {chunks} row chunk(s) ({where})":
              build_model(s1, args, attention_chunks=chunks, energy_gradient=gradient)
              for gradient in ("autograd", "first_order")
              for chunks, where in ((CPU_CHUNKS, "CPU's choice"), (gpu_chunks, "GPU's choice"))}
    seconds = seconds_per_step(models, idx, args.rounds)  # warms up first: rotary tables are built once
    counts, peaks = {}, {}
    for label, model in models.items():
        with AtenOps() as counts[label]:
            train_step(model, idx)
        peaks[label] = peak_allocated_bytes(functools.partial(train_step, model, idx))
    rows = [(label, counts[label].total, counts[label].kernels, f"{seconds[label] * 1e3:.1f}",
             f"{peaks[label] / 2**20:.1f}") for label in models]
    print("4. Launches: one S1 training step (ebt-s1-small's options), energy gradient by autograd's double "
          "backward or first order, two-stream attention in row chunks")
    print_table(("energy gradient, attention", "ATen ops", "not views", "CPU ms", "peak MiB"), rows)


LAUNCH = re.compile(r"^\s+(?:\w+ = )?(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(",
                    re.MULTILINE)
"""A kernel call in inductor's wrapper code: its own fused C++ kernels, the library kernels it
calls (GEMMs), and the ATen ops it falls back to."""


def compiled_launches(code: list[str]) -> int:
    """Kernel calls in one run of the generated graphs (forward and backward; their wrappers
    have no loops, so each call runs once)."""
    return sum(len(LAUNCH.findall(graph)) for graph in code)


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """min-median-max of `values` times `scale`."""
    return "-".join(f"{v * scale:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


RECIPES = {"s1": "ebt-s1-small", "s2": "ebt-s2-small"}
"""`--recipe` -> the flavor whose options `--compile` times at the bench's shape."""
WARMUP_STEPS = {"s1": 1, "s2": 5}
"""Steps before the timed rounds, which compile every graph the rounds run: S2's draws of seeds
0-4 give 3 steps on the first batch, then 3 and 2 steps on batches extended by replayed rows."""


class DrawnStep:
    """A training step that first seeds the model's shared draws, as the trainer does before every
    forward, from the number of steps that model has taken: every contender draws the same step
    counts."""

    def __init__(self):
        self.taken = collections.Counter()

    def __call__(self, model, idx) -> None:
        model.seed_shared_draws(str(self.taken[id(model)]))
        self.taken[id(model)] += 1
        train_step(model, idx)


def compiled_step(args, idx) -> None:
    recipe = Contender(f"ebt {args.recipe.upper()}", RECIPES[args.recipe])
    compiled_cpu_kernel_settings()  # as a compiled CPU run of the trainer
    autograd = build_model(recipe, args, energy_gradient="autograd", attention_chunks=args.chunks)
    first_order = build_model(recipe, args, energy_gradient="first_order", attention_chunks=args.chunks)
    compiled = copy.deepcopy(first_order)
    compiled.compile(backend="inductor", fullgraph=True)
    models = {"eager, autograd": autograd, "eager, first_order": first_order, "compiled, first_order": compiled}
    step, code = DrawnStep(), []
    start = time.perf_counter()
    for _ in range(WARMUP_STEPS[args.recipe]):
        code += run_and_get_code(step, compiled, idx)[1]
    compile_seconds = time.perf_counter() - start
    for label in ("eager, autograd", "eager, first_order"):  # the same draws and replay store as compiled
        for _ in range(WARMUP_STEPS[args.recipe]):
            step(models[label], idx)
    seconds = seconds_per_round(models, idx, args.rounds, step)
    launches = {"compiled, first_order": f"{compiled_launches(code)} kernels" if args.recipe == "s1"
                else f"{len(code)} graphs"}
    for label in ("eager, autograd", "eager, first_order"):
        with AtenOps() as ops:
            step(models[label], idx)
        launches[label] = f"{ops.total} ATen ops ({ops.kernels} not views)"
    peaks = {label: peak_allocated_bytes(functools.partial(step, model, idx)) for label, model in models.items()}
    base = seconds["eager, autograd"]
    rows = [(label, launches[label], spread(seconds[label], 1e3), spread([t / b for t, b in zip(seconds[label], base)],
                                                                         digits=2),
             f"{peaks[label] / 2**20:.1f}") for label in models]
    print(f"5. Compiled: one {args.recipe.upper()} training step ({RECIPES[args.recipe]}'s options, "
          f"{args.chunks or CPU_CHUNKS} attention row chunk(s)), {args.rounds} interleaved rounds "
          f"(min-median-max); inductor, the trainer's CPU kernel settings; target: compiled <= 0.7x eager autograd")
    print_table(("step", "per step", "CPU ms", "/ eager autograd (per round)", "peak MiB"), rows)
    # where each step's time goes: what compiling leaves to the library and to unfused ATen ops
    splits = {label: cpu_time_split(models[label], idx, step=step)
              for label in ("eager, first_order", "compiled, first_order")}
    print_table(("step", "GEMMs (library)", "other ATen ops", "the rest (Python, wrappers, inductor's kernels)"),
                [(label, *(f"{share:.2f}" for share in split.values())) for label, split in splits.items()])
    print(f"GEMM share of the eager first_order step (the floor of compiled / eager first_order): "
          f"{splits['eager, first_order']['library']:.2f}; compiling took {compile_seconds:.0f} s (wall) "
          f"over the first {WARMUP_STEPS[args.recipe]} step(s)")


def first_compiled_step(args, cache_file: Path, use: str) -> tuple[float, str | None]:
    """Run in a process of its own: the wall time of a first compiled S1 step (the trainer's CPU
    settings), with `cache_file` used as `use` says ("load" before the step, "save" after it, or
    "none"); and the load's report line."""
    torch.set_num_threads(args.threads)
    loaded = load_compile_cache(cache_file) if use == "load" else None
    compiled_cpu_kernel_settings()
    model = build_model(Contender("ebt S1", RECIPES["s1"]), args, energy_gradient="first_order",
                        attention_chunks=args.chunks)
    model.compile(backend="inductor", fullgraph=True)
    torch.manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    start = time.perf_counter()
    train_step(model, idx)
    seconds = time.perf_counter() - start
    if use == "save":
        save_compile_cache(cache_file)
    return seconds, loaded


def compile_cache(args) -> None:
    """Three fresh processes in turn, each with an empty inductor cache of its own."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as tmp:
        cache_file = Path(tmp, "compile_cache.bin")
        for job, use in (("cold, saves the cache", "save"), ("loads the cache", "load"), ("cold again", "none")):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=tmp)  # read by the child at its start
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
                seconds, loaded = child.submit(first_compiled_step, args, cache_file, use).result()
            rows.append([job, f"{seconds:.1f}", loaded.split(" from ")[0] if loaded else ""])
    cold = statistics.mean(float(rows[i][1]) for i in (0, 2))
    for row in rows:
        row.insert(2, f"{float(row[1]) / cold:.2f}")
    print(f"6. The compile cache: the first compiled S1 step ({RECIPES['s1']}'s options, {args.chunks or CPU_CHUNKS} "
          "attention row chunk(s)) of a fresh process with an empty inductor cache, wall time")
    print_table(("process", "first step s", "/ cold (mean)", "loaded"), rows)


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.ebt", description=__doc__.split("\n")[0])
    add_shape_arguments(parser)  # --steps: the number of layers here
    parser.add_argument("--launches", action="store_true", help="only the ATen ops per step (section 4)")
    parser.add_argument("--compile", action="store_true", help="only the compiled step against eager (section 5)")
    parser.add_argument("--chunks", type=int, default=None,
                        help=f"--compile: the two-stream attention's row chunks (default: the device's choice, "
                             f"{CPU_CHUNKS} on a CPU, 1 on a GPU)")
    parser.add_argument("--recipe", choices=RECIPES, default="s1", help="--compile: the EBT recipe timed")
    parser.add_argument("--compile-cache", action="store_true",
                        help="only the first compiled step with and without the compile cache (section 6)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, D={args.width}, "
          f"{args.heads} heads, T={args.seq_len}, B={args.batch}, V={args.vocab}, {args.steps} layers\n")
    if args.launches:
        launches(args, idx)
        return
    if args.compile:
        compiled_step(args, idx)
        return
    if args.compile_cache:
        compile_cache(args)
        return
    executed_flops(args, idx)
    thinking_costs(args, idx)
    checkpointed_growth(args, idx)


if __name__ == "__main__":
    run_command(main)
