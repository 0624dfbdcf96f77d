"""prepare: tokenization against tiktoken, packing, the hash split, sources, atomic output."""
import hashlib
import json
import multiprocessing
import os
import shutil
import socket

import numpy as np
import pytest
import tiktoken

from conftest import TINY_SETTINGS, run_at_once
from data_pipeline.prepare import ensure_prepared, prepare
from data_pipeline.sources import DataError, parse_source
from data_pipeline.streaming_compat import streaming
from data_pipeline.tokenizer import GPT2_EOT_ID, _gpt2_files_dir, decode, gpt2_encoding
from data_pipeline.tokenizing import is_val_document

GPT2_FILE_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}


def split_stream(data_dir: str, split: str) -> np.ndarray:
    """All windows of a split, in file order, concatenated."""
    windows = streaming.base.local.LocalDataset(data_dir, split)
    if len(windows) == 0:
        return np.empty(0, dtype=np.uint16)
    return np.concatenate([windows[i]["tokens"] for i in range(len(windows))])


def reference_streams(docs: list[str], val_fraction: float) -> dict[str, list[int]]:
    """What each split must hold: every document's tokens then EOT, in corpus order."""
    streams = {"train": [], "val": []}
    for doc in docs:
        split = "val" if is_val_document(doc, val_fraction) else "train"
        streams[split] += gpt2_encoding().encode_ordinary(doc) + [GPT2_EOT_ID]
    return streams


def manifest_of(data_dir: str) -> dict:
    with open(os.path.join(data_dir, "manifest.json")) as f:
        return json.load(f)


def test_offline_gpt2_encoding_equals_tiktokens_own(tmp_path, monkeypatch, corpus_docs):
    # tiktoken's registered "gpt2" loader reads its cache by the sha1 of each file's address;
    # seeding that cache gives tiktoken's own construction as an independent reference.
    for name, url in GPT2_FILE_URLS.items():
        shutil.copy(os.path.join(_gpt2_files_dir(), name),
                    tmp_path / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    reference = tiktoken.get_encoding("gpt2")
    ours = gpt2_encoding()
    assert ours.encode_ordinary("Hello world") == [15496, 995]
    assert (ours.n_vocab, ours.eot_token) == (50257, GPT2_EOT_ID)
    sample = corpus_docs[::20] + corpus_docs[-5:]
    assert [ours.encode_ordinary(d) for d in sample] == [reference.encode_ordinary(d)
                                                         for d in sample]
    # encode_ordinary semantics: special-token text inside a document is plain text.
    assert GPT2_EOT_ID not in ours.encode_ordinary(corpus_docs[-5])
    assert ours.decode(ours.encode_ordinary(corpus_docs[-3])) == corpus_docs[-3]


def test_every_token_lands_in_exactly_one_window(tiny_dataset, corpus_docs):
    manifest = manifest_of(tiny_dataset)
    window = TINY_SETTINGS["seq_len"] + 1
    expected = reference_streams(corpus_docs, TINY_SETTINGS["val_fraction"])
    index = json.load(open(os.path.join(tiny_dataset, "train", "index.json")))
    assert len(index["shards"]) > 5  # packing crossed many shard (and work-chunk) boundaries
    for split, reference in expected.items():
        counts = manifest["splits"][split]
        stored = split_stream(tiny_dataset, split)
        kept = len(reference) // window * window
        # Same tokens in the same order; only the final partial window is dropped.
        assert stored.tolist() == reference[:kept]
        assert counts["windows"] * window == kept
        assert counts["tokens"] == len(reference)
        assert counts["dropped_tokens"] == len(reference) - kept < window
        n_docs = sum(is_val_document(d, 0.1) == (split == "val") for d in corpus_docs)
        assert counts["docs"] == n_docs
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == len(
        corpus_docs)


def test_eot_follows_every_document_and_only_there(tiny_dataset, corpus_docs):
    stream = split_stream(tiny_dataset, "train").tolist()
    train_docs = [d for d in corpus_docs if not is_val_document(d, 0.1)]
    ends = np.flatnonzero(np.array(stream) == GPT2_EOT_ID)
    lengths = np.diff(np.concatenate([[-1], ends])) - 1
    expected = [len(gpt2_encoding().encode_ordinary(d)) for d in train_docs][:len(ends)]
    assert lengths.tolist() == expected


def test_split_does_not_depend_on_workers_or_order(tiny_dataset, corpus_docs, tmp_path):
    reference = manifest_of(tiny_dataset)  # prepared with num_proc=2
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_docs))
    serial = prepare(f"jsonl:{corpus}", str(tmp_path / "serial"), num_proc=1, **TINY_SETTINGS)
    assert serial["fingerprint"] == reference["fingerprint"]
    assert serial["splits"] == reference["splits"]
    # The split is a property of each document: reversing the corpus moves no document.
    reversed_corpus = tmp_path / "reversed.jsonl"
    reversed_corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_docs[::-1]))
    flipped = prepare(f"jsonl:{reversed_corpus}", str(tmp_path / "rev"), num_proc=2,
                      **TINY_SETTINGS)
    for split in ("train", "val"):
        for key in ("docs", "tokens"):
            assert flipped["splits"][split][key] == reference["splits"][split][key]
    val_share = reference["splits"]["val"]["docs"] / len(corpus_docs)
    assert 0.05 < val_share < 0.15  # binomial(605, 0.1): 4+ standard deviations of margin


def test_datasets_streaming_sources_match_jsonl(tiny_dataset, corpus_docs, tmp_path):
    """parquet: and hf:<local folder> go through `datasets` streaming, the openwebtext path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "hub_like"
    folder.mkdir()
    half = len(corpus_docs) // 2
    pq.write_table(pa.table({"text": corpus_docs[:half] + [None]}), folder / "part-0.parquet")
    pq.write_table(pa.table({"text": corpus_docs[half:]}), folder / "part-1.parquet")
    fingerprint = manifest_of(tiny_dataset)["fingerprint"]
    from_parquet = prepare(f"parquet:{folder}", str(tmp_path / "pq"), num_proc=2, **TINY_SETTINGS)
    from_hub_path = prepare(f"hf:{folder}", str(tmp_path / "hf"), num_proc=2, **TINY_SETTINGS)
    assert from_parquet["fingerprint"] == fingerprint
    assert from_hub_path["fingerprint"] == fingerprint
    assert from_hub_path["empty_docs"] == 1  # the null text
    with pytest.raises(DataError, match=r"has no field 'body' \(fields: text\)"):
        prepare(f"parquet:{folder}", str(tmp_path / "body"), text_field="body", **TINY_SETTINGS)


def test_text_source_units_and_invalid_utf8(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    # \xe9 starts a 3-byte sequence that a space interrupts; \xff and \xfe never occur in UTF-8;
    # the genuine U+FFFD is not a replacement.
    (folder / "a.txt").write_bytes(b"caf\xe9 au lait\n\nsecond \xff\xfe para"
                                   + "\ufffd".encode() + b"\n")
    (folder / "b.txt").write_text("third paragraph\nhas two lines\n", encoding="utf-8")
    by_paragraph = prepare(f"text:{folder}/*.txt", str(tmp_path / "para"), seq_len=4,
                           val_fraction=0.0, tokenizer="char", text_unit="paragraph")
    assert by_paragraph["invalid_utf8_replacements"] == 3
    assert by_paragraph["splits"]["train"]["docs"] == 3
    stream = split_stream(str(tmp_path / "para"), "train")
    text = decode(by_paragraph, stream)
    expected = ("caf\ufffd au lait<|endoftext|>second \ufffd\ufffd para\ufffd<|endoftext|>"
                "third paragraph\nhas two lines<|endoftext|>")
    assert expected.startswith(text) and len(stream) >= 50 - 4  # all but a partial window
    by_file = prepare(f"text:{folder}", str(tmp_path / "file"), seq_len=4, val_fraction=0.0,
                      tokenizer="char")
    assert by_file["splits"]["train"]["docs"] == 2


def test_char_tokenizer_vocabulary_in_manifest(tmp_path, corpus_docs):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_docs[:200]))
    manifest = prepare(f"jsonl:{corpus}", str(tmp_path / "char"), seq_len=64, val_fraction=0.0,
                       tokenizer="char", num_proc=2)
    chars = sorted(set("".join(corpus_docs[:200])))
    assert manifest["chars"] == chars
    assert (manifest["vocab_size"], manifest["eot_id"]) == (len(chars) + 1, len(chars))
    stream = split_stream(str(tmp_path / "char"), "train").tolist()
    expected = [i for d in corpus_docs[:200] for i in [*map(chars.index, d), len(chars)]]
    assert stream == expected[:len(stream)] and len(expected) - len(stream) < 65


def test_shakespeare_documents_are_clean_scenes():
    source = parse_source("shakespeare")
    scenes = list(source.documents())
    assert 700 < len(scenes) < 850
    text = "\n".join(scenes)
    for markup in ("**", "###", "\\[", "&amp;"):
        assert markup not in text
    assert scenes[0].startswith("A Midsummer Night's Dream\n\nACT I\n\nSCENE I.")
    assert "THESEUS:\nNow, fair Hippolyta, our nuptial hour" in scenes[0]


def test_rerun_keeps_same_dataset_and_refuses_another(tmp_path, corpus_jsonl):
    out = str(tmp_path / "ds")
    first = prepare(f"jsonl:{corpus_jsonl}", out, seq_len=16, val_fraction=0.1, max_docs=100)
    again = prepare(f"jsonl:{corpus_jsonl}", out, seq_len=16, val_fraction=0.1, max_docs=100)
    assert again == first
    with pytest.raises(DataError, match="already holds a different dataset .*seq_len"):
        prepare(f"jsonl:{corpus_jsonl}", out, seq_len=8, val_fraction=0.1, max_docs=100)
    replaced = prepare(f"jsonl:{corpus_jsonl}", out, seq_len=8, val_fraction=0.1, max_docs=100,
                       overwrite=True)
    assert manifest_of(out) == replaced and replaced["seq_len"] == 8
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # nothing left beside it


def test_failure_midway_leaves_no_output(tmp_path, corpus_docs):
    corpus = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}) for d in corpus_docs] + ["{broken"]
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"docs.jsonl:606: not valid JSON"):
        prepare(f"jsonl:{corpus}", str(out), seq_len=16, shard_size="4kb")
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]
    # A failed overwrite leaves the previous dataset untouched.
    good = prepare(f"jsonl:{corpus}", str(out), seq_len=16, val_fraction=0.1, max_docs=100)
    with pytest.raises(DataError, match="not valid JSON"):
        prepare(f"jsonl:{corpus}", str(out), seq_len=16, val_fraction=0.1, overwrite=True)
    assert manifest_of(str(out)) == good
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "out"]


def test_staging_of_a_killed_run_is_removed(tmp_path, corpus_jsonl):
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    abandoned = tmp_path / f".ds.incomplete-{socket.gethostname()}-{dead.pid}"
    (abandoned / "train").mkdir(parents=True)
    alive = tmp_path / f".ds.incomplete-{socket.gethostname()}-{os.getpid()}.old"
    alive.mkdir()  # a live process's: kept
    prepare(f"jsonl:{corpus_jsonl}", str(tmp_path / "ds"), seq_len=16, val_fraction=0.1,
            max_docs=100)
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, "ds"])


def test_ensure_prepared_from_many_processes_at_once(tmp_path, corpus_jsonl):
    path = str(tmp_path / "shared" / "ds")
    fingerprints = run_at_once(lambda: ensure_prepared(
        path, f"jsonl:{corpus_jsonl}", seq_len=16, val_fraction=0.1, max_docs=300,
        num_proc=1)["fingerprint"])
    assert len(set(fingerprints)) == 1 and not fingerprints[0].startswith("error")
    assert sorted(os.listdir(tmp_path / "shared")) == ["ds", "ds.lock"]
    assert ensure_prepared(path, f"jsonl:{corpus_jsonl}", seq_len=16, val_fraction=0.1,
                           max_docs=300)["fingerprint"] == fingerprints[0]
    with pytest.raises(DataError, match="prepared with other settings .*seq_len"):
        ensure_prepared(path, f"jsonl:{corpus_jsonl}", seq_len=32, val_fraction=0.1,
                        max_docs=300)
