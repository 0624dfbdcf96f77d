"""build_loader: batches, determinism, epochs, exact resume at world size 1 and 2, integrity.

The world-size-2 tests launch this module under `torchrun --nproc_per_node=2`; `worker_main`
at the bottom is what each rank runs.
"""
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_SETTINGS, run_at_once
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.sources import DataError
from data_pipeline.streaming_compat import streaming

WINDOW = TINY_SETTINGS["seq_len"] + 1


def take(loader, n_batches: int | None = None) -> list[torch.Tensor]:
    """Up to n_batches windows-batches ([B, seq_len + 1], rebuilt from inputs and targets)."""
    batches = []
    for inputs, targets in loader:
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        batches.append(torch.cat([inputs, targets[:, -1:]], dim=1))
        if n_batches is not None and len(batches) == n_batches:
            break
    return batches


def all_windows(data_dir: str, split: str) -> list[tuple[int, ...]]:
    windows = streaming.base.local.LocalDataset(data_dir, split)
    return sorted(tuple(windows[i]["tokens"].tolist()) for i in range(len(windows)))


def rows(batches: list[torch.Tensor]) -> list[tuple[int, ...]]:
    return sorted(tuple(row) for batch in batches for row in batch.tolist())


def test_batches_are_shifted_windows(tiny_dataset):
    loader = build_loader(tiny_dataset, "train", micro_batch_size=4, seed=0)
    inputs, targets = next(iter(loader))
    assert inputs.shape == targets.shape == (4, TINY_SETTINGS["seq_len"])
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_one_epoch_reads_every_window_once_and_epochs_continue(tiny_dataset):
    loader = build_loader(tiny_dataset, "val", micro_batch_size=4, seed=3)
    n_windows = loader.manifest["splits"]["val"]["windows"]
    per_epoch = n_windows // 4
    assert len(loader) == per_epoch
    batches = take(loader, 2 * per_epoch + 1)
    first, second = batches[:per_epoch], batches[per_epoch:2 * per_epoch]
    expected = all_windows(tiny_dataset, "val")
    # Each epoch reads every window once, except the few that do not fill a last batch.
    assert len(set(rows(first))) == len(rows(first)) == per_epoch * 4
    assert set(rows(first)) <= set(expected) and len(expected) - len(rows(first)) < 4
    assert set(rows(second)) <= set(expected) and len(set(rows(second))) == per_epoch * 4
    # The next epoch is reshuffled (streaming's seed + epoch) and the counter moved on.
    assert [b.tolist() for b in first] != [b.tolist() for b in second]
    assert loader.epoch == 2


def test_iterating_leaves_the_global_rng_alone(tiny_dataset):
    loader = build_loader(tiny_dataset, "val", micro_batch_size=4, seed=0)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    take(loader, len(loader) + 2)  # crosses an epoch boundary: a new DataLoader iterator
    assert torch.equal(torch.rand(3), expected)


def test_order_is_deterministic_per_seed(tiny_dataset):
    first = take(build_loader(tiny_dataset, "train", micro_batch_size=4, seed=7), 12)
    again = take(build_loader(tiny_dataset, "train", micro_batch_size=4, seed=7, num_workers=0),
                 12)
    other = take(build_loader(tiny_dataset, "train", micro_batch_size=4, seed=8), 12)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_resume_mid_epoch_at_world_size_1(tiny_dataset):
    loader = build_loader(tiny_dataset, "train", micro_batch_size=4, seed=5, repeat=False)
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    state = loader.state_dict()
    rest = take(iterator)
    # A fresh loader (as a restarted job builds it) continues with exactly the same batches.
    resumed = build_loader(tiny_dataset, "train", micro_batch_size=4, seed=5, repeat=False)
    resumed.load_state_dict(state)
    again = take(resumed)
    assert len(again) == len(rest) > 10
    assert all(torch.equal(a, b) for a, b in zip(again, rest))


def test_going_back_to_an_earlier_position_after_iterating(tiny_dataset):
    """As a trainer does when it reloads an earlier checkpoint mid-run (also across epochs)."""
    loader = build_loader(tiny_dataset, "val", micro_batch_size=4, seed=5)
    iterator = iter(loader)
    take(iterator, 3)
    state = loader.state_dict()
    expected = take(iterator, len(loader) + 5)  # runs into the next epoch
    loader.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(take(iter(loader), len(expected)), expected))


def test_train_and_val_loaders_side_by_side_and_recreated(tiny_dataset):
    train = iter(build_loader(tiny_dataset, "train", micro_batch_size=2, seed=1))
    val = iter(build_loader(tiny_dataset, "val", micro_batch_size=2, seed=1, shuffle=False))
    for _ in range(5):
        next(train), next(val)
    evaluations = [take(build_loader(tiny_dataset, "val", micro_batch_size=2, seed=1,
                                     shuffle=False, repeat=False)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*evaluations))


def test_independent_processes_read_one_dataset_at_once(tiny_dataset):
    """Separate jobs on one machine (each its own world of one) start loaders simultaneously."""
    def one_epoch():
        loader = build_loader(tiny_dataset, "val", micro_batch_size=2, seed=4, repeat=False)
        return [batch.tolist() for batch in take(loader)]

    expected = one_epoch()
    for epoch in run_at_once(one_epoch):
        assert epoch == expected, str(epoch)[:300]


def test_tiny_split_at_world_size_1(tmp_path, corpus_jsonl):
    out = str(tmp_path / "tiny")
    manifest = prepare(f"jsonl:{corpus_jsonl}", out, seq_len=32, val_fraction=0.0, max_docs=4)
    n_windows = manifest["splits"]["train"]["windows"]
    assert 5 < n_windows < 64
    loader = build_loader(out, "train", micro_batch_size=1, seed=0, repeat=False)
    assert rows(take(loader)) == all_windows(out, "train")
    with pytest.raises(DataError, match="fewer than one global batch"):
        build_loader(out, "train", micro_batch_size=n_windows + 1, seed=0)


def test_corrupted_or_truncated_shard_is_named(tiny_dataset, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(tiny_dataset, copy)
    shard = os.path.join(copy, "train", "shard.00002.mds")
    with open(shard, "r+b") as f:
        f.seek(300)
        byte = f.read(1)
        f.seek(300)
        f.write(bytes([byte[0] ^ 1]))
    # A flipped bit is found by the checksum when a DataLoader worker first reads the shard.
    loader = build_loader(copy, "train", micro_batch_size=2, seed=0, repeat=False)
    with pytest.raises(DataError, match=r"shard .*shard\.00002\.mds is corrupted: xxh64"):
        take(loader)
    # Truncation (or a missing file) is found by the size check when the loader is built.
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"shard .*shard\.00002\.mds is truncated"):
        build_loader(copy, "train", micro_batch_size=2, seed=0)
    os.remove(shard)
    with pytest.raises(DataError, match=r"shard .*shard\.00002\.mds is missing"):
        build_loader(copy, "train", micro_batch_size=2, seed=0)


@pytest.mark.parametrize("damage", ["manifest.json cut short", "index.json cut short", "index.json missing"])
def test_a_damaged_manifest_or_index_is_named(tiny_dataset, tmp_path, damage):
    """Streaming would read a broken index.json into a traceback of its own."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dataset, copy)
    name, how = damage.split(" ", 1)
    file = copy / ("train" if name == "index.json" else "") / name
    if how == "missing":
        file.unlink()
        message = rf"{file} is missing: the train split is incomplete"
    else:
        file.write_bytes(file.read_bytes()[:40])
        message = rf"{file}: not a readable JSON file \("
    with pytest.raises(DataError, match=message):
        build_loader(str(copy), "train", micro_batch_size=2, seed=0)


def test_zstd_dataset_reads_like_uncompressed(tiny_dataset, corpus_jsonl, tmp_path):
    out = str(tmp_path / "zstd")
    prepare(f"jsonl:{corpus_jsonl}", out, compression="zstd", **TINY_SETTINGS)
    assert any(name.endswith(".mds.zstd") for name in os.listdir(os.path.join(out, "val")))
    plain = take(build_loader(tiny_dataset, "val", micro_batch_size=4, seed=2), 20)
    packed = take(build_loader(out, "val", micro_batch_size=4, seed=2), 20)
    assert all(torch.equal(a, b) for a, b in zip(plain, packed))


# --- world size 2 -------------------------------------------------------------------------------

RESUME_AFTER = 5
"""Batches read before the position is saved."""


def test_world_size_2_matches_world_size_1_and_resumes_exactly(tiny_dataset, two_rank_reads):
    """Two ranks read the same global batches as one rank, and resume mid-epoch exactly."""
    ranks = [torch.load(two_rank_reads / f"rank{rank}.pt") for rank in (0, 1)]
    # Elastic determinism: global batch k at world size 2 holds the samples of batch k at world
    # size 1 (micro-batch 4 x 2 ranks == 8); rank r holds positions r, r + 2, ...
    single = take(build_loader(tiny_dataset, "train", micro_batch_size=8, seed=11,
                               repeat=False))
    check_two_ranks(ranks, single)
    # The small val split is spread over both ranks: every window is read, and at most one is
    # read twice (streaming balances an odd count over two ranks by repeating a window).
    val = rows(ranks[0]["val"] + ranks[1]["val"])
    expected = all_windows(tiny_dataset, "val")
    assert len(val) - len(set(val)) <= 1 and set(val) <= set(expected)
    assert len(expected) - len(set(val)) < 2 * 2  # only the last partial global batch


def check_two_ranks(ranks: list[dict], single: list[torch.Tensor]) -> None:
    """Each rank read its half of world size 1's batches `single`, and resumed exactly."""
    assert len(ranks[0]["full"]) == len(ranks[1]["full"]) == len(single) > 10
    for k, batch in enumerate(single):
        assert torch.equal(ranks[0]["full"][k], batch[0::2])
        assert torch.equal(ranks[1]["full"][k], batch[1::2])
    for result in ranks:
        assert len(result["resumed"]) == len(result["full"]) - RESUME_AFTER
        assert all(torch.equal(a, b)
                   for a, b in zip(result["resumed"], result["full"][RESUME_AFTER:]))


def mixture_of(a: str, b: str) -> list:
    """The two-dataset mixture the world-size-2 worker reads (as `data.mixture` entries)."""
    return [SimpleNamespace(path=a, proportion=0.5, repeat=None),
            SimpleNamespace(path=b, proportion=0.5, repeat=None)]


def read_and_resume(make_loader, out_dir: str, name: str) -> dict:
    """A whole epoch, and the same epoch resumed after RESUME_AFTER batches by a new loader (as
    a restarted job builds it); the saved position goes to `out_dir/{name}_state{rank}.pt`."""
    loader = make_loader()
    iterator = iter(loader)
    full = take(iterator, RESUME_AFTER)
    state_path = os.path.join(out_dir, f"{name}_state{torch.distributed.get_rank()}.pt")
    torch.save(loader.state_dict(), state_path)
    full += take(iterator)
    resumed_loader = make_loader()
    resumed_loader.load_state_dict(torch.load(state_path))
    return {"full": full, "resumed": take(resumed_loader)}

def global_batches(dataset, nodes: int, ranks_per_node: int, global_batch: int, sample_in_epoch: int,
                   steps: int) -> list[list[int]]:
    """The windows (sorted ids) of each global batch of an epoch at this layout, as the loader's
    batching method deals them: rank r's s-th batch is its worker s % W's batch s // W."""
    from data_pipeline.loader import ANY_NODE_COUNT
    from data_pipeline.streaming_compat import streaming

    workers = 2
    dataset.batch_size = global_batch // (nodes * ranks_per_node)
    world = streaming.base.world.World(num_nodes=nodes, ranks_per_node=ranks_per_node,
                                       workers_per_rank=workers, worker=0)
    work = streaming.base.batching.generate_work(ANY_NODE_COUNT, dataset, world, 0, sample_in_epoch)
    return [sorted(work[:, :, step % workers, step // workers].flatten().tolist()) for step in range(steps)]


def test_any_node_count_deals_the_same_global_batches(tiny_dataset):
    """3 or 6 nodes against 4 canonical nodes (which streaming's own partition refuses): every
    global batch holds the same windows as at 1, 2 or 4 nodes, from the start and from a
    position mid-epoch (a resume on another layout); where streaming's partition works, the
    loader's is streaming's, unchanged."""
    from data_pipeline.loader import WindowDataset
    from data_pipeline.streaming_compat import streaming

    dataset = WindowDataset(verify=False, local=os.path.join(tiny_dataset, "train"), batch_size=4,
                            shuffle=True, shuffle_seed=3, num_canonical_nodes=4)
    dataset.shuffle_block_size = 1 << 18  # streaming sets it when iteration starts
    for start in (0, 5 * 24):
        expected = global_batches(dataset, 1, 1, 24, start, 6)
        for nodes, ranks_per_node in ((2, 1), (4, 2), (3, 1), (3, 2), (6, 1), (1, 3)):
            assert global_batches(dataset, nodes, ranks_per_node, 24, start, 6) == expected, (nodes, ranks_per_node)
    world = streaming.base.world.World(num_nodes=2, ranks_per_node=2, workers_per_rank=2, worker=0)
    dataset.batch_size = 6
    assert (streaming.base.batching.generate_work(dataset.batching_method, dataset, world, 0, 0) ==
            streaming.base.batching.generate_work("random", dataset, world, 0, 0)).all()



def worker_main(data_dir: str, mixture_a: str, mixture_b: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    options = dict(micro_batch_size=4, seed=11, repeat=False)
    result = read_and_resume(lambda: build_loader(data_dir, "train", **options), out_dir, "single")
    result["val"] = take(build_loader(data_dir, "val", micro_batch_size=2, seed=0, shuffle=False,
                                      repeat=False))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    mixture = read_and_resume(lambda: build_loader(mixture_a, "train", **options,
                                                   mixture=mixture_of(mixture_a, mixture_b)),
                              out_dir, "mixture")
    torch.save(mixture, os.path.join(out_dir, f"mixture_rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    worker_main(*sys.argv[1:])

