"""The checks a launch makes before any work: the output root can take the run directory, the
checkpoint to resume from is intact and compatible, and the dataset fits the model.
`Trainer.setup` starts with them; `python -m pretrain.train --check` runs them alone, once, in
one process, before a launcher starts the ranks (`launch/torchrun.sh`)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from common import objectstore
from pretrain.config import ConfigError, RunConfig, batch_split, model_config
from pretrain.models import padded_vocab
from pretrain.training.checkpoint import CheckpointManager


def preflight(cfg: RunConfig, checkpoints: CheckpointManager, checking_only: bool = False) -> None:
    """What every launch checks before any work (the config itself was validated already):
    the output root can take the run directory, the checkpoint to resume from (intact,
    compatible) and, if the dataset exists already and is not to be rebuilt (`data.overwrite`),
    that it fits the model. `Trainer.setup`
    starts with these; `--check` runs them alone, once, before a launcher starts the ranks."""
    from data_pipeline.packing import INDEX, MANIFEST, existing_manifest

    check_output_root(cfg)
    checkpoints.resume_point(checking_only)
    if cfg.data.source and cfg.data.overwrite:
        return  # the dataset there may be rebuilt first; `Trainer.prepare_data` checks it then
    manifest = existing_manifest(cfg.data.path)
    if manifest is not None:
        check_dataset(cfg, manifest)
        evaluates(cfg, manifest, checkpoints.world_size)
        return
    if objectstore.is_remote(cfg.data.path):
        raise ConfigError(f"data.path={cfg.data.path}: no prepared dataset there (no {MANIFEST}); prepare one with "
                          f"python -m data_pipeline.prepare --source SOURCE --out {cfg.data.path}")
    path = Path(cfg.data.path)
    if path.is_file():
        raise ConfigError(f"data.path={path} is a file; it must be the directory of a prepared dataset "
                          f"(the one holding {MANIFEST})")
    if (path / INDEX).is_file() and (path.parent / MANIFEST).is_file():
        raise ConfigError(f"data.path={path} is the {path.name} split of the dataset at {path.parent}; "
                          f"set data.path={path.parent}")
    if not cfg.data.source:
        missing = f"no {MANIFEST}" if path.is_dir() else "no such directory"
        raise ConfigError(f"data.path={path}: no prepared dataset there ({missing}); prepare one with "
                          f"python -m data_pipeline.prepare --source SOURCE --out {path}, or set "
                          "data.source to prepare it on first use")


def check_output_root(cfg: RunConfig) -> None:
    """The run directory can be created (or exists as a directory) and written, and so can its
    parent (the run's lock goes there). Tried for real, since permission bits do not tell: root
    passes os.access on /proc and on a full file system. A probe directory, with the missing part
    of the run directory's path inside it, is made where the first missing directory would go, and
    one inside an existing run directory; both are removed again. Their names are unique (every
    rank checks at once), so no rank removes a directory another rank's check or the run uses."""
    target = cfg.run_dir
    existing = next(p for p in [target, *target.parents] if p.exists() or p == Path(p.anchor))
    key = "run_name" if existing == target else "output_root"
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is not a directory, so {target} cannot be the run directory")
    base = target.parent if existing == target else existing
    try:
        _probe(base, target.relative_to(base))
    except OSError as e:
        raise ConfigError(f"output_root: cannot create directories in {base} ({e.strerror or e}), so the "
                          f"run directory {target} cannot be made there; choose another output_root") from None
    if existing == target:
        try:
            _probe(target, Path())
        except OSError as e:
            raise ConfigError(f"run_name: cannot create anything in the run directory {target} "
                              f"({e.strerror or e}); choose another run_name or output_root") from None


def _probe(directory: Path, inner: Path) -> None:
    """Make a uniquely named directory in `directory`, `inner` inside it, and remove them again."""
    probe = Path(tempfile.mkdtemp(prefix=".write-check-", dir=directory))
    try:
        (probe / inner).mkdir(parents=True, exist_ok=True)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def check_dataset(cfg: RunConfig, manifest: dict) -> None:
    """The prepared dataset fits the run: its windows are `data.seq_len` long and every token id
    it holds has an embedding in the model (a model vocabulary much larger than the data's is
    allowed, with a warning: most of it can never occur)."""
    data = cfg.data
    if manifest["seq_len"] != data.seq_len:
        raise ConfigError(f"data.seq_len={data.seq_len}: the dataset at {data.path} has "
                          f"windows for seq_len={manifest['seq_len']}")
    model_vocab = model_config(cfg, manifest["vocab_size"]).vocab_size
    if model_vocab < manifest["vocab_size"]:
        raise ConfigError(f"model.overrides.vocab_size={model_vocab}: smaller than the vocabulary of "
                          f"the dataset at {data.path} ({manifest['vocab_size']} token ids); drop the "
                          "override (the model then takes the dataset's vocabulary)")
    if model_vocab > 4 * padded_vocab(manifest["vocab_size"]) and int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: the model has {model_vocab} embeddings but the dataset at {data.path} uses "
              f"only {manifest['vocab_size']} token ids ({manifest.get('tokenizer')} tokenizer): most "
              "of the vocabulary can never occur", file=sys.stderr)


def evaluates(cfg: RunConfig, manifest: dict, world_size: int) -> bool:
    """Whether the run evaluates on the val split of its dataset: not when the dataset has none
    (prepared with --val-fraction 0) and eval.interval=0 (which otherwise evaluates once, at the
    end). A run that must evaluate needs a val split that fills a micro-batch on every process."""
    data, interval = cfg.data, cfg.eval.interval
    windows = manifest["splits"].get("val", {}).get("windows", 0)
    if windows == 0 and interval == 0:
        if cfg.eval.downstream.tasks:
            raise ConfigError(f"eval.downstream.tasks: they run at the evaluations, and this run has none "
                              f"(the dataset at {data.path} has no val split and eval.interval=0); drop "
                              "them, or prepare the dataset with a val fraction")
        return False
    if windows == 0:
        raise ConfigError(f"eval.interval={interval}: the dataset at {data.path} has no val split "
                          "(prepared with --val-fraction 0); set eval.interval=0 to train without "
                          "evaluation, or prepare the dataset with a val fraction")
    micro_batch_size = batch_split(cfg, world_size).micro_batch_size
    if windows < micro_batch_size * world_size:
        # The trainer may take a smaller micro-batch than configured (to split the global batch).
        taken = "" if micro_batch_size == data.micro_batch_size else f" ({micro_batch_size})"
        raise ConfigError(f"data.micro_batch_size={data.micro_batch_size}: the val split of the dataset at "
                          f"{data.path} has {windows} window(s), fewer than one micro-batch{taken} "
                          f"on each of {world_size} process(es); lower "
                          "data.micro_batch_size, prepare the dataset "
                          "with a larger --val-fraction, or with --val-fraction 0 and set eval.interval=0 "
                          "to train without evaluation")
    return True
