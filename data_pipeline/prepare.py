"""Prepare a dataset: stream a text source, tokenize it in parallel, pack it into windows of
`seq_len + 1` tokens and write them as MDS shards, with a manifest.

    python -m data_pipeline.prepare --source SOURCE --out DIR [--seq-len N] [--val-fraction F]
        [--num-proc P] [--max-docs N] [--tokenizer gpt2|char] [--overwrite] [--compression zstd]
        [--skip-bad-lines] [--text-field NAME] [--text-unit file|paragraph] [--shard-size 64mb]

Layout of DIR: `manifest.json`, `train/` and `val/` (and for ListOps `test/` plus the examples
files), each split an MDS dataset with one column `tokens` (ndarray:uint16) per window.

Documents are concatenated, each followed by the end-of-document token, and cut into
non-overlapping windows, so every token of the corpus lands in exactly one window; only the last
partial window of each split is dropped (counted as `dropped_tokens`). A document goes to val when
a hash of its text falls below `val_fraction`, so the split depends on neither the worker count
nor the document order. Everything is built in a hidden staging directory next to DIR and moved
into place at the end: an interrupted run never leaves a DIR that looks complete.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from common import objectstore
from common.cli import STOP_SIGNALS, ArgumentParser, Stopped, run_command, signals_held, stop_signals_raising
from data_pipeline.errors import DataError
from data_pipeline.hub import Archive
from data_pipeline.listops import build_listops_dataset
from data_pipeline.packing import (MANIFEST, check_uint16, dataset_fingerprint, existing_manifest, read_manifest,
                                   write_manifest, write_splits)
from data_pipeline.remote import INCOMPLETE, remote_contents, upload_dataset
from data_pipeline.sources import Source, SourceStats, archive_texts, fingerprint_change, parse_source
from data_pipeline.streaming_compat import streaming
from data_pipeline.tokenizer import CharTokenizer, GPT2Tokenizer
from data_pipeline.tokenizing import SPLITS, results_up_to, tokenized_chunks

FORMAT_VERSION = 1
SETTINGS_KEYS = ("source", "revision", "tokenizer", "seq_len", "val_fraction", "max_docs",
                 "text_field", "text_unit", "skip_bad_lines")
"""Manifest fields that define the dataset's content; a rerun with other values is refused."""


def default_num_proc() -> int:
    return max(1, len(os.sched_getaffinity(0)))


# --- the prepare entry points ------------------------------------------------------------------

def _check_arguments(seq_len: int, val_fraction: float, num_proc: int, max_docs: int | None,
                     tokenizer: str, compression: str | None, shard_size: int | str) -> None:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"--seq-len must be an integer >= 1, got {seq_len!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction!r}")
    if num_proc < 1:
        raise DataError(f"--num-proc must be >= 1, got {num_proc!r}")
    if max_docs is not None and max_docs < 1:
        raise DataError(f"--max-docs must be >= 1, got {max_docs!r}")
    if tokenizer not in ("gpt2", "char"):
        raise DataError(f"unknown tokenizer {tokenizer!r} (expected gpt2 or char)")
    if compression and not streaming.base.compression.is_compression(compression):
        raise DataError(f"unknown --compression {compression!r} (e.g. zstd, zstd:7, gz)")
    try:
        valid_size = 0 < streaming.base.util.bytes_to_int(shard_size) < 1 << 32
    except ValueError:
        valid_size = False
    if not valid_size:
        raise DataError(f"--shard-size must be between 1 byte and 4gb, got {shard_size!r}")


def settings_mismatch(manifest: dict, settings: dict) -> str | None:
    """Description of the first setting that differs between a manifest and `settings`."""
    for key in SETTINGS_KEYS:
        if key in settings and manifest.get(key) != settings[key]:
            return f"{key}={manifest.get(key)!r} there, {settings[key]!r} asked"
    return None


def _limit(units: Iterable[str | Archive], max_docs: int | None) -> Iterator[str | Archive]:
    """Stop after `max_docs` plain documents (archives are cut by `results_up_to`)."""
    count = 0
    for unit in units:
        if isinstance(unit, str):
            if max_docs is not None and count >= max_docs:
                return
            count += 1
        yield unit


def _char_vocabulary(source: Source, max_docs: int | None) -> list[str]:
    """The sorted characters of every document a tokenizer process will see: the first
    `max_docs`, and the rest of the archive the last of them is in (archives are tokenized
    whole, then cut)."""
    chars: set[str] = set()
    count = 0
    for unit in _limit(source.work_units(), max_docs):
        if max_docs is not None and count >= max_docs:
            break
        docs = [unit] if isinstance(unit, str) else [
            doc for doc in archive_texts(unit, SourceStats()) if doc]
        for doc in docs:
            chars.update(doc)
        count += len(docs)
    check_uint16(len(chars), "char")  # the end-of-document id comes after the characters
    return sorted(chars)


def _build_text_dataset(source: Source, staging: str, settings: dict, num_proc: int,
                        compression: str | None, shard_size, progress_bar: bool) -> dict:
    max_docs, val_fraction = settings["max_docs"], settings["val_fraction"]
    if settings["tokenizer"] == "char":
        spec = {"tokenizer": "char", "chars": _char_vocabulary(source, max_docs)}
        tokenizer = CharTokenizer(spec["chars"])
    else:
        spec, tokenizer = {"tokenizer": "gpt2"}, GPT2Tokenizer()
    worker_stats = SourceStats()

    def parts() -> Iterator[list[tuple[np.ndarray, int, int]]]:
        # closed explicitly, also when writing fails or a stop signal interrupts it: closing
        # stops the tokenizer processes
        with contextlib.closing(tokenized_chunks(_limit(source.work_units(), max_docs), spec,
                                                 val_fraction, num_proc)) as results:
            for result in results_up_to(results, max_docs):
                worker_stats.add(result.stats)
                yield result.parts()

    with tqdm(desc=f"prepare {source.spec}", unit="doc", total=max_docs, file=sys.stderr,
              disable=None if progress_bar else True, mininterval=1.0) as bar, \
            contextlib.closing(parts()) as chunks:
        counts = write_splits(staging, chunks, SPLITS, settings["seq_len"], compression,
                              shard_size, bar)
    total_docs = sum(c["docs"] for c in counts.values())
    if total_docs == 0:
        raise DataError(f"{source.spec} holds no documents")
    for name in SPLITS:
        if counts[name]["windows"] == 0 and (name == "train" or val_fraction > 0):
            raise DataError(f"the {name} split got no complete window of {settings['seq_len'] + 1} "
                            f"tokens ({counts[name]['docs']} of {total_docs} documents, "
                            f"{counts[name]['tokens']} tokens); "
                            f"{_empty_split_hint(name, counts, source, settings)}")
    stats = source.stats
    stats.add(worker_stats)
    return {**settings, **spec, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "splits": counts, **vars(stats), "source_layout": source.layout,
            "fingerprint": dataset_fingerprint(spec, counts)}


def _empty_split_hint(name: str, counts: dict, source: Source, settings: dict) -> str:
    """What to do about a split that got no complete window."""
    corpus_tokens = sum(c["tokens"] for c in counts.values())
    if corpus_tokens <= settings["seq_len"]:
        return (f"the whole corpus has {corpus_tokens} tokens: use a larger corpus or a smaller "
                "--seq-len")
    # The corpus would fill a window: its documents went to the other split, each whole.
    docs, val_fraction = sum(c["docs"] for c in counts.values()), settings["val_fraction"]
    smaller = (" (e.g. --text-unit paragraph)"
               if source.kind == "text" and settings["text_unit"] == "file" else "")
    larger = f", a larger --val-fraction than {val_fraction}" if name == "val" and docs > 1 else ""
    return (f"each document goes to one split whole (by a hash of its text), and {docs} "
            f"document(s) are too few to split with --val-fraction {val_fraction}: use more, "
            f"smaller documents{smaller}{larger} or --val-fraction 0 for no val split")


def _warn_about_replacements(stats: dict) -> None:
    """One warning line when bytes that are not UTF-8 became U+FFFD, naming the worst files."""
    worst = Counter(stats.get("invalid_utf8_by_file", {})).most_common()
    if not worst:
        return
    named = ", ".join(f"{path} ({count:,})" for path, count in worst[:3])
    more = f" and {len(worst) - 3} more (all in {MANIFEST})" if len(worst) > 3 else ""
    print(f"warning: {stats['invalid_utf8_replacements']:,} byte sequence(s) that are not UTF-8 "
          f"became U+FFFD, in {len(worst)} file(s): {named}{more}; if the input is in another "
          "encoding (e.g. Latin-1), convert it to UTF-8 (iconv -f latin1 -t utf-8) and prepare "
          "again with --overwrite", file=sys.stderr)


def prepare(source: str, out: str, *, seq_len: int = 1024, val_fraction: float = 0.0005,
            num_proc: int | None = None, max_docs: int | None = None, tokenizer: str = "gpt2",
            overwrite: bool = False, compression: str | None = None,
            skip_bad_lines: bool = False, text_field: str = "text", text_unit: str = "file",
            shard_size: int | str = "64mb", progress_bar: bool = True,
            revision: str | None = None, hub_repo=None) -> dict:
    """Prepare `source` into `out` (see the module docstring) and return the manifest.

    If `out` already holds a dataset made with the same settings from an unchanged source it is
    kept and its manifest returned; other settings or a changed source are refused unless
    `overwrite`. `revision` pins a hub source; `hub_repo` (a `hub.HubRepo`) stands in for the
    hub repository of a hub source, e.g. a local copy with the same file layout.
    """
    num_proc = default_num_proc() if num_proc is None else num_proc
    _check_arguments(seq_len, val_fraction, num_proc, max_docs, tokenizer, compression,
                     shard_size)
    src = parse_source(source, text_field=text_field, text_unit=text_unit,
                       skip_bad_lines=skip_bad_lines, revision=revision, hub_repo=hub_repo)
    if src.kind == "listops":
        tokenizer = "listops"
    settings = {"format_version": FORMAT_VERSION, "source": source, "revision": revision,
                "tokenizer": tokenizer, "seq_len": seq_len, "val_fraction": val_fraction,
                "max_docs": max_docs, "text_field": text_field, "text_unit": text_unit,
                "skip_bad_lines": skip_bad_lines, "compression": compression}
    if objectstore.is_remote(out):
        existing = _check_remote_out(out, settings, overwrite, src)
        if existing is not None:
            return existing
        # prepared locally as always (in the temp directory: TMPDIR chooses where), then uploaded
        with tempfile.TemporaryDirectory(prefix="prepare-") as staging:
            manifest = _build(src, staging, settings, num_proc, compression, shard_size, progress_bar)
            upload_dataset(staging, out, replace=True)
        _warn_about_replacements(manifest)
        return manifest
    problem = objectstore.unsupported_url(out, "--out")
    if problem:
        raise DataError(problem)
    out = os.path.abspath(out)
    existing = _check_out_dir(out, settings, overwrite, src)
    if existing is not None:
        return existing

    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned_staging(parent, name)
    staging = os.path.join(parent, f".{name}.incomplete-{socket.gethostname()}-{os.getpid()}")
    os.makedirs(staging)
    try:
        manifest = _build(src, staging, settings, num_proc, compression, shard_size, progress_bar)
        with signals_held():  # stopped between its two renames, `out` would be gone
            _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _warn_about_replacements(manifest)
    return manifest


def _build(src: Source, staging: str, settings: dict, num_proc: int, compression: str | None,
           shard_size: int | str, progress_bar: bool) -> dict:
    """Prepare the dataset into the directory `staging`, manifest last; returns the manifest."""
    start = time.perf_counter()
    source_fingerprint = src.fingerprint()  # before reading: what the data was built from
    if src.kind == "listops":
        manifest = build_listops_dataset(staging, settings, shard_size)
    else:
        manifest = _build_text_dataset(src, staging, settings, num_proc, compression,
                                       shard_size, progress_bar)
    manifest["source_fingerprint"] = source_fingerprint
    manifest["prepare_seconds"] = round(time.perf_counter() - start, 3)
    write_manifest(staging, manifest)
    return manifest


def source_change(manifest: dict, source: Source) -> str | None:
    """What changed in `source` since the dataset of `manifest` was built from it, or None.

    A hub that cannot be reached to resolve an unpinned revision, or a dataset prepared before
    fingerprints were recorded, cannot be checked: a warning says so and the dataset is kept.
    """
    if "source_fingerprint" not in manifest:
        print(f"warning: the dataset of {source.spec} records no source fingerprint (prepared by "
              "an older version); cannot tell whether the source changed", file=sys.stderr)
        return None
    recorded = manifest["source_fingerprint"]
    if recorded is None:
        return None
    try:
        current = source.fingerprint()
    except DataError as err:
        if not source.is_hub:
            raise
        print(f"warning: keeping the dataset of {source.spec} at commit {recorded['commit']} "
              f"unchecked: {err}", file=sys.stderr)
        return None
    return fingerprint_change(recorded, current)


def _check_out_dir(out: str, settings: dict, overwrite: bool, source: Source) -> dict | None:
    """The existing manifest if `out` already holds this dataset; raise if it holds another."""
    if not os.path.exists(out):
        return None
    if not os.path.isdir(out):
        raise DataError(f"--out {out} exists and is not a directory")
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        if os.listdir(out):
            raise DataError(f"--out {out} is a non-empty directory that holds no dataset "
                            f"({MANIFEST} missing); refusing to write into it")
        return None
    if overwrite:  # whatever dataset it holds, one with a damaged manifest too
        return None
    try:
        manifest = read_manifest(out)
    except DataError as e:
        raise DataError(f"{e}; pass --overwrite to rebuild the dataset") from None
    return _same_dataset_or_refuse(out, manifest, settings, source)


def _same_dataset_or_refuse(out: str, manifest: dict, settings: dict, source: Source) -> dict:
    """`manifest` if it is of the dataset `settings` and `source` make; else the refusal."""
    mismatch = settings_mismatch(manifest, settings)
    if mismatch:
        raise DataError(f"--out {out} already holds a different dataset ({mismatch}); "
                        "pass --overwrite to replace it")
    change = source_change(manifest, source)
    if change:
        raise DataError(f"--out {out} was prepared from another state of the source ({change}); "
                        "pass --overwrite to rebuild it")
    return manifest


def _check_remote_out(url: str, settings: dict, overwrite: bool, source: Source) -> dict | None:
    """`_check_out_dir` for an s3:// --out: the existing manifest if the prefix holds this
    dataset; raise if it holds another, or objects that are no dataset of ours."""
    objects = remote_contents(url)
    if MANIFEST not in objects:
        if objects and INCOMPLETE not in objects and not overwrite:
            raise DataError(f"--out {url} holds {len(objects)} object(s) but no dataset ({MANIFEST} missing); "
                            "refusing to write into it (--overwrite replaces them)")
        return None  # empty, or an upload of ours that was interrupted
    if overwrite:
        return None
    return _same_dataset_or_refuse(url, read_manifest(url), settings, source)


def _remove_abandoned_staging(parent: str, name: str) -> None:
    """Delete staging directories of killed runs on this host (they can hold a whole corpus)."""
    prefix = f".{name}.incomplete-{socket.gethostname()}-"
    for entry in os.listdir(parent):
        pid = entry[len(prefix):].removesuffix(".old")
        if not entry.startswith(prefix) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _move_into_place(staging: str, out: str) -> None:
    if not os.path.exists(out):
        os.rename(staging, out)
        return
    # Replace an existing dataset (or empty dir): move it aside first so `out` is never partial.
    retired = f"{staging}.old"
    os.rename(out, retired)
    os.rename(staging, out)
    shutil.rmtree(retired, ignore_errors=True)


def ensure_prepared(path: str, source: str, *, seq_len: int, tokenizer: str = "gpt2",
                    val_fraction: float = 0.0005, max_docs: int | None = None,
                    num_proc: int | None = None, revision: str | None = None,
                    overwrite: bool = False) -> dict:
    """Prepare the dataset at `path` once, and return its manifest.

    Safe to call from every rank of a job at once: the first process to take the lock file
    `path + ".lock"` prepares, the others wait for it and then read the manifest. A dataset that
    exists with other settings, or was built from another state of the source, is an error
    (rebuilt instead with `overwrite`), never silently reused or replaced.
    """
    if objectstore.is_remote(path):  # ranks of several nodes cannot share a lock on it
        raise DataError(f"data.source={source} with data.path={path}: a dataset in an object store is prepared "
                        f"once, beforehand (python -m data_pipeline.prepare --source {source} --out {path}); "
                        "then drop data.source")
    path = os.path.abspath(path)
    settings = {"source": source, "revision": revision,
                "tokenizer": "listops" if source == "listops" else tokenizer,
                "seq_len": seq_len, "val_fraction": val_fraction, "max_docs": max_docs}
    src = parse_source(source, revision=revision)

    def current() -> dict | None:
        """The manifest if `path` holds this dataset; None if it holds none (or, with
        `overwrite`, a stale one)."""
        try:
            manifest = existing_manifest(path)
        except DataError:  # a damaged manifest
            if overwrite:
                return None
            raise
        if manifest is None:
            return None
        mismatch = settings_mismatch(manifest, settings)
        problem = f"with other settings ({mismatch})" if mismatch else None
        if problem is None:
            change = source_change(manifest, src)
            problem = f"from another state of the source ({change})" if change else None
        if problem is None:
            return manifest
        if overwrite:
            return None
        raise DataError(f"dataset {path} was prepared {problem}; set data.overwrite to rebuild "
                        "it, or delete it or choose another path")

    manifest = current()
    if manifest is not None:
        return manifest
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = current()
        if manifest is None:
            manifest = prepare(source, path, seq_len=seq_len, val_fraction=val_fraction,
                               tokenizer=tokenizer, max_docs=max_docs, num_proc=num_proc,
                               revision=revision, overwrite=overwrite)
    return manifest


# --- command line --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m data_pipeline.prepare", description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--source", required=True,
                        help="openwebtext | shakespeare | listops | hf:NAME[:CONFIG] | "
                             "text:PATH | jsonl:PATH | parquet:PATH (file, directory or glob)")
    parser.add_argument("--out", required=True, help="output dataset directory, or s3://bucket/prefix")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="tokens per training sequence; windows hold seq_len + 1 tokens")
    parser.add_argument("--val-fraction", type=float, default=0.0005,
                        help="fraction of documents (by hash) in the val split")
    parser.add_argument("--num-proc", type=int, default=default_num_proc(),
                        help="tokenizer processes")
    parser.add_argument("--max-docs", type=int, default=None,
                        help="stop after this many documents")
    parser.add_argument("--tokenizer", choices=("gpt2", "char"), default="gpt2")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a different dataset already in --out, or rebuild one "
                             "whose source changed")
    parser.add_argument("--compression", default=None,
                        help="MDS shard compression, e.g. zstd")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) jsonl lines that are not JSON or lack the field")
    parser.add_argument("--text-field", default="text",
                        help="record field holding the text (jsonl, parquet, hf)")
    parser.add_argument("--text-unit", choices=("file", "paragraph"), default="file",
                        help="text: sources: one document per file or per paragraph")
    parser.add_argument("--shard-size", default="64mb", help="MDS shard size limit")
    parser.add_argument("--revision", default=None,
                        help="hub sources: branch, tag or commit to read (recorded in the "
                             "manifest with the commit it resolved to)")
    args = parser.parse_args(argv)
    # A scheduler's SIGTERM (or SIGUSR1) ends the run as Ctrl-C does: the tokenizer processes
    # stopped, the staging directory removed, one line. Ctrl-C stays run_command's.
    try:
        with stop_signals_raising(tuple(signum for signum in STOP_SIGNALS if signum != signal.SIGINT)):
            manifest = prepare(args.source, args.out, seq_len=args.seq_len,
                               val_fraction=args.val_fraction, num_proc=args.num_proc,
                               max_docs=args.max_docs, tokenizer=args.tokenizer,
                               overwrite=args.overwrite, compression=args.compression,
                               skip_bad_lines=args.skip_bad_lines, text_field=args.text_field,
                               text_unit=args.text_unit, shard_size=args.shard_size,
                               revision=args.revision)
    except (DataError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(f"error: stopped by {signal.Signals(stop.signum).name}: nothing was written; rerun "
              "the same command to prepare the dataset", file=sys.stderr)
        return 128 + stop.signum
    splits = ", ".join(f"{name}: {c['docs']:,} docs, {c['tokens']:,} tokens, {c['windows']:,} "
                       f"windows" for name, c in manifest["splits"].items())
    print(f"{args.out}: {manifest['tokenizer']} vocab {manifest['vocab_size']}, "
          f"seq_len {manifest['seq_len']}; {splits}")
    return 0


if __name__ == "__main__":
    run_command(main)
