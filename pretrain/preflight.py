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

from pretrain.checkpoint import CheckpointManager
from pretrain.config import ConfigError, RunConfig, model_config, padded_vocab


def preflight(cfg: RunConfig, checkpoints: CheckpointManager, checking_only: bool = False) -> None:
    """What every launch checks before any work (the config itself was validated already):
    the output root can take the run directory, the checkpoint to resume from (intact,
    compatible) and, if the dataset exists already and is not to be rebuilt (`data.overwrite`),
    that it fits the model. `Trainer.setup`
    starts with these; `--check` runs them alone, once, before a launcher starts the ranks."""
    from data_pipeline.prepare import existing_manifest

    check_output_root(cfg)
    checkpoints.resume_point(checking_only)
    if cfg.data.source and cfg.data.overwrite:
        return  # the dataset there may be rebuilt first; `Trainer.prepare_data` checks it then
    manifest = existing_manifest(cfg.data.path)
    if manifest is not None:
        check_dataset(cfg, manifest)
    elif not cfg.data.source:
        raise ConfigError(f"data.path={cfg.data.path}: no prepared dataset there (no manifest.json); "
                          "prepare one with python -m data_pipeline.prepare SOURCE --out "
                          f"{cfg.data.path}, or set data.source to prepare it on first use")


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
