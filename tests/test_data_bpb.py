"""Bits per byte: UTF-8 bytes per split in the manifest, the token byte table, and `eval/bpb`
from a real training run (which also trains on a `data.mixture`)."""
import json
import math
import os

import pytest
import yaml

import trainer_runs as runs
from conftest import TINY_SETTINGS
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.tokenizer import GPT2_EOT_ID, gpt2_encoding, token_byte_lengths
from data_pipeline.tokenizing import is_val_document
from pretrain.training.evaluation import bits_per_byte


def test_manifest_bytes_are_the_texts_and_the_tokens_bytes(tiny_dataset, corpus_docs):
    manifest = json.load(open(os.path.join(tiny_dataset, "manifest.json")))
    table = token_byte_lengths(manifest)
    for split in ("train", "val"):
        docs = [d for d in corpus_docs
                if is_val_document(d, TINY_SETTINGS["val_fraction"]) == (split == "val")]
        assert manifest["splits"][split]["utf8_bytes"] == sum(len(d.encode()) for d in docs)
        # GPT-2 tokens are byte strings: their lengths add up to the text's, EOT adding none.
        tokens = [t for d in docs for t in gpt2_encoding().encode_ordinary(d) + [GPT2_EOT_ID]]
        assert int(table[tokens].sum()) == manifest["splits"][split]["utf8_bytes"]


def test_bits_per_byte_of_known_texts(tmp_path):
    table = token_byte_lengths({"tokenizer": "gpt2"})
    assert table[gpt2_encoding().encode_ordinary("Hello world")].tolist() == [5, 6]
    assert table[GPT2_EOT_ID] == 0 and table.shape == (50257,)
    # "café" in a character vocabulary: é is two bytes.
    chars = token_byte_lengths({"tokenizer": "char", "chars": ["a", "c", "f", "\u00e9"]})
    assert chars.tolist() == [1, 1, 1, 2, 0]
    # A uniform guess over 256 symbols costs 8 bits per symbol: on one-byte characters, 8 bits
    # per byte; on "Hello world" as GPT-2's 2 tokens (11 bytes), 16 / 11.
    assert bits_per_byte(math.log(256), tokens=1000, utf8_bytes=1000) == pytest.approx(8.0)
    assert bits_per_byte(math.log(256), tokens=2, utf8_bytes=11) == pytest.approx(16 / 11)
    assert token_byte_lengths({"tokenizer": "listops"}) is None


def test_training_on_a_mixture_logs_bits_per_byte(tmp_path):
    # Character-level (a small, fast model): the trainer tests' Shakespeare dataset, mixed with
    # the same documents split differently (one character vocabulary, as a mixture needs).
    paths = [str(runs.char_dataset()), str(tmp_path / "resplit")]
    prepare("shakespeare", paths[1], seq_len=32, val_fraction=0.2, tokenizer="char", max_docs=80,
            num_proc=1)
    config = {**runs.BASE_CONFIG, "output_root": str(tmp_path / "runs"), "run_name": "mix",
              "data": {**runs.BASE_CONFIG["data"], "path": paths[0],
                       "mixture": [{"path": paths[0], "proportion": 0.5},
                                   {"path": paths[1], "proportion": 0.5}]},
              "train": {**runs.BASE_CONFIG["train"], "max_steps": 2},
              "checkpoint": {"interval": 0}}
    config_file = tmp_path / "mix.yaml"
    config_file.write_text(yaml.safe_dump(config))
    done = runs.train_here([], config_file)
    assert done.returncode == 0, done.stderr[-3000:]
    from pretrain.scaling.experiments.common import scalar_curve

    loss, bpb = (scalar_curve(tmp_path / "runs" / "mix", tag)[-1][1] for tag in ("eval/loss", "eval/bpb"))
    # The evaluated windows: the trainer's val loader, first eval.batches micro-batches.
    val = build_loader(paths[0], "val", micro_batch_size=2, seed=runs.BASE_CONFIG["seed"],
                       shuffle=False, num_workers=0, repeat=False)
    table = token_byte_lengths(val.manifest)
    batches = [targets.numpy() for _, (_, targets) in zip(range(config["eval"]["batches"]), val)]
    target_bytes = int(sum(table[t].sum() for t in batches))
    tokens = sum(t.size for t in batches)
    assert bpb == pytest.approx(loss * tokens / math.log(2) / target_bytes, rel=1e-5)
    assert "bits/byte" in done.stdout
