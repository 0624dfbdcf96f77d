"""Where a run's checkpoints are and whether one can be trusted: the directory layout (see
`pretrain.training.checkpoint`), the completion marker, finding the checkpoint to resume from, and the
size and checksum record of every file (written by all ranks together, checked on resume)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
import xxhash

from pretrain.config import RunConfig, from_dict, to_dict

MARKER = "complete.json"
LATEST = "latest"
UNIVERSAL = "universal"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded or converted; the message is one line."""



@dataclass
class Marker:
    """`complete.json`: what a checkpoint is, readable without loading it."""

    step: int
    """Optimizer steps taken when it was written."""
    world_size: int
    """Processes that wrote it (ZeRO shards fit only this world size)."""
    config: RunConfig
    """The run's resolved config at the time."""
    model_config: dict
    """The model family config, as plain data."""
    time: float = 0.0
    """When it was completed (seconds since the epoch)."""
    files: dict[str, list] = field(default_factory=dict)
    """Relative path -> [size in bytes, xxh3-64 hex digest] of every file written; empty in
    checkpoints written before integrity records existed (they are trusted as they are)."""
    data: dict | None = None
    """Identity of the training data (fingerprint, tokenizer, vocabulary, seq_len); None in
    checkpoints written before it was recorded."""
    precision: str | None = None
    """The precision it was trained in (`train.precision` resolved: `auto` is bf16 or fp32);
    None in checkpoints written before it was recorded."""

    @classmethod
    def read(cls, tag_dir: Path) -> Marker:
        path = tag_dir / MARKER
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            known = {f.name for f in dataclasses.fields(cls)}
            values = {k: v for k, v in raw.items() if k in known}
            values["config"] = from_dict(raw["config"], origin=str(path))
            return cls(**values)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())})") from None

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "config": to_dict(self.config)})




def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_state_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rank_state_{rank:05d}.pt"


def state_file(tag_dir: Path, name: str, rank: int) -> Path:
    """The file of `rank`'s per-rank state `name` (`CheckpointManager.states`)."""
    return tag_dir / f"{name}_{rank:05d}.pt"


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / MARKER).is_file()


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint directories (complete or not), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_"))


def newest_complete(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint, warning (on rank 0) about newer incomplete ones it skips."""
    for tag_dir in reversed(list_checkpoints(ckpt_dir)):
        if is_complete(tag_dir):
            return tag_dir
        warn(f"skipping incomplete checkpoint {tag_dir} (its write was interrupted)")
    return None


def warn(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def find_checkpoint(resume: str, ckpt_dir: Path) -> Path | None:
    """The checkpoint to resume from: `resume` is "auto" (the run's newest complete checkpoint,
    or None for a fresh start), "never"/"restart" (None) or a path to a checkpoint, a `ckpt/`
    directory or a run directory (its newest complete checkpoint; an error if it has none)."""
    if resume in ("never", "restart"):
        return None
    if resume == "auto":
        return newest_complete(ckpt_dir)
    path = Path(resume)
    if path.name.startswith("step_"):
        if not is_complete(path):
            raise ValueError(f"resume={resume}: checkpoint is incomplete (no {MARKER})")
        return path
    for candidate in (path / "ckpt", path):
        found = newest_complete(candidate)
        if found is not None:
            return found
    raise ValueError(f"resume={resume}: no complete checkpoint found there")


# --- integrity --------------------------------------------------------------------------------

def checkpoint_files(tag_dir: Path) -> list[str]:
    """The files a checkpoint's marker vouches for (relative paths, sorted): everything written
    with it, not the marker itself nor a universal copy made later."""
    files = []
    for path in tag_dir.rglob("*"):
        rel = path.relative_to(tag_dir)
        if path.is_file() and rel.parts[0] != UNIVERSAL and not rel.parts[0].startswith(".") \
                and rel.name != MARKER:
            files.append(rel.as_posix())
    return sorted(files)


def file_digest(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def from_rank0(compute):
    """compute() as rank 0 finds it, on every rank of the job (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    value = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(value, src=0)
    return value[0]


def _shared(items: list, compute) -> dict:
    """{item: compute(item)} for rank 0's `items`, with the work split over the ranks of the job
    (every rank gets the whole result). The split goes by position in rank 0's list: ranks can
    disagree on what they see (a listing of a network file system with attribute caching), and
    a list of their own would leave items to no rank. Outside a distributed job, one process
    does it all."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {item: compute(item) for item in items}
    items = from_rank0(lambda: items)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {item: compute(item) for i, item in enumerate(items) if i % world == rank}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def record_files(tag_dir: Path, written: dict[str, list] | None = None) -> dict[str, list]:
    """[size, digest] of every checkpoint file (collective, once every rank has written its
    files). `written`: relative path -> [size, digest] of the files this rank hashed as it wrote
    them; the others (rank 0's listing of the directory, the same for every rank) are hashed by
    all ranks together."""
    parts = [written or {}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, written or {})
    recorded = {rel: record for part in parts for rel, record in part.items()}
    listed = checkpoint_files(tag_dir) if not dist.is_initialized() or dist.get_rank() == 0 else []
    recorded |= _shared([rel for rel in listed if rel not in recorded],
                        lambda rel: [(tag_dir / rel).stat().st_size, file_digest(tag_dir / rel)])
    return dict(sorted(recorded.items()))


def damaged_files(tag_dir: Path, marker: Marker, checksums: bool = True) -> list[str]:
    """What no longer matches the marker's record: "path (why)" per file; [] when intact.
    Sizes first (cheap, by rank 0 for every rank), then (with `checksums`) the checksums of the
    files whose size is right (collective)."""
    def sizes() -> tuple[list[str], list[str]]:
        problems, to_hash = [], []
        for rel, (size, digest) in sorted(marker.files.items()):
            path = tag_dir / rel
            if not path.is_file():
                problems.append(f"{path} (missing)")
            elif path.stat().st_size != size:
                problems.append(f"{path} ({path.stat().st_size} bytes, {size} written)")
            else:
                to_hash.append(rel)
        return problems, to_hash

    problems, to_hash = from_rank0(sizes)
    # a rank on a node of its own (a private run directory) may lack a file rank 0 has: a mismatch
    digests = _shared(to_hash if checksums else [],
                      lambda rel: file_digest(tag_dir / rel) if (tag_dir / rel).is_file() else "missing")
    problems += [f"{tag_dir / rel} (checksum mismatch)" for rel in digests
                 if digests[rel] != marker.files[rel][1]]
    return problems


def check_intact(tag_dir: Path, checksums: bool = True) -> tuple[Marker | None, list[str]]:
    """(marker, damaged files) of a complete checkpoint: (None, [why]) if the marker itself is
    unreadable. Collective when the job is distributed."""
    def read() -> Marker | str:
        try:
            return Marker.read(tag_dir)
        except CheckpointError as e:
            return str(e).removesuffix(".")

    marker = from_rank0(read)  # as rank 0 reads it: nodes of their own may not have it
    if isinstance(marker, str):
        return None, [marker]
    return marker, damaged_files(tag_dir, marker, checksums)



def kept_by_prune(ckpt_dir: Path, keep: int) -> list[str]:
    """The tags `prune` keeps of the complete checkpoints: the newest `keep`."""
    return [p.name for p in list_checkpoints(ckpt_dir) if is_complete(p)][-keep:]


def prune_to(ckpt_dir: Path, kept: list[str]) -> None:
    """`prune` on a node with a run directory of its own, which has no markers (rank 0 writes
    them): drop the checkpoints older than the newest of rank 0's `kept` tags and not among them."""
    for tag_dir in list_checkpoints(ckpt_dir):
        if kept and tag_dir.name not in kept and tag_dir.name < kept[-1]:
            shutil.rmtree(tag_dir, ignore_errors=True)


def whole(tag_dir: Path) -> bool:
    """Whether this node holds the complete checkpoint `tag_dir` entirely: its marker, and every
    file the marker vouches for at its size (a node with a run directory of its own holds only
    its ranks' files, and only rank 0's node the marker)."""
    try:
        marker = Marker.read(tag_dir)
    except CheckpointError:
        return False
    return all((tag_dir / rel).is_file() and (tag_dir / rel).stat().st_size == size
               for rel, (size, _) in marker.files.items())


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and older incomplete ones."""
    tag_dirs = list_checkpoints(ckpt_dir)
    complete = [p for p in tag_dirs if is_complete(p)]
    kept = set(complete[-keep:])
    for tag_dir in tag_dirs:
        if tag_dir not in kept and tag_dir.name < complete[-1].name:
            shutil.rmtree(tag_dir, ignore_errors=True)
