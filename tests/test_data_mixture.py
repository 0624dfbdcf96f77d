"""data.mixture: several prepared datasets as streaming Streams of one StreamingDataset.

Proportions and repeats hold over an epoch, the datasets are interleaved, and the mixture keeps
the loader's guarantees: exact mid-epoch resume, the same global order at world size 1 and 2,
and a position saved at one world size continuing at another. The two ranks' reads come from
the torchrun launch of test_data_loader's worker (the `two_rank_reads` fixture).
"""
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_SETTINGS
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.sources import DataError
from data_pipeline.streaming_compat import streaming
from test_data_loader import RESUME_AFTER, check_two_ranks, mixture_of, rows, take


def entry(path, proportion=None, repeat=None):
    return SimpleNamespace(path=path, proportion=proportion, repeat=repeat)


def windows_of(data_dir: str) -> set[tuple[int, ...]]:
    split = streaming.base.local.LocalDataset(data_dir, "train")
    return {tuple(split[i]["tokens"].tolist()) for i in range(len(split))}


def test_proportions_hold_over_an_epoch_and_streams_interleave(mixture_datasets):
    a, b = mixture_datasets
    in_a, in_b = windows_of(a), windows_of(b)
    assert not in_a & in_b and len(in_a) > 2 * len(in_b)
    loader = build_loader(a, "train", micro_batch_size=4, seed=3, repeat=False,
                          mixture=[entry(a, proportion=1), entry(b, proportion=3)])
    epoch = [row for batch in take(loader) for row in batch.tolist()]
    total = len(in_a) + len(in_b)  # an epoch holds as many windows as the datasets together
    assert total - 4 < len(epoch) <= total  # all but a last partial batch
    counts = Counter(map(tuple, epoch))
    from_b = sum(n for window, n in counts.items() if window in in_b)
    assert set(counts) <= in_a | in_b
    assert abs(from_b - 0.75 * total) <= 4
    # b is upsampled (each window read about 0.75 * total / |b| times, evenly), a downsampled
    # (a window at most once).
    b_reads = [counts[w] for w in in_b]
    assert max(b_reads) - min(b_reads) <= 1 and min(b_reads) >= 1
    assert max(counts[w] for w in in_a) == 1
    # Interleaved, not one dataset after the other: the first half of the epoch holds b's share
    # within 4 standard deviations.
    half = epoch[:len(epoch) // 2]
    share = sum(tuple(w) in in_b for w in half) / len(half)
    assert abs(share - 0.75) < 4 * math.sqrt(0.75 * 0.25 / len(half))


def test_repeats_and_exact_resume_mid_epoch(mixture_datasets):
    a, b = mixture_datasets
    mixture = [entry(a, repeat=1), entry(b, repeat=2)]
    loader = build_loader(a, "train", micro_batch_size=4, seed=5, repeat=False, mixture=mixture)
    iterator = iter(loader)
    first = take(iterator, 7)
    state = loader.state_dict()
    rest = take(iterator)
    counts = Counter(rows(first + rest))
    in_a, in_b = windows_of(a), windows_of(b)
    assert len(loader) * 4 > len(in_a) + 2 * len(in_b) - 4
    # Every window of a once, of b twice, except the few of a last partial batch.
    missing = sum(1 - counts[w] for w in in_a) + sum(2 - counts[w] for w in in_b)
    assert 0 <= missing < 4 and all(counts[w] <= 1 for w in in_a) and all(counts[w] <= 2 for w in in_b)
    resumed = build_loader(a, "train", micro_batch_size=4, seed=5, repeat=False, mixture=mixture)
    resumed.load_state_dict(state)
    again = take(resumed)
    assert len(again) == len(rest) > 10 and all(torch.equal(x, y) for x, y in zip(again, rest))


def test_mixture_of_other_tokenizers_or_weights_is_refused(mixture_datasets, tmp_path, corpus_jsonl):
    a, b = mixture_datasets
    char = str(tmp_path / "char")
    prepare(f"jsonl:{corpus_jsonl}", char, tokenizer="char", max_docs=40, **TINY_SETTINGS)
    with pytest.raises(DataError, match=r"data.mixture: .*char was prepared with tokenizer='char'"):
        build_loader(a, "train", micro_batch_size=4, seed=0,
                     mixture=[entry(a, proportion=1), entry(char, proportion=1)])
    with pytest.raises(DataError, match="give every entry a proportion, or every entry a repeat"):
        build_loader(a, "train", micro_batch_size=4, seed=0,
                     mixture=[entry(a, proportion=1), entry(b, repeat=1)])


def test_world_size_2_and_a_world_size_change(mixture_datasets, two_rank_reads):
    """Two ranks read world size 1's global batches and resume exactly; a position saved by two
    ranks continues at one."""
    a, b = mixture_datasets
    ranks = [torch.load(two_rank_reads / f"mixture_rank{rank}.pt") for rank in (0, 1)]
    options = dict(seed=11, repeat=False, mixture=mixture_of(a, b))
    single = take(build_loader(a, "train", micro_batch_size=8, **options))
    check_two_ranks(ranks, single)
    # The position two ranks saved after RESUME_AFTER global batches, resumed by one rank with
    # the same global batch, continues with world size 1's next batch.
    one_rank = build_loader(a, "train", micro_batch_size=8, **options)
    one_rank.load_state_dict(torch.load(two_rank_reads / "mixture_state0.pt"))
    continued = take(one_rank)
    assert len(continued) == len(single) - RESUME_AFTER
    assert all(torch.equal(x, y) for x, y in zip(continued, single[RESUME_AFTER:]))
