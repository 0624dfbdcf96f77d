"""One-shot GPU benchmark (issue 7): training throughput, MFU and peak memory of the paper-size
flavors through the trainer's own step (`Trainer.train_step`: DeepSpeed ZeRO-2, bf16, one
device) on synthetic tokens of the real vocabulary, with activation checkpointing off and on,
and EBT's second-order check (loss and gradients with TF32 and in bf16 against a float32
reference).

    python -m bench.gpu [--out DIR] [--budget-s 420]    # one GPU: paper-size flavors at T=1024
    python -m bench.gpu --device cpu --tiny --out DIR    # the same code path on tiny flavors (CI)
    bench/gpu.sh [ARGS]                                  # installs carried wheels first if needed

DIR/gpu.json and DIR/gpu.md are rewritten after every finished case, so an interrupted run
keeps what it measured. This process only schedules: each group of cases (one flavor) runs in
a worker process (`--worker`), so an out-of-memory error, a crash or a hang costs that group
only. Every case has a time cap, the whole run a budget; cases that do not fit are reported
as skipped. A case that runs out of memory is retried at half the micro-batch while time allows.
Ctrl-C, or a scheduler's SIGTERM or SIGUSR1, stops the worker too, reports the cases left as
stopped, and exits with 128 + the signal's number.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from common.cli import STOP_SIGNALS, ArgumentParser, Stopped, run_command, signals_held, stop_signals_raising
from common.fileio import atomic_write_text, markdown_table

REPO = Path(__file__).resolve().parent.parent
RESULT = "BENCH-RESULT "
"""Prefix of the worker's protocol lines on stdout; anything else goes to the log."""
GPT2_VOCAB = 50257
"""The real vocabulary (the models pad it to 50304); synthetic tokens are drawn from it."""
STARTUP_S = 60.0
"""Allowance for a worker to import torch and DeepSpeed and initialise the device."""
WORKER_GRACE_S = 10.0
"""How long a worker that is told to stop gets before it is killed. Not killed at once, because
on a CPU a worker may be building DeepSpeed's communication op, and a build killed outright
leaves its lock file behind: every later build then waits on it forever."""


@dataclass
class Case:
    name: str
    """Label in the tables, unique within a plan."""
    flavor: str
    """Registered model flavor."""
    group: str
    """Cases of one group share a worker process (run in plan order)."""
    kind: str = "throughput"
    """"throughput" (training steps) or "ebt_check" (second-order numerics)."""
    checkpointing: str = "off"
    """Activation checkpointing: "off" or "step" (each block / recurrent step / descent step)."""
    micro_batch: int = 8
    """Sequences per step (one micro-batch, no accumulation)."""
    seq_len: int = 1024
    """Tokens per sequence."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Model config overrides."""
    compile: str = "off"
    """`model.compile` of the run config."""


@dataclass
class Settings:
    device: str
    """"cuda" or "cpu"."""
    vocab_size: int
    """Synthetic tokens are drawn from [0, vocab_size); the models pad it to a multiple of 64."""
    warmup: int
    """Untimed steps before timing (the first one records the attention kernels)."""
    steps: int
    """Timed steps at most."""
    case_seconds: float
    """Time cap of one case: engine build, warmup and timed steps."""
    peak_tflops: float | None
    """Peak for MFU; None looks the device up in pretrain.flops."""


def throughput_cases(flavors: dict[str, str], micro_batch: dict[str, int], seq_len: int) -> list[Case]:
    """Activation checkpointing off and on for each family, at the same micro-batch."""
    return [Case(f"{flavor} ac={ac}", flavor, family, checkpointing=ac, micro_batch=micro_batch[family],
                 seq_len=seq_len)
            for family, flavor in flavors.items() for ac in ("off", "step")]


def gpu_plan() -> list[Case]:
    """The issue's table at T=1024: the EBT check first (short, and the one correctness figure),
    then each family; NRGPT's explicit attention (its `full` heads have head dim 768, beyond
    the flash and cuDNN kernels) is measured against SDPA's memory-efficient kernel last."""
    flavors = {"gpt": "gpt-124m", "gpt_rec": "gpt_rec-85m", "nrgpt": "nrgpt-ff2w-90m",
               "ebt": "ebt-s1-small", "transformer_pp": "transformer_pp-small"}
    micro_batch = {"gpt": 16, "gpt_rec": 16, "nrgpt": 16, "ebt": 8, "transformer_pp": 16}
    return ([Case("ebt-s1-small second-order check", "ebt-s1-small", "ebt_check", kind="ebt_check",
                  micro_batch=2, seq_len=1024)]
            + throughput_cases(flavors, micro_batch, 1024)
            + [Case("nrgpt-ff2w-90m ac=off attention=explicit", "nrgpt-ff2w-90m", "nrgpt", micro_batch=16,
                    overrides={"attention_impl": "explicit"})])


def tiny_plan() -> list[Case]:
    """The same cases on the tiny flavors, in one worker: on a CPU, starting torch and DeepSpeed
    takes longer than all the tiny cases together."""
    flavors = {"gpt": "gpt-tiny", "gpt_rec": "gpt_rec-tiny", "nrgpt": "nrgpt-tiny", "ebt": "ebt-tiny",
               "transformer_pp": "transformer_pp-tiny"}
    plan = ([Case("ebt-tiny second-order check", "ebt-tiny", "ebt_check", kind="ebt_check", micro_batch=2,
                  seq_len=32)]
            + throughput_cases(flavors, dict.fromkeys(flavors, 4), 64)
            + [Case("nrgpt-tiny ac=off attention=explicit", "nrgpt-tiny", "nrgpt", micro_batch=4, seq_len=64,
                    overrides={"attention_impl": "explicit"})])
    return [dataclasses.replace(case, group="tiny") for case in plan]


def compile_cases(plan: list[Case]) -> list[Case]:
    """torch.compile (inductor) variants of the checkpointing-off cases of the families without
    double backward."""
    from pretrain.models import model_class, resolve

    return [dataclasses.replace(case, name=f"{case.name} compile=inductor", compile="inductor")
            for case in plan if case.kind == "throughput" and case.checkpointing == "off"
            and not case.overrides and not model_class(resolve(case.flavor)).needs_double_backward]


# ---------------------------------------------------------------------------------------------
# Measurements (run in the worker)

SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
"""ATen's SDPA implementations (the op the dispatcher picked) -> kernel name."""


def attention_kernels(work: Callable[[], object]) -> dict[str, int]:
    """Which SDPA kernels `work()` ran, forward and backward, with their call counts, read from
    the profiler's record of dispatched ATen ops (the dispatcher's own choice, on any device).
    Attention written as plain matmuls (NRGPT's explicit path, EBT's predicted rows) does not
    appear."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    counts = Counter()
    for event in prof.events():
        op = event.name.removeprefix("aten::")
        backward = op.endswith("_backward")
        kernel = SDPA_KERNELS.get(op.removesuffix("_backward"))
        if kernel is not None:
            counts[kernel + (" backward" if backward else "")] += 1
    return dict(sorted(counts.items()))


def synthetic_batches(micro_batch: int, seq_len: int, vocab_size: int, pin: bool, seed: int = 0):
    """(inputs, targets) windows of uniform random tokens, as the data loader yields them (CPU,
    int64, pinned for asynchronous copies on GPU); a few distinct batches, cycled."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    windows = [torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=generator)
               for _ in range(4)]
    batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]
    if pin:
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    while True:
        yield from batches


def run_config(case: Case, settings: Settings, micro_batch: int, output_root: str):
    """The run config of a throughput case, checked like a real run's."""
    from pretrain.config import (DataSection, ModelSection, RunConfig, ScheduleSection, TrainSection,
                                 ZeroSection, validate)

    cfg = RunConfig(
        run_name="bench-gpu", output_root=output_root,
        model=ModelSection(flavor=case.flavor, overrides=dict(case.overrides),
                           activation_checkpointing=case.checkpointing, compile=case.compile),
        data=DataSection(path="(synthetic tokens)", seq_len=case.seq_len, micro_batch_size=micro_batch,
                         num_workers=0),
        schedule=ScheduleSection(kind="constant"),
        train=TrainSection(max_steps=10**9, global_batch_size=micro_batch, precision="bf16",
                           peak_tflops=settings.peak_tflops),
        zero=ZeroSection(stage=2))
    validate(cfg, world_size=1, has_gpu=settings.device == "cuda")
    return cfg


def measure_throughput(case: Case, settings: Settings, micro_batch: int, started: float) -> dict:
    """Build the trainer's engine for `case` and time `Trainer.train_step` on synthetic tokens."""
    import torch
    from pretrain.flops import achieved_tflops, mfu
    from pretrain.train import Trainer

    on_gpu = settings.device == "cuda"
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as output_root:
        trainer = Trainer(run_config(case, settings, micro_batch, output_root))
        try:
            trainer.build_engine(settings.vocab_size)
            trainer.batches = synthetic_batches(micro_batch, case.seq_len, settings.vocab_size, pin=on_gpu)

            def step() -> float:
                start = time.perf_counter()
                result = trainer.train_step(log_now=False)  # ends in a host sync (all-reduce, .tolist())
                trainer.state.step += 1
                losses.append(result.loss)
                return time.perf_counter() - start

            losses: list[float] = []
            kernels = attention_kernels(step)
            for _ in range(settings.warmup - 1):
                step()
            trainer.throughput.reset_interval()
            seconds = []
            timed_until = started + 0.8 * settings.case_seconds
            while len(seconds) < settings.steps and (len(seconds) < 2 or time.perf_counter() < timed_until):
                seconds.append(step())
            tokens_per_step = micro_batch * case.seq_len
            tokens_per_s = tokens_per_step / statistics.median(seconds)
            peak = trainer.throughput.peak_tflops  # train.peak_tflops, or the device's entry in pretrain.flops
            return {
                "params": trainer.params, "flops_per_token": trainer.flops_per_token,
                "tokens_per_step": tokens_per_step, "timed_steps": len(seconds),
                "step_ms_median": 1e3 * statistics.median(seconds), "step_ms_min": 1e3 * min(seconds),
                "tokens_per_s": tokens_per_s,
                "tflops": achieved_tflops(trainer.flops_per_token, tokens_per_s),
                "peak_tflops": peak,
                "mfu": mfu(trainer.flops_per_token, tokens_per_s, 1, peak) if peak else None,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
                "data_wait_frac": trainer.throughput.figures()["train/data_wait_frac"],
                "attention_kernels": kernels, "precision": trainer.precision,
                "loss_first": losses[0], "loss_last": losses[-1],
            }
        finally:
            if "engine" in trainer.__dict__:
                trainer.engine.destroy()
            trainer.close()


def run_throughput(case: Case, settings: Settings) -> dict:
    """`measure_throughput`, retried at half the micro-batch after running out of memory."""
    import torch

    started = time.perf_counter()
    micro_batch, oom_retries = case.micro_batch, 0
    while True:
        memory_at_start = None
        if settings.device == "cuda":
            gc.collect()  # what a previous case or attempt left in reference cycles
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            memory_at_start = torch.cuda.memory_allocated() / 2**30
        try:
            measured = measure_throughput(case, settings, micro_batch, started)
        except torch.OutOfMemoryError:
            oom_retries += 1
            elapsed = time.perf_counter() - started
            if micro_batch == 1 or elapsed > 0.5 * settings.case_seconds:
                return {"status": "oom", "micro_batch": micro_batch, "oom_retries": oom_retries,
                        "error": f"out of memory at micro-batch {micro_batch}"}
            micro_batch //= 2
            continue
        finite = all(map(math.isfinite, (measured["loss_first"], measured["loss_last"])))
        return {"status": "ok" if finite else "error", "micro_batch": micro_batch, "oom_retries": oom_retries,
                "memory_at_start_gib": memory_at_start,
                **({} if finite else {"error": "non-finite training loss"}), **measured}


ENERGY_HEAD = "descent.energy_head.weight"
"""EBT's energy head: its gradient comes only through the second-order backward."""
EBT_CHECK_TOLERANCES = {
    "tf32": {"loss": 1e-3, "grads": 2e-2},
    "bf16": {"loss": 5e-3, "grads": 1e-1},
}
"""Relative errors allowed against the float32 reference: |loss - ref| / |ref|, and for the
gradients the largest ||g - g_ref|| / ||g_ref|| over the parameter tensors (the energy head's
gradient, reached only through the second-order backward, among them). On CPU, bf16 gave
3-6e-5 for the loss and 1-2.4e-2 for the worst tensor (docs/benchmarks.md, "GPU (H200)");
TF32 rounds only matmul inputs, to 10 mantissa bits instead of bf16's 7 everywhere."""


def run_ebt_check(case: Case, settings: Settings) -> dict:
    """Loss and gradients of one EBT training forward/backward (second order through the
    descent) with TF32 matmuls (GPU only) and with the model in bf16, as DeepSpeed's bf16 runs
    it, against the same model in float32 with full-precision matmuls."""
    import copy

    import torch
    from pretrain.models import build, resolve

    on_gpu = settings.device == "cuda"
    device = torch.device(settings.device)
    vocab = -(-settings.vocab_size // 64) * 64
    config = resolve(case.flavor, {"vocab_size": vocab, "block_size": case.seq_len, **case.overrides})
    torch.manual_seed(0)
    reference = build(config).to(device).train()
    inputs, targets = next(synthetic_batches(case.micro_batch, case.seq_len, settings.vocab_size, pin=False))
    inputs, targets = inputs.to(device), targets.to(device)

    def loss_and_grads(model, tf32: bool):
        if on_gpu:
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same candidate noise for every variant (drawn in float32)
        loss = model(inputs, targets).loss
        loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.item(), grads

    try:
        ref_loss, ref_grads = loss_and_grads(reference, tf32=False)
        variants = {"bf16": (copy.deepcopy(reference).to(torch.bfloat16), False)}
        if on_gpu:
            variants = {"tf32": (reference, True), **variants}
        kernels = {}
        results = {}
        for name, (model, tf32) in variants.items():
            kernels[name] = attention_kernels(lambda: loss_and_grads(model, tf32))
            loss, grads = loss_and_grads(model, tf32)
            results[name] = compare_to_reference(loss, grads, ref_loss, ref_grads, EBT_CHECK_TOLERANCES[name])
    finally:
        if on_gpu:
            torch.set_float32_matmul_precision("high")
    return {"status": "ok" if all(r["pass"] for r in results.values()) else "failed",
            "reference_loss": ref_loss, "energy_head_grad_norm": ref_grads[ENERGY_HEAD].norm().item(),
            "variants": results, "attention_kernels": kernels, "tokens": case.micro_batch * case.seq_len}


def compare_to_reference(loss: float, grads: dict, ref_loss: float, ref_grads: dict, tolerance: dict) -> dict:
    """Relative errors of a variant's loss and gradients (see EBT_CHECK_TOLERANCES)."""
    per_tensor = {n: ((grads[n] - g).norm() / g.norm()).item()
                  for n, g in ref_grads.items() if n in grads and g.norm() > 0}
    worst = max(per_tensor, key=per_tensor.get)
    errors = {"loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
              "max_grad_rel_err": per_tensor[worst], "max_grad_rel_err_param": worst,
              "energy_head_grad_rel_err": per_tensor[ENERGY_HEAD]}
    passed = (set(grads) == set(ref_grads) and all(map(math.isfinite, per_tensor.values()))
              and math.isfinite(errors["loss_rel_err"]) and errors["loss_rel_err"] <= tolerance["loss"]
              and errors["max_grad_rel_err"] <= tolerance["grads"])
    return {**errors, "tolerance": tolerance, "pass": passed}


def environment(device: str) -> dict:
    import deepspeed
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "device": f"cpu ({platform.machine()})", "cuda": torch.version.cuda}
    if device == "cuda":
        env.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                   cudnn=torch.backends.cudnn.version(),
                   memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
        try:  # a private API: recorded when this torch has it
            from torch.nn.attention import SDPBackend

            env["sdpa_priority"] = [SDPBackend(i).name for i in torch._C._get_sdp_priority_order()]
        except Exception:
            pass
    return env


def worker() -> int:
    """Run the cases given on stdin (JSON) in order; one protocol line per result on stdout.
    A stop signal ends it with the case it was running reported as stopped (under Slurm the
    whole job gets the scheduler's SIGTERM, this process too)."""
    spec = json.loads(sys.stdin.read())
    settings = Settings(**spec["settings"])
    case = None
    try:
        with stop_signals_raising():
            import deepspeed
            import torch
            from pretrain.engine import distributed_env

            if settings.device == "cpu":
                torch.set_num_threads(1)  # tiny models on a shared CPU: one thread wastes least
            distributed_env()
            deepspeed.init_distributed(verbose=False)
            emit({"environment": environment(settings.device)})
            for raw in spec["cases"]:
                case = Case(**raw)
                started = time.perf_counter()
                try:
                    result = (run_ebt_check if case.kind == "ebt_check" else run_throughput)(case, settings)
                except Exception as e:  # reported, and the next case still runs
                    result = {"status": "error", "error": one_line(e)}
                emit({"case": case.name, "seconds": time.perf_counter() - started, **result})
                case = None
    except (Stopped, KeyboardInterrupt) as e:  # the trainer raises KeyboardInterrupt for Ctrl-C
        signum = getattr(e, "signum", signal.SIGINT)
        if case is not None:
            emit({"case": case.name, "seconds": time.perf_counter() - started, "status": "stopped",
                  "error": f"stopped by {signal.Signals(signum).name}"})
        return 128 + signum
    return 0


def emit(record: dict) -> None:
    print(RESULT + json.dumps(record), flush=True)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ---------------------------------------------------------------------------------------------
# Scheduling and reports (the parent process)


def run_group(cases: list[Case], settings: Settings, deadline: float, log) -> Iterator[dict]:
    """Run `cases` in one worker until they are done, it dies or `deadline` (monotonic) passes,
    yielding each record as it arrives (then one for each case that did not finish). The worker
    is stopped (`stop_worker`) also when this generator is closed early or a stop signal
    interrupts it: it runs in a session of its own, which the terminal's Ctrl-C does not reach."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if settings.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)  # each worker is a world of its own
    with signals_held():  # a stop now would leave a worker that nothing kills
        proc = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--worker"], cwd=REPO, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.stdin.write(json.dumps({"settings": dataclasses.asdict(settings),
                                     "cases": [dataclasses.asdict(c) for c in cases]}))
        proc.stdin.close()
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        tail, pending = [], [c.name for c in cases]
        while pending:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if not line.startswith(RESULT):
                log.write(line)
                tail = (tail + [line.strip()])[-5:]
                continue
            record = json.loads(line[len(RESULT):])
            if "case" in record:
                pending.remove(record["case"])
            yield record
    finally:
        stop_worker(proc)
    stopped_by = {128 + s: s.name for s in STOP_SIGNALS}.get(proc.returncode)  # see `worker`
    if time.monotonic() >= deadline:
        status, reason = "timeout", "time cap reached"
    elif stopped_by:
        status, reason = "stopped", f"worker stopped by {stopped_by}"
    else:
        status, reason = "crashed", f"worker exited with code {proc.returncode}: {tail[-1] if tail else 'no output'}"
    for name in pending:
        yield {"case": name, "status": status, "error": reason[:300]}
    log.flush()


def stop_worker(proc: subprocess.Popen) -> None:
    """End a worker still running: SIGTERM to its process group, SIGKILL after WORKER_GRACE_S."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=WORKER_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def write_reports(out: Path, report: dict) -> None:
    """gpu.json and gpu.md, each replaced atomically."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu.json", json.dumps(report, indent=2) + "\n"), ("gpu.md", markdown(report))):
        atomic_write_text(out / name, text)


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    lines = [f"# bench.gpu ({report['mode']})", "",
             f"{report['date']}, {env.get('device', report['device'])}; torch {env.get('torch', '?')}, "
             f"DeepSpeed {env.get('deepspeed', '?')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}; "
             f"bf16, ZeRO-2, one process; synthetic tokens (vocabulary {report['vocab_size']}); "
             f"{report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget.", ""]
    columns = ("case", "status", "micro-batch x T", "tokens/s", "MFU", "TFLOP/s", "peak memory GiB",
               "step ms (median)", "data wait", "attention kernels (calls per step)")
    rows, checks = [], []
    for r in report["cases"]:
        if r.get("kind") == "ebt_check":
            checks.append(r)
        elif r["status"] != "ok":
            rows.append(dict.fromkeys(columns, "") | {"case": r["case"], "status": f"{r['status']}: {r.get('error', '')}"})
        else:
            kernels = ", ".join(f"{k} {v}" for k, v in r["attention_kernels"].items()) or "none (explicit)"
            rows.append(dict(zip(columns, (
                r["case"], "ok", f"{r['micro_batch']} x {r['tokens_per_step'] // r['micro_batch']}",
                f"{r['tokens_per_s']:,.0f}", _percent(r["mfu"]), f"{r['tflops']:.3g}",
                _number(r["peak_memory_gib"]), f"{r['step_ms_median']:.1f}", f"{r['data_wait_frac']:.1%}", kernels))))
    if rows:
        lines.append(markdown_table(rows).rstrip("\n"))
    for r in checks:
        lines += ["", f"**{r['case']}**: {r['status']}"]
        if "variants" not in r:
            lines[-1] += f" ({r.get('error', '')})"
            continue
        lines += [f"(reference loss {r['reference_loss']:.4f} in float32 without TF32, "
                  f"energy-head gradient norm {r['energy_head_grad_norm']:.3g})", ""]
        lines.append(markdown_table([{
            "variant": name, "loss rel. error": f"{v['loss_rel_err']:.2e}",
            "worst gradient rel. error (tensor)": f"{v['max_grad_rel_err']:.2e} ({v['max_grad_rel_err_param']})",
            "energy-head gradient rel. error": f"{v['energy_head_grad_rel_err']:.2e}",
            "tolerance (loss / gradients)": f"{v['tolerance']['loss']:g} / {v['tolerance']['grads']:g}",
            "pass": "yes" if v["pass"] else "NO"} for name, v in r["variants"].items()]).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny flavors (small vocabulary, T=64): a smoke test")
    parser.add_argument("--out", default="bench/out/gpu", help="directory for gpu.json, gpu.md and the log")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the whole run (default 420 s; 240 s with --tiny)")
    parser.add_argument("--case-seconds", type=float, default=None,
                        help="time cap of one case (default 40 s; 60 s with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case at most (default 10; 2 tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per case (default 3; 1 tiny)")
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="run only cases whose name contains one of these")
    parser.add_argument("--compile", action="store_true",
                        help="add torch.compile (inductor) cases for the families without double backward")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (default: by device name)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()

    if args.device == "cpu" and not args.tiny:
        print("error: the paper-size cases need a GPU; on a CPU use --device cpu --tiny", file=sys.stderr)
        return 2
    if args.device == "cuda" and not _has_cuda():
        print("error: no CUDA device is visible; use --device cpu --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    tiny = args.tiny
    settings = Settings(device=args.device, vocab_size=512 if tiny else GPT2_VOCAB,
                        warmup=max(1, args.warmup or (1 if tiny else 3)), steps=max(2, args.steps or (2 if tiny else 10)),
                        case_seconds=args.case_seconds or (60.0 if tiny else 40.0), peak_tflops=args.peak_tflops)
    budget = args.budget_s or (240.0 if tiny else 420.0)
    plan = tiny_plan() if tiny else gpu_plan()
    if args.compile:
        plan += compile_cases(plan)
    if args.only:
        plan = [c for c in plan if any(text in c.name for text in args.only)]
    if not plan:
        print("error: --only matches no case", file=sys.stderr)
        return 2

    start, wall_start = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {c.name: {"case": c.name, "kind": c.kind, "flavor": c.flavor, "checkpointing": c.checkpointing,
                        "status": "pending", **({"overrides": c.overrides} if c.overrides else {}),
                        **({"compile": c.compile} if c.compile != "off" else {})} for c in plan}
    report = {"mode": ("tiny " if tiny else "") + args.device, "device": args.device,
              "date": wall_start.strftime("%Y-%m-%d %H:%M UTC"), "vocab_size": settings.vocab_size,
              "budget_s": budget, "elapsed_s": 0.0, "settings": dataclasses.asdict(settings),
              "command": "python -m bench.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": {}, "cases": list(results.values())}
    groups: dict[str, list[Case]] = {}
    for case in plan:
        groups.setdefault(case.group, []).append(case)
    try:
        with stop_signals_raising(), open(out / "gpu_workers.log", "w") as log:
            for cases in groups.values():
                left = budget - (time.monotonic() - start)
                if left < STARTUP_S / 2:
                    for case in cases:
                        results[case.name].update(status="skipped", error="run budget spent")
                    continue
                deadline = time.monotonic() + min(left, STARTUP_S + len(cases) * 1.5 * settings.case_seconds)
                print(f"[{time.monotonic() - start:5.0f} s] {', '.join(c.name for c in cases)}", flush=True)
                with contextlib.closing(run_group(cases, settings, deadline, log)) as records:
                    for record in records:
                        if "environment" in record:
                            report["environment"] = report["environment"] or record["environment"]
                            continue
                        results[record["case"]].update(record)
                        print(f"    {record['case']}: {summary_line(results[record['case']])}", flush=True)
                        report["elapsed_s"] = time.monotonic() - start
                        write_reports(out, report)
    except Stopped as e:
        name = signal.Signals(e.signum).name
        for r in results.values():
            if r["status"] == "pending":
                r.update(status="stopped", error=f"stopped by {name}")
        report["elapsed_s"] = time.monotonic() - start
        write_reports(out, report)
        print(f"error: stopped by {name}; {out / 'gpu.json'} and gpu.md report the cases finished before it",
              file=sys.stderr)
        return 128 + e.signum
    report["elapsed_s"] = time.monotonic() - start
    write_reports(out, report)
    print(f"\n{markdown(report)}\nwritten: {out / 'gpu.json'}, {out / 'gpu.md'}")
    return 0


def summary_line(r: dict) -> str:
    if r["status"] not in ("ok", "failed"):
        return f"{r['status']} ({r.get('error', '')})"
    if r["kind"] == "ebt_check":
        return r["status"] + "; " + ", ".join(
            f"{n}: loss {v['loss_rel_err']:.1e}, gradients {v['max_grad_rel_err']:.1e}" for n, v in r["variants"].items())
    return (f"{r['tokens_per_s']:,.0f} tokens/s, MFU {_percent(r['mfu'])}, "
            f"peak {_number(r['peak_memory_gib'])} GiB, {r['step_ms_median']:.1f} ms/step")


def _has_cuda() -> bool:
    """Without importing torch in this process (the workers do)."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


if __name__ == "__main__":
    run_command(main)
