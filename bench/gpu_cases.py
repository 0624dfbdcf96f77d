"""What each case of `bench.gpu` measures, run inside its worker process: a config's training
steps through the trainer (tokens/s, MFU, memory, the attention kernels the dispatcher ran) and
EBT's bf16 check; each under its time cap (`run_case`). `bench.gpu` plans the cases and runs the
worker."""
from __future__ import annotations

import gc
import math
import signal
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.gpu_report import GIB

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    name: str
    """Label in the tables, unique within a plan."""
    kind: str
    """"train" (training steps of a config) or "bf16_check" (EBT's second-order numerics)."""
    cap_s: float
    """Time cap of the case."""
    config: str = ""
    """train: the config file, relative to the repository."""
    overrides: list[str] = field(default_factory=list)
    """train: `key=value` overrides that make the run (tiny flavor, compile setting)."""
    fill_replay_store: bool = False
    """train: step until EBT's replay store is full before timing (the memory probe)."""
    flavor: str = ""
    """bf16_check: the model flavor."""
    micro_batch: int = 0
    """bf16_check: sequences in the batch."""
    seq_len: int = 0
    """bf16_check: tokens per sequence."""
    kept_for_later_s: float | None = None
    """A case of the part being run: the caps of that part's cases after it, the time it leaves
    them; it may take the rest, which is its cap and what the part's earlier cases left unused.
    None: a case of a later part, run on the time left, at most its cap (`case_cap`)."""


def case_cap(case: Case, left_s: float) -> float:
    """The time `case` may take with `left_s` seconds to the run's deadline."""
    if case.kept_for_later_s is None:
        return min(case.cap_s, left_s)
    return min(left_s, max(case.cap_s, left_s - case.kept_for_later_s))


@dataclass
class Settings:
    device: str
    """"cuda" or "cpu"."""
    vocab_size: int
    """Synthetic tokens are drawn from [0, vocab_size); the models pad it to a multiple of 64."""
    warmup: int
    """Untimed steps before the profiled one: the first one compiles, and a second compilation
    (transformer_pp's rotary tables are filled by its first step) falls into the second."""
    steps: int
    """Timed steps at most."""
    peak_tflops: float | None
    """Peak for MFU; None looks the device up in pretrain.training.flops."""
    deadline: float
    """time.monotonic() by which the worker is to have ended its last case."""



SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
"""ATen's SDPA implementations (the op the dispatcher picked) -> kernel name."""
PREDICTED_KERNELS = {"flash": ("flash", "cudnn"), "efficient": ("memory-efficient",), "math": ("math",)}
"""`models.sdpa.sdpa_kernel`'s answer -> the kernels that bear it out ("flash" stands for
cuDNN's kernel too, which takes a subset of flash's shapes)."""


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


def prediction_holds(predicted: str | None, ran: dict[str, int]) -> bool | None:
    """Whether the forward kernels a GPU ran are the predicted one's (SDPA that ran where none
    was predicted, or none where one was, is a disagreement too); None when neither has any."""
    forward = [kernel for kernel in ran if not kernel.endswith(" backward")]
    if predicted is None and not forward:
        return None
    return predicted is not None and bool(forward) and all(k in PREDICTED_KERNELS[predicted] for k in forward)


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


def bench_config(case: Case, settings: Settings, output_root: str):
    """The case's config as the trainer reads it, changed only where synthetic tokens and a
    benchmark need it: one micro-batch of the configured size per step (the split the trainer
    takes on one GPU), no data files, a temporary output root. Checked like a real run's."""
    from pretrain.config import load_config
    from pretrain.config.validation import validate

    cfg = load_config(REPO / case.config, [*case.overrides, "run_name=bench-gpu", f"output_root={output_root}",
                                           "data.path=synthetic-tokens", "data.num_workers=0"])
    cfg.train.global_batch_size = cfg.data.micro_batch_size
    cfg.train.peak_tflops = settings.peak_tflops
    validate(cfg, world_size=1, has_gpu=settings.device == "cuda")
    return cfg


def planned_memory(cfg, vocab_size: int) -> dict[str, int]:
    """Bytes of one GPU at the peak of a step of `cfg` on one GPU, by part, as `python -m
    pretrain.plan --gpus 1` has them (`make_plan` itself would look for a dataset through the
    data pipeline, and so mosaicml-streaming, which the GPU machine lacks)."""
    from pretrain.config import model_config
    from pretrain.config.precision import resolve_precision
    from pretrain.training.planner import memory_parts, meta_model

    precision = resolve_precision(cfg.train.precision, has_gpu=True)
    parts = memory_parts(cfg, meta_model(model_config(cfg, vocab_size)), precision, 1, cfg.data.micro_batch_size)
    return {**parts.as_dict(), "tensors": parts.tensors, "total": parts.total}


def measure_training(case: Case, settings: Settings, cap_s: float, result: dict) -> None:
    """Build the trainer's engine for the case's config and time `Trainer.train_step` on
    synthetic tokens, filling `result` as figures come (a case cut short keeps them)."""
    import torch
    from pretrain.config import gpu_attention
    from pretrain.config.precision import resolve_precision
    from pretrain.models.replay import replay_store_bytes
    from pretrain.training.flops import achieved_tflops, mfu
    from pretrain.training.trainer import Trainer

    started = time.perf_counter()
    on_gpu = settings.device == "cuda"
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as output_root:
        cfg = bench_config(case, settings, output_root)
        micro_batch, seq_len = cfg.data.micro_batch_size, cfg.data.seq_len
        predicted = gpu_attention(cfg)  # on this GPU; H100-class where there is none
        result.update(config=case.config, overrides=case.overrides, flavor=cfg.model.flavor,
                      compile=cfg.model.compile, micro_batch=micro_batch, seq_len=seq_len,
                      precision=resolve_precision(cfg.train.precision, on_gpu).name, attention={
                          "predicted": predicted and predicted[0], "head_dim": predicted and predicted[1]})
        if case.fill_replay_store:
            result["plan"] = planned_memory(cfg, settings.vocab_size)
        trainer = Trainer(cfg)
        try:
            trainer.build_engine(settings.vocab_size)
            result.update(params=trainer.params, flops_per_token=trainer.flops_per_token)
            trainer.feed(synthetic_batches(micro_batch, seq_len, settings.vocab_size, pin=on_gpu))
            losses: list[float] = []

            def step() -> float:
                start = time.perf_counter()
                losses.append(trainer.train_step(log_now=False).loss)  # ends in a host sync (.tolist())
                return time.perf_counter() - start

            for _ in range(settings.warmup):
                step()
            if case.fill_replay_store:
                store, rows = trainer.engine.module.replay_store, trainer.model_config.replay_buffer_size
                while int((store.tensors["lengths"] > 0).sum()) < rows:
                    step()
                result["replay_store"] = {
                    "rows": rows, "replayed_rows_per_step": trainer.model_config.replayed_rows(micro_batch),
                    "bytes": sum(t.nbytes for t in store.tensors.values()),
                    "planned_bytes": replay_store_bytes(trainer.model_config)}
            ran = attention_kernels(step)
            result["attention"].update(ran=ran, holds=prediction_holds(result["attention"]["predicted"], ran)
                                       if on_gpu else None)
            seconds: list[float] = []
            peak = trainer.throughput.peak_tflops  # train.peak_tflops, or the device's entry in pretrain.training.flops
            while len(seconds) < settings.steps and (len(seconds) < 2 or time.perf_counter() - started < 0.8 * cap_s):
                seconds.append(step())
                tokens_per_s = micro_batch * seq_len / statistics.median(seconds)
                result.update(
                    timed_steps=len(seconds), step_ms_median=1e3 * statistics.median(seconds),
                    step_ms_min=1e3 * min(seconds), tokens_per_s=tokens_per_s,
                    tflops=achieved_tflops(trainer.flops_per_token, tokens_per_s), peak_tflops=peak,
                    mfu=mfu(trainer.flops_per_token, tokens_per_s, 1, peak) if peak else None,
                    loss_first=losses[0], loss_last=losses[-1])
            if not all(map(math.isfinite, losses)):
                result.update(status="error", error="non-finite training loss")
        finally:
            if on_gpu:
                result.update(peak_memory_gib=torch.cuda.max_memory_allocated() / GIB,
                              peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
                if "plan" in result:
                    result["peak_over_plan"] = torch.cuda.max_memory_allocated() / result["plan"]["tensors"]
            trainer.close(release_engine=True)


BF16_CHECK_CONFIG = "configs/owt/ebt_s1_small.yaml"
"""The config whose model options (its energy gradient) the bf16 check's flavor takes: the check
tests the arithmetic that config trains."""
ENERGY_HEAD = "descent.energy_head.weight"
"""EBT's energy head: its gradient comes only through the second-order backward."""
BF16_MARGIN = 3.0
"""The bf16 check's gradient tolerance over the largest gradient error `bench.precision` measured
in pure bf16. Those are whole parameter groups at D = 64; the check takes the worst single
tensor of ebt-s1-small (D = 768), which reached 1.7x the largest of them at T = 128 on the CPU
(docs/benchmarks.md); the GPU's T = 1024 is not measured yet."""


def bf16_tolerance() -> dict[str, float]:
    """Relative errors allowed against the float32 reference: |loss - ref| / |ref| (bf16 gave
    3-6e-5 on the CPU), and for the gradients the largest ||g - g_ref|| / ||g_ref|| over the
    parameter tensors (the energy head's, reached only through the second-order backward, among
    them): BF16_MARGIN times the largest of `bench.precision.BF16_GRADIENT_ERRORS`."""
    from bench.precision import BF16_GRADIENT_ERRORS

    worst = max(error for groups in BF16_GRADIENT_ERRORS.values() for error in groups.values())
    return {"loss": 5e-3, "grads": BF16_MARGIN * worst}


def check_bf16(case: Case, settings: Settings, cap_s: float, result: dict) -> None:
    """Loss and gradients of one EBT training forward/backward (second order through the
    descent) with the model in bf16, as DeepSpeed's bf16 runs it, against the same model in
    float32 with full-precision matmuls."""
    import copy

    import torch
    from pretrain.config import load_config, typed_model_overrides
    from pretrain.models import build, resolve

    device = torch.device(settings.device)
    vocab = -(-settings.vocab_size // 64) * 64
    options = typed_model_overrides(load_config(REPO / BF16_CHECK_CONFIG))
    config = resolve(case.flavor, {**options, "vocab_size": vocab, "block_size": case.seq_len})
    torch.manual_seed(0)
    reference = build(config).to(device).train()
    inputs, targets = next(synthetic_batches(case.micro_batch, case.seq_len, settings.vocab_size, pin=False))
    inputs, targets = inputs.to(device), targets.to(device)
    result.update(flavor=case.flavor, micro_batch=case.micro_batch, seq_len=case.seq_len, n_layer=config.n_layer,
                  energy_gradient=config.energy_gradient)

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same candidate noise for both (drawn in float32)
        loss = model(inputs, targets).loss
        loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.item(), grads

    matmul_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 in the reference
    try:
        ref_loss, ref_grads = loss_and_grads(reference)
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
    result.update(reference_loss=ref_loss, energy_head_grad_norm=ref_grads[ENERGY_HEAD].norm().item())
    loss, grads = loss_and_grads(copy.deepcopy(reference).to(torch.bfloat16))
    result.update(compare_to_reference(loss, grads, ref_loss, ref_grads, bf16_tolerance()))
    if not result["pass"]:
        result.update(status="failed", error="bf16 beyond its tolerance")


def compare_to_reference(loss: float, grads: dict, ref_loss: float, ref_grads: dict, tolerance: dict) -> dict:
    """Relative errors of the loss and gradients (see `bf16_tolerance`)."""
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


class CaseTimeout(BaseException):
    """A case's time cap, raised where the case was by the alarm. A BaseException, so that no
    `except Exception` on the way swallows it."""


def on_alarm(signum, frame) -> None:
    raise CaseTimeout()


def run_case(case: Case, settings: Settings, cap_s: float) -> dict:
    """The case's result: its status and whatever it measured before it ended."""
    import torch

    torch._dynamo.reset()  # each compiled case compiles afresh, as a training run does
    if settings.device == "cuda":
        gc.collect()  # what a previous case left in reference cycles
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    result = {"memory_at_start_gib": torch.cuda.memory_allocated() / GIB} if settings.device == "cuda" else {}
    started = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, cap_s)
    try:
        (measure_training if case.kind == "train" else check_bf16)(case, settings, cap_s, result)
    except CaseTimeout:
        result.update(status="timeout", error=f"time cap of {cap_s:.0f} s reached")
    except torch.OutOfMemoryError as e:
        result.update(status="oom", error=one_line(e))
    except Exception as e:  # reported, and the next case still runs
        result.update(status="error", error=one_line(e))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {"status": "ok", **result, "seconds": time.perf_counter() - started}


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
