"""The memory and time plan of a config on N GPUs (`make_plan`), which `python -m pretrain.plan`
prints and the GPU bench checks against what a device allocates.

The activations are measured, not modelled: the config's model is built at full size on the
meta device (shapes and dtypes, no memory) and runs one micro-batch's forward and backward with
the config's activation checkpointing and precision and the GPU's attention kernels (with their
own buffers), while every tensor the pass creates is counted until it is freed; their peak is
the figure. Paper-scale flavors answer in seconds on a machine without a GPU."""
from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pretrain.config import RunConfig, batch_split, model_config
from pretrain.config.precision import Precision, resolve_precision
from pretrain.config.validation import validate
from pretrain.models import FLAVORS, build, family_name, family_spec
from pretrain.training.engine import deepspeed_config
from pretrain.training.flops import peak_tflops
from pretrain.training.meta_attention import attention_on_meta, kernel_scratch_bytes


GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    """The device name as torch reports it (`pretrain.training.flops` looks its peak up by it)."""
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi's total)."""


GPUS = {
    "h100-80gb": GPU("NVIDIA H100 80GB HBM3", 81559 * 2**20),
    "h200": GPU("NVIDIA H200", 143771 * 2**20),
    "a100-80gb": GPU("NVIDIA A100-SXM4-80GB", 81920 * 2**20),
}
"""The GPUs a plan can be made for (SXM boards). Their dense bf16 peaks are vendor datasheet
numbers, in `pretrain.training.flops.PEAK_BF16_TFLOPS`: 989 TFLOP/s for H100 and H200, 312 for A100."""

MFU_RANGE = (0.5, 0.3)
"""Model FLOPs utilisation of the fast and the slow end of the step-time range."""
RESERVED_BYTES = 3 * GIB // 2
"""Device memory outside torch's allocator: the CUDA context, NCCL's and cuBLAS's buffers."""
FRAGMENTATION = 0.10
"""Memory the caching allocator holds in blocks not in use at the peak, as a fraction of what the
tensors need."""

@dataclass
class Parts:
    """Bytes one GPU holds at the peak of a training step, by part."""
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    buffers: int

    @property
    def tensors(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.buffers

    @property
    def margin(self) -> int:
        return RESERVED_BYTES + round(FRAGMENTATION * self.tensors)

    @property
    def total(self) -> int:
        return self.tensors + self.margin

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "margin": self.margin}


# ---------------------------------------------------------------------------------------------
# Model states: parameters, gradients, optimizer states


def model_state_bytes(n_params: int, gathered_params: int, ds_config: dict, world_size: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) in bytes on one GPU for AdamW under DeepSpeed
    configured by `ds_config` (`engine.deepspeed_config`): the weights and gradients in the
    training precision; with 16-bit training an fp32 master copy of the weights (and under ZeRO,
    whatever the precision, the fp32 partition the optimizer steps), its fp32 gradient and Adam's
    two fp32 moments. ZeRO stage 1 partitions the fp32 states over the GPUs, stage 2 also the
    gradients, stage 3 also the weights (plus the largest module it gathers whole, at 4 bytes per
    parameter as DeepSpeed's estimate counts it). Gradients accumulated in fp32
    (`data_types.grad_accum_dtype`) are kept in fp32 only, and the optimizer steps from them.
    Optimizer offloading moves the fp32 states and the gradient partitions to the host.

    For 16-bit training with 16-bit accumulation this is DeepSpeed's own estimate at stage 2
    (`estimate_zero2_model_states_mem_needs`: 2 + 18 / GPUs bytes per parameter, with offload 2)
    and 2 / GPUs above its stage-3 one, which leaves out one of the two gradient partitions."""
    zero = ds_config["zero_optimization"]
    stage = zero["stage"]
    weight = precision_bytes(ds_config)
    fp32_copy = weight < 4 or stage >= 1

    def share(size: float, partitioned_from: int) -> float:
        return size / world_size if stage >= partitioned_from else size

    parameters = share(weight * n_params, 3)
    if stage == 3:
        parameters += 2 * weight * gathered_params
    if accumulates_in_fp32(ds_config):
        gradients = share(4 * n_params, 2)
    else:
        gradients = share(weight * n_params, 2) + (share(4 * n_params, 1) if fp32_copy else 0)
    optimizer = share((4 if fp32_copy else 0) * n_params + 8 * n_params, 1)
    if "offload_optimizer" in zero:
        gradients = optimizer = 0
    return round(parameters), round(gradients), round(optimizer)


def precision_bytes(ds_config: dict) -> int:
    """Bytes per element of the weights DeepSpeed trains."""
    return 2 if ds_config["bf16"]["enabled"] or ds_config["fp16"]["enabled"] else 4


def accumulates_in_fp32(ds_config: dict) -> bool:
    return precision_bytes(ds_config) < 4 and ds_config.get("data_types", {}).get("grad_accum_dtype") == "fp32"


def gathered_parameters(model: nn.Module) -> int:
    """The most parameters ZeRO-3 gathers at once: the largest module's own parameters, or all
    parameters of a module it gathers whole (`zero3_leaf_modules`, e.g. EBT's descent)."""
    leaves = tuple(model.zero3_leaf_modules())
    return max(sum(p.numel() for p in (module.parameters() if isinstance(module, leaves)
                                       else module.parameters(recurse=False)))
               for module in model.modules())


def reduce_bucket_bytes(ds_config: dict) -> int:
    """DeepSpeed's gradient reduce bucket: ZeRO allocates `reduce_bucket_size` elements when
    gradients are copied into contiguous buffers (always when offloading), twice at stages 1-2
    to overlap communication; in the training precision, except at stage 1 accumulating in fp32
    (stage 2 stages 16-bit gradients there and accumulates its partition in fp32)."""
    zero = ds_config["zero_optimization"]
    stage = zero["stage"]
    if stage == 0 or not (zero["contiguous_gradients"] or "offload_optimizer" in zero):
        return 0
    copies = 2 if zero["overlap_comm"] and stage < 3 else 1
    element = 4 if stage == 1 and accumulates_in_fp32(ds_config) else precision_bytes(ds_config)
    return copies * zero["reduce_bucket_size"] * element


def rank_state_bytes(config: Any) -> int:
    """One GPU's per-rank training state outside the module (EBT's replay store; 0 for most families)."""
    return family_spec(config).rank_state_bytes(config)


# ---------------------------------------------------------------------------------------------
# Activations: one micro-batch's forward and backward on the meta device


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the tensors created while it is active, from each op's outputs until
    their storage is freed, and keeps the peak. An output on one of the op's inputs' storages
    (a view, an in-place result) is no new memory: neither one of a tensor counted before nor
    one of a tensor from before (a view of a weight). A GPU attention kernel's own buffers
    (`kernel_scratch_bytes`) count beside its outputs while it runs."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in inputs:
                self.count(tensor.untyped_storage())
        self.transient(kernel_scratch_bytes(func, args))
        return out

    def transient(self, size: int) -> None:
        """`size` bytes held for a moment beside the live tensors."""
        self.peak = max(self.peak, self.live + size)

    def count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        known = self.storages.get(key)
        if known is not None and known() is storage:
            return
        size = storage.nbytes()
        self.live += size
        self.storages[key] = weakref.ref(storage, lambda _, key=key, size=size: self.freed(key, size))

    def freed(self, key: int, size: int) -> None:
        self.live -= size
        self.storages.pop(key, None)


def meta_model(config: Any) -> nn.Module:
    """The model of `config` on the meta device: its shapes and dtypes, no memory."""
    with torch.device("meta"):
        return build(config)


def hand_off_gradients(model: nn.Module) -> None:
    """Drop each parameter's gradient once it is complete, as ZeRO does after copying it into
    its reduce bucket: the gradients part counts what stays of them."""
    def drop(param: torch.Tensor) -> None:
        param.grad = None

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(drop)


def micro_batch_loss(model: nn.Module, micro_batch_size: int, seq_len: int) -> torch.Tensor:
    """One training micro-batch's forward on random tokens, on the model's device: its loss (the
    trainer keeps no other output through the backward)."""
    device = next(model.parameters()).device
    idx = torch.randint(0, model.config.vocab_size, (micro_batch_size, seq_len), device=device)
    return model(idx, torch.roll(idx, -1, dims=1)).loss


def micro_batch_pass(model: nn.Module, micro_batch_size: int, seq_len: int) -> None:
    """One training micro-batch's forward and backward on random tokens, on the model's device."""
    micro_batch_loss(model, micro_batch_size, seq_len).backward()


def descent_rows(config: Any, micro_batch_size: int) -> int:
    """The rows a micro-batch runs: EBT's replay store adds replayed rows once it is full."""
    return micro_batch_size + family_spec(config).replayed_rows(config, micro_batch_size)


def measured_model_config(config: Any) -> Any:
    """The config the activations are measured on: the largest step of a training run (for EBT:
    the most descent steps, and replayed rows as extra rows of the micro-batch, `descent_rows`,
    while the buffers part counts its store)."""
    return family_spec(config).largest_step(config)


def activation_bytes(config: Any, micro_batch_size: int, seq_len: int, dtype: torch.dtype,
                     gpu_compute_dtype: torch.dtype | None = None) -> int:
    """Peak bytes of the tensors one training micro-batch creates in its forward and backward,
    the parameters' gradients excepted (handed off as ZeRO does): the config's model built on
    the meta device in `dtype` (`Precision.param_dtype`, as DeepSpeed casts it), with the
    config's activation checkpointing, and its attention on the kernels of a GPU running
    `gpu_compute_dtype` (`Precision.compute_dtype`) with their buffers, or (None) of the CPU.
    Under autocast (which the meta device lacks) the matmuls' outputs are bf16 and the residual
    stream and norms fp32: measured in fp32, an upper bound. As the forward ends, the family's
    per-rank states take their update's scratch (EBT's replay store keeps the final candidates)."""
    model = meta_model(measured_model_config(config)).to(dtype).train()
    hand_off_gradients(model)
    tracker = LiveTensorBytes()
    with attention_on_meta(gpu_compute_dtype), tracker:
        loss = micro_batch_loss(model, descent_rows(config, micro_batch_size), seq_len)
        tracker.transient(family_spec(config).rank_state_scratch_bytes(config))
        loss.backward()
    return tracker.peak


def largest_fitting(measure: Callable[[int], int], budget: int, most: int, measured: dict[int, int]) -> int:
    """The largest b in 1..most with measure(b) <= budget (0 if none), for a `measure` that is
    convex in b: activations are sums of per-sequence and fixed tensors, so the live bytes at
    each moment grow affinely with the micro-batch and their peak, the maximum of those lines,
    is convex. A line through two measured points then lies below the curve outside them, so
    the points it puts over the budget are over it; a guess the line puts under the budget is
    measured. `measured` holds known values (and receives new ones); in practice it takes one
    or two measurements besides the known one."""
    def value(b: int) -> int:
        if b not in measured:
            measured[b] = measure(b)
        return measured[b]

    def surely_over(b: int) -> bool:
        points = sorted(measured)
        for p, q in zip(points, points[1:]):
            if b > q or b < p:
                line = measured[p] + (measured[q] - measured[p]) * (b - p) / (q - p)
                if line > budget:
                    return True
        return False

    if not measured:
        value(1)
    start = min(measured)
    if len(measured) < 2 and most > 1:
        value(start + 1 if start < most else start - 1)
    while True:
        fitting = [b for b in measured if measured[b] <= budget]
        over = [b for b in measured if measured[b] > budget]
        low, high = max(fitting, default=0), min(over, default=most + 1)
        if low + 1 >= high or surely_over(low + 1):
            return low
        # the secant through the two measured points nearest the bracket guesses the crossing
        p, q = sorted(sorted(measured, key=lambda b: (abs(b - low), b))[:2])
        slope = (measured[q] - measured[p]) / (q - p)
        guess = p + math.floor((budget - measured[p]) / slope) if slope > 0 else high - 1
        value(min(max(guess, low + 1), high - 1))


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    config_path: str
    gpus: int
    gpu: str
    precision: str
    """The resolved `train.precision`'s name."""
    zero_stage: int
    flavor: str
    family: str
    activation_checkpointing: str
    vocab_size: int
    vocab_source: str
    n_params: int
    micro_batch_size: int
    accumulation_steps: int
    tokens_per_step: int
    flops_per_token: float
    parts: Parts
    gpu_memory_bytes: int
    peak_tflops: float | None
    """The GPU's dense peak at the run's precision; None without a tensor-core peak (fp32)."""
    step_time_s: tuple[float, float] | None
    """(fast, slow) at the MFU_RANGE ends; None without a tensor-core peak."""
    largest_micro_batch_that_fits: int | None
    """None when not looked for (the micro-batch was given: --micro-batch)."""
    per_process_batch: int

    @property
    def fits(self) -> bool:
        return self.parts.total <= self.gpu_memory_bytes

    def as_json(self) -> dict:
        out = {
            "config": self.config_path, "gpus": self.gpus, "gpu": self.gpu,
            "gpu_memory_gib": round(self.gpu_memory_bytes / GIB, 2),
            "memory_per_gpu_gib": round(self.parts.total / GIB, 2), "fits": self.fits,
            "parts": {name: round(size / GIB, 4) for name, size in self.parts.as_dict().items()},
            "precision": self.precision, "zero_stage": self.zero_stage, "flavor": self.flavor,
            "family": self.family, "activation_checkpointing": self.activation_checkpointing,
            "vocab_size": self.vocab_size, "parameters": self.n_params,
            "micro_batch_size": self.micro_batch_size, "accumulation_steps": self.accumulation_steps,
            "tokens_per_step": self.tokens_per_step, "flops_per_token": self.flops_per_token,
            "step_time_s": None if self.step_time_s is None else [float(f"{t:.4g}") for t in self.step_time_s],
        }
        if self.largest_micro_batch_that_fits is not None:
            out["largest_micro_batch_that_fits"] = self.largest_micro_batch_that_fits
        return out


def dataset_vocabulary(cfg: RunConfig) -> tuple[int, str]:
    """(token ids, where the number comes from): the prepared dataset's, else the flavor's own."""
    from data_pipeline.packing import existing_manifest

    manifest = existing_manifest(cfg.data.path)  # an s3:// dataset's too
    if manifest is not None:
        return manifest["vocab_size"], f"the dataset at {cfg.data.path}"
    return FLAVORS[cfg.model.flavor].vocab_size, f"the flavor's own: no prepared dataset at {cfg.data.path}"


def memory_parts(cfg: RunConfig, model: nn.Module, precision: Precision, gpus: int, micro_batch_size: int) -> Parts:
    """What one GPU holds at the peak of a training step of `cfg` (its model on the meta device,
    `meta_model`; its precision resolved for a GPU, `precision`) on `gpus` GPUs at
    `micro_batch_size`, by part."""
    config = model.config
    ds_config = deepspeed_config(cfg, gpus, precision)
    states = model_state_bytes(model.num_params(), gathered_parameters(model), ds_config, gpus)
    activations = activation_bytes(config, micro_batch_size, cfg.data.seq_len, precision.param_dtype,
                                   precision.compute_dtype)
    return Parts(*states, activations, reduce_bucket_bytes(ds_config) + rank_state_bytes(config))


def make_plan(config_path: str, cfg: RunConfig, gpus: int, gpu: str, find_largest: bool = True) -> Plan:
    """The plan of `cfg` on `gpus` GPUs of kind `gpu` (a key of GPUS), with the largest
    micro-batch that fits if `find_largest`. Raises ConfigError for a config the trainer would
    refuse at that GPU count."""
    validate(cfg, gpus, has_gpu=True)
    precision = resolve_precision(cfg.train.precision, has_gpu=True)
    vocab, vocab_source = dataset_vocabulary(cfg)
    config = model_config(cfg, vocab)
    model = meta_model(config)
    n_params = model.num_params()
    split = batch_split(cfg, gpus)
    seq_len = cfg.data.seq_len
    parts = memory_parts(cfg, model, precision, gpus, split.micro_batch_size)

    def activations(b: int) -> int:
        return activation_bytes(config, b, seq_len, precision.param_dtype, precision.compute_dtype)

    measured = {split.micro_batch_size: parts.activations}
    capacity = GPUS[gpu].memory_bytes
    per_process = cfg.train.global_batch_size // gpus
    largest = None
    if find_largest:
        # total = (static + activations) x (1 + FRAGMENTATION) + RESERVED_BYTES <= capacity
        static = parts.tensors - parts.activations
        budget = math.floor((capacity - RESERVED_BYTES) / (1 + FRAGMENTATION)) - static
        largest = largest_fitting(activations, budget, per_process, measured)
    flops_per_token = model.flops_per_token(seq_len, training=True)
    peak = peak_tflops(GPUS[gpu].name, precision)
    step_time = None
    if peak is not None:
        seconds = flops_per_token * cfg.tokens_per_step / (gpus * peak * 1e12)
        step_time = tuple(seconds / mfu for mfu in MFU_RANGE)
    return Plan(config_path=config_path, gpus=gpus, gpu=gpu, precision=precision.name, zero_stage=cfg.zero.stage,
                flavor=cfg.model.flavor, family=family_name(config),
                activation_checkpointing=config.activation_checkpointing, vocab_size=config.vocab_size,
                vocab_source=vocab_source, n_params=n_params, micro_batch_size=split.micro_batch_size,
                accumulation_steps=split.accumulation_steps, tokens_per_step=cfg.tokens_per_step,
                flops_per_token=flops_per_token, parts=parts, gpu_memory_bytes=capacity, peak_tflops=peak,
                step_time_s=step_time, largest_micro_batch_that_fits=largest, per_process_batch=per_process)
