"""The tokenization step of `prepare`: a source's documents, grouped into units of work, are
tokenized in worker processes, each sent to the train or val split by a hash of its text; the
results come back in input order, per split, as `packing.write_splits` takes them."""
from __future__ import annotations

import hashlib
import multiprocessing
import signal
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from common.cli import STOP_SIGNALS, signals_held
from data_pipeline.errors import DataError
from data_pipeline.hub import Archive
from data_pipeline.packing import check_uint16
from data_pipeline.sources import SourceStats, archive_texts
from data_pipeline.tokenizer import tokenizer_from_spec

SPLITS = ("train", "val")
CHUNK_MAX_DOCS = 256
"""Documents per unit of work sent to a tokenizer process."""
CHUNK_MAX_CHARS = 1 << 20
"""Characters per unit of work (a chunk closes once it reaches this many)."""
CHUNKS_IN_FLIGHT_PER_PROC = 6
"""Chunks queued per tokenizer process: bounds memory, and is deep enough that the workers keep
busy while the reading/writing main process waits for a core on a busy machine (measured: 2 in
flight lost ~7% more throughput than 6 on an oversubscribed 2-core machine)."""

_worker: dict = {}


def _init_worker(tokenizer_spec: dict, val_fraction: float) -> None:
    """Start a tokenizer process. Ctrl-C and a scheduler's warning (SIGUSR1) reach the whole
    process group: the parent alone stops the run, once, and stops these processes itself. SIGTERM
    ends one at once, as it must: the pool stops its processes with it (once one has died, say),
    and a scheduler's stops the parent too."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # forked inside the parent's signals_held
    _load_tokenizer(tokenizer_spec, val_fraction)


def _load_tokenizer(tokenizer_spec: dict, val_fraction: float) -> None:
    _worker["tokenizer"] = tokenizer_from_spec(tokenizer_spec)
    _worker["val_fraction"] = val_fraction


def is_val_document(text: str, val_fraction: float) -> bool:
    """Deterministic split decision from the document's own text (uniform in [0, 1))."""
    return _is_val(text.encode("utf-8"), val_fraction)


def _is_val(utf8: bytes, val_fraction: float) -> bool:
    digest = hashlib.blake2b(utf8, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


@dataclass
class ChunkResult:
    """What a tokenizer process returns for one unit of work (documents in input order)."""

    tokens: list[np.ndarray]
    """Per split: uint16 token ids, each document's followed by the end-of-document id."""
    doc_ends: list[np.ndarray]
    """Per split: the end offset in `tokens` of each document (its EOT included)."""
    doc_bytes: list[np.ndarray]
    """Per split: the UTF-8 bytes of each document's text."""
    doc_splits: np.ndarray
    """The split index of each document, in input order."""
    stats: SourceStats
    """Counts from decoding archives in the worker (empty for plain documents)."""

    def first_docs(self, count: int) -> "ChunkResult":
        """This result cut after its first `count` documents (for --max-docs)."""
        kept = [int(np.sum(self.doc_splits[:count] == s)) for s in range(len(SPLITS))]
        tokens = [t[:e[k - 1]] if k else t[:0] for t, e, k in zip(self.tokens, self.doc_ends, kept)]
        return ChunkResult(tokens, [e[:k] for e, k in zip(self.doc_ends, kept)],
                           [b[:k] for b, k in zip(self.doc_bytes, kept)],
                           self.doc_splits[:count], self.stats)

    def parts(self) -> list[tuple[np.ndarray, int, int]]:
        """(tokens, documents, UTF-8 bytes) per split, as `write_splits` takes them."""
        return [(tokens, len(ends), int(sizes.sum()))
                for tokens, ends, sizes in zip(self.tokens, self.doc_ends, self.doc_bytes)]


def _tokenize_docs(docs: list[str], stats: SourceStats) -> ChunkResult:
    tokenizer, val_fraction = _worker["tokenizer"], _worker["val_fraction"]
    eot = np.array([tokenizer.eot_id])
    pieces: list[list[np.ndarray]] = [[] for _ in SPLITS]
    lengths: list[list[int]] = [[] for _ in SPLITS]
    sizes: list[list[int]] = [[] for _ in SPLITS]
    doc_splits = np.zeros(len(docs), dtype=np.uint8)
    for position, doc in enumerate(docs):
        utf8 = doc.encode("utf-8")
        split = int(_is_val(utf8, val_fraction)) if val_fraction > 0 else 0
        ids = tokenizer.encode(doc)
        pieces[split] += (ids, eot)
        lengths[split].append(len(ids) + 1)
        sizes[split].append(len(utf8))
        doc_splits[position] = split
    tokens = []
    for split_pieces in pieces:
        ids = np.concatenate(split_pieces) if split_pieces else np.empty(0, dtype=np.int64)
        if ids.size:
            check_uint16(int(ids.max()), type(tokenizer).__name__)
        tokens.append(ids.astype(np.uint16))
    return ChunkResult(tokens, [np.cumsum(n, dtype=np.int64) for n in lengths],
                       [np.array(b, dtype=np.int64) for b in sizes], doc_splits, stats)


def _tokenize_unit(unit: list[str] | Archive) -> ChunkResult:
    """Tokenize a chunk of documents, or the documents of an archive decoded here. Any failure
    is a one-line DataError, in a worker process as in the main one."""
    try:
        stats = SourceStats()
        if isinstance(unit, Archive):
            docs = list(archive_texts(unit, stats))
            stats.empty_docs = docs.count("")
            unit = [doc for doc in docs if doc]
        return _tokenize_docs(unit, stats)
    except DataError:
        raise
    except Exception as err:  # anything else would reach the user as a raw traceback
        where = unit.name if isinstance(unit, Archive) else f"a chunk of {len(unit)} documents"
        first_line = (str(err).strip().splitlines() or [""])[0]
        raise DataError(f"tokenizing {where} failed: {type(err).__name__}: {first_line}") from None


def _chunks(units: Iterable[str | Archive]) -> Iterator[list[str] | Archive]:
    """Plain documents grouped into chunks; each archive is a unit of work of its own."""
    chunk: list[str] = []
    chars = 0
    for unit in units:
        if isinstance(unit, Archive):
            if chunk:
                yield chunk
                chunk, chars = [], 0
            yield unit
            continue
        chunk.append(unit)
        chars += len(unit)
        if len(chunk) >= CHUNK_MAX_DOCS or chars >= CHUNK_MAX_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def tokenized_chunks(units: Iterable[str | Archive], tokenizer_spec: dict, val_fraction: float,
                     num_proc: int) -> Iterator[ChunkResult]:
    """Tokenize units of work in `num_proc` processes, yielding results in input order."""
    if num_proc == 1:  # tokenize here, where stop signals keep their handlers
        _load_tokenizer(tokenizer_spec, val_fraction)
        yield from map(_tokenize_unit, _chunks(units))
        return
    # fork: workers start instantly and inherit the imported modules. Unlike
    # multiprocessing.Pool, the executor fails (instead of waiting forever) if a worker dies.
    executor = ProcessPoolExecutor(num_proc, multiprocessing.get_context("fork"), _init_worker,
                                   (tokenizer_spec, val_fraction))
    pending: deque = deque()
    try:
        for chunk in _chunks(units):
            with signals_held():  # see signals_held: a Ctrl-C inside would break the shutdown below
                pending.append(executor.submit(_tokenize_unit, chunk))
            if len(pending) >= CHUNKS_IN_FLIGHT_PER_PROC * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise DataError("a tokenizer process died (killed, e.g. out of memory); "
                        "nothing was written") from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def results_up_to(results: Iterable[ChunkResult], max_docs: int | None) -> Iterator[ChunkResult]:
    """The results up to `max_docs` documents in all (archives hold unknown counts)."""
    remaining = max_docs
    for result in results:
        if remaining is not None and len(result.doc_splits) >= remaining:
            yield result.first_docs(remaining)
            return
        if remaining is not None:
            remaining -= len(result.doc_splits)
        yield result
