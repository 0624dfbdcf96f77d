"""Hugging Face hub repositories read as files, whatever their layout.

A dataset repository is read at one commit through an fsspec file system (`HfFileSystem` for
the hub itself; any other fsspec file system holding the same file layout stands in for it,
e.g. a local copy). Two layouts are understood:

    data files   parquet (or JSON Lines) files anywhere in the repo: streamed through `datasets`
                 from the file system's URLs, in path order
    tarballs     `subsets/*.tar`, each a tar of `.xz` archives that are each a tar of `.txt`
                 documents: the layout of OpenWebText, whose loading script `datasets` >= 4
                 refuses to run. Read as a stream (no download first): the main process reads
                 each `.xz` member's compressed bytes off the outer tar, and the tokenizer
                 processes decompress and split them (`archive_documents`)

Tarball documents are what OpenWebText's loading script yields: one per `.txt` file, in the
order of the tarball names, then of the members inside each tarball, then of the files inside
each `.xz`; the text is decoded as UTF-8, runs of three or more newlines become two, and
surrounding whitespace is stripped.
"""
from __future__ import annotations

import io
import lzma
import os
import re
import tarfile
from dataclasses import dataclass
from typing import Any, Iterator

from data_pipeline.errors import DataError

TARBALL_DIR = "subsets"
"""Folder of the raw subset tarballs in the tarball layout."""
DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
"""Data file endings and the `datasets` builder that streams them (first match wins)."""
METADATA_FILES = ("dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json")
"""JSON files `datasets` writes about a dataset, never data (script repos often hold the first)."""
READ_BLOCK = 8 << 20
"""Bytes fetched per request when reading a tarball (HfFileSystem reads over HTTP ranges)."""
_BLANK_RUNS = re.compile("\n\n\n+")


@dataclass
class HubRepo:
    """A dataset repository at one commit, as files of an fsspec file system."""

    name: str
    """Repository name, e.g. Skylion007/openwebtext."""
    revision: str | None
    """Revision asked for (branch, tag or commit); None: the default branch."""
    commit: str
    """The commit the revision resolved to: what was read (recorded in the manifest)."""
    fs: Any
    """The fsspec file system serving the repository's files."""
    root: str
    """Path of the repository at `commit` inside `fs`."""

    def files(self) -> list[str]:
        """Paths of all files, relative to the repository root, sorted."""
        found = self.fs.find(self.root)
        return sorted(path.removeprefix(self.root.rstrip("/") + "/") for path in found)

    def url(self, relative: str) -> str:
        """The fsspec URL of one file (what `datasets` is given)."""
        return self.fs.unstrip_protocol(f"{self.root.rstrip('/')}/{relative}")

    def open(self, relative: str):
        return self.fs.open(f"{self.root.rstrip('/')}/{relative}", "rb", block_size=READ_BLOCK)


def open_hub_repo(name: str, revision: str | None) -> HubRepo:
    """`name` on the Hugging Face hub, with `revision` resolved to its commit now."""
    from huggingface_hub import HfApi, HfFileSystem

    try:
        commit = HfApi().dataset_info(name, revision=revision).sha
    except Exception as err:  # offline, unknown repo or revision: all mean "cannot read it"
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"cannot resolve hub dataset {name}"
                       f"{'@' + revision if revision else ''}: {first_line}") from err
    return HubRepo(name, revision, commit, HfFileSystem(), f"datasets/{name}@{commit}")


@dataclass
class Layout:
    """How a repository holds its documents."""

    kind: str
    """"data-files" or "tarballs"."""
    files: list[str]
    """The files read, relative to the repository root, in reading order."""
    builder: str | None = None
    """For data files: the `datasets` builder ("parquet" or "json")."""


def detect_layout(repo: HubRepo) -> Layout:
    """The repository's layout; DataError if it has neither data files nor subset tarballs."""
    files = [f for f in repo.files() if os.path.basename(f) not in METADATA_FILES]
    for ending, builder in DATA_FILE_BUILDERS.items():
        data_files = [f for f in files if f.endswith(ending)]
        if data_files:
            return Layout("data-files", data_files, builder)
    tarballs = [f for f in files if f.startswith(TARBALL_DIR + "/") and f.endswith(".tar")]
    if tarballs:
        return Layout("tarballs", tarballs)
    raise DataError(f"hub dataset {repo.name}@{repo.commit} holds neither data files "
                   f"({', '.join(DATA_FILE_BUILDERS)}) nor {TARBALL_DIR}/*.tar tarballs")


@dataclass
class Archive:
    """One `.xz` member of a subset tarball, still compressed: a unit of tokenizer work."""

    name: str
    """`tarball/member`, for error messages."""
    data: bytes
    """The member's bytes (an xz-compressed tar of .txt files)."""


def tarball_archives(repo: HubRepo, tarballs: list[str]) -> Iterator[Archive]:
    """The `.xz` members of each tarball in order, read as a stream (never seeking back)."""
    for tarball in tarballs:
        try:
            with repo.open(tarball) as f, tarfile.open(fileobj=f, mode="r|") as outer:
                for member in outer:
                    if member.isfile() and member.name.endswith(".xz"):
                        yield Archive(f"{tarball}/{member.name}", outer.extractfile(member).read())
        except tarfile.TarError as err:
            raise DataError(f"{repo.name}: {tarball} is not a readable tar file ({err})") from err


def archive_documents(archive: Archive) -> Iterator[bytes]:
    """The raw bytes of each `.txt` file of an archive, in member order."""
    try:
        inner = tarfile.open(fileobj=io.BytesIO(lzma.decompress(archive.data)), mode="r:")
        with inner:
            for member in inner:
                if member.isfile() and member.name.endswith(".txt"):
                    yield inner.extractfile(member).read()
    except (lzma.LZMAError, tarfile.TarError, EOFError) as err:
        raise DataError(f"{archive.name} is not an xz-compressed tar of .txt files ({err})"
                        ) from err


def normalize_document(text: str) -> str:
    """A tarball document as OpenWebText's loading script yields it."""
    return _BLANK_RUNS.sub("\n\n", text).strip()


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_tarball_layout(root: str, texts: list[bytes], docs_per_archive: int,
                         archives_per_tarball: int) -> None:
    """Write `texts` as OpenWebText's raw layout under `root` (a local stand-in for the hub
    repository, for tests and benchmarks): `subsets/urlsf_subsetNN.tar`, each holding
    `openwebtext/urlsf_subsetNN-K_data.xz` archives of `.txt` files, beside a loading script."""
    os.makedirs(os.path.join(root, TARBALL_DIR))
    with open(os.path.join(root, "openwebtext.py"), "w") as f:
        f.write("# the loading script that datasets >= 4 refuses to run\n")
    archives = [texts[i:i + docs_per_archive] for i in range(0, len(texts), docs_per_archive)]
    for first in range(0, len(archives), archives_per_tarball):
        subset = first // archives_per_tarball
        members = []
        for k, archive in enumerate(archives[first:first + archives_per_tarball], start=1):
            inner = _tar_bytes([(f"{subset:04d}{k:03d}{j:04d}-page.txt", text)
                                for j, text in enumerate(archive)])
            members.append((f"openwebtext/urlsf_subset{subset:02d}-{k}_data.xz",
                            lzma.compress(inner)))
        with open(os.path.join(root, TARBALL_DIR, f"urlsf_subset{subset:02d}.tar"), "wb") as f:
            f.write(_tar_bytes(members))
