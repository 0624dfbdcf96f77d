"""OpenWebText from a hub repository in either layout, served through an fsspec file system.

The hub is unreachable here, so each test builds a repository with the hub's file layout on
disk and serves it through fsspec's local file system, the interface `HfFileSystem` implements
for the real hub: the raw layout (a loading script beside `subsets/*.tar`, each a tar of `.xz`
archives of `.txt` documents) and a data-files layout (parquet). Both must give the documents a
direct read of the files gives, in the same order.
"""
import json
import os
import re
import tarfile

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline.hub import HubRepo, write_tarball_layout
from data_pipeline.prepare import main, prepare
from data_pipeline.sources import DataError, parse_source

SETTINGS = dict(seq_len=32, val_fraction=0.1, shard_size="8kb")
COMMIT = "1" * 40


def raw_texts(docs: list[str]) -> list[bytes]:
    """The documents as .txt files hold them: with blank-line runs and surrounding whitespace
    that the loading script normalized away."""
    return [f"\n {doc}\n\n\n\n(end of page {i})\n\n".encode() for i, doc in enumerate(docs)]


def write_tarball_repo(root, texts: list[bytes], per_archive: int = 40) -> None:
    write_tarball_layout(str(root), texts, docs_per_archive=per_archive, archives_per_tarball=3)
    (root / "README.md").write_text("---\nlicense: cc0-1.0\n---\n")
    # Script repositories often carry the metadata file `datasets` wrote: JSON, but not data.
    (root / "dataset_infos.json").write_text('{"plain_text": {"description": "OpenWebText"}}')


def read_tarballs_directly(root) -> list[str]:
    """Reference: every .txt of every .xz, opened with random access, normalized as the
    loading script does."""
    docs = []
    for name in sorted(os.listdir(root / "subsets")):
        with tarfile.open(root / "subsets" / name) as outer:
            for member in outer.getmembers():
                with tarfile.open(fileobj=outer.extractfile(member), mode="r:xz") as inner:
                    for txt in inner.getmembers():
                        text = inner.extractfile(txt).read().decode("utf-8")
                        docs.append(re.sub(r"\n{3,}", "\n\n", text).strip())
    return docs


def local_repo(root, commit: str = COMMIT) -> HubRepo:
    return HubRepo("Skylion007/openwebtext", "main", commit, fsspec.filesystem("file"), str(root))


@pytest.fixture(scope="module")
def tarball_repo(tmp_path_factory, corpus_docs):
    root = tmp_path_factory.mktemp("hub") / "openwebtext"
    write_tarball_repo(root, raw_texts(corpus_docs))
    return root


def test_tarball_layout_gives_the_documents_of_a_direct_read(tarball_repo, corpus_docs, tmp_path):
    expected = read_tarballs_directly(tarball_repo)
    assert len(expected) == len(corpus_docs) and len(os.listdir(tarball_repo / "subsets")) > 1
    source = parse_source("openwebtext", revision="main", hub_repo=local_repo(tarball_repo))
    assert list(source.documents()) == expected
    assert source.layout == "tarballs"
    # Prepared (archives decoded in two tokenizer processes), the dataset is the one the same
    # documents give as JSON Lines.
    jsonl = tmp_path / "expected.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in expected))
    reference = prepare(f"jsonl:{jsonl}", str(tmp_path / "ref"), num_proc=2, **SETTINGS)
    manifest = prepare("openwebtext", str(tmp_path / "owt"), num_proc=2, revision="main",
                       hub_repo=local_repo(tarball_repo), **SETTINGS)
    assert manifest["fingerprint"] == reference["fingerprint"]
    assert manifest["splits"] == reference["splits"]
    assert manifest["source_layout"] == "tarballs" and manifest["revision"] == "main"
    assert manifest["source_fingerprint"] == {"hub": "Skylion007/openwebtext",
                                              "revision": "main", "commit": COMMIT}
    # --max-docs cuts inside an archive at exactly that many documents.
    cut = prepare("openwebtext", str(tmp_path / "cut"), num_proc=2, max_docs=95,
                  hub_repo=local_repo(tarball_repo), **SETTINGS)
    cut_reference = prepare(f"jsonl:{jsonl}", str(tmp_path / "cut_ref"), max_docs=95, **SETTINGS)
    assert cut["fingerprint"] == cut_reference["fingerprint"]
    assert sum(split["docs"] for split in cut["splits"].values()) == 95


def test_data_files_layout_gives_the_same_documents(tarball_repo, tmp_path):
    expected = read_tarballs_directly(tarball_repo)
    root = tmp_path / "converted"
    (root / "plain_text").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: cc0-1.0\n---\n")
    third = len(expected) // 3
    for k, part in enumerate([expected[:third], expected[third:2 * third], expected[2 * third:]]):
        pq.write_table(pa.table({"text": part}), root / "plain_text" / f"train-{k:05d}-of-00003.parquet")
    source = parse_source("openwebtext", hub_repo=local_repo(root))
    assert list(source.documents()) == expected
    assert source.layout == "data-files"
    from_files = prepare("openwebtext", str(tmp_path / "pq"), num_proc=2,
                         hub_repo=local_repo(root), **SETTINGS)
    from_tarballs = prepare("openwebtext", str(tmp_path / "tar"), num_proc=2,
                            hub_repo=local_repo(tarball_repo), **SETTINGS)
    assert from_files["fingerprint"] == from_tarballs["fingerprint"]
    assert from_files["source_layout"] == "data-files"


def test_new_hub_commit_is_refused_unless_overwrite(tarball_repo, tmp_path):
    out = str(tmp_path / "owt")
    first = prepare("openwebtext", out, hub_repo=local_repo(tarball_repo), max_docs=200, **SETTINGS)
    assert prepare("openwebtext", out, hub_repo=local_repo(tarball_repo), max_docs=200,
                   **SETTINGS) == first
    moved = "2" * 40
    with pytest.raises(DataError, match=f"another state of the source .hub commit {COMMIT} then, "
                                        f"{moved} now"):
        prepare("openwebtext", out, hub_repo=local_repo(tarball_repo, moved), max_docs=200,
                **SETTINGS)
    rebuilt = prepare("openwebtext", out, hub_repo=local_repo(tarball_repo, moved), max_docs=200,
                      overwrite=True, **SETTINGS)
    assert rebuilt["source_fingerprint"]["commit"] == moved
    # A pinned revision is a setting: asking for another one is a different dataset.
    with pytest.raises(DataError, match="revision=None there, 'v2' asked"):
        prepare("openwebtext", out, revision="v2", hub_repo=local_repo(tarball_repo, moved),
                max_docs=200, **SETTINGS)


def test_corrupt_archive_fails_with_one_line_from_any_process(tmp_path, corpus_docs, capsys):
    root = tmp_path / "repo"
    write_tarball_repo(root, raw_texts(corpus_docs[:100]), per_archive=20)
    # Corrupt the middle of the second archive's compressed stream (the outer tar stays valid).
    tarball = root / "subsets" / "urlsf_subset00.tar"
    data = bytearray(tarball.read_bytes())
    second = data.index(b"\xfd7zXZ", data.index(b"\xfd7zXZ") + 1)
    data[second + 200:second + 260] = bytes(60)
    tarball.write_bytes(bytes(data))
    errors = []
    for num_proc in (1, 2):
        with pytest.raises(DataError) as failure:
            prepare("openwebtext", str(tmp_path / "out"), num_proc=num_proc,
                    hub_repo=local_repo(root), **SETTINGS)
        errors.append(str(failure.value))
    assert errors[0] == errors[1]
    assert re.fullmatch(r"subsets/urlsf_subset00\.tar/openwebtext/urlsf_subset00-2_data\.xz is "
                        r"not an xz-compressed tar of \.txt files \(.*\)", errors[0])
    assert sorted(os.listdir(tmp_path)) == ["repo"]


def test_revision_is_for_hub_sources_only(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a document"}\n')
    code = main(["--source", f"jsonl:{corpus}", "--out", str(tmp_path / "o"), "--revision", "v1"])
    assert code == 1
    assert capsys.readouterr().err.strip() == (f"error: --revision applies to hub sources "
                                               f"(openwebtext, hf:NAME), not jsonl:{corpus}")


def test_char_vocabulary_covers_the_archive_cut_by_max_docs(tarball_repo, tmp_path):
    """Workers tokenize whole archives before the --max-docs cut: the vocabulary must hold the
    characters of the rest of the last archive too."""
    manifest = prepare("openwebtext", str(tmp_path / "char"), num_proc=2, max_docs=45,
                       tokenizer="char", hub_repo=local_repo(tarball_repo), **SETTINGS)
    docs = read_tarballs_directly(tarball_repo)
    assert sum(split["docs"] for split in manifest["splits"].values()) == 45
    assert set("".join(docs[:45])) <= set(manifest["chars"]) <= set("".join(docs[:80]))
