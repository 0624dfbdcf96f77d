"""Whether a run config can run here: `validate` checks the values and combinations that the
reader (`pretrain.config`) cannot judge field by field, against the world size and the device,
and prints the cautions a run may start with.

    cfg = load_config("configs/tiny/gpt.yaml", ["zero.stage=3"])
    validate(cfg, world_size=2, has_gpu=False)"""
from __future__ import annotations

import os
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from common import objectstore
from pretrain.config import (DECAY_SETS, RESUME_MODES, ConfigError, LengthChangeSchedule, RunConfig, ScheduleKind,
                             SpikeSkipping, TrainingDevice, ZeroStage, batch_split, get_key, gpu_attention,
                             run_name_problem, typed_model_overrides)
from pretrain.config.precision import PRECISION_SETTINGS


def validate(cfg: RunConfig, world_size: int, has_gpu: bool, cautions: bool = True) -> None:
    """Raise ConfigError for values and combinations that cannot run on this machine; print the
    cautions of a run that can (unless `cautions` is False: a sweep checks its runs ahead of
    their launch, which prints them)."""
    def require(ok: bool, key: str, message: str):
        if not ok:
            raise ConfigError(f"{key}={get_key(cfg, key)!r}: {message}")

    def require_choice(key: str, choices: Any):
        *others, last = map(repr, typing.get_args(choices))  # a Literal's
        require(get_key(cfg, key) in typing.get_args(choices), key, f"must be {', '.join(others)} or {last}")

    check_urls(cfg)
    require(cfg.resume in RESUME_MODES or Path(cfg.resume).exists(), "resume",
            f"must be {', '.join(map(repr, RESUME_MODES))} or an existing run directory or checkpoint")
    problem = run_name_problem(cfg.run_name)
    require(problem is None, "run_name", problem or "")
    require(bool(cfg.data.path), "data.path", "is required (a prepared dataset directory)")
    for key in ("data.seq_len", "data.micro_batch_size", "train.global_batch_size",
                "train.log_interval", "checkpoint.keep", "eval.batches", "eval.think_steps"):
        require(get_key(cfg, key) >= 1, key, "must be >= 1")
    for key in ("data.num_workers", "schedule.warmup_steps", "checkpoint.interval", "eval.interval",
                "eval.sample_tokens", "train.max_consecutive_skips", "train.max_reloads",
                "optimizer.weight_decay", "optimizer.grad_clip", "schedule.min_lr"):
        require(get_key(cfg, key) >= 0, key, "must be >= 0")
    require(0.0 < cfg.data.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")
    require(cfg.train.max_steps is not None or cfg.train.max_tokens is not None, "train.max_steps",
            "a budget is required: set train.max_steps or train.max_tokens")
    for key in ("train.max_steps", "train.max_tokens", "schedule.decay_steps", "train.peak_tflops"):
        require(get_key(cfg, key) is None or get_key(cfg, key) > 0, key, "must be > 0")
    require(cfg.train.max_consecutive_skips >= 1, "train.max_consecutive_skips", "must be >= 1")
    require_choice("train.skip_spikes", SpikeSkipping)
    require(cfg.train.spike_window >= 2, "train.spike_window", "must be >= 2")
    require(cfg.train.spike_sigmas > 0, "train.spike_sigmas", "must be > 0")
    require(cfg.train.collective_timeout > 0, "train.collective_timeout", "must be > 0 (seconds)")
    for key in ("train.hang_factor", "train.straggler_factor"):
        require(get_key(cfg, key) == 0 or get_key(cfg, key) > 1, key, "must be > 1 (or 0: off)")
    for key in ("train.hang_min_s", "train.hang_first_s"):
        require(get_key(cfg, key) > 0, key, "must be > 0 (seconds)")
    require(cfg.train.straggler_intervals >= 1, "train.straggler_intervals", "must be >= 1")

    require(cfg.optimizer.lr > 0, "optimizer.lr", "must be > 0")
    require(len(cfg.optimizer.betas) == 2 and all(0 <= b < 1 for b in cfg.optimizer.betas),
            "optimizer.betas", "must be two numbers in [0, 1)")
    require(cfg.optimizer.eps > 0, "optimizer.eps", "must be > 0")
    require(all(m > 0 for m in cfg.optimizer.lr_multipliers.values()), "optimizer.lr_multipliers",
            "factors must be > 0")
    require(cfg.optimizer.decay in DECAY_SETS, "optimizer.decay", f"must be one of {', '.join(DECAY_SETS)}")
    require_choice("schedule.kind", ScheduleKind)
    require_choice("schedule.on_length_change", LengthChangeSchedule)
    require(cfg.schedule.min_lr <= cfg.optimizer.lr, "schedule.min_lr",
            f"must not exceed optimizer.lr={cfg.optimizer.lr}")
    require(cfg.schedule.kind != "exponential" or cfg.schedule.min_lr > 0, "schedule.min_lr",
            "must be > 0 for the exponential schedule (it decays geometrically to it)")

    require_choice("train.device", TrainingDevice)
    require(cfg.train.precision in PRECISION_SETTINGS, "train.precision",
            "must be one of " + ", ".join(f"'{name}'" for name in PRECISION_SETTINGS))
    require(has_gpu or cfg.train.precision != "fp16", "train.precision",
            "fp16 needs a GPU (DeepSpeed refuses it on CPU); use fp32 or bf16")
    require_choice("zero.stage", ZeroStage)
    require(cfg.zero.stage >= 1 or not cfg.zero.offload_optimizer, "zero.offload_optimizer",
            "needs zero.stage >= 1")
    batch_split(cfg, world_size)
    require(cfg.model.init_from is None or (Path(cfg.model.init_from) / "config.json").is_file(),
            "model.init_from", "must be a Hugging Face model directory (one holding config.json)")
    require(cfg.model.activation_checkpointing in (None, "off", "step", "block"),
            "model.activation_checkpointing", "must be 'off', 'step' or 'block'")
    for key in ("eval.downstream.limit", "eval.downstream.batch_size"):
        require(get_key(cfg, key) >= 1, key, "must be >= 1")
    require(cfg.eval.downstream.interval >= 0, "eval.downstream.interval", "must be >= 0")
    if cfg.eval.downstream.tasks:
        from pretrain.downstream.harness import TaskError, check_tasks

        try:
            check_tasks(cfg.eval.downstream.tasks)
        except TaskError as e:
            raise ConfigError(f"eval.downstream.tasks: {e}") from None
        manifest = Path(cfg.data.path) / "manifest.json"
        local = not objectstore.is_remote(cfg.data.path)  # an s3:// dataset's is checked when it is read
        tokenizer = yaml.safe_load(manifest.read_text())["tokenizer"] if local and manifest.is_file() else "gpt2"
        require(tokenizer == "gpt2", "eval.downstream.tasks",
                f"text tasks need a GPT-2 BPE dataset; {cfg.data.path} is tokenized {tokenizer!r}")
    require(0 <= cfg.fault.nan_loss_rank < world_size, "fault.nan_loss_rank",
            f"must be a rank of this run (0..{world_size - 1})")

    from pretrain.models import model_class, resolve  # the registry; imported late to keep config light
    overrides = typed_model_overrides(cfg)
    try:
        model_config = resolve(cfg.model.flavor, overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    block_size = model_config.block_size if "block_size" in cfg.model.overrides else None
    require(block_size is None or block_size >= cfg.data.seq_len, "model.overrides",
            f"block_size={block_size} is shorter than data.seq_len={cfg.data.seq_len}")
    require(cfg.model.compile == "off" or cfg.model.compile in _compile_backends(), "model.compile",
            "must be 'off' or a torch.compile backend such as 'inductor'")
    refusal = model_class(model_config).compile_refusal(model_config)
    require(cfg.model.compile == "off" or refusal is None, "model.compile",
            f"flavor {cfg.model.flavor}: {refusal}, or use 'off'")
    attention = gpu_attention(cfg, model_config) if has_gpu else None
    if attention and attention[0] == "math" and "attention_impl" not in cfg.model.overrides:
        _, head_dim, precision = attention
        on_purpose = (", or set model.overrides.attention_impl on purpose (explicit: scores from plain "
                      "matmuls; sdpa: the math kernel)" if hasattr(model_config, "attention_impl") else "")
        raise ConfigError(f"model.flavor={cfg.model.flavor}: attention of head dim {head_dim} in {precision} "
                          "leaves SDPA only its math kernel on the GPU (fp32 scores of [batch, heads, T, T] "
                          f"kept for backward); use a width whose head dim is a multiple of 8{on_purpose}")
    if not hasattr(model_config, "activation_checkpointing"):
        require(cfg.model.activation_checkpointing in (None, "off"), "model.activation_checkpointing",
                f"flavor {cfg.model.flavor} has no activation checkpointing")
    if not cautions:
        return
    warnings = [text for text in (short_warmup(cfg), dynamics_without_descent(cfg, model_config)) if text]
    if int(os.environ.get("RANK", "0")) == 0:  # every rank validates; one line each is enough
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)


def check_urls(cfg: RunConfig) -> None:
    """Every path of the config is local or, where the project reads one, an s3:// URL: any other
    URL (gs://, hf://, ...) is refused in one line, never taken for a local directory."""
    local_only = {"output_root": "checkpoint.remote=s3://... uploads the checkpoints there",
                  "resume": "checkpoint.remote=s3://... resumes from the checkpoints there",
                  "model.init_from": "download the model first", "data.cache_dir": "the cache is a local disk"}
    for key, hint in local_only.items():
        value = get_key(cfg, key)
        problem = objectstore.unsupported_url(value, key, remote_ok=False)
        if problem:
            raise ConfigError(f"{problem}" + (f" ({hint})" if objectstore.is_remote(value) else ""))
    for key, value in [("data.path", cfg.data.path), ("checkpoint.remote", cfg.checkpoint.remote),
                       *((f"data.mixture[{i}].path", e.path) for i, e in enumerate(cfg.data.mixture))]:
        problem = objectstore.unsupported_url(value, key)
        if problem:
            raise ConfigError(problem)
    if cfg.checkpoint.remote and not objectstore.is_remote(cfg.checkpoint.remote):
        raise ConfigError(f"checkpoint.remote={cfg.checkpoint.remote!r}: must be s3://bucket/prefix (or empty: none)")
    if cfg.data.source and objectstore.is_remote(cfg.data.path):
        raise ConfigError(f"data.source={cfg.data.source}: a dataset in an object store (data.path={cfg.data.path}) "
                          f"is prepared once beforehand (python -m data_pipeline.prepare --source {cfg.data.source} "
                          f"--out {cfg.data.path}); then drop data.source")
    if cfg.data.cache_limit is not None:
        from data_pipeline.streaming_compat import streaming

        try:
            limit = streaming.base.util.bytes_to_int(cfg.data.cache_limit)
        except ValueError:
            limit = 0
        if limit <= 0:
            raise ConfigError(f"data.cache_limit={cfg.data.cache_limit!r}: must be a size such as 50gb (or null: no limit)")
    if cfg.checkpoint.upload_attempts < 1:
        raise ConfigError(f"checkpoint.upload_attempts={cfg.checkpoint.upload_attempts}: must be >= 1")


def dynamics_without_descent(cfg: RunConfig, model_config: Any) -> str | None:
    """What `eval.dynamics` will not do for a family without a descent, or None. A warning, not an
    error: a sweep may set it for every family, and those with a descent get their scalars."""
    from pretrain.models import family_spec
    from pretrain.models.probes import descending_families

    spec = family_spec(model_config)
    if not cfg.eval.dynamics or spec.descends:
        return None
    return (f"eval.dynamics=true: a {spec.name} model has no descent to measure, so this run logs no "
            f"eval/dynamics scalars and summary.json's dynamics stays null (they exist for "
            f"{', '.join(descending_families())})")


def short_warmup(cfg: RunConfig) -> str | None:
    """What is wrong with a run that ends before its warmup does (it never trains at
    `optimizer.lr`), or None. A warning for a run as configured; an error for the runs a sweep
    generates (`pretrain.scaling.sweep`)."""
    steps, warmup = cfg.total_steps, cfg.schedule.warmup_steps
    if steps >= warmup:
        return None
    budget = (f"train.max_steps={steps}" if steps == cfg.train.max_steps else
              f"train.max_tokens={cfg.train.max_tokens} ({steps} step{'s' * (steps != 1)} of "
              f"{cfg.tokens_per_step} tokens)")
    return (f"{budget} ends the run before schedule.warmup_steps={warmup}: the learning rate peaks at "
            f"{cfg.optimizer.lr * steps / warmup:.3g}, never reaching optimizer.lr={cfg.optimizer.lr:g}; "
            f"set schedule.warmup_steps to at most {steps}")


def _compile_backends() -> list[str]:
    import torch

    return torch.compiler.list_backends(exclude_tags=())
