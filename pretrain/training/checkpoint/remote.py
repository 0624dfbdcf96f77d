"""A run's checkpoints in an object store (`checkpoint.remote`), for nodes that share no
filesystem, or that a requeue replaces.

Layout: the run's `ckpt/` mirrored under REMOTE/RUN_NAME/ckpt/, one prefix per checkpoint
(`step_00000200/...`), without `latest`: a checkpoint there is complete when its
`complete.json` is, and that is uploaded last, after every file it vouches for. A checkpoint
whose upload was cut short has no marker and is skipped, as a local one without its marker is.

Uploads run in a thread of rank 0 (`Uploader`), after the checkpoint is complete locally: the
training loop goes on while the bytes leave. A store that cannot be reached is tried again with
waits doubling from 1 s (`checkpoint.upload_attempts` tries), then one warning line; the
checkpoint stays local (the newest is never pruned) and the next save, the end of the run or
the next run uploads the newest one. Pruning (`checkpoint.keep`) follows each upload there.

A run with `resume=auto` whose run directory holds no complete checkpoint as new as the newest
complete one in the store fetches that one first (`fetch_newest`), once per node; the resume then
checks it against the sizes and checksums its marker records, as any local checkpoint."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import objectstore
from common.objectstore import RemoteError
from pretrain.config import RunConfig
from pretrain.training.checkpoint.layout import MARKER, Marker, list_checkpoints, warn, whole

NODES = ".nodes"
"""Under a checkpoint's prefix: one empty object per node (other than rank 0's) whose ranks'
files are uploaded, with a run directory of its own."""
NODE_WAIT_S = 600
"""How long rank 0's upload waits for the other nodes' files before it gives up on a checkpoint."""
UPLOAD_NICE = 10
"""The nice value of the upload thread."""
FETCH_LOCK = ".fetch.lock"
"""Taken in the local `ckpt/` while a node fetches a checkpoint: the node's first rank fetches,
and on a shared filesystem the other nodes then find it there."""


def remote_ckpt(cfg: RunConfig) -> str:
    """Where the run's checkpoints go in the store."""
    return objectstore.join(cfg.checkpoint.remote, cfg.run_name, "ckpt")


def remote_tags(url: str, objects: dict[str, int] | None = None) -> tuple[list[str], list[str]]:
    """(complete, incomplete) checkpoint tags under `url` (whose `objects` are listed already, or
    listed here), oldest first."""
    tags: dict[str, bool] = {}
    for key in objectstore.listing(url) if objects is None else objects:
        tag, _, rest = key.partition("/")
        if tag.startswith("step_"):
            tags[tag] = tags.get(tag, False) or rest == MARKER
    return sorted(t for t, done in tags.items() if done), sorted(t for t, done in tags.items() if not done)


def upload_checkpoint(tag_dir: Path, url: str, files: dict | None = None, node: str | None = None,
                      nodes_to_wait_for: tuple[str, ...] = ()) -> bool:
    """Upload the checkpoint `tag_dir` (complete locally) under `url`, its marker last. False if
    it was there already (with its marker). Files of an upload cut short are sent again, all of
    them: a file of the same size there may be another run's write of the same step.

    Nodes with run directories of their own each hold only their ranks' files: each uploads the
    files of `files` (the marker's record, which every rank has) that it holds, and a node other
    than rank 0's (`node`: its name) then says so with an object NODES/<node>. Rank 0's upload
    waits for those of `nodes_to_wait_for` before it uploads the marker."""
    target = objectstore.join(url, tag_dir.name)
    if MARKER in objectstore.listing(target):
        return False
    private = node is not None or bool(nodes_to_wait_for)
    files = files if files is not None else Marker.read(tag_dir).files
    for rel in sorted(files):
        if private and not (tag_dir / rel).is_file():
            if not tag_dir.is_dir():
                raise FileNotFoundError(tag_dir)  # pruned meanwhile
            continue  # another node's
        objectstore.upload(tag_dir / rel, objectstore.join(target, rel))
    if node is not None:
        objectstore.upload_bytes(b"", objectstore.join(target, NODES, node))
        return True
    deadline = time.monotonic() + NODE_WAIT_S
    while nodes_to_wait_for:
        there = objectstore.listing(objectstore.join(target, NODES))
        missing = [name for name in nodes_to_wait_for if name not in there]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise RemoteError(f"uploading {target}: node(s) {', '.join(missing)} did not upload their files within "
                              f"{NODE_WAIT_S} s")
        time.sleep(0.5)
    objectstore.upload(tag_dir / MARKER, objectstore.join(target, MARKER))
    return True


def prune_remote(url: str, keep: int) -> None:
    """`prune` in the store: keep the newest `keep` complete checkpoints there, and drop older
    ones and incomplete ones older than the newest complete one (a newer incomplete one may be
    an upload under way)."""
    objects = objectstore.listing(url)
    complete, incomplete = remote_tags(url, objects)
    if not complete:
        return
    doomed = {tag for tag in complete[:-keep]} | {tag for tag in incomplete if tag < complete[-1]}
    # each checkpoint's marker first: one half deleted is never taken for a whole one
    objectstore.delete(url, [f"{tag}/{MARKER}" for tag in sorted(doomed) if f"{tag}/{MARKER}" in objects])
    objectstore.delete(url, [key for key in objects if key.partition("/")[0] in doomed and not key.endswith(MARKER)])


def fetch_checkpoint(url: str, tag: str, ckpt_dir: Path) -> Path:
    """Download checkpoint `tag` from `url` into `ckpt_dir/tag` (replacing an incomplete local one),
    its marker last; returns the directory."""
    target = objectstore.join(url, tag)
    tag_dir = ckpt_dir / tag
    staging = ckpt_dir / f".{tag}.fetching-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        objectstore.download(objectstore.join(target, MARKER), staging / MARKER)
        marker = Marker.read(staging)
        (staging / MARKER).rename(staging.with_name(staging.name + ".marker"))
        for rel in sorted(marker.files):
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            objectstore.download(objectstore.join(target, rel), staging / rel)
        staging.with_name(staging.name + ".marker").rename(staging / MARKER)
        if tag_dir.exists():
            shutil.rmtree(tag_dir)
        os.rename(staging, tag_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        staging.with_name(staging.name + ".marker").unlink(missing_ok=True)
    return tag_dir


def newer_in_store(url: str, ckpt_dir: Path) -> str | None:
    """The newest complete checkpoint under `url` if this node holds none as new entirely (what
    `fetch_newest` would fetch), else None."""
    complete, _ = remote_tags(url)
    local = [p.name for p in list_checkpoints(ckpt_dir) if whole(p)]
    return complete[-1] if complete and (not local or local[-1] < complete[-1]) else None


def remote_marker(url: str, tag: str) -> Marker:
    """The marker of checkpoint `tag` under `url`, read without fetching the checkpoint."""
    with tempfile.TemporaryDirectory() as directory:
        objectstore.download(objectstore.join(url, tag, MARKER), Path(directory) / MARKER)
        return Marker.read(Path(directory))


def fetch_newest(url: str, ckpt_dir: Path) -> str | None:
    """Fetch the newest complete checkpoint under `url` into `ckpt_dir` if no complete local one
    is as new (newer incomplete ones there are skipped with a warning); returns the line saying
    what was fetched, or None. Holds the node's fetch lock."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with open(ckpt_dir / FETCH_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        complete, incomplete = remote_tags(url)
        newest = complete[-1] if complete else ""
        for tag in incomplete:
            if tag > newest:
                warn(f"skipping incomplete checkpoint {objectstore.join(url, tag)} (no {MARKER}: its upload was "
                     "interrupted)")
        # a node with a run directory of its own holds a checkpoint only in part (its ranks' files)
        local = [p.name for p in list_checkpoints(ckpt_dir) if whole(p)]
        if not complete or (local and local[-1] >= newest):
            return None
        tag_dir = fetch_checkpoint(url, newest, ckpt_dir)
        return f"fetched checkpoint {tag_dir.name} from {objectstore.join(url, newest)}"


def say(warning: str) -> None:
    """A warning of an uploader, on whichever rank runs it (rank 0, or a node's first rank)."""
    print(f"warning: {warning}", file=sys.stderr, flush=True)


class Uploader:
    """Rank 0's background uploads: `request(tag_dir)` after each save (the newest request
    wins: an older one not yet started is superseded), `finish()` as the run ends."""

    def __init__(self, url: str, keep: int, attempts: int, node: str | None = None,
                 nodes_to_wait_for: tuple[str, ...] = ()):
        self.url, self.keep, self.attempts = url, keep, attempts
        self.node, self.nodes_to_wait_for = node, nodes_to_wait_for
        """See `upload_checkpoint`: this node's name where it is not rank 0's and has a run
        directory of its own; on rank 0 the names of such nodes."""
        self.failure: str | None = None
        """The line of the last upload that failed for good, None after one that succeeded."""
        self.uploaded = 0
        """Checkpoints uploaded so far."""
        self.cpu_s = 0.0
        """CPU seconds the uploads took in this process (what they take from training)."""
        self._wanted: tuple[Path, dict | None] | None = None
        self._busy = self._closing = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def request(self, tag_dir: Path, files: dict | None = None) -> None:
        """Upload `tag_dir` (`files`: its marker's record, for a node without the marker)."""
        with self._changed:
            self._wanted = (tag_dir, files)
            self._changed.notify_all()

    def finish(self) -> str | None:
        """Wait for the requested uploads; returns the failure line, if the last one failed."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        return self.failure

    def _work(self) -> None:
        # the uploads' share of the CPU goes to the training threads first (a thread's own nice value)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICE)
        while True:
            with self._changed:
                while self._wanted is None and not self._closing:
                    self._changed.wait()
                if self._wanted is None:
                    return
                (tag_dir, files), self._wanted = self._wanted, None
            started = time.thread_time()
            self._upload(tag_dir, files)
            self.cpu_s += time.thread_time() - started

    def _upload(self, tag_dir: Path, files: dict | None) -> None:
        def retrying(error: RemoteError, delay: float) -> None:
            say(f"uploading checkpoint {tag_dir.name}: {error}; trying again in {delay:g} s")

        try:
            sent = objectstore.with_retries(self.attempts, 1.0, lambda: upload_checkpoint(
                tag_dir, self.url, files, self.node, self.nodes_to_wait_for), retrying)
            self.uploaded += sent
            if self.node is None:  # rank 0's
                objectstore.with_retries(self.attempts, 1.0, lambda: prune_remote(self.url, self.keep), retrying)
            self.failure = None
        except RemoteError as e:
            self.failure = (f"checkpoint {tag_dir.name} not uploaded: {e}; it is kept in {tag_dir.parent}, and the next "
                            "save, or the next run, uploads the newest checkpoint")
            say(self.failure)
        except FileNotFoundError:
            pass  # pruned locally meanwhile, for a newer checkpoint, whose upload is requested
        except Exception as e:  # noqa: BLE001  (a thread's failure would otherwise vanish with it)
            self.failure = f"checkpoint {tag_dir.name} not uploaded: {type(e).__name__}: {' '.join(str(e).split())}"
            say(self.failure)
