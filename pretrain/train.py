"""The training loop.

    python -m pretrain.train --config configs/tiny/nrgpt.yaml [key.sub=value ...]
    torchrun --nproc_per_node=2 -m pretrain.train --config ... zero.stage=3

One optimizer step = `gradient_accumulation_steps` micro-batches per rank through the DeepSpeed
engine. After each step the ranks exchange one small tensor (loss sum, non-finite count,
preemption flag), which is all the synchronisation the loop itself adds. The run directory
holds the resolved config, TensorBoard events, sharded checkpoints and, at the end,
summary.json. Runs resume automatically from their latest complete checkpoint, also on another
number of processes or ZeRO stage (the checkpoint is converted once to DeepSpeed's universal
format) and with another global batch.

Exit codes: 0 done, 2 bad configuration or data, 1 an unrecoverable training error,
75 (EX_TEMPFAIL) checkpoint saved after SIGTERM/SIGUSR1: requeue the job to resume."""
from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import platform
import random
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from pretrain import checkpoint
from pretrain.config import (ConfigError, RunConfig, get_key, gradient_accumulation_steps,
                             load_config, model_config, resolved_precision, to_dict, validate)
from pretrain.downstream.in_training import evaluate_in_training
from pretrain.engine import configure_device_math, deepspeed_config, distributed_env, initialize
from pretrain.evaluate import EvalResult, decode_padded, evaluate
from pretrain.fileio import atomic_write_text
from pretrain.flops import achieved_tflops, mfu, peak_tflops
from pretrain.metrics import Metrics, diagnostic_scalars
from pretrain.models import build, family_name
from pretrain.optim import build_optimizer, lr_factor, param_groups, set_lr
from pretrain.summary import RunRecord

EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1 after saving a checkpoint; resubmit to resume."""


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Finish the step, save a checkpoint and exit with EXIT_PREEMPTED (Slurm: SIGUSR1 as the
warning before the time limit, SIGTERM on preemption or scancel)."""


class NonFiniteError(RuntimeError):
    """Non-finite updates keep coming back after reloading the last good checkpoint."""


@dataclass
class TrainState:
    """Progress of a run, saved in every checkpoint's client state."""

    step: int = 0
    """Optimizer steps taken (skipped ones included: their data was consumed)."""
    tokens_seen: int = 0
    """Training tokens consumed by all ranks."""
    samples_seen: int = 0
    """Training sequences consumed by all ranks (world-size independent position in the data)."""
    skipped_steps: int = 0
    """Updates skipped because a loss or the gradient norm was not finite."""
    reloads: int = 0
    """Reloads of the last good checkpoint after repeated non-finite updates."""
    last_train_loss: float | None = None
    """Mean training loss of the latest applied step."""
    last_val_loss: float | None = None
    """Validation loss of the latest evaluation."""
    best_val_loss: float | None = None
    """Lowest validation loss so far."""
    think_losses: list[float] | None = None
    """EBT: val loss after 1..N inference steps at the latest evaluation."""
    wall_time_s: float = 0.0
    """Seconds spent in this run up to the latest checkpoint, summed over resumed segments."""


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank, self.world_size, local_rank = distributed_env()
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", local_rank) if self.on_gpu else torch.device("cpu")
        if self.on_gpu:
            torch.cuda.set_device(self.device)
        self.precision = resolved_precision(cfg, self.on_gpu)
        self.grad_accum = gradient_accumulation_steps(cfg, self.world_size)
        self.total_steps = cfg.total_steps
        self.run_dir = cfg.run_dir
        self.ckpt_dir = self.run_dir / "ckpt"
        self.state = TrainState()
        self.downstream: dict[str, float] = {}
        """The latest downstream scalars (eval.downstream), for summary.json."""
        self.resume_notes: list[str] = []
        self.batches = None
        self.faults_fired: set[int] = set()
        self.session_start = time.perf_counter()
        self.session_train_s = 0.0
        self.session_tokens = 0
        # throughput accumulators since the last log point
        self.interval = dict.fromkeys(("steps", "time_s", "tokens", "data_wait_s"), 0.0)
        # preemption: finish the step, save, exit with EXIT_PREEMPTED
        self.stop_signal = 0
        self.previous_handlers = {signum: signal.signal(signum, self._on_signal)
                                  for signum in PREEMPTION_SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    # --- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        import deepspeed
        from data_pipeline.prepare import ensure_prepared
        from data_pipeline.loader import build_loader, read_manifest

        cfg = self.cfg
        resume_from = self._resume_checkpoint()
        deepspeed.init_distributed(verbose=False)
        data = cfg.data
        if data.source:
            self.manifest = ensure_prepared(data.path, data.source, seq_len=data.seq_len,
                                            tokenizer=data.tokenizer, val_fraction=data.val_fraction)
        else:
            self.manifest = read_manifest(data.path)
        if self.manifest["seq_len"] != data.seq_len:
            raise ConfigError(f"data.seq_len={data.seq_len}: the dataset at {data.path} has "
                              f"windows for seq_len={self.manifest['seq_len']}")
        self.build_engine(self.manifest["vocab_size"])

        self.loader = build_loader(data.path, "train", micro_batch_size=data.micro_batch_size,
                                   seed=cfg.seed, shuffle=True, num_workers=data.num_workers,
                                   pin_memory=self.on_gpu)
        # Schedulers signal every process of the job, loader workers included, and a worker
        # dead of SIGTERM fails the batch the step still needs; the trainer handles preemption.
        self.loader.dataloader.worker_init_fn = _ignore_preemption_signals
        self.val_loader = build_loader(data.path, "val", micro_batch_size=data.micro_batch_size,
                                       seed=cfg.seed, shuffle=False, num_workers=0, repeat=False)
        if resume_from is not None:
            self._load(resume_from)
        else:
            self._restart_batches()

        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
            atomic_write_text(self.run_dir / "config.yaml", text)
        self.metrics = Metrics(self.run_dir, self.rank == 0, self.total_steps, self.state.step)
        self.metrics.hparams(to_dict(cfg), ["train/loss", "eval/loss"])
        self.metrics.print(
            f"{cfg.run_name}: {cfg.model.flavor} ({self.params / 1e6:.2f}M params, "
            f"{self.non_embedding_params / 1e6:.2f}M non-embedding), {self.world_size} process(es), "
            f"ZeRO-{cfg.zero.stage}, {self.precision}, global batch {cfg.train.global_batch_size} x "
            f"{data.seq_len} tokens ({self.grad_accum} accumulation step(s)), "
            f"{'resuming at step ' + str(self.state.step) if self.state.step else 'fresh start'}")
        for note in self.resume_notes:
            self.metrics.print(note)

    def build_engine(self, dataset_vocab_size: int) -> None:
        """The model, its optimizer and the DeepSpeed engine, with the figures MFU needs
        (`bench.gpu` calls this directly to train on synthetic tokens without a dataset)."""
        cfg = self.cfg
        self.model_config = model_config(cfg, dataset_vocab_size)
        configure_device_math(cfg, self.on_gpu)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = build(self.model_config)
        self.params = model.num_params()
        self.non_embedding_params = model.num_params(non_embedding=True)
        self.flops_per_token = model.flops_per_token(cfg.data.seq_len, training=True)
        self._seed_rank()

        groups, self.group_infos = param_groups(model, cfg.optimizer)
        optimizer = build_optimizer(groups, cfg.optimizer, cfg.zero, self.on_gpu)
        self.engine = initialize(model, optimizer, deepspeed_config(cfg, self.world_size, self.precision),
                                 compile_backend=cfg.model.compile)
        device_name = torch.cuda.get_device_name(self.device) if self.on_gpu else None
        self.peak_tflops = cfg.train.peak_tflops or peak_tflops(device_name, self.precision)

    def _resume_checkpoint(self) -> Path | None:
        """The checkpoint to start from, checked against this config before any work."""
        if self.cfg.resume == "never" and checkpoint.list_checkpoints(self.ckpt_dir):
            raise ConfigError(f"resume=never, but {self.run_dir} already holds checkpoints; "
                              "resume=auto continues that run, or choose another run_name")
        try:
            tag_dir = checkpoint.find_checkpoint(self.cfg.resume, self.ckpt_dir)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if tag_dir is not None:
            saved = checkpoint.read_marker(tag_dir)["config"]
            for key in ("model", "data.seq_len"):
                before, now = get_key(saved, key), get_key(self.cfg, key)
                now = asdict(now) if key == "model" else now
                if before != now:
                    raise ConfigError(f"{key}={now!r} differs from the checkpoint {tag_dir} "
                                      f"({before!r}); start a new run (another run_name or resume=never)")
            try:  # a ZeRO stage change that cannot be converted fails here, before any work
                checkpoint.needs_universal(tag_dir, self.world_size, self.cfg.zero.stage)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return tag_dir

    def _seed_rank(self, step: int = 0) -> None:
        """Each rank's own random streams (e.g. EBT's candidate noise): seed + 1000 x rank at
        the start; a rank resuming at `step` without streams of its own to restore (the
        checkpoint was saved at another world size) derives them from (seed, rank, step)."""
        if step == 0:
            seed = self.cfg.seed + 1000 * self.rank
        else:
            digest = hashlib.blake2b(f"{self.cfg.seed}/{self.rank}/{step}".encode(), digest_size=4)
            seed = int.from_bytes(digest.digest(), "little")  # < 2**32, as numpy requires
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    # --- checkpoints ----------------------------------------------------------------------

    def _client_state(self) -> dict:
        return {"train_state": asdict(self.state), "loader": self.loader.state_dict(),
                "config": to_dict(self.cfg), "model_config": asdict(self.model_config),
                "lr_schedule": {"kind": self.cfg.schedule.kind, "step": self.state.step}}

    def save(self) -> None:
        self.state.wall_time_s, self.session_start = self._wall_time(), time.perf_counter()
        checkpoint.save(self.engine, self.ckpt_dir, self.state.step, self._client_state(),
                        self._rank_state(), keep=self.cfg.checkpoint.keep,
                        marker={"config": to_dict(self.cfg), "model_config": asdict(self.model_config)})
        self.metrics.print(f"saved checkpoint {checkpoint.tag_for(self.state.step)}")

    def _rank_state(self) -> dict:
        """Model buffers, which DeepSpeed saves from rank 0 only, but which can differ per rank
        (e.g. EBT's replay buffer of this rank's recent candidates)."""
        return {"buffers": {name: b.detach().cpu().clone()
                            for name, b in self.engine.module.named_buffers()}}

    def _load(self, tag_dir: Path, reload: bool = False) -> None:
        """Restore the run from `tag_dir`; a `reload` after non-finite updates goes back in
        progress but keeps counting skips, reloads and time. A checkpoint of another world
        size or ZeRO stage goes through its universal form (see docs/design.md, "Launching,
        preemption and elastic resume")."""
        marker = checkpoint.read_marker(tag_dir)
        universal = checkpoint.needs_universal(tag_dir, self.world_size, self.cfg.zero.stage)
        client_state, own_state = checkpoint.load(self.engine, tag_dir, universal)
        saved = TrainState(**client_state["train_state"])
        if reload:
            saved.reloads, saved.skipped_steps = self.state.reloads, self.state.skipped_steps
            saved.wall_time_s, self.session_start = self._wall_time(), time.perf_counter()
        self.state = saved
        self._restore_rank_state(tag_dir, own_state, same_world=marker["world_size"] == self.world_size)
        self.loader.load_state_dict(client_state["loader"])
        if not reload:
            self.total_steps = self.cfg.total_steps_after(saved.step, saved.tokens_seen)
            self.resume_notes = self._layout_changes(marker, universal, client_state["loader"])
        self._restart_batches()

    def _restore_rank_state(self, tag_dir: Path, own_state: dict | None, same_world: bool) -> None:
        """This rank's buffers and random streams. Per-rank streams have no counterpart at
        another world size, so after a world-size change every rank derives fresh ones from
        (seed, rank, step); a rank that saved no state of its own takes rank 0's buffers (for
        EBT: its replay rows)."""
        state = own_state if own_state is not None else checkpoint.read_rank_state(tag_dir, 0)
        buffers = dict(self.engine.module.named_buffers())
        for name, value in (state or {}).get("buffers", {}).items():
            buffers[name].copy_(value)
        if own_state is not None and same_world:
            checkpoint.restore_rng(own_state["rng"])
            return
        if same_world:
            print(f"warning: rank {self.rank}: {checkpoint.rank_state_file(tag_dir, self.rank)} is "
                  "missing; its random streams restart from (seed, rank, step)", file=sys.stderr)
        self._seed_rank(self.state.step)

    def _layout_changes(self, marker: dict, universal: bool, loader_state: dict) -> list[str]:
        """One console line per change since the checkpoint was written (world size, ZeRO stage,
        global batch), saying what happens to the state, the data and the schedule."""
        notes = []
        saved_world, saved = marker["world_size"], marker["config"]
        position = f"sample {loader_state['sample_in_epoch']} of epoch {loader_state['epoch']}"
        if (saved_world, saved["zero"]["stage"]) != (self.world_size, self.cfg.zero.stage):
            note = (f"checkpoint of {saved_world} process(es) with ZeRO-{saved['zero']['stage']} resumed on "
                    f"{self.world_size} with ZeRO-{self.cfg.zero.stage}: model and optimizer state "
                    f"{'through its universal form' if universal else 'loaded as saved'}")
            if saved_world != self.world_size:
                note += (f"; the data continues at {position} of the same order; each rank's random "
                         "streams are derived from (seed, rank, step)")
            notes.append(note)
        batch, saved_batch = self.cfg.train.global_batch_size, saved["train"]["global_batch_size"]
        if batch != saved_batch:
            notes.append(f"global batch changed from {saved_batch} to {batch} sequences at step "
                         f"{self.state.step}: the data continues at {position} of the same order (no "
                         "sample repeated or skipped); the learning-rate schedule stays a function of the "
                         f"step, not rescaled for the batch; the run ends at step {self.total_steps}")
        return notes

    def _restart_batches(self) -> None:
        """Iterate the train loader from its current state (stopping a previous iteration's workers)."""
        if self.batches is not None:
            self.batches.close()
        self.batches = iter(self.loader)

    def _wall_time(self) -> float:
        return self.state.wall_time_s + time.perf_counter() - self.session_start

    # --- the loop -------------------------------------------------------------------------

    def train(self) -> int:
        cfg = self.cfg
        consecutive_skips = 0
        last_eval = last_save = -1
        while self.state.step < self.total_steps:
            update = self.state.step + 1
            # the first update too, so that curves and console show where the loss started
            log_now = update % cfg.train.log_interval == 0 or update in (1, self.total_steps)
            result = self.train_step(log_now)
            self.state.step += 1
            self.state.tokens_seen += cfg.tokens_per_step
            self.state.samples_seen += cfg.train.global_batch_size
            self.metrics.advance()
            if result["nonfinite"]:
                self.state.skipped_steps += 1
                consecutive_skips += 1
                self.metrics.print(f"step {self.state.step}: non-finite loss or gradient norm, "
                                   f"update skipped on all ranks ({consecutive_skips} in a row)")
            else:
                consecutive_skips = 0
                self.state.last_train_loss = result["loss"]
            if log_now:
                self.log(result)

            if consecutive_skips >= cfg.train.max_consecutive_skips:
                self._reload_after_nonfinite(consecutive_skips)
                consecutive_skips = 0
                continue
            step = self.state.step
            if cfg.eval.interval and step % cfg.eval.interval == 0:
                self.run_eval()
                last_eval = step
            if result["stop"]:
                self.save()
                cause = signal.Signals(self.stop_signal).name if self.stop_signal else "another rank's signal"
                self.metrics.print(f"stopping at step {step} on {cause}: checkpoint saved, exit "
                                   f"code {EXIT_PREEMPTED}; rerun the same command to resume")
                self.metrics.close()
                return EXIT_PREEMPTED
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                self.save()
                last_save = step

        if last_eval != self.state.step:
            self.run_eval()
        if last_save != self.state.step and not checkpoint.is_complete(
                self.ckpt_dir / checkpoint.tag_for(self.state.step)):
            self.save()
        self.write_summary()
        self.metrics.close()
        return 0

    def log(self, result: dict) -> None:
        """TensorBoard scalars and the console line of the step just taken; throughput figures
        are averages over the steps since the previous log point."""
        interval = self.interval
        values = {"train/lr": result["lr"], **{"train/lr/" + name: lr for name, lr in result["lrs"].items()}}
        if not result["nonfinite"]:
            values["train/loss"] = result["loss"]
        if result["grad_norm"] is not None:
            values["train/grad_norm"] = result["grad_norm"]
        tokens_per_s = interval["tokens"] / interval["time_s"]
        values.update({
            "train/tokens_seen": self.state.tokens_seen,
            "train/tokens_per_s": tokens_per_s,
            "train/step_time_s": interval["time_s"] / interval["steps"],
            "train/data_wait_frac": interval["data_wait_s"] / interval["time_s"],
            "train/tflops": achieved_tflops(self.flops_per_token, tokens_per_s),
            "train/peak_mem_gb": _peak_memory_gb(self.on_gpu),
            "train/skipped_steps": self.state.skipped_steps,
            **result["diagnostics"]})
        if self.peak_tflops:
            values["train/mfu"] = mfu(self.flops_per_token, tokens_per_s, self.world_size, self.peak_tflops)
        self.metrics.scalars(self.state.step, values)
        self.metrics.console(self.state.step, values)
        self.interval = dict.fromkeys(interval, 0.0)

    def train_step(self, log_now: bool) -> dict:
        """One optimizer step over `grad_accum` micro-batches on every rank."""
        engine, cfg = self.engine, self.cfg
        start = time.perf_counter()
        step = self.state.step
        lr = cfg.optimizer.lr * lr_factor(step, cfg.schedule, cfg.optimizer.lr, self.total_steps)
        lrs = set_lr(engine.optimizer, self.group_infos, lr)
        loss_sum = torch.zeros((), device=self.device)
        nonfinite = torch.zeros((), device=self.device)
        data_wait = 0.0
        diagnostics = {}
        for micro in range(self.grad_accum):
            t0 = time.perf_counter()
            # The loader's own random draws (worker seeds when it starts an epoch, which a
            # resumed run does at a different step) must not move the training RNG.
            with torch.random.fork_rng(devices=[]):
                inputs, targets = next(self.batches)
            data_wait += time.perf_counter() - t0
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            last_micro = micro == self.grad_accum - 1
            out = engine(inputs, targets, return_energies=log_now and last_micro)
            loss = self._maybe_inject_fault(out.loss.float(), step + 1)
            finite = torch.isfinite(loss)
            nonfinite += ~finite
            loss_sum += torch.where(finite, loss.detach(), 0.0)
            # A non-finite loss must make the gradients non-finite too (they may not be, e.g.
            # for a NaN added outside the graph), so that ZeRO's check skips the update.
            engine.backward(loss * torch.where(finite, 1.0, math.nan))
            if last_micro and log_now and self.rank == 0:
                diagnostics = diagnostic_scalars(out.diagnostics)
            engine.step()

        stop_requested = torch.tensor(float(self.stop_signal != 0), device=self.device)
        stats = torch.stack([loss_sum, nonfinite, stop_requested])
        dist.all_reduce(stats)
        loss_total, nonfinite_total, stop = stats.tolist()
        # every optimizer skips an update with non-finite gradients on all ranks (ZeRO's own
        # check, or optim.GuardedAdamW without ZeRO) and says so through was_step_applied
        applied = engine.was_step_applied()
        grad_norm = float(engine.get_global_grad_norm()) if applied and engine.get_global_grad_norm() is not None else None
        # fp16 loss scaling skips overflowing steps by design; those are not faults
        skipped_by_fault = nonfinite_total > 0 or (not applied and self.precision != "fp16")
        step_time = time.perf_counter() - start
        for key, value in (("steps", 1), ("time_s", step_time), ("tokens", cfg.tokens_per_step),
                           ("data_wait_s", data_wait)):
            self.interval[key] += value
        self.session_train_s += step_time
        self.session_tokens += cfg.tokens_per_step
        return {"loss": loss_total / (self.grad_accum * self.world_size), "nonfinite": skipped_by_fault, "lr": lr,
                "grad_norm": grad_norm, "lrs": lrs,
                "diagnostics": diagnostics, "stop": stop > 0}

    def _maybe_inject_fault(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Test-only (config section `fault`): NaN loss on one rank, once per listed step."""
        fault = self.cfg.fault
        if step in fault.nan_loss_steps and self.rank == fault.nan_loss_rank and step not in self.faults_fired:
            self.faults_fired.add(step)
            return loss * math.nan
        return loss

    def _reload_after_nonfinite(self, skips: int) -> None:
        tag_dir = checkpoint.newest_complete(self.ckpt_dir)
        where = f"{skips} consecutive non-finite updates up to step {self.state.step}"
        if tag_dir is None:
            raise NonFiniteError(f"{where} and no checkpoint to reload; lower optimizer.lr or "
                                 "check the data")
        if self.state.reloads >= self.cfg.train.max_reloads:
            raise NonFiniteError(f"{where}, after {self.state.reloads} reload(s) of the last good "
                                 f"checkpoint (train.max_reloads); lower optimizer.lr or check the data")
        self.state.reloads += 1
        self.metrics.print(f"{where}: reloading {tag_dir.name} (reload {self.state.reloads} of "
                           f"at most {self.cfg.train.max_reloads})")
        self._load(tag_dir, reload=True)
        self.metrics.scalars(self.state.step, {"train/reloads": self.state.reloads})

    def close(self) -> None:
        """Stop the data loader workers and release streaming's shared memory now rather than
        whenever garbage collection gets to it, so that a next run in the same process starts
        clean; restore the signal handlers."""
        if self.batches is not None:
            self.batches.close()
        for name in ("batches", "loader", "val_loader", "engine"):
            self.__dict__.pop(name, None)
        gc.collect()
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)

    # --- evaluation and summary -----------------------------------------------------------

    def run_eval(self) -> EvalResult:
        from data_pipeline.tokenizer import decode

        def text(ids: list[int]) -> str:
            return decode_padded(lambda run: decode(self.manifest, run), ids, self.manifest["vocab_size"])

        result = evaluate(self.engine, self.val_loader, self.cfg.eval, self.device,
                          seed=self.cfg.seed, decode=text)
        state = self.state
        state.last_val_loss = result.loss
        state.best_val_loss = result.loss if state.best_val_loss is None else min(state.best_val_loss, result.loss)
        state.think_losses = result.think_losses
        self.metrics.scalars(state.step, result.scalars())
        line = f"eval at step {state.step}: val loss {result.loss:.4f}, ppl {math.exp(min(result.loss, 50)):.2f}"
        if result.think_losses:
            line += ", thinking curve " + " ".join(f"{x:.3f}" for x in result.think_losses)
        self.metrics.print(line)
        if result.sample is not None:
            self.metrics.text(state.step, "eval/sample", result.sample)
        self.downstream.update(evaluate_in_training(self.engine.module, self.cfg.eval.downstream, self.manifest,
                                                    state.step, state.step >= self.total_steps, self.metrics.scalars))
        return result

    def write_summary(self) -> None:
        if self.rank != 0:
            return
        cfg, state = self.cfg, self.state
        hardware = torch.cuda.get_device_name(self.device) if self.on_gpu else f"cpu ({platform.machine()})"
        RunRecord(
            run_name=cfg.run_name, family=family_name(self.model_config), flavor=cfg.model.flavor,
            params=self.params, non_embedding_params=self.non_embedding_params,
            tokens_seen=state.tokens_seen, train_flops=self.flops_per_token * state.tokens_seen,
            final_train_loss=state.last_train_loss if state.last_train_loss is not None else math.nan,
            best_val_loss=state.best_val_loss, final_val_loss=state.last_val_loss,
            wall_time_s=self._wall_time(), hardware=hardware, world_size=self.world_size,
            steps=state.step,
            extra={"flops_per_token": self.flops_per_token, "precision": self.precision,
                   "zero_stage": cfg.zero.stage, "global_batch_size": cfg.train.global_batch_size,
                   "seq_len": cfg.data.seq_len, "skipped_steps": state.skipped_steps,
                   "reloads": state.reloads, "think_losses": state.think_losses,
                   "tokens_per_s": self.session_tokens / max(self.session_train_s, 1e-9),
                   "model_config": asdict(self.model_config), "downstream": self.downstream},
        ).save(self.run_dir)


def _ignore_preemption_signals(worker_id: int) -> None:
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _peak_memory_gb(on_gpu: bool) -> float:
    if on_gpu:
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


def run(cfg: RunConfig) -> int:
    """Train `cfg` in this process (one rank of the job); returns the exit code."""
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config (configs/...)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, values parsed as YAML (e.g. zero.stage=3)")
    args = parser.parse_args(argv)
    from data_pipeline.sources import DataError

    try:
        _, world_size, _ = distributed_env()
        cfg = load_config(args.config, args.overrides)
        validate(cfg, world_size, torch.cuda.is_available())
        code = run(cfg)
    except (ConfigError, DataError, NonFiniteError, checkpoint.CheckpointError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, (ConfigError, DataError)) else 1
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
