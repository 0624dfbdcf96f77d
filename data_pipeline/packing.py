"""Packing token streams into MDS windows, and the dataset manifest.

A split is written as an MDS dataset with one column, `tokens` (ndarray:uint16), one sample per
window of `seq_len + 1` tokens. Tokens are packed in arrival order into non-overlapping windows,
so every token lands in exactly one window except the last partial window, which is dropped and
counted. Each shard's xxh64 checksum goes into the split's `index.json` (checked by the loader).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

import numpy as np
from tqdm import tqdm

from common import objectstore
from common.fileio import read_json
from data_pipeline.errors import DataError
from data_pipeline.streaming_compat import streaming
from data_pipeline.tokenizer import UINT16_LIMIT

MANIFEST = "manifest.json"
INDEX = "index.json"
"""Streaming's index of a split's shards (sizes and checksums), one per split directory."""
SHARD_HASH = "xxh64"
"""Checksum recorded for every shard."""


def read_manifest(data_dir: str) -> dict:
    """The manifest of a prepared dataset, local or in an object store (s3://); DataError if
    `data_dir` holds none."""
    manifest = existing_manifest(data_dir)
    if manifest is None:
        raise DataError(f"{data_dir} is not a prepared dataset (no {MANIFEST}); prepare it with "
                        f"python -m data_pipeline.prepare --source SOURCE --out {data_dir}")
    return manifest


def existing_manifest(data_dir: str) -> dict | None:
    """The manifest of the dataset at `data_dir` (a directory or an s3:// URL), None if it holds
    none; a damaged manifest, or a store that fails, is a DataError."""
    if objectstore.is_remote(data_dir):
        url = objectstore.join(data_dir, MANIFEST)
        try:
            text = objectstore.read_bytes(url)
        except objectstore.RemoteError as e:
            raise DataError(str(e)) from None
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError as e:
            raise DataError(f"{url}: not a readable JSON file ({e})") from None
    path = os.path.join(data_dir, MANIFEST)
    return read_json(path, DataError) if os.path.isfile(path) else None


def write_manifest(data_dir: str, manifest: dict) -> None:
    with open(os.path.join(data_dir, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


def check_uint16(max_id: int, tokenizer_name: str) -> None:
    if max_id >= UINT16_LIMIT:
        raise DataError(f"token id {max_id} does not fit uint16 (ids must be < {UINT16_LIMIT}); "
                        f"the {tokenizer_name} vocabulary is too large for this format")


class WindowWriter:
    """Packs a split's token stream into `seq_len + 1` windows and writes them as MDS samples."""

    def __init__(self, out_dir: str, seq_len: int, compression: str | None,
                 shard_size: int | str) -> None:
        self.window = seq_len + 1
        self.digest = hashlib.sha256()
        self.writer = streaming.MDSWriter(out=out_dir, columns={"tokens": "ndarray:uint16"},
                                          compression=compression, hashes=[SHARD_HASH],
                                          size_limit=shard_size)
        self.carry = np.empty(0, dtype=np.uint16)
        self.docs = self.tokens = self.windows = self.utf8_bytes = 0

    def add(self, tokens: np.ndarray, docs: int, utf8_bytes: int) -> None:
        self.docs += docs
        self.tokens += len(tokens)
        self.utf8_bytes += utf8_bytes
        stream = np.concatenate([self.carry, tokens]) if len(self.carry) else tokens
        full = len(stream) // self.window
        windows = stream[:full * self.window].reshape(full, self.window)
        for window in windows:
            self.writer.write({"tokens": window})
        self.digest.update(windows.tobytes())
        self.windows += full
        self.carry = stream[full * self.window:].copy()

    def finish(self) -> dict:
        self.writer.finish()
        return {"docs": self.docs, "tokens": self.tokens, "windows": self.windows,
                "dropped_tokens": len(self.carry), "utf8_bytes": self.utf8_bytes,
                "sha256": self.digest.hexdigest()}


def write_splits(out_dir: str, chunks: Iterable[list[tuple[np.ndarray, int, int]]],
                 split_names: tuple[str, ...], seq_len: int, compression: str | None,
                 shard_size: int | str, progress: tqdm | None = None) -> dict[str, dict]:
    """Write each split's windows under `out_dir/<split>/`; returns the per-split counts.

    `chunks` yields, per unit of work, one (tokens, documents, UTF-8 bytes of the documents'
    text) triple per split, in `split_names` order; each split's tokens are packed in the order
    they arrive. A split's `utf8_bytes` is what bits per byte divide by.
    """
    writers = {name: WindowWriter(os.path.join(out_dir, name), seq_len, compression, shard_size)
               for name in split_names}
    tokens_done = 0
    for parts in chunks:
        for name, (tokens, docs, utf8_bytes) in zip(split_names, parts):
            writers[name].add(tokens, docs, utf8_bytes)
        if progress is not None:
            tokens_done += sum(len(tokens) for tokens, _, _ in parts)
            progress.update(sum(docs for _, docs, _ in parts))
            elapsed = max(progress.format_dict["elapsed"], 1e-9)
            progress.set_postfix_str(f"{tokens_done / elapsed:,.0f} tok/s", refresh=False)
    return {name: writer.finish() for name, writer in writers.items()}


def dataset_fingerprint(vocabulary: dict, counts: dict[str, dict]) -> str:
    """Content hash of a dataset: its vocabulary and the windows of every split."""
    digest = hashlib.sha256(json.dumps(vocabulary, sort_keys=True).encode("utf-8"))
    for name in sorted(counts):
        digest.update(f"{name}:{counts[name]['sha256']}".encode())
    return digest.hexdigest()
