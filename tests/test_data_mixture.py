"""data.mixture: several prepared datasets as streaming Streams of one StreamingDataset.

Proportions and repeats hold over an epoch, the datasets are interleaved, and the mixture keeps
the loader's guarantees: exact mid-epoch resume, the same global order at world size 1 and 2,
and a position saved at one world size continuing at another. The world-size-2 part launches
this module under `torchrun --nproc_per_node=2`; `worker_main` is what each rank runs.
"""
import json
import math
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.sources import DataError
from data_pipeline.streaming_compat import streaming
from test_data_loader import rows, take

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = dict(seq_len=32, val_fraction=0.1, shard_size="8kb")
RESUME_AFTER = 5


def entry(path, proportion=None, repeat=None):
    return SimpleNamespace(path=path, proportion=proportion, repeat=repeat)


def windows_of(data_dir: str) -> set[tuple[int, ...]]:
    split = streaming.base.local.LocalDataset(data_dir, "train")
    return {tuple(split[i]["tokens"].tolist()) for i in range(len(split))}


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory, corpus_docs):
    """Two GPT-2 datasets of different documents (the first about 2.5x the second)."""
    root = tmp_path_factory.mktemp("mixture")
    paths = []
    for name, docs in (("a", corpus_docs[:430]), ("b", corpus_docs[430:])):
        corpus = root / f"{name}.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        paths.append(str(root / name))
        prepare(f"jsonl:{corpus}", paths[-1], num_proc=1, **SETTINGS)
    return paths


def test_proportions_hold_over_an_epoch_and_streams_interleave(two_datasets):
    a, b = two_datasets
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


def test_repeats_and_exact_resume_mid_epoch(two_datasets):
    a, b = two_datasets
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


def test_mixture_of_other_tokenizers_or_weights_is_refused(two_datasets, tmp_path, corpus_jsonl):
    a, b = two_datasets
    char = str(tmp_path / "char")
    prepare(f"jsonl:{corpus_jsonl}", char, tokenizer="char", max_docs=40, **SETTINGS)
    with pytest.raises(DataError, match=r"data.mixture: .*char was prepared with tokenizer='char'"):
        build_loader(a, "train", micro_batch_size=4, seed=0,
                     mixture=[entry(a, proportion=1), entry(char, proportion=1)])
    with pytest.raises(DataError, match="give every entry a proportion, or every entry a repeat"):
        build_loader(a, "train", micro_batch_size=4, seed=0,
                     mixture=[entry(a, proportion=1), entry(b, repeat=1)])


def test_world_size_2_and_a_world_size_change(two_datasets, tmp_path):
    """Two ranks read world size 1's global batches and resume exactly; a position saved by two
    ranks continues at one."""
    a, b = two_datasets
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "tests.test_data_mixture", a, b, str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    options = dict(seed=11, repeat=False, mixture=mixture_of(a, b))
    single = take(build_loader(a, "train", micro_batch_size=8, **options))
    assert len(ranks[0]["full"]) == len(ranks[1]["full"]) == len(single) > 10
    for k, batch in enumerate(single):
        assert torch.equal(ranks[0]["full"][k], batch[0::2])
        assert torch.equal(ranks[1]["full"][k], batch[1::2])
    for result in ranks:
        assert all(torch.equal(x, y) for x, y in zip(result["resumed"], result["full"][RESUME_AFTER:]))
        assert len(result["resumed"]) == len(result["full"]) - RESUME_AFTER
    # The position two ranks saved after RESUME_AFTER global batches, resumed by one rank with
    # the same global batch, continues with world size 1's next batch.
    one_rank = build_loader(a, "train", micro_batch_size=8, **options)
    one_rank.load_state_dict(torch.load(tmp_path / "state0.pt"))
    continued = take(one_rank)
    assert len(continued) == len(single) - RESUME_AFTER
    assert all(torch.equal(x, y) for x, y in zip(continued, single[RESUME_AFTER:]))


def mixture_of(a: str, b: str) -> list:
    return [entry(a, proportion=0.5), entry(b, proportion=0.5)]


def worker_main(a: str, b: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    options = dict(micro_batch_size=4, seed=11, repeat=False, mixture=mixture_of(a, b))
    loader = build_loader(a, "train", **options)
    iterator = iter(loader)
    full = take(iterator, RESUME_AFTER)
    state_path = os.path.join(out_dir, f"state{rank}.pt")
    torch.save(loader.state_dict(), state_path)
    full += take(iterator)
    resumed_loader = build_loader(a, "train", **options)
    resumed_loader.load_state_dict(torch.load(state_path))
    torch.save({"full": full, "resumed": take(resumed_loader)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    worker_main(*sys.argv[1:])
