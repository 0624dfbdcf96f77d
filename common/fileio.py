"""Small file utilities every component shares: atomic writes, JSON reads and Markdown tables."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` a temporary file next to `path`, then rename it into place: readers see the
    old file or the new one, never half of one (and a failed write leaves no temporary file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def sha256_hex(path: str | Path) -> str:
    """The file's SHA-256 digest in hex, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system holding `path` (which exists)."""
    path = Path(path).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def amount(size: int) -> str:
    """A number of bytes for people: "1.5 GB (1,500,000,000 bytes)"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit} ({size:,} bytes)"
    return f"{size:,} bytes"


def write_failure_reason(error: OSError, directory: str | Path) -> str:
    """Why a write into `directory` failed, in words; for a full file system also which one and
    what is free on it (where to make room)."""
    reason = error.strerror or " ".join(str(error).split())
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return reason
    existing = next(p for p in [Path(directory), *Path(directory).parents] if p.exists())
    return (f"{reason}: out of space on {mount_point(existing)}, the file system of {directory}, "
            f"{amount(shutil.disk_usage(existing).free)} free")


def read_json(path: str | Path, error: type[Exception] = ValueError) -> Any:
    """The JSON document in `path`, or `error` with one line naming the file and what is wrong
    with it (damaged, cut short, unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not a readable JSON file ({e})") from None


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Fill the yielded staging directory (next to `path`), which then replaces `path` by
    renames: `path` is never a partial directory, and a failure leaves it untouched (the staging
    directory is removed; a killed process leaves it behind, under a name with its pid). An
    existing `path` is moved aside first, so between the two renames it is briefly absent."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.incomplete-{os.getpid()}")
    retired = staging.with_name(staging.name + ".old")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if path.exists():
            os.rename(path, retired)  # a rename cannot replace a non-empty directory
        try:
            os.rename(staging, path)
        except OSError:
            if retired.exists():  # never neither: the old one goes back
                os.rename(retired, path)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if retired.is_dir():
            shutil.rmtree(retired, ignore_errors=True)
        else:
            retired.unlink(missing_ok=True)


def markdown_table(rows: list[dict[str, Any]], formats: dict[str, str] | None = None) -> str:
    """Rows (dicts with the same keys) as a Markdown table; `formats` maps a column to its
    format spec (e.g. ".3f"); other cells are written with str()."""
    formats = formats or {}
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(format(row[c], formats.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"
