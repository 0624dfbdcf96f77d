"""The training loop (`Trainer`), which `python -m pretrain.train` runs on each rank.

One optimizer step = `batch_split(...).accumulation_steps` micro-batches per rank through the DeepSpeed
engine. After each step the ranks exchange one small tensor (loss sum, non-finite count,
preemption flag), which is all the synchronisation the loop itself adds. The run directory
holds the resolved config, TensorBoard events, sharded checkpoints and, at the end,
summary.json. Runs resume automatically from their latest complete checkpoint, also on another
number of processes or ZeRO stage (the checkpoint is converted once to DeepSpeed's universal
format) and with another global batch."""
from __future__ import annotations

import gc
import math
import platform
import time
from dataclasses import asdict
from typing import Iterator

import torch
import torch.distributed as dist
import yaml

from common.fileio import atomic_write_text, write_failure_reason
from pretrain.config import (ConfigError, RunConfig, batch_split, describe_attention, describe_batch_split,
                             model_config, to_dict)
from pretrain.config.precision import resolve_precision
from pretrain.models import build, family_name, family_spec
from pretrain.training.checkpoint import CheckpointManager, ResumeState, data_identity
from pretrain.training.engine import (COMPILE_CACHE_FILE, configure_device_math, deepspeed_config, distributed_env,
                                      host_names, init_distributed, initialize, load_compile_cache,
                                      save_compile_cache, seed_process, time_out_every_group, training_device,
                                      use_current_collectives)
from pretrain.training.evaluation import EvalResult, evaluate, evaluate_downstream
from pretrain.training.faults import Faults
from pretrain.training.flops import peak_tflops
from pretrain.training.metrics import Metrics, StepResult, Throughput, diagnostic_scalars
from pretrain.training.optim import SpikeGuard, build_optimizer, length_change_note, lr_factor, param_groups, set_lr
from pretrain.training.preflight import check_dataset, evaluates, preflight
from pretrain.training.stopping import EXIT_PREEMPTED, StopSignals, ignore_stop_signals
from pretrain.training.stragglers import Stragglers
from pretrain.training.summary import SUMMARY_FILE, LengthChange, RunRecord, TrainState
from pretrain.training.watchdog import Watchdog

class NonFiniteError(RuntimeError):
    """Non-finite updates keep coming back after reloading the last good checkpoint."""


class SummaryError(RuntimeError):
    """summary.json could not be written (a full disk); the message is one line."""


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank, self.world_size, local_rank = distributed_env()
        self.device = training_device(cfg.train.device, local_rank)
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu:
            torch.cuda.set_device(self.device)
        self.precision = resolve_precision(cfg.train.precision, self.on_gpu)
        self.split = batch_split(cfg, self.world_size)
        self.total_steps = cfg.total_steps
        self.run_dir = cfg.run_dir
        self.checkpoints = CheckpointManager(cfg, self.rank, self.world_size, self.precision.name)
        self.state = TrainState()
        self.downstream: dict[str, float] = {}
        """The latest downstream scalars (eval.downstream), for summary.json."""
        self.resume_notes: list[str] = []
        self.batches = self.data = self.manifest = None
        self.faults = Faults(cfg.fault, self.rank)
        self.watchdog = Watchdog(cfg.train.hang_factor, cfg.train.hang_min_s, cfg.train.hang_first_s, self.rank)
        self.session_start = time.perf_counter()
        self.stops = StopSignals(self.rank)

    # --- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        from data_pipeline.loader import build_loader, read_manifest

        cfg = self.cfg
        init_distributed(cfg.train.collective_timeout, self.on_gpu)
        use_current_collectives()
        preflight(cfg, self.checkpoints)  # before any work
        self.stragglers = Stragglers(cfg.train.straggler_factor, cfg.train.straggler_intervals, host_names())
        self.manifest = manifest = self.prepare_data()
        self.data = data_identity(manifest, [(read_manifest(entry.path), entry.proportion, entry.repeat)
                                             for entry in cfg.data.mixture])
        self.checkpoints.check_data(self.data)
        self.build_engine(manifest["vocab_size"])

        data = cfg.data
        self.loader = build_loader(data.path, "train", micro_batch_size=self.split.micro_batch_size,
                                   seed=cfg.seed, shuffle=True, num_workers=data.num_workers,
                                   pin_memory=self.on_gpu, mixture=data.mixture, cache_dir=data.cache_dir,
                                   cache_limit=data.cache_limit)
        self.loader.dataloader.worker_init_fn = ignore_stop_signals  # the trainer handles them
        self.val_loader = None  # a dataset without a val split, with eval.interval=0: no evaluation
        if evaluates(cfg, manifest, self.world_size):
            self.val_loader = build_loader(data.path, "val", micro_batch_size=self.split.micro_batch_size,
                                           seed=cfg.seed, shuffle=False, num_workers=0, repeat=False,
                                           cache_dir=data.cache_dir, cache_limit=data.cache_limit)
        self._continue_from(self.checkpoints.load(self.engine))
        if cfg.model.compile != "off" and self.checkpoints.resumed_run_dir is not None:
            # before the first compiled call: the graphs of the resumed run's last job that ended
            loaded = load_compile_cache(self.checkpoints.resumed_run_dir / COMPILE_CACHE_FILE)
            self.resume_notes += [loaded] if loaded else []

        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self.metrics = Metrics(self.run_dir, self.rank == 0, self.total_steps, self.state.step)
        self.metrics.hparams(to_dict(cfg), ["train/loss", "eval/loss"])
        self.metrics.print(
            f"{cfg.run_name}: {cfg.model.flavor} ({self.params / 1e6:.2f}M params, "
            f"{self.non_embedding_params / 1e6:.2f}M non-embedding), {self.world_size} process(es), "
            f"ZeRO-{cfg.zero.stage}, {self.precision.name}, {data.seq_len} tokens per sequence, "
            f"{'resuming at step ' + str(self.state.step) if self.state.step else 'fresh start'}")
        for line in (describe_batch_split(cfg, self.world_size), *describe_attention(cfg, self.on_gpu),
                     *self.resume_notes):
            self.metrics.print(line)

    def prepare_data(self) -> dict:
        """The training data's manifest, preparing the dataset first if the config says how."""
        from data_pipeline.loader import read_manifest
        from data_pipeline.prepare import ensure_prepared

        data = self.cfg.data
        if data.source:
            manifest = ensure_prepared(data.path, data.source, seq_len=data.seq_len,
                                       tokenizer=data.tokenizer, val_fraction=data.val_fraction,
                                       revision=data.revision, overwrite=data.overwrite)
        else:
            manifest = read_manifest(data.path)
        check_dataset(self.cfg, manifest)
        return manifest

    def build_engine(self, dataset_vocab_size: int) -> None:
        """The model, its optimizer and the DeepSpeed engine, with the figures MFU needs
        (`bench.gpu` calls this directly to train on synthetic tokens without a dataset)."""
        cfg = self.cfg
        self.model_config = model_config(cfg, dataset_vocab_size)
        configure_device_math(cfg, self.on_gpu)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = build(self.model_config)
        self.checkpoints.states = family_spec(self.model_config).rank_states(model)
        # before the engine partitions the parameters; a resumed run gets its weights from its checkpoint
        if cfg.model.init_from and self.checkpoints.resume_from is None:
            from pretrain.hf.load import load_pretrained_weights
            from pretrain.models.weights import LoadError

            try:
                self.resume_notes += load_pretrained_weights(model, cfg.model.init_from)
            except LoadError as e:
                raise ConfigError(f"model.init_from: {e}") from None
        self.params = model.num_params()
        self.non_embedding_params = model.num_params(non_embedding=True)
        self.flops_per_token = model.flops_per_token(cfg.data.seq_len, training=True)
        seed_process(cfg.seed, self.rank)

        groups, self.group_infos = param_groups(model, cfg.optimizer)
        optimizer = build_optimizer(groups, cfg.optimizer, cfg.zero, self.on_gpu)
        self.engine = initialize(model, optimizer, deepspeed_config(cfg, self.world_size, self.precision),
                                 compile_backend=cfg.model.compile)
        time_out_every_group(cfg.train.collective_timeout)
        self.spikes = SpikeGuard.for_run(cfg.train, family_spec(self.model_config))
        self.spikes.install(self.engine)
        device_name = torch.cuda.get_device_name(self.device) if self.on_gpu else None
        peak = cfg.train.peak_tflops or peak_tflops(device_name, self.precision)
        self.throughput = Throughput(self.flops_per_token, self.world_size, peak, self.on_gpu)

    # --- checkpoints ----------------------------------------------------------------------

    def save(self) -> None:
        self.state.wall_time_s, self.session_start = self._wall_time(), time.perf_counter()
        with self.watchdog.longer():
            tag_dir = self.checkpoints.save(self.engine, self.state.step,
                                            {"train_state": asdict(self.state), "loader": self.loader.state_dict()},
                                            asdict(self.model_config), self.data)
        self.metrics.print(f"saved checkpoint {tag_dir.name}")

    def keep_compiled_graphs(self) -> None:
        """Rank 0 saves the graphs this job compiled or found in its cache for the run's next job
        (`load_compile_cache`), once, as the job ends: torch 2.13 reads back only the last batch of
        a process's graphs that `save_cache_artifacts` appends at each call. A job that is killed
        outright saves none: the next one generates them again."""
        if self.rank == 0 and self.cfg.model.compile != "off":
            save_compile_cache(self.run_dir / COMPILE_CACHE_FILE)

    def _continue_from(self, resumed: ResumeState | None, reload: bool = False) -> None:
        """Take up the run where `resumed` left it (None: a fresh start); a `reload` after
        non-finite updates goes back in progress but keeps counting skips, reloads and time."""
        if resumed is not None:
            saved = TrainState.from_saved(resumed.train_state)
            if reload:
                saved.reloads, saved.skipped_steps = self.state.reloads, self.state.skipped_steps
                saved.wall_time_s, self.session_start = self._wall_time(), time.perf_counter()
                # the run's schedule as it is now: a checkpoint from before a length change lacks it
                saved.length_changes = self.state.length_changes
            else:
                self.total_steps = self.cfg.total_steps_after(saved.step, saved.tokens_seen)
                self.resume_notes = resumed.notes
                if saved.total_steps not in (None, self.total_steps):
                    schedule = self.cfg.schedule
                    saved.length_changes.append(LengthChange(saved.step, saved.total_steps, self.total_steps,
                                                             schedule.on_length_change))
                    self.resume_notes.append(length_change_note(saved.length_changes, schedule,
                                                                self.cfg.optimizer.lr))
            self.state = saved
            if resumed.loader_state is not None:
                self.loader.load_state_dict(resumed.loader_state)
        self.state.total_steps = self.total_steps
        self._restart_batches()

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
        self.stops.looping = True
        self.watchdog.start()
        while self.state.step < self.total_steps:
            update = self.state.step + 1
            # the first update too, so that curves and console show where the loss started
            log_now = update % cfg.train.log_interval == 0 or update in (1, self.total_steps)
            with self.watchdog.longer():
                self.faults.hold(update, self.stops)
            result = self.train_step(log_now)
            self.watchdog.step_done(result.time_s)
            self.metrics.advance()
            if result.nonfinite:
                self.state.skipped_steps += 1
                consecutive_skips += 1
                self.metrics.print(f"step {self.state.step}: non-finite loss or gradient norm, "
                                   f"update skipped on all ranks ({consecutive_skips} in a row)")
            else:
                consecutive_skips = 0
                self.state.last_train_loss = result.loss
            if result.spike:
                self.metrics.print(f"step {self.state.step}: loss {result.loss:.4g}, gradient norm "
                                   f"{result.grad_norm:.4g}: a spike, update skipped on all ranks")
            if log_now:
                self.metrics.log_step(self.state.step, result, self.throughput, self.state)
                self.name_stragglers(result)

            if consecutive_skips >= cfg.train.max_consecutive_skips:
                self._reload_after_nonfinite(consecutive_skips)
                consecutive_skips = 0
                continue
            step = self.state.step
            if cfg.eval.interval and step % cfg.eval.interval == 0:
                self.run_eval()
                last_eval = step
            if result.stop:
                self.save()
                self.keep_compiled_graphs()
                self.metrics.print(f"stopping at step {step} on {self.stops.cause()}: checkpoint saved, exit "
                                   f"code {EXIT_PREEMPTED}; rerun the same command to resume")
                self.metrics.close()
                return EXIT_PREEMPTED
            if self.checkpoints.due(step):
                self.save()
                last_save = step

        if last_eval != self.state.step and self.val_loader is not None:
            self.run_eval()
        if last_save != self.state.step and not self.checkpoints.has(self.state.step):
            self.save()
        self.keep_compiled_graphs()  # the final evaluation's graphs too
        self.write_summary()
        self.metrics.close()
        return 0

    def name_stragglers(self, result: StepResult) -> None:
        scalars, warnings = self.stragglers.observe(result.rank_times)
        self.metrics.scalars(self.state.step, scalars)
        for line in warnings:
            self.metrics.print(line)

    def train_step(self, log_now: bool) -> StepResult:
        """One optimizer step over the batch split's micro-batches on every rank; the run's state
        counts it (its step and tokens seen), whether or not the update was applied."""
        engine, cfg = self.engine, self.cfg
        start = time.perf_counter()
        step = self.state.step
        lr = cfg.optimizer.lr * lr_factor(step, cfg.schedule, cfg.optimizer.lr, self.total_steps,
                                          self.state.length_changes)
        lrs = set_lr(engine.optimizer, self.group_infos, lr)
        loss_sum = torch.zeros((), device=self.device)
        nonfinite = torch.zeros((), device=self.device)
        data_wait = 0.0
        diagnostics = {}
        for micro in range(self.split.accumulation_steps):
            t0 = time.perf_counter()
            self.watchdog.reading = True
            self.faults.read(step + 1)
            # The loader's own random draws (worker seeds when it starts an epoch, which a
            # resumed run does at a different step) must not move the training RNG.
            with torch.random.fork_rng(devices=[]):
                inputs, targets = next(self.batches)
            self.watchdog.reading = False
            data_wait += time.perf_counter() - t0
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            last_micro = micro == self.split.accumulation_steps - 1
            engine.module.seed_shared_draws(f"{cfg.seed}/{step}/{micro}")
            out = engine(inputs, targets, return_energies=log_now and last_micro)
            # Only the loss and the diagnostics outlive the forward: the logits ([B, T, V], GiBs
            # at a 50k vocabulary) would otherwise stay through backward and the next forward.
            model_loss, model_diagnostics = out.loss, out.diagnostics
            del out
            loss = self.faults.loss(model_loss.float(), step + 1, last_micro)
            finite = torch.isfinite(loss)
            nonfinite += ~finite
            loss_sum += torch.where(finite, loss.detach(), 0.0)
            if last_micro:
                # The update's loss over all ranks, before the optimizer step the spike guard
                # vetoes, and on log steps each rank's own part of the step (`stragglers`). It is
                # reduced before the last backward, whose gradient reduction makes every rank
                # wait for the slowest: up to here a rank's time is its own.
                # Filled on the device: torch.tensor(flag, device=...) would be a copy that waits.
                stop_requested = torch.full((), float(self.stops.signum != 0), device=self.device)
                stats = torch.stack([loss_sum, nonfinite, stop_requested])
                if log_now:
                    stats = torch.cat([stats, self.own_step_times(start, data_wait)])
                dist.all_reduce(stats)
            # A non-finite loss must make the gradients non-finite too (they may not be, e.g.
            # for a NaN added outside the graph), so that ZeRO's check skips the update.
            engine.backward(loss * torch.where(finite, 1.0, math.nan))
            if last_micro:
                if log_now and self.rank == 0:
                    diagnostics = diagnostic_scalars(model_diagnostics, family_name(self.model_config))
                loss_total, nonfinite_total, stop, *rank_times = stats.tolist()
                mean_loss = loss_total / (self.split.accumulation_steps * self.world_size)
                self.spikes.arm(self.state, mean_loss)
            engine.step()
        # every optimizer skips an update with non-finite gradients on all ranks (ZeRO's own
        # check, or optim.GuardedAdamW without ZeRO) and says so through was_step_applied
        applied = engine.was_step_applied()
        grad_norm = engine.get_global_grad_norm() if applied else None
        # loss scaling skips overflowing steps by design; those are not faults
        skipped_by_fault = nonfinite_total > 0 or (not applied and not self.precision.loss_scaling)
        result = StepResult(loss=mean_loss, nonfinite=skipped_by_fault, spike=self.spikes.settle(), lr=lr, lrs=lrs,
                            time_s=time.perf_counter() - start, data_wait_s=data_wait, tokens=cfg.tokens_per_step,
                            grad_norm=None if grad_norm is None else float(grad_norm), diagnostics=diagnostics,
                            stop=stop > 0, rank_times=rank_times)
        self.throughput.add(result)
        self.state.step += 1
        self.state.tokens_seen += result.tokens
        return result

    def own_step_times(self, step_start: float, data_wait_s: float) -> torch.Tensor:
        """This rank's slots of every rank's (computation, data wait) in seconds, zeros elsewhere,
        for the step's all-reduce to fill in: its own part of the step so far. On a GPU the
        host waits for the device first (on log steps only), or the time would be the launches'."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        elapsed_s = time.perf_counter() - step_start
        times = torch.zeros(2 * self.world_size, device=self.device)
        times[self.rank] = elapsed_s - data_wait_s
        times[self.world_size + self.rank] = data_wait_s
        return times

    def _reload_after_nonfinite(self, skips: int) -> None:
        where = f"{skips} consecutive non-finite updates up to step {self.state.step}"
        if self.state.reloads >= self.cfg.train.max_reloads:
            raise NonFiniteError(f"{where}, after {self.state.reloads} reload(s) of the last good "
                                 f"checkpoint (train.max_reloads); lower optimizer.lr or check the data")
        with self.watchdog.longer():
            resumed = self.checkpoints.reload_newest(self.engine)
        if resumed is None:
            raise NonFiniteError(f"{where} and no checkpoint to reload; lower optimizer.lr or "
                                 "check the data")
        self.state.reloads += 1
        self.metrics.print(f"{where}: reloading {resumed.tag_dir.name} (reload {self.state.reloads} of "
                           f"at most {self.cfg.train.max_reloads})")
        self._continue_from(resumed, reload=True)
        self.metrics.scalars(self.state.step, {"train/reloads": self.state.reloads})

    def feed(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Train on these (inputs, targets) micro-batches from now on instead of the dataset's
        (a benchmark's synthetic tokens, without `setup`): after `build_engine`."""
        if self.batches is not None:
            self.batches.close()
        self.batches = batches

    def close(self, release_engine: bool = False) -> None:
        """Stop the data loader workers and release streaming's shared memory now rather than
        whenever garbage collection gets to it, so that a next run in the same process starts
        clean; restore the signal handlers. `release_engine`: also free the engine's optimizer
        state and hooks (a process that builds another engine next); not where a collective may
        have failed, since DeepSpeed synchronises the device first, which waits on a dead peer."""
        if self.batches is not None:
            self.batches.close()
        if release_engine and hasattr(self, "engine"):
            self.engine.destroy()
        self.checkpoints.release()
        for name in ("batches", "loader", "val_loader", "engine"):
            self.__dict__.pop(name, None)
        gc.collect()
        self.stops.restore()
        self.watchdog.stop()

    # --- evaluation and summary -----------------------------------------------------------

    def run_eval(self) -> EvalResult:
        with self.watchdog.longer():
            return self._run_eval()

    def _run_eval(self) -> EvalResult:
        result = evaluate(self.engine, self.val_loader, self.cfg.eval, self.device, self.cfg.seed, self.manifest)
        state = self.state
        state.record_eval(result.loss, result.think_losses, result.dynamics)
        self.metrics.scalars(state.step, result.scalars())
        self.metrics.print(f"eval at step {state.step}: {result.line()}")
        if result.sample is not None:
            self.metrics.text(state.step, "eval/sample", result.sample)
        self.downstream.update(evaluate_downstream(self.engine.module, self.cfg.eval.downstream, self.manifest,
                                                   state.step, state.step >= self.total_steps, self.metrics.scalars))
        return result

    def write_summary(self) -> None:
        """Rank 0 writes summary.json, after the final checkpoint; a failed write (a full disk) is
        a SummaryError saying how to get it (a rerun resumes at the final step and writes it)."""
        if self.rank != 0:
            return
        cfg, state = self.cfg, self.state
        hardware = torch.cuda.get_device_name(self.device) if self.on_gpu else f"cpu ({platform.machine()})"
        record = RunRecord(
            run_name=cfg.run_name, family=family_name(self.model_config), flavor=cfg.model.flavor,
            params=self.params, non_embedding_params=self.non_embedding_params,
            tokens_seen=state.tokens_seen, train_flops=self.flops_per_token * state.tokens_seen,
            final_train_loss=state.last_train_loss if state.last_train_loss is not None else math.nan,
            best_val_loss=state.best_val_loss, final_val_loss=state.last_val_loss,
            wall_time_s=self._wall_time(), hardware=hardware, world_size=self.world_size,
            steps=state.step, length_changes=state.length_changes,
            extra={"flops_per_token": self.flops_per_token, "precision": self.precision.name,
                   "zero_stage": cfg.zero.stage, "global_batch_size": cfg.train.global_batch_size,
                   "seq_len": cfg.data.seq_len, "skipped_steps": state.skipped_steps, "spike_skips": state.spike_skips,
                   "reloads": state.reloads, "think_losses": state.think_losses, "dynamics": state.dynamics,
                   "tokens_per_s": self.throughput.session_tokens_per_s(),
                   "model_config": asdict(self.model_config), "downstream": self.downstream},
        )
        try:
            record.save(self.run_dir)
        except OSError as e:
            raise SummaryError(f"{self.run_dir / SUMMARY_FILE} not written ({write_failure_reason(e, self.run_dir)}); "
                               f"the final checkpoint (step {state.step}) is saved: make room there, then rerun "
                               "the same command to write it") from None


def run(cfg: RunConfig) -> int:
    """Train `cfg` in this process (one rank of the job); returns the exit code."""
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
