"""Prepared datasets in an object store (`s3://bucket/prefix`): the upload of a prepared
dataset, and the node-local cache a loader reads it from.

The loader reads a node-local copy, made once per node and dataset before the first batch,
instead of handing streaming a `remote` to fetch shards from on demand. With the copy every
promise the loader keeps on local data holds unchanged, because it *is* local data to streaming
(the same sample order, exact resume, any node count), and streaming's traps around a `remote`
cannot occur: its "Reused local directory" check (two jobs, or a re-created loader, on one cache
directory) applies only with a remote, and its per-worker downloads fail inside the workers. The
price: a node needs disk for the datasets it trains on (`data.cache_limit` bounds the cache by
evicting the least recently used other datasets), and the first run on a node waits for the copy.

Layout of the cache (`data.cache_dir`, by default in the temp directory: node-local):

    CACHE/<key>/          one dataset: manifest.json (written last: the copy is whole), the splits
    CACHE/.<key>.lock     taken while the copy is made: one process per node makes it, the others
                          (the node's other ranks, another job) wait and then read it

`<key>` is a hash of the remote manifest, so a dataset prepared again under the same URL gets a
new copy rather than a stale one. Every shard is checked against the size and xxh64 checksum its
split's index.json records as it arrives; a shard damaged in the bucket is an error naming it.

Uploading (`prepare --out s3://...`): the dataset is prepared into a local staging directory as
always, then uploaded with its manifest last, so a reader never takes a partial upload for a
dataset; an `.incomplete` object marks a prefix whose upload is under way or was interrupted,
which the next upload may replace."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from common import objectstore
from common.fileio import amount
from common.objectstore import RemoteError
from data_pipeline.errors import DataError
from data_pipeline.packing import INDEX, MANIFEST, SHARD_HASH
from data_pipeline.streaming_compat import streaming

INCOMPLETE = ".incomplete"
"""Object marking a dataset prefix whose upload has not finished."""
DEFAULT_CACHE = "pretrain-data-cache"
"""The cache's directory under the temp directory (`tempfile.gettempdir()`) by default."""


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / DEFAULT_CACHE


@contextlib.contextmanager
def as_data_error() -> Iterator[None]:
    """A failure of the store as the data pipeline's one-line error."""
    try:
        yield
    except RemoteError as e:
        raise DataError(str(e)) from None


def upload_dataset(local_dir: str, url: str, replace: bool) -> None:
    """Upload the prepared dataset in `local_dir` to `url`, manifest last; `replace`: remove what
    `url` holds first (the old manifest before anything else, so the old dataset is never read
    half-replaced)."""
    with as_data_error():
        old = objectstore.listing(url)
        marker = objectstore.join(url, INCOMPLETE)
        objectstore.upload_bytes(b"", marker)
        if replace and old:
            objectstore.delete(url, [MANIFEST] if MANIFEST in old else [])
            objectstore.delete(url, [key for key in old if key not in (MANIFEST, INCOMPLETE)])
        files = sorted(p for p in Path(local_dir).rglob("*") if p.is_file() and p.name != MANIFEST)
        for path in files:
            objectstore.upload(path, objectstore.join(url, path.relative_to(local_dir).as_posix()))
        objectstore.upload(Path(local_dir, MANIFEST), objectstore.join(url, MANIFEST))
        objectstore.delete(url, [INCOMPLETE])


def remote_contents(url: str) -> dict[str, int]:
    """What the prefix `url` holds (key -> size), as a DataError if the store fails."""
    with as_data_error():
        return objectstore.listing(url)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def local_copy(url: str, cache_dir: str | None = None, cache_limit: int | None = None) -> str:
    """The directory of this node's copy of the dataset at `url`, made first if there is none
    (by the first process of the node to ask; the others wait for it)."""
    with as_data_error():
        manifest_bytes = objectstore.read_bytes(objectstore.join(url, MANIFEST))
    if manifest_bytes is None:
        raise DataError(f"{url} is not a prepared dataset (no {MANIFEST}); prepare it with "
                        f"python -m data_pipeline.prepare --source SOURCE --out {url}")
    root = cache_root(cache_dir)
    key = hashlib.sha256(url.encode() + b"\0" + manifest_bytes).hexdigest()[:16]
    copy = root / key
    if not (copy / MANIFEST).is_file():
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f".{key}.lock"):
            if not (copy / MANIFEST).is_file():
                _copy_dataset(url, manifest_bytes, copy, cache_limit)
    os.utime(copy / MANIFEST)  # the cache evicts the least recently used datasets first
    return str(copy)


def _copy_dataset(url: str, manifest_bytes: bytes, copy: Path, cache_limit: int | None) -> None:
    with as_data_error():
        objects = objectstore.listing(url)
    if INCOMPLETE in objects:
        raise DataError(f"{url}: its upload has not finished (or was interrupted); prepare it again with "
                        f"--out {url}")
    needed = sum(size for key, size in objects.items())
    make_room(copy.parent, needed, cache_limit, url)
    staging = copy.with_name(f".{copy.name}.incomplete-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        manifest = json.loads(manifest_bytes)
        with as_data_error():
            for split in manifest["splits"]:
                _copy_split(url, split, staging / split, objects)
            for key in objects:  # what else the dataset holds (e.g. ListOps's examples)
                if key != MANIFEST and key.partition("/")[0] not in manifest["splits"]:
                    (staging / key).parent.mkdir(parents=True, exist_ok=True)
                    objectstore.download(objectstore.join(url, key), staging / key)
        (staging / MANIFEST).write_bytes(manifest_bytes)  # last: the copy is whole
        (staging / "source.txt").write_text(url + "\n")
        os.rename(staging, copy)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _copy_split(url: str, split: str, directory: Path, objects: dict[str, int]) -> None:
    """Download a split's index and shards into `directory`, each shard checked against the size
    and checksum its index records."""
    directory.mkdir(parents=True)
    if f"{split}/{INDEX}" not in objects:
        raise DataError(f"{objectstore.join(url, split, INDEX)} is missing: the {split} split is incomplete; "
                        f"prepare the dataset again with --out {url}")
    objectstore.download(objectstore.join(url, split, INDEX), directory / INDEX)
    try:
        shards = json.loads((directory / INDEX).read_text())["shards"]
    except (ValueError, KeyError) as e:
        raise DataError(f"{objectstore.join(url, split, INDEX)}: not a readable index ({e})") from None
    for shard in shards:
        for info in (shard.get("raw_data"), shard.get("zip_data")):
            if info is None or f"{split}/{info['basename']}" not in objects:
                continue  # a compressed split stores only the compressed file
            name, where = info["basename"], objectstore.join(url, split, info["basename"])
            objectstore.download(where, directory / name)
            data = (directory / name).read_bytes()
            if len(data) != info["bytes"]:
                raise DataError(f"shard {where} is truncated or corrupted: {len(data)} bytes, index.json says "
                                f"{info['bytes']}; prepare the dataset again with --out {url}")
            checksum = streaming.base.hashing.get_hash(SHARD_HASH, data)
            if checksum != info["hashes"][SHARD_HASH]:
                raise DataError(f"shard {where} is corrupted: {SHARD_HASH} {checksum}, index.json says "
                                f"{info['hashes'][SHARD_HASH]}; prepare the dataset again with --out {url}")


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def make_room(root: Path, needed: int, cache_limit: int | None, url: str) -> None:
    """Evict the least recently used datasets of the cache until `needed` more bytes fit within
    `cache_limit` (None: no limit)."""
    if cache_limit is None:
        return
    if needed > cache_limit:
        raise DataError(f"data.cache_limit={cache_limit} is smaller than the dataset at {url} "
                        f"({amount(needed)}); raise it, or set it to null for no limit")
    copies = sorted((p for p in root.iterdir() if (p / MANIFEST).is_file()),
                    key=lambda p: (p / MANIFEST).stat().st_mtime)
    used = sum(_size(p) for p in copies)
    while copies and used + needed > cache_limit:
        oldest = copies.pop(0)
        used -= _size(oldest)
        # the manifest first: a half-removed copy is never taken for a whole one
        (oldest / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(oldest, ignore_errors=True)

