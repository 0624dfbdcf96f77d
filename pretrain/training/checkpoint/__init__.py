"""Sharded DeepSpeed checkpoints: layout, completion marker, integrity, retention, exact resume.

Layout of a run's `ckpt/` directory:

    ckpt/step_00000200/          one DeepSpeed checkpoint (model + optimizer shards, client state)
        rank_state_00000.pt      per-process state: RNG states (python, numpy, torch, CUDA), buffers
        replay_store_00000.pt    per-process state the trainer hands over by name (`CheckpointManager.states`:
                                 the model family's, e.g. EBT's replay store), one file per name
        complete.json            written by rank 0 after every rank finished writing: the config,
                                 the world size, the dataset's identity, each file's size + checksum
    ckpt/latest                  tag of the newest complete checkpoint, replaced atomically

A checkpoint without `complete.json` was interrupted while being written and is never resumed
from; one whose files no longer match the sizes and checksums in its marker is damaged, and a
resume falls back to the newest intact one. DeepSpeed's own `latest` writing is switched off
(it would point at a checkpoint before all ranks are done).

ZeRO shards the optimizer state by rank, so a checkpoint resumed at another world size or ZeRO
stage is first converted, once, to DeepSpeed's universal format (one file per parameter and
state, independent of the partitioning), stored inside it:

    ckpt/step_00000200/universal/    made by the first resume that needs it, then reused

The trainer talks to `CheckpointManager` only: `resume_point()` before any work, `save()`,
`load()` and `reload_newest()`."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from common.fileio import amount, atomic_write_text, mount_point
from common.objectstore import RemoteError
from pretrain.config import REPLACED_SUFFIX, ConfigError, RunConfig, get_key, model_config
from pretrain.models import padded_vocab
from pretrain.training.checkpoint.layout import (LATEST, MARKER, CheckpointError, Marker, from_rank0, check_intact,
                                                 find_checkpoint, is_complete, kept_by_prune, list_checkpoints, prune,
                                                 prune_to, rank_state_file, record_files, state_file, tag_for, warn)
from pretrain.training.checkpoint.remote import (Uploader, fetch_newest, newer_in_store, remote_ckpt, remote_marker,
                                                 remote_tags)
from pretrain.training.checkpoint.universal import ensure_universal, needs_universal
from pretrain.training.checkpoint.writes import WriteFailure, recorded_writes
from pretrain.training.engine import seed_process
from pretrain.training.runlock import RunLock, hold_run


def model_changes(cfg: RunConfig, marker: Marker) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The model config fields that `cfg` resolves to other values than the checkpoint's (against
    its own vocabulary: the data's is checked with the data), as {field: (checkpoint's, now)}:
    (those that make another model, those that only choose how it computes). `model.compile` is
    of the second kind: a model is compiled in place, so its checkpoint is the eager model's."""
    saved = marker.model_config
    config = model_config(cfg, saved.get("vocab_size", 0))
    now = json.loads(json.dumps(dataclasses.asdict(config)))
    # a field the checkpoint lacks did not exist then; its default keeps the old behaviour
    changed = {key: (value, now[key]) for key, value in saved.items() if key in now and now[key] != value}
    how = {key: changed.pop(key) for key in config.EXECUTION_FIELDS if key in changed}
    if cfg.model.compile != marker.config.model.compile:
        how["model.compile"] = (marker.config.model.compile, cfg.model.compile)
    return changed, how


def check_same_model(cfg: RunConfig, tag_dir: Path, marker: Marker) -> None:
    """Refuse to resume checkpoint `tag_dir` as another model: the same flavor and seq_len, and
    the same model config as the checkpoint's (the flavor with `model.overrides`) but for the
    fields that choose how it computes (`model_changes`; `_changes_since` reports them). A flavor
    whose definition changed since the checkpoint was saved (nrgpt-ff2w-126m was D = 1020)
    resumes with overrides that give the checkpoint's model back."""
    new_run = "start a new run (another run_name, or resume=restart to move this one aside)"
    for key in ("model.flavor", "data.seq_len"):
        before, now = get_key(marker.config, key), get_key(cfg, key)
        if before != now:
            raise ConfigError(f"{key}={now!r} differs from the checkpoint {tag_dir} ({before!r}); {new_run}")
    changed, _ = model_changes(cfg, marker)
    if not changed:
        return
    differences = ", ".join(f"{key} {now!r} (checkpoint: {then!r})" for key, (then, now) in changed.items())
    fix = new_run
    section_then, section_now = (dataclasses.replace(section, init_from=None)
                                 for section in (marker.config.model, cfg.model))
    if section_then == section_now:  # the same model section: the flavor itself changed
        fix = ("the flavor's definition changed since; to resume, add "
               + " ".join(f"model.overrides.{key}={json.dumps(then)}" for key, (then, _) in changed.items()))
    raise ConfigError(f"model: {cfg.model.flavor} with model.overrides={cfg.model.overrides!r} gives "
                      f"{differences}, not the model of checkpoint {tag_dir}; {fix}")


SAME_STATE_PRECISIONS = {"fp32", "bf16-autocast"}
"""Precisions whose checkpoints hold the same state: fp32 weights, gradients and optimizer (autocast
only runs the forward's matmuls in bf16 and saves nothing of its own), so a resume may switch
between them and loads exactly what was saved (tests/test_precision.py). DeepSpeed's bf16 keeps
the module in bf16 beside the optimizer's fp32 master weights, in optimizer files of other names
(`bf16_zero_pp_rank_*`: a resume across that line failed inside DeepSpeed's load, on a file not
found), and fp16 adds a loss scale: a checkpoint of either continues only in its own precision."""


def saved_precision(marker: Marker) -> str | None:
    """The precision the checkpoint was trained in: recorded since checkpoints record it, else
    the config's when it names one (an older checkpoint of `auto` does not say which it was)."""
    if marker.precision is not None:
        return marker.precision
    return None if marker.config.train.precision == "auto" else marker.config.train.precision


def check_same_precision(precision: str, tag_dir: Path, marker: Marker) -> None:
    """Refuse to resume checkpoint `tag_dir` in another precision than it was trained in
    (`precision`: this run's, resolved), except between fp32 and bf16-autocast, whose states are
    the same (`SAME_STATE_PRECISIONS`)."""
    saved = saved_precision(marker)
    if saved is None or saved == precision or {saved, precision} <= SAME_STATE_PRECISIONS:
        return
    raise ConfigError(f"train.precision: checkpoint {tag_dir} was trained in {saved}, this run would continue "
                      f"it in {precision}, which its saved weights and optimizer state do not fit; set "
                      f"train.precision={saved} to resume it, or export it (python -m pretrain.export RUN_DIR "
                      "--format hf --out DIR) and start a new run from its weights with model.init_from=DIR")




@dataclass
class ResumeState:
    """What `CheckpointManager.load` restored; the trainer continues from here."""

    tag_dir: Path
    """The checkpoint loaded."""
    train_state: dict
    """The trainer's progress record as saved."""
    loader_state: dict | None
    """The train loader's position, None when the data changed deliberately (data.allow_change)."""
    notes: list[str]
    """One console line per layout change since the checkpoint was written."""




def read_rank_state(tag_dir: Path, rank: int) -> dict | None:
    """The state `rank` saved in `tag_dir` (RNG states, buffers), None if it saved none."""
    path = rank_state_file(tag_dir, rank)
    return torch.load(path, weights_only=False) if path.exists() else None


class RankState(Protocol):
    """Training state a rank keeps outside the module state (a model family's: `FamilySpec.rank_states`)."""

    def state_dict(self) -> dict:
        """The state to save: tensors (where they are) and plain values."""

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Take a saved state (this rank's, at the same world size) onto `device`."""

    def dealt_from(self, rank: int, saved_world: int, world: int) -> list[int]:
        """The saved ranks whose states `deal` needs for `rank` after a world-size change."""

    def deal(self, saved: dict[int, dict], saved_world: int, rank: int, world: int, device: torch.device) -> str:
        """Take this rank's share of the saved ranks' states (saved rank -> state) after the world
        size changed from `saved_world` to `world`; returns the console line that says how."""


def _read_state(tag_dir: Path, name: str, rank: int, device: torch.device) -> dict:
    return torch.load(state_file(tag_dir, name, rank), map_location=device, weights_only=True)


def capture_rng() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def data_identity(manifest: dict, mixture: list[tuple[dict, float | None, float | None]] = ()) -> dict:
    """What makes the training data the same data: recorded in every checkpoint, compared on
    resume. `mixture`: (manifest, proportion, repeat) of each mixed dataset, which then is the
    training data."""
    identity = {key: manifest.get(key) for key in ("fingerprint", "tokenizer", "vocab_size", "seq_len")}
    if mixture:
        identity["mixture"] = [[m.get("fingerprint"), proportion, repeat] for m, proportion, repeat in mixture]
    return identity


# --- the manager --------------------------------------------------------------------------------

class CheckpointManager:
    """Owns a run's `ckpt/` directory: which checkpoint a run resumes from (checked against the
    config before any work), saving every `checkpoint.interval` steps with retention, loading
    (through the universal form after a layout change), and per-rank state (buffers, RNG, and the
    `states` handed over)."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, precision: str):
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.precision = precision
        """The run's `train.precision`, resolved (`precision.resolve_precision`'s name)."""
        self.ckpt_dir = cfg.run_dir / "ckpt"
        self.resume_from: tuple[Path, Marker, bool] | None = None
        """The checkpoint `resume_point` chose, its marker and whether it loads through its
        universal form."""
        self.run_lock: RunLock | None = None
        """Rank 0's hold on the run directory, from `resume_point` until `release`."""
        self.uploader: Uploader | None = None
        """The background uploads to `checkpoint.remote` of rank 0, and of the first rank of each
        node with a run directory of its own (None elsewhere, and without a remote)."""
        self.own_node_dir = False
        """This rank is the first of a node whose run directory is its own, not rank 0's (nodes
        without a shared filesystem): it prunes and uploads its node's part of each checkpoint."""
        self.states: dict[str, RankState] = {}
        """Per-rank state saved and restored with each checkpoint, name -> object (the trainer hands
        over its model family's once the model is built: `FamilySpec.rank_states`)."""

    # -- before any work

    def resume_point(self, checking_only: bool = False) -> Path | None:
        """Find and check the checkpoint this run starts from (None: a fresh start): intact (a
        damaged newest one is skipped with a warning for the newest intact one), of the same
        model and seq_len, loadable at this world size and ZeRO stage. `resume=restart` first
        moves an existing run directory aside. Collective once the job is distributed (the
        checksums are shared out; every rank reaches the same decision). `checking_only` (a
        launcher's check before it starts the ranks): sizes but no checksums, nothing moved.
        First of all it takes the run (`runlock`): nothing is read or moved under a live trainer."""
        cfg = self.cfg
        self.run_lock = hold_run(cfg.run_dir, self.rank, checking_only)
        if cfg.checkpoint.remote:
            in_store = self._take_remote(checking_only)
            if in_store is not None:
                # a launch's check: the ranks will fetch it; checked here by its marker alone
                marker = remote_marker(remote_ckpt(cfg), in_store)
                check_same_model(cfg, self.ckpt_dir / in_store, marker)
                check_same_precision(self.precision, self.ckpt_dir / in_store, marker)
                return self.ckpt_dir / in_store
        if cfg.resume == "restart":
            if not checking_only:
                self._move_run_aside()
            return None
        if cfg.resume == "never" and list_checkpoints(self.ckpt_dir):
            raise ConfigError(f"resume=never, but {cfg.run_dir} already holds checkpoints; "
                              "resume=auto continues that run, resume=restart moves it aside and "
                              "starts over, or choose another run_name")
        try:
            tag_dir = find_checkpoint(cfg.resume, self.ckpt_dir)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.checkpoint.remote and cfg.resume == "auto":
            name = from_rank0(lambda: None if tag_dir is None else tag_dir.name)
            tag_dir = None if name is None else self.ckpt_dir / name
        if tag_dir is None:
            return None
        explicit = Path(cfg.resume).name.startswith("step_")
        candidates = [tag_dir] if explicit else [
            p for p in reversed(list_checkpoints(tag_dir.parent)) if p.name <= tag_dir.name and is_complete(p)]
        if cfg.checkpoint.remote:  # rank 0's choice: a node with a run directory of its own may see others
            candidates = [self.ckpt_dir / name for name in from_rank0(lambda: [p.name for p in candidates])]
        skipped = []
        for candidate in candidates:
            marker, damage = check_intact(candidate, checksums=not checking_only)
            if not damage:
                break
            skipped.append(damage)
        else:
            detail = "; ".join(", ".join(damage) for damage in skipped)
            if explicit:
                raise CheckpointError(f"resume={cfg.resume}: the checkpoint is damaged: {detail}")
            raise CheckpointError(f"no intact checkpoint in {tag_dir.parent}, every one is damaged: {detail}")
        for damage in skipped:
            warn(f"damaged checkpoint skipped ({', '.join(damage)}); resuming from {candidate}")
        check_same_model(cfg, candidate, marker)
        check_same_precision(self.precision, candidate, marker)
        try:  # decided once; a ZeRO stage change that cannot be converted fails here, before any work
            universal = self._needs_universal(candidate, marker)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.resume_from = (candidate, marker, universal)
        return candidate

    def _take_remote(self, checking_only: bool) -> str | None:
        """With `checkpoint.remote`: refuse a fresh start over a remote run that holds checkpoints,
        fetch its newest complete checkpoint where the run directory has none as new (the first
        rank of each node, for its node), and have rank 0's uploader send the newest local one
        if the store lacks it (an upload the last run could not finish). A store that cannot be
        reached, refuses the credentials or lacks the bucket stops the run here, in one line.
        `checking_only` (a launch's check) fetches nothing: returns the tag of the checkpoint in the
        store the ranks will fetch, if any."""
        cfg, url = self.cfg, remote_ckpt(self.cfg)
        error, fetched, in_store = None, None, None
        try:
            complete, _ = remote_tags(url)
            if cfg.resume in ("never", "restart") and complete:
                error = (f"resume={cfg.resume}, but {url} already holds checkpoints of run {cfg.run_name}; resume=auto "
                         "continues that run, or choose another run_name (or delete them there)")
            elif cfg.resume == "auto" and checking_only:
                in_store = newer_in_store(url, self.ckpt_dir)
            elif cfg.resume == "auto" and int(os.environ.get("LOCAL_RANK", "0")) == 0:
                fetched = fetch_newest(url, self.ckpt_dir)
        except RemoteError as e:
            error = f"checkpoint.remote: {e}"
        errors = [error]
        if dist.is_initialized() and dist.get_world_size() > 1:  # one node's failure stops every rank
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
        if error:
            raise ConfigError(error)
        if fetched and self.rank == 0:
            print(fetched, flush=True)
        if checking_only:
            return in_store
        own_nodes = self._nodes_with_own_run_dirs()
        if self.rank == 0:
            self.uploader = Uploader(url, cfg.checkpoint.keep, cfg.checkpoint.upload_attempts,
                                     nodes_to_wait_for=tuple(own_nodes))
            complete = [p for p in list_checkpoints(self.ckpt_dir) if is_complete(p)]
            if complete and not own_nodes:  # an upload the last run could not finish
                self.uploader.request(complete[-1])
        elif self.own_node_dir:
            self.uploader = Uploader(url, cfg.checkpoint.keep, cfg.checkpoint.upload_attempts, node=socket.gethostname())
        return None

    def _nodes_with_own_run_dirs(self) -> list[str]:
        """The hosts whose ranks do not see rank 0's run directory (a probe file rank 0 makes in
        it), sorted; sets `own_node_dir` on the first rank of each. Collective."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return []
        probe = self.ckpt_dir / f".probe-{socket.gethostname()}-{os.getpid()}"
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            probe.touch()
        probe = Path(from_rank0(lambda: str(probe)))
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, (socket.gethostname(), probe.exists()))
        if self.rank == 0:
            probe.unlink()
        self.own_node_dir = int(os.environ.get("LOCAL_RANK", "0")) == 0 and not views[self.rank][1]
        return sorted({host for host, sees in views if not sees})

    @property
    def resumed_run_dir(self) -> Path | None:
        """The directory of the run whose checkpoint this one resumes (its own, or another's with
        resume=PATH); None for a fresh start."""
        return None if self.resume_from is None else self.resume_from[0].parent.parent

    def _move_run_aside(self) -> None:
        """resume=restart: rank 0 renames an existing run directory to RUN_DIR.replaced-TIME
        (never deleting anything); every rank waits for it."""
        run_dir = self.cfg.run_dir
        if self.rank == 0 and run_dir.exists():
            aside = run_dir.with_name(run_dir.name + time.strftime(REPLACED_SUFFIX))
            os.replace(run_dir, aside)
            warn(f"resume=restart: moved the previous run to {aside}; starting fresh")
        if dist.is_initialized():
            dist.barrier()

    def release(self) -> None:
        """Let go of the run directory (the job is over, or it failed), once the uploads to
        `checkpoint.remote` are done (or have failed, with a warning)."""
        if self.uploader is not None:
            self.uploader.finish()
            if self.rank == 0 and self.uploader.uploaded:
                print(f"checkpoint.remote: {self.uploader.uploaded} checkpoint(s) uploaded to {self.uploader.url}, "
                      f"{self.uploader.cpu_s:.2f} s of rank 0's CPU", flush=True)
            self.uploader = None
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def check_data(self, data: dict) -> None:
        """Refuse to continue the chosen checkpoint on other data than it was trained on (by
        identity: fingerprint, tokenizer, vocabulary, seq_len) unless data.allow_change, and
        refuse even then a vocabulary the model's embeddings do not fit."""
        if self.resume_from is None:
            return
        tag_dir, marker, _ = self.resume_from
        cfg = self.cfg
        if marker.data is None or marker.data == data:
            return
        changed = ", ".join(f"{k} {marker.data.get(k)!r} -> {data.get(k)!r}" for k in data
                            if marker.data.get(k) != data.get(k))
        if not cfg.data.allow_change:
            raise ConfigError(f"data.path={cfg.data.path}: not the data checkpoint {tag_dir} was "
                              f"trained on ({changed}); data.allow_change=true continues on it "
                              "deliberately (the loader then starts from its beginning)")
        if padded_vocab(data["vocab_size"]) != marker.model_config.get("vocab_size"):
            raise ConfigError(f"data.path={cfg.data.path}: its vocabulary ({data['vocab_size']} "
                              f"tokens) does not fit the model of checkpoint {tag_dir} "
                              f"({marker.model_config.get('vocab_size')} embeddings), even with "
                              "data.allow_change; continue on data of the same tokenizer")

    # -- during the run

    def due(self, step: int) -> bool:
        """Whether the loop saves after `step` (every checkpoint.interval steps)."""
        interval = self.cfg.checkpoint.interval
        return bool(interval) and step % interval == 0

    def has(self, step: int) -> bool:
        return is_complete(self.ckpt_dir / tag_for(step))

    def save(self, engine, step: int, client_state: dict, model_config: dict, data: dict | None) -> Path:
        """Write checkpoint `step` on every rank (with this rank's buffers and RNG streams), then
        record every file's size and checksum and mark it complete, point `latest` at it and
        delete checkpoints beyond the newest `checkpoint.keep`. Collective: every rank calls it.
        A write that fails on any rank (a full disk) fails the save on every rank alike: the
        partial checkpoint is removed, the previous one stays the newest (and `latest`), and
        every rank raises the same CheckpointError, naming the file system and the space needed."""
        tag_dir = self.ckpt_dir / tag_for(step)
        if (self.rank == 0 or self.own_node_dir) and tag_dir.exists():  # left over by a run killed while writing it
            shutil.rmtree(tag_dir)
        dist.barrier()
        with recorded_writes(engine) as writes:
            engine.save_checkpoint(str(self.ckpt_dir), tag=tag_dir.name, client_state=client_state,
                                   save_latest=False)
            rank_state = {"buffers": {name: b.detach().cpu().clone() for name, b in engine.module.named_buffers()},
                          "rng": capture_rng()}
            writes.save_atomically(rank_state, rank_state_file(tag_dir, self.rank))
            for name, state in self.states.items():  # torch.save copies device tensors to the host one at a time
                writes.save_atomically(state.state_dict(), state_file(tag_dir, name, self.rank))
        while self.cfg.fault.checkpoint_stall_file and os.path.exists(self.cfg.fault.checkpoint_stall_file):
            time.sleep(0.1)
        reports = [None] * self.world_size  # also waits for every rank's writes
        dist.all_gather_object(reports, (writes.failure, writes.bytes))
        failure = next((failure for failure, _ in reports if failure is not None), None)
        if failure is None:
            files = record_files(tag_dir, {Path(os.path.relpath(path, tag_dir)).as_posix(): record
                                           for path, record in writes.written.items()})
            kept = []
            if self.rank == 0:
                marker = Marker(step=step, world_size=self.world_size, config=self.cfg,
                                model_config=model_config, time=time.time(), files=files, data=data,
                                precision=self.precision)
                for path, text in ((tag_dir / MARKER, marker.to_json()), (self.ckpt_dir / LATEST, tag_dir.name)):
                    failure = writes.write(path, lambda: atomic_write_text(path, text))
                kept = kept_by_prune(self.ckpt_dir, self.cfg.checkpoint.keep)
            outcome = [failure, kept]
            dist.broadcast_object_list(outcome, src=0)
            if outcome[0] is None:
                if self.rank == 0:
                    prune(self.ckpt_dir, self.cfg.checkpoint.keep)
                elif self.own_node_dir:
                    prune_to(self.ckpt_dir, outcome[1])
                if self.uploader is not None:
                    self.uploader.request(tag_dir, files)
                return tag_dir
            failure = outcome[0]
        message = [None]
        if self.rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
            message = [self._not_saved(tag_dir, failure, needed=sum(size for _, size in reports))]
        dist.broadcast_object_list(message, src=0)
        raise CheckpointError(message[0])

    def _not_saved(self, tag_dir: Path, failure: WriteFailure, needed: int) -> str:
        """The one line for a save that failed (its partial checkpoint removed already)."""
        complete = [p for p in list_checkpoints(self.ckpt_dir) if is_complete(p)]
        kept = (f"{complete[-1].name} stays the newest checkpoint" if complete
                else "there is no earlier checkpoint")
        if not failure.out_of_space:
            return (f"checkpoint {tag_dir} not saved: writing {failure.path} failed ({failure.reason}); "
                    f"the partial checkpoint was removed and {kept}; fix that, then rerun the same command to resume")
        free = shutil.disk_usage(self.ckpt_dir).free
        return (f"checkpoint {tag_dir} not saved: out of space on {mount_point(self.ckpt_dir)} (the file "
                f"system of {self.ckpt_dir}; {failure.reason}): the checkpoint needs {amount(needed)}, "
                f"{amount(free)} are free; the partial checkpoint was removed and {kept}; make room "
                "there (or choose another output_root), then rerun the same command to resume")

    def load(self, engine) -> ResumeState | None:
        """Restore the checkpoint `resume_point` chose (None for a fresh start). Collective."""
        if self.resume_from is None:
            return None
        tag_dir, marker, universal = self.resume_from
        return self._restore(engine, tag_dir, marker, universal, describe=True)

    def reload_newest(self, engine) -> ResumeState | None:
        """Restore the newest intact checkpoint (after repeated non-finite updates); None if there
        is none. Collective."""
        for tag_dir in reversed(list_checkpoints(self.ckpt_dir)):
            if is_complete(tag_dir):
                marker, damage = check_intact(tag_dir)
                if not damage:
                    return self._restore(engine, tag_dir, marker, self._needs_universal(tag_dir, marker),
                                         describe=False)
        return None

    def _needs_universal(self, tag_dir: Path, marker: Marker) -> bool:
        return needs_universal(marker.world_size, marker.config.zero.stage, self.world_size,
                               self.cfg.zero.stage, tag_dir)

    def _restore(self, engine, tag_dir: Path, marker: Marker, universal: bool, describe: bool) -> ResumeState:
        client_state = load_engine_state(engine, tag_dir, universal)
        train_state = client_state["train_state"]
        same_world = marker.world_size == self.world_size
        self._restore_rank_state(engine, tag_dir, train_state["step"], same_world)
        dealt = self._restore_states(engine, tag_dir, marker.world_size)
        loader_state = client_state["loader"]
        notes = self._changes_since(marker, universal, loader_state, train_state) if describe else []
        if describe:
            notes += dealt
        if describe and marker.data is not None and self.cfg.data.allow_change and loader_state is not None:
            saved_data = marker.data
            notes.append(f"data.allow_change: continuing on {self.cfg.data.path} (trained so far on "
                         f"fingerprint {saved_data.get('fingerprint')}); the loader starts at its beginning")
            loader_state = None
        return ResumeState(tag_dir=tag_dir, train_state=train_state, loader_state=loader_state, notes=notes)

    def _restore_rank_state(self, engine, tag_dir: Path, step: int, same_world: bool) -> None:
        """This rank's buffers and random streams. Per-rank streams have no counterpart at
        another world size, so after a world-size change every rank derives fresh ones from
        (seed, rank, step); a rank that saved no state of its own takes rank 0's buffers (for
        checkpoints from before the per-rank state files, whose buffers held that state: EBT's replay rows)."""
        own_state = read_rank_state(tag_dir, self.rank)
        state = own_state if own_state is not None else read_rank_state(tag_dir, 0)
        # not strict: the parameters are DeepSpeed's; a family may take buffers of checkpoints written
        # before its per-rank state files (EBT's `take_legacy_replay_buffers`)
        unexpected = engine.module.load_state_dict((state or {}).get("buffers", {}), strict=False).unexpected_keys
        if unexpected:
            raise CheckpointError(f"{rank_state_file(tag_dir, self.rank)}: buffers {', '.join(unexpected)} "
                                  "have no counterpart in the model")
        if own_state is not None and same_world:
            restore_rng(own_state["rng"])
            return
        if same_world:
            print(f"warning: rank {self.rank}: {rank_state_file(tag_dir, self.rank)} is "
                  "missing; its random streams restart from (seed, rank, step)", file=sys.stderr)
        seed_process(self.cfg.seed, self.rank, step)

    def _restore_states(self, engine, tag_dir: Path, saved_world: int) -> list[str]:
        """This rank's `states`: each its own saved state at the same world size, else its share
        dealt out from the saved ranks' states (`RankState.deal`); returns the lines saying how
        they were dealt. A state without files (a checkpoint from before them: the module's
        buffers held it, which `_restore_rank_state` loaded) keeps what it has."""
        device = next(engine.module.parameters()).device
        dealt = []
        for name, state in self.states.items():
            if not state_file(tag_dir, name, 0).exists():
                continue
            if saved_world == self.world_size:
                state.load_state_dict(_read_state(tag_dir, name, self.rank, device), device)
                continue
            saved = {rank: _read_state(tag_dir, name, rank, torch.device("cpu"))
                     for rank in state.dealt_from(self.rank, saved_world, self.world_size)}
            dealt.append(state.deal(saved, saved_world, self.rank, self.world_size, device))
        return dealt

    def _changes_since(self, marker: Marker, universal: bool, loader_state: dict,
                       train_state: dict) -> list[str]:
        """One console line per change since the checkpoint was written (world size, ZeRO stage,
        global batch, how the model computes), saying what happens to the state, the data and the
        schedule."""
        notes = []
        cfg, saved = self.cfg, marker.config
        position = f"sample {loader_state['sample_in_epoch']} of epoch {loader_state['epoch']}"
        if (marker.world_size, saved.zero.stage) != (self.world_size, cfg.zero.stage):
            note = (f"checkpoint of {marker.world_size} process(es) with ZeRO-{saved.zero.stage} resumed "
                    f"on {self.world_size} with ZeRO-{cfg.zero.stage}: model and optimizer state "
                    f"{'through its universal form' if universal else 'loaded as saved'}")
            if marker.world_size != self.world_size:
                note += (f"; the data continues at {position} of the same order; each rank's random "
                         "streams are derived from (seed, rank, step)")
            notes.append(note)
        batch, saved_batch = cfg.train.global_batch_size, saved.train.global_batch_size
        if batch != saved_batch:
            total = cfg.total_steps_after(train_state["step"], train_state["tokens_seen"])
            notes.append(f"global batch changed from {saved_batch} to {batch} sequences at step "
                         f"{train_state['step']}: the data continues at {position} of the same order "
                         "(no sample repeated or skipped); the learning-rate schedule stays a function of "
                         f"the step, not rescaled for the batch; the run ends at step {total}")
        _, how = model_changes(cfg, marker)
        if how:  # e.g. a compiled run that a new GPU trips continues eagerly, or checkpointed
            notes.append(f"changed at step {train_state['step']}: "
                         + ", ".join(f"{key} {then} -> {now}" for key, (then, now) in how.items())
                         + ": how the model computes, not what; the same weights, optimizer state and data "
                         "position, though the losses need not match the unchanged run's to the bit")
        return notes


def load_engine_state(engine, tag_dir: Path, universal: bool) -> dict:
    """Load model and optimizer from `tag_dir`, through its universal form (made on first use)
    if `universal`; returns the client state. Collective: every rank must call it."""
    source = ensure_universal(tag_dir) if universal else tag_dir
    groups = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    # DeepSpeed reads this switch from its config at load time; it is set per load because one
    # engine can resume from a universal checkpoint and later reload one of its own checkpoints.
    engine._config.load_universal_checkpoint = universal
    load_path, client_state = engine.load_checkpoint(str(source.parent), tag=source.name,
                                                     load_optimizer_states=True,
                                                     load_lr_scheduler_states=False)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {tag_dir}")
    if universal:
        # DeepSpeed's ZeRO-3 universal load gives every param group the first group's settings
        # (weight decay differs per group) and one shared step tensor, which AdamW then advances
        # once per group: keep the groups' own settings and give each its own step.
        for group, settings in zip(engine.optimizer.param_groups, groups, strict=True):
            group.update(settings)
        for state in engine.optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
    return client_state
