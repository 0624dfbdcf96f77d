"""DeepSpeed setup: the process environment, the DeepSpeed JSON generated from the run config,
and `deepspeed.initialize` with the model, its optimizer parameter groups and ZeRO-3 leaves."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import random
import re
import socket
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from common.fileio import atomic_write
from pretrain.config import ConfigError, RunConfig, batch_split
from pretrain.config.precision import Precision


def distributed_env() -> tuple[int, int, int]:
    """(rank, world size, local rank), filling the variables torch.distributed reads.

    torchrun sets them; under `srun` (one task per device) they come from Slurm's; a plain
    `python -m pretrain.train` is a world of one on a free local port (without these DeepSpeed
    would go looking for MPI)."""
    env = os.environ
    # DeepSpeed JIT-builds its CPU shared-memory op on first use. In the shared default cache two
    # environments rebuild it back and forth, and a process killed mid-build leaves a lock file
    # that makes every later run wait forever; one build directory per environment avoids both.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env["LOCAL_WORLD_SIZE"] = str(_slurm_tasks_on_this_node(env))
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    # streaming elects one process per node to set up shared memory from these
    env.setdefault("LOCAL_WORLD_SIZE", "1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        if env["WORLD_SIZE"] != "1":
            raise ConfigError("MASTER_PORT is not set for a multi-process run; use torchrun or "
                              "launch/slurm.sbatch, which set it")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])


def init_distributed(timeout_s: float, on_gpu: bool) -> None:
    """Join the job's process group (and DeepSpeed's view of it), collectives timing out after
    `timeout_s`.

    Under torchrun the workers meet in the store of the launcher's agent, which outlives an
    in-job restart. The keys of the attempt before a restart (each rank's gloo address, the
    groups' barriers) are still there, and a restarted rank read the dead rank 0's address from
    them and failed to connect ("connectFullMesh failed ... Connection refused"). So each attempt
    keeps its keys under a namespace of its own: the one the launcher agreed on for every node
    (ATTEMPT_VARIABLE), or, under plain torchrun on one node, the restart count."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from common.cli import ATTEMPT_VARIABLE

    env, timeout = os.environ, timedelta(seconds=timeout_s)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not dist.is_initialized():
        attempt = env.get(ATTEMPT_VARIABLE) or f"restart-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        rank, world_size, local_rank = distributed_env()
        agent_store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
                                    timeout=timeout)
        # as DeepSpeed would make it: a GPU process binds its device (NCCL's eager communicator)
        device = {"device_id": torch.device("cuda", local_rank)} if on_gpu and world_size > 1 else {}
        dist.init_process_group(get_accelerator().communication_backend_name(),
                                store=dist.PrefixStore(f"pretrain/{attempt}/", agent_store), rank=rank,
                                world_size=world_size, timeout=timeout, **device)
    deepspeed.init_distributed(verbose=False, timeout=timeout)


GLOO_PEER_ERROR = re.compile(r"\] ([^\[\]]*?) ?\[([0-9A-Fa-f.:]+)\]:\d+(?:: ([^.\n]+))?")
"""gloo's message for a connection to a peer that broke, in its two forms: `[SOURCE] Read error
[ADDRESS]:PORT: REASON` (the peer reset it) and `[SOURCE] Connection closed by peer [ADDRESS]:PORT`
(the peer's kernel closed it in order when its process died); which one a survivor sees depends on
whether the dead peer had unread data."""


def host_names() -> list[str]:
    """Every rank's host name, by rank (a collective once distributed)."""
    import torch.distributed as dist

    names = [socket.gethostname()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [""] * dist.get_world_size()
        dist.all_gather_object(names, socket.gethostname())
    return names


LOST_PEER_PREFIX = "error: a collective failed"
"""How `lost_peer_line` begins: the launcher tells a rank that lost its peer from one that failed."""


def lost_peer_line(error: BaseException, timeout_s: float) -> str | None:
    """The one line for a collective that failed because another process of the job is gone (its
    node failed or was cut off from the network), or None for any other error. gloo raises a
    RuntimeError naming the peer's address (or a time-out, naming none); NCCL and the
    rendezvous store raise torch.distributed.DistError."""
    import torch.distributed as dist

    text = str(error)
    if not isinstance(error, dist.DistError) and "/gloo/" not in text:
        return None
    found = GLOO_PEER_ERROR.search(text)
    if found:
        event, address, reason = found.groups()
        try:
            peer = f"{socket.gethostbyaddr(address)[0]} ({address})"
        except OSError:
            peer = address
        what = f"lost the connection to {peer}: {(reason or event).strip()}"
    elif "Timed out" in text or "timed out" in text:
        what = f"another process sent nothing for train.collective_timeout={timeout_s:g} s"
    else:
        what = text.strip().splitlines()[0][:300]
    return (f"{LOST_PEER_PREFIX} on {socket.gethostname()}, {what}; a node of the job failed "
            "or was cut off, and the job cannot go on without it: rerun it (a Slurm job is "
            "requeued) to resume from the newest complete checkpoint")


def training_device(wanted: str, local_rank: int) -> torch.device:
    """The device this process trains on (train.device): "auto" takes a GPU when torch can use
    one, "cuda" insists on one. Raises ConfigError naming what torch saw instead."""
    with warnings.catch_warnings(record=True) as seen:  # e.g. "the NVIDIA driver ... is too old"
        warnings.simplefilter("always")
        usable = torch.cuda.is_available()
    if not usable:
        if wanted == "auto":
            return torch.device("cpu")
        if not torch.version.cuda:
            raise ConfigError(f"train.device=cuda: torch {torch.__version__} is a CPU-only build; install "
                              "a CUDA build of torch, or set train.device=auto to train on the CPU")
        saw = str(seen[0].message).strip().splitlines()[0] if seen else \
            f"it sees no GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        raise ConfigError(f"train.device=cuda: torch {torch.__version__} (built for CUDA {torch.version.cuda}) "
                          f"cannot use a GPU here: {saw}; run on a GPU node whose driver supports that CUDA, "
                          "or set train.device=auto to train on the CPU")
    return torch.device("cuda", gpu_index(local_rank, torch.cuda.device_count()))


def gpu_index(local_rank: int, visible_gpus: int) -> int:
    """Which visible GPU a process takes: its local rank among the node's GPUs, or the one GPU it
    sees when the launcher gives each task its own (Slurm's --gpus-per-task=1 sets
    CUDA_VISIBLE_DEVICES per task, so every task's device is 0 whatever its local rank)."""
    if visible_gpus == 1:
        return 0
    if local_rank >= visible_gpus:
        raise ConfigError(f"LOCAL_RANK={local_rank}, but this process sees only {visible_gpus} GPUs: start "
                          "at most one process per GPU on a node (torchrun --nproc_per_node, or srun "
                          "with --ntasks-per-node equal to the GPUs per node)")
    return local_rank


def seed_process(seed: int, rank: int, step: int = 0) -> None:
    """Seed this process's random streams (python, numpy, torch; e.g. EBT's candidate noise):
    seed + 1000 x rank at the start; a rank resuming at `step` without streams of its own to
    restore (the checkpoint was saved at another world size) derives them from (seed, rank, step)."""
    if step == 0:
        process_seed = seed + 1000 * rank
    else:
        digest = hashlib.blake2b(f"{seed}/{rank}/{step}".encode(), digest_size=4)
        process_seed = int.from_bytes(digest.digest(), "little")  # < 2**32, as numpy requires
    random.seed(process_seed)
    np.random.seed(process_seed)
    torch.manual_seed(process_seed)


def _slurm_tasks_on_this_node(env) -> int:
    """Tasks of this job step on this node, from Slurm's compact "2(x3),1" per-node list."""
    counts = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")).split(","):
        if part:
            count, _, repeat = part.partition("(x")
            counts += [int(count)] * int(repeat.rstrip(")") or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else int(env["SLURM_NTASKS"])


def deepspeed_config(cfg: RunConfig, world_size: int, precision: Precision) -> dict:
    """DeepSpeed's JSON, generated from the run config and its resolved precision (the only
    place it is written)."""
    zero = cfg.zero
    zero_json = {
        "stage": zero.stage,
        "overlap_comm": zero.overlap_comm,
        "contiguous_gradients": zero.contiguous_gradients,
        "reduce_bucket_size": zero.reduce_bucket_size,
    }
    if zero.stage in (1, 2):
        zero_json["allgather_bucket_size"] = zero.allgather_bucket_size
    if zero.stage == 3:
        zero_json["stage3_prefetch_bucket_size"] = zero.stage3_prefetch_bucket_size
        zero_json["stage3_param_persistence_threshold"] = zero.stage3_param_persistence_threshold
        # export goes through zero_to_fp32 on the sharded checkpoint instead
        zero_json["stage3_gather_16bit_weights_on_model_save"] = False
    if zero.offload_optimizer:
        zero_json["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    split = batch_split(cfg, world_size)
    # bf16 under ZeRO-2: gradients accumulate over the micro-batches in fp32, not bf16 (whose 8-bit
    # mantissa drops a micro-batch's small contributions; docs/design.md, "ZeRO for 85-127M models")
    bf16 = precision.param_dtype == torch.bfloat16
    data_types = {"grad_accum_dtype": "fp32"} if bf16 and zero.stage == 2 else {}
    return {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": split.micro_batch_size,
        "gradient_accumulation_steps": split.accumulation_steps,
        # without ZeRO, optim.GuardedAdamW clips (DeepSpeed's clipping would precede its check)
        "gradient_clipping": cfg.optimizer.grad_clip if zero.stage > 0 else 0.0,
        "zero_optimization": zero_json,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "fp16": {"enabled": precision.param_dtype == torch.float16},
        # bf16-autocast: fp32 weights, gradients and optimizer, the forward under torch.autocast
        # (the engine enters it around each forward). No module's gradients are declared safe to
        # reduce in bf16 (DeepSpeed's default would reduce every nn.Linear's in bf16).
        "torch_autocast": {"enabled": precision.autocast, "dtype": "bfloat16",
                           "lower_precision_safe_modules": []},
        "data_types": data_types,
        # the optimizer is torch's AdamW with our parameter groups (or CPU Adam when offloading)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # the training loop does its own logging
        "wall_clock_breakdown": False,
    }


def configure_device_math(cfg: RunConfig, on_gpu: bool) -> None:
    """Let float32 matmuls use TF32 tensor cores on GPU when `train.tf32` (fp32 runs, and the
    float32 parts of bf16 runs). `set_float32_matmul_precision` is the one TF32 switch that
    works on every torch this project meets: since torch 2.9, mixing the legacy `allow_tf32`
    flags with the new `fp32_precision` ones raises when either is read back. CPU runs keep
    torch's defaults (their losses are compared bit for bit across resumes), and keep freed
    host memory for reuse (`keep_freed_host_memory`: only CPU tensors are malloc's; on GPU it
    would just hold the host at its peak, every checkpoint's copy included)."""
    if on_gpu:
        torch.set_float32_matmul_precision("high" if cfg.train.tf32 else "highest")
    else:
        keep_freed_host_memory()


def keep_freed_host_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the OS.
    By default every block over 32 MB is mmapped and unmapped again when freed, so a CPU
    step's large tensors (the logits of a 50k vocabulary are 100 MB at 512 tokens) arrive as
    fresh pages each time: at the tiny widths page faults were 40% of a step's CPU time. For
    CPU work only: the process keeps its peak host memory instead. No-op where the C library has
    no `mallopt` (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    mallopt(m_mmap_max, 0)  # large blocks come from the heap, where free() keeps them
    mallopt(m_trim_threshold, 2**31 - 1)  # and the heap's top is not returned either


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict,
               compile_backend: str = "off"):
    """Wrap model and optimizer in a DeepSpeed engine. Modules that must be gathered whole under
    ZeRO-3 (those calling autograd.grad in forward, e.g. EBT's descent) are marked as leaves.
    `compile_backend` other than "off" compiles the module through DeepSpeed's
    `engine.compile` (torch.compile in place, so parameter and checkpoint names stay as they are;
    on CPU with deterministic kernels, which exact resume needs, and a cache keyed on the CPU)."""
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules

    zero3 = ds_config["zero_optimization"]["stage"] == 3
    leaves = model.zero3_leaf_modules()
    if leaves and zero3:
        set_z3_leaf_modules(model, leaves)
    kept = []
    if ds_config["bf16"]["enabled"] and model.float32_names():
        if not zero3:
            kept = float32_parameters(model, optimizer)
        elif int(os.environ.get("RANK", "0")) == 0:  # one buffer of one dtype per partition (DeepSpeed asserts it)
            print(f"warning: zero.stage=3 holds every parameter in bf16, {', '.join(sorted(model.float32_names()))} "
                  "too, whose updates are finer than bf16's spacing at its value; ZeRO-2 keeps it float32",
                  file=sys.stderr, flush=True)
    with left_in_float32(kept):
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if compile_backend != "off":
        if engine.device.type == "cpu":
            compiled_cpu_kernel_settings()
        engine.compile(backend=compile_backend)
    return engine


def float32_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters the model keeps in float32 beside a bf16 module (`float32_names`), each
    alone in its optimizer group: ZeRO flattens a group into one buffer of one dtype."""
    names = model.float32_names()
    kept = [p for name, p in model.named_parameters() if name in names]
    for group in optimizer.param_groups:
        if len(group["params"]) > 1 and {id(p) for p in kept} & {id(p) for p in group["params"]}:
            raise ConfigError(f"optimizer.lr_multipliers: {', '.join(sorted(names))} stays float32 in a bf16 "
                              "run and needs a parameter group of its own; leave it out of the patterns")
    return kept


@contextlib.contextmanager
def left_in_float32(params: list[torch.nn.Parameter]):
    """Have `deepspeed.initialize` leave `params` in float32. DeepSpeed's bf16 mode casts every
    parameter of the module, and no setting exempts one (`data_types.keep_in_fp32_modules` keeps
    buffers only): its engine's cast is wrapped for the duration to put their float32 data back,
    before the ZeRO optimizer flattens each group into a buffer of its dtype and keeps its
    float32 master copy (ZeRO-1 and 2, and stage 0's bf16 optimizer, take a group of another
    dtype). DeepSpeed 0.19.8's private method, as pinned."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    cast = DeepSpeedEngine._cast_module_mixed_precision

    def cast_all_others(engine, *args, **kwargs):
        kept = [(p, p.data) for p in params]
        cast(engine, *args, **kwargs)
        for p, data in kept:
            p.data = data

    DeepSpeedEngine._cast_module_mixed_precision = cast_all_others
    try:
        yield
    finally:
        DeepSpeedEngine._cast_module_mixed_precision = cast


def time_out_every_group(seconds: float) -> None:
    """Every process group's collectives give up after `seconds` (train.collective_timeout). The
    world group has it from init_process_group, but the groups made after it take torch's
    default (30 minutes on gloo, 10 on NCCL): DeepSpeed's clone of the world, over which ZeRO
    reduces the gradients, and its data-parallel groups. A cut-off node then left its peers
    waiting there for half an hour. (torch 2.13's private group table and setter, as pinned.)"""
    import torch.distributed.distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def use_current_collectives() -> None:
    """Point DeepSpeed's communication backend at torch's current names of the single-tensor
    collectives. It calls `all_gather_into_tensor` and `reduce_scatter_tensor`, which torch
    deprecates for `all_gather_single` and `reduce_scatter_single` (the same collectives, same
    arguments), so that every ZeRO launch printed a FutureWarning per process; a torch without
    the new names keeps DeepSpeed's choice."""
    import torch.distributed as dist
    from deepspeed import comm

    backend = comm.comm.cdb
    for attribute, current in (("all_gather_function", "all_gather_single"),
                               ("reduce_scatter_function", "reduce_scatter_single")):
        if hasattr(dist, current) and getattr(backend, attribute, None) is not None:
            setattr(backend, attribute, getattr(dist, current))


COMPILE_CACHE_FILE = "compile_cache.bin"
"""In a run's directory: the graphs that torch.compile generated for the run, which its next job
loads (`load_compile_cache`) instead of generating them again."""


def load_compile_cache(path: Path) -> str | None:
    """Hands inductor's local cache the graphs that an earlier job of the run saved to `path`
    (`save_compile_cache`), so that a requeued job, on whatever node, skips code generation for
    each graph it compiles again (EBT-S1's first step on a CPU in 0.34-0.47 of the time,
    docs/benchmarks.md).
    One file, read whole, rather than a cache directory on the shared filesystem, whose file
    locks some cluster filesystems do not honour. An entry of another torch, device or
    instruction set is keyed apart and never used. Returns the line to report, None without
    the file; a file that cannot be read is reported, and the job compiles from nothing."""
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"warning: {path} not read ({e.strerror}): the compiled graphs are generated again"
    if info is None:
        return f"warning: {path} is not a compile cache this torch reads: the compiled graphs are generated again"
    return f"compile cache: {len(info.inductor_artifacts)} compiled graph(s) from {path}"


def save_compile_cache(path: Path) -> None:
    """Writes the graphs this process's torch.compile generated or found in its cache to `path`
    (atomically; nothing when there are none). A failed write (a full disk) warns and leaves
    the previous file: the next job then generates more itself."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    try:
        atomic_write(path, lambda tmp: tmp.write_bytes(saved[0]))
    except OSError as e:
        print(f"warning: {path}: the compiled graphs were not saved ({e.strerror})", file=sys.stderr, flush=True)


def compiled_cpu_kernel_settings() -> None:
    """Settings for the CPU kernels inductor generates, set before the first compiled call.

    Deterministic sums: inductor's embedding backward otherwise adds the rows of repeated tokens
    with atomic adds from several threads, in an order that varies with scheduling (on a busy
    host a resumed run's loss differed from the uninterrupted run's in the last bit); in
    deterministic mode it calls aten's serial kernel instead, as eager does. New tensors stay
    unfilled (deterministic mode would also fill each one, a cost that orders no sum).

    A cache keyed on the CPU's vector instructions: inductor's on-disk cache of generated code
    (torch 2.13) is not keyed on the vector instruction set that the C++ was written for, while
    that C++ is compiled for the CPU that loads it. Code cached on an AVX-512 CPU and loaded on
    an AVX2 one (a cache directory shared by hosts, a machine image moved to another CPU,
    ATEN_CPU_CAPABILITY set) runs its 16-float loops on 8-float vectors, reading and writing past
    its buffers: garbage gradients, or an index error in the embedding backward. The capability
    in use (which inductor also follows) goes into the cache key's tag, after any tag the user set."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    isa_tag = f"cpu-isa={torch.backends.cpu.get_cpu_capability()}"
    user_tag = torch.compiler.config.cache_key_tag
    if isa_tag not in user_tag.split(";"):
        torch.compiler.config.cache_key_tag = f"{user_tag};{isa_tag}" if user_tag else isa_tag
