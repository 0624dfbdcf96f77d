"""Per-rank, resumable loading of a prepared dataset's windows as (inputs, targets) batches.

Built on mosaicml-streaming: `StreamingDataset` partitions and shuffles the windows of a split
over ranks and DataLoader workers, and `StreamingDataLoader.state_dict()` records how far the
whole job got, so a restarted job resumes the exact sample order mid-epoch.

Choices that are not streaming's defaults, and why:
- The split directory is read in place (`local` = the split, no `remote`): no copy of the data,
  and streaming's "reused local directory" check (which only applies with a remote) never
  trips, so train and val loaders, re-created loaders and concurrent jobs can share a dataset.
- `num_canonical_nodes` is fixed by the split size alone (see `canonical_nodes_for`), never by
  the world size: with it fixed, streaming's global sample order for a fixed global batch is the
  same at any number of ranks (elastic determinism), and tiny splits are not spread so thin that
  streaming repeats windows to fill its partitions.
- Any node count: streaming partitions the sample order over physical nodes, and refuses a node
  count that neither divides the canonical node count nor is divisible by it (3 or 6 nodes
  against a power of two). For those the loader partitions as if the job were one node of all
  its ranks and hands each node its ranks' rows (`ANY_NODE_COUNT`): each global batch holds the
  same windows as at any other world size; only which rank reads which window differs. Node
  counts streaming takes are partitioned by streaming itself, unchanged.
- Epochs: iterating the loader runs epoch after epoch (streaming's epoch counter advances and,
  with shuffling, reshuffles with seed + epoch) unless `repeat=False`, which stops after one.
- Shards are checked against the sizes (when the loader is built) and xxh64 checksums (when a
  process first reads from a shard) in the split's `index.json`, so a corrupted or truncated
  shard is an error naming the shard, not a wrong batch.
- Failures in workers: streaming only logs an exception of its threads that make shards local
  (a disk filled by decompressing one) and then ends the epoch early or waits for ever; here it
  reaches the reader. What a DataLoader raises about a worker (its exception with its traceback,
  or its death) becomes one line (`data_worker_error`), and the workers are stopped at once.
- Mixtures: several prepared datasets (one tokenizer, one seq_len) are streaming `Stream`s of
  one `StreamingDataset`, each with a `proportion` of every epoch or a `repeat` count, so a
  mixture partitions, shuffles and resumes exactly like a single dataset. With proportions an
  epoch holds as many windows as the datasets together; a dataset with a larger share than its
  size has its windows repeated, a smaller one gets a fresh random subset each epoch.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import fcntl
import mmap
import multiprocessing.resource_tracker
import os
import re
import signal
import tempfile
from typing import Any, Iterator

import numpy as np
import torch

from common import objectstore
from common.fileio import read_json
from data_pipeline.errors import DataError, DataWorkerError
from data_pipeline.packing import INDEX, SHARD_HASH, read_manifest
from data_pipeline.remote import local_copy
from data_pipeline.streaming_compat import streaming

READY_AHEAD = 4096
"""Streaming's `predownload`: how many samples its background threads run ahead of the reader.
Its default (8 micro-batches) caps a worker at about that many samples per 7 ms polling tick,
a few thousand windows per second; local shards cost nothing to "download" ahead."""
PREFIX_LOCK = "data_pipeline_streaming_prefix.lock"
"""Lock file (in the temp dir) serializing streaming's shared-memory registration per machine."""
MAX_CANONICAL_NODES = 64
"""Upper bound on canonical nodes (streaming's usual value for its py1e shuffle)."""
MIN_WINDOWS_PER_CANONICAL_NODE = 64
"""Windows each canonical node gets at least, so tiny splits use few canonical nodes."""


def canonical_nodes_for(num_windows: int) -> int:
    """Largest power of two that divides `num_windows`, at most 64 and at most num_windows / 64.

    Streaming pads every canonical node's share to the same length by repeating windows; a
    divisor of the split size needs no padding, so each epoch reads each window exactly once.
    """
    limit = max(1, min(MAX_CANONICAL_NODES, num_windows // MIN_WINDOWS_PER_CANONICAL_NODE))
    nodes = 1
    while nodes * 2 <= limit and num_windows % (nodes * 2) == 0:
        nodes *= 2
    return nodes


ANY_NODE_COUNT = "pretrain_any_node_count"
"""The loader's batching method: streaming's `random` batching, at node counts streaming refuses
too (see the module doc)."""


def _work_at_any_node_count(dataset, world, epoch: int, sample_in_epoch: int) -> np.ndarray:
    """Streaming's `random` batching work [nodes, ranks per node, workers, batches, batch] of an
    epoch, computed for one node of all the job's ranks where the job's node count and the
    canonical one do not divide each other. Global rank = node * ranks_per_node + local rank, as
    torchrun and Slurm number them and streaming indexes the result."""
    random_batching = streaming.base.batching.batching_methods["random"]
    nodes, canonical = world.num_nodes, dataset.num_canonical_nodes
    if nodes % canonical == 0 or canonical % nodes == 0:
        return random_batching(dataset, world, epoch, sample_in_epoch)
    one_node = streaming.base.world.World(num_nodes=1, ranks_per_node=world.num_ranks,
                                          workers_per_rank=world.workers_per_rank, worker=world.worker)
    work = random_batching(dataset, one_node, epoch, sample_in_epoch)
    return work.reshape(nodes, world.ranks_per_node, *work.shape[2:])


# streaming looks its batching methods up by name in this table (and checks the name only when a
# dataset is built, so WindowDataset sets it afterwards)
streaming.base.batching.batching_methods[ANY_NODE_COUNT] = _work_at_any_node_count


def _stored_files(shard) -> list:
    """File infos of a shard's files on disk: the raw file and/or the compressed one (a
    compressed split stores the .zstd file; streaming adds the raw file on first read)."""
    infos = [info for pair in shard.file_pairs for info in pair if info is not None]
    present = [info for info in infos
               if os.path.isfile(os.path.join(shard.dirname, shard.split, info.basename))]
    if not present:
        raise DataError(f"shard {os.path.join(shard.dirname, shard.split, infos[-1].basename)} "
                        "is missing")
    return present


def check_shard_sizes(shards) -> None:
    """Every shard file is present with the size its index records (catches truncation)."""
    for shard in shards:
        for info in _stored_files(shard):
            path = os.path.join(shard.dirname, shard.split, info.basename)
            size = os.path.getsize(path)
            if size != info.bytes:
                raise DataError(f"shard {path} is truncated or corrupted: {size} bytes, "
                                f"index.json says {info.bytes}")


def verify_shard_checksums(shard) -> None:
    """Every file of the shard matches the xxh64 checksum its index records."""
    for info in _stored_files(shard):
        path = os.path.join(shard.dirname, shard.split, info.basename)
        with open(path, "rb") as f:
            checksum = streaming.base.hashing.get_hash(SHARD_HASH, f.read())
        if checksum != info.hashes[SHARD_HASH]:
            raise DataError(f"shard {path} is corrupted: {SHARD_HASH} {checksum}, index.json "
                            f"says {info.hashes[SHARD_HASH]}")


@contextlib.contextmanager
def _machine_lock():
    """The lock that orders streaming shared-memory registrations and releases on this machine."""
    with open(os.path.join(tempfile.gettempdir(), PREFIX_LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _registration_turn():
    """Hold this machine's turn to register a streaming dataset's shared memory.

    Streaming picks the first free shared-memory prefix, then the job's local leader creates it;
    two jobs starting together can pick the same prefix and one fails (FileExistsError). Each
    job's local rank 0 holds a machine-wide lock for the whole registration, and the job's other
    ranks look up the prefix while it is held, so registrations never interleave.
    """
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    with _machine_lock() if leader else contextlib.nullcontext():
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # the other ranks start once local rank 0 has the lock
        yield


def _start_resource_tracker_deaf_to_stop_signals() -> None:
    """Start multiprocessing's resource tracker (the helper process that streaming's shared
    memory registers with) with SIGUSR1 blocked, which it inherits. A scheduler's stop signal
    reaches every process of a job step (`scancel --signal=USR1` does), and the tracker, which
    ignores only SIGINT and SIGTERM, would die of it: its replacement then fails to unregister
    the segments at exit, one traceback per segment. Does nothing if the tracker runs already."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        multiprocessing.resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _release_prefix(registered: list[int]) -> None:
    """Remove the lock files streaming leaves in the temp dir for a dataset's prefix.

    While they exist no later dataset may take the prefix, so each run would push prefixes (and
    files) up by one. Runs at exit after streaming has unlinked the dataset's shared memory, and
    under the machine lock, so a prefix never becomes free while another job registers (its
    ranks would look up different prefixes).
    """
    constant = streaming.base.constant
    with _machine_lock():
        for prefix in registered:
            for name in (constant.BARRIER_FILELOCK, constant.CACHE_FILELOCK):
                try:
                    os.remove(os.path.join(tempfile.gettempdir(), f"{prefix:06}_{name}"))
                except FileNotFoundError:
                    pass


class WindowDataset(streaming.StreamingDataset):
    """A split's windows as uint16 arrays of `seq_len + 1` tokens, as stored.

    With `verify`, each process checks a shard's checksum the first time it reads from it: the
    check costs one read of the data per reading process and epoch 0, spread over the run
    instead of a pass over the whole split before the first step.

    The first read of a shard in a process goes through streaming (which makes the shard local,
    decompressing it if needed); later reads take the sample's bytes from a read-only memory map
    of the shard's MDS file and decode them with streaming's reader. Streaming opens, seeks and
    closes the file for every sample, which cost more than a whole tiny training step's worth
    of windows. (This relies on shards never being evicted: the loader sets no cache limit.)
    """

    def __init__(self, *, verify: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batching_method = ANY_NODE_COUNT
        self.verify = verify
        self.mapped_shards: dict[int, np.ndarray] = {}
        self.background_failure: BaseException | None = None
        """What failed in this process's streaming threads (see `on_exception`)."""

    def on_exception(self, future) -> None:
        """Streaming's callback as each of its two threads that make shards local ahead of the
        reader (e.g. decompress them, which can fill a disk) ends. Streaming raises a failed
        thread's exception here, where concurrent.futures only logs it with a traceback; its
        reader then ends the epoch as if it were complete, and waits for ever for the failed
        thread to say that it exited. This keeps the exception for the reader to raise, and
        counts the failed thread as exited."""
        if future.exception() is not None:
            self.background_failure = future.exception()
            self._event.set()  # stops the other thread and the reader
            self._iterator.on_exit()

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        """Streaming's, except that a shard this process failed to make local is marked as not
        local again rather than as being prepared for ever (streaming raises only while it
        prepares the shard itself): every reader waiting for it, in this process or another
        worker, then tries it and meets the error itself instead of waiting for ever."""
        try:
            super().prepare_shard(shard_id, blocking)
        except BaseException:
            self._shard_states[shard_id] = streaming.base.dataset._ShardState.REMOTE
            raise

    def __iter__(self) -> Iterator[np.ndarray]:
        try:
            yield from super().__iter__()
        except Exception:
            if self.background_failure is None:
                raise
            raise self.background_failure from None  # rather than streaming's "Background thread failed"
        if self.background_failure is not None:  # streaming's reader stops quietly after one
            raise self.background_failure

    def get_item(self, sample_id: int, retry: int = 7) -> np.ndarray:
        shard_id, index = self.spanner[sample_id]
        mapped = self.mapped_shards.get(shard_id)
        if mapped is None:
            shard = self.shards[shard_id]
            if self.verify:
                verify_shard_checksums(shard)
            window = super().get_item(sample_id, retry)["tokens"]
            path = os.path.join(shard.dirname, shard.split, shard.raw_data.basename)
            with open(path, "rb") as f:
                self.mapped_shards[shard_id] = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ),
                                                             dtype=np.uint8)
            return window
        # MDS: a uint32 sample count, then sample i's [begin, end) byte offsets at 4 (1 + i)
        begin, end = mapped[4 * (1 + index):4 * (3 + index)].view(np.uint32)
        return self.shards[shard_id].decode_sample(mapped[begin:end].tobytes())["tokens"]


def stack_windows(windows: list[np.ndarray]) -> dict[str, np.ndarray]:
    """A micro-batch {"tokens": [B, seq_len + 1]} still in uint16. A DataLoader worker sends a
    numpy array through its queue by value (one small pickle), where tensors would each get a
    shared-memory segment, which dominated the cost of small batches. A dict, because
    streaming counts the samples of a batch (for its resume position) as the length of a dict's
    first value, and of anything else but a tensor as the length of its first element."""
    return {"tokens": np.stack(windows)}


def inputs_targets(batch: dict[str, np.ndarray], pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) int64 [B, seq_len]: targets are the inputs shifted by one token."""
    tokens = torch.from_numpy(batch["tokens"].astype(np.int64))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if pin_memory:
        return inputs.pin_memory(), targets.pin_memory()
    return inputs, targets


WORKER_EXCEPTION = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)\.\nOriginal Traceback")
"""How a DataLoader raises an exception of one of its workers in the main process: of the same
type (RuntimeError where that type cannot be made from a message), with this message and then
the worker's traceback, whose last line is `module.Type: message`."""
WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is (killed by signal: [^.]*)|exited "
                         r"unexpectedly(?: with (exit code -?\d+))?)")
"""A DataLoader's RuntimeError for a worker that died, raised when the loader waits for it or,
from its SIGCHLD handler, wherever the main process is at the time."""


def data_worker_error(error: BaseException) -> DataError | DataWorkerError | None:
    """A one-line error for what a DataLoader raised about one of its workers, without the
    worker's traceback: a DataError with the worker's own message (bad data), a DataWorkerError
    for another exception in a worker or a worker that died; None for any other error."""
    text = str(error)
    if raised := WORKER_EXCEPTION.match(text):
        name, worker = raised.groups()
        message = text.rstrip().splitlines()[-1].partition(": ")[2]
        if isinstance(error, DataError):
            return DataError(message)
        return DataWorkerError(f"data loader worker {worker} failed: {name}: {message}")
    if isinstance(error, RuntimeError) and (died := WORKER_DIED.match(text)):
        if error.__cause__ is not None and WORKER_DIED.match(str(error.__cause__)):
            # where the SIGCHLD handler's exception (naming the signal) interrupts the loader's
            # wait for a batch, the loader raises "exited unexpectedly" from it
            return data_worker_error(error.__cause__)
        pids, signal_name, exit_code = died.groups()
        return DataWorkerError(f"data loader worker (pid {pids}) died: "
                               f"{signal_name or exit_code or 'it exited unexpectedly'}")
    return None


class TokenLoader:
    """Iterates (inputs, targets) int64 tensors `[micro_batch_size, seq_len]` for this rank.

    `state_dict()` / `load_state_dict()` save and restore the position of the whole job (epoch
    and samples consumed in it, counted over all ranks), so the first batch of the next
    `iter(loader)` is the one that came after the saved position. Restoring also works after
    iterating, to go back to an earlier position.
    """

    def __init__(self, dataset: WindowDataset, dataloader, manifest: dict, split: str,
                 repeat: bool, pin_memory: bool) -> None:
        self.dataset = dataset
        self.pin_memory = pin_memory
        self.dataloader = dataloader
        self.manifest = manifest
        self.split = split
        self.repeat = repeat
        self.epoch = 0
        """Streaming's epoch number of the last batch yielded."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        empty_epochs = 0
        while True:
            produced = False
            try:
                for batch in self.dataloader:
                    if not produced:
                        # Streaming advanced its shared epoch counter when this epoch started.
                        self.epoch = int(self.dataset.next_epoch) - 1
                    produced = True
                    yield inputs_targets(batch, self.pin_memory)
            except Exception as error:
                failure = data_worker_error(error)
                if failure is None:
                    raise
                raise failure from None
            if not self.repeat:
                return
            # A restored position at the very end of an epoch gives one empty epoch; two in a
            # row would mean the split cannot fill a single batch.
            empty_epochs = 0 if produced else empty_epochs + 1
            if empty_epochs == 2:
                raise DataError(f"split {self.split} yields no full batch for this rank")

    def __len__(self) -> int:
        """Full micro-batches per epoch for this rank."""
        return len(self.dataset) // self.dataloader.batch_size

    def state_dict(self) -> dict[str, Any]:
        return self.dataloader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Streaming ignores a saved position older than its own epoch counter (it takes it for a
        # stale checkpoint), so going back to a position after iterating (e.g. reloading an
        # earlier checkpoint mid-run) needs the counter rewound to the saved epoch first.
        self.dataset.next_epoch = max(int(state["epoch"]), 0)
        self.dataloader.load_state_dict(state)


MIXTURE_MUST_MATCH = ("tokenizer", "vocab_size", "eot_id", "seq_len", "chars", "vocab")
"""Manifest fields every dataset of a mixture shares with the main dataset (same token ids)."""


def _split_dir(data_dir: str, manifest: dict, split: str) -> str:
    split_dir = os.path.abspath(os.path.join(data_dir, split))
    if split not in manifest["splits"] or not os.path.isdir(split_dir):
        raise DataError(f"{data_dir} has no split {split!r} "
                        f"(splits: {', '.join(manifest['splits'])})")
    index = os.path.join(split_dir, INDEX)
    if not os.path.isfile(index):
        raise DataError(f"{index} is missing: the {split} split is incomplete; prepare the dataset again")
    read_json(index, DataError)  # streaming would read a damaged one into a traceback
    return split_dir


def mixture_streams(data_dir: str, manifest: dict, mixture, split: str) -> tuple[list, int]:
    """Streaming `Stream`s of a mixture's datasets and the windows of one epoch of it.

    `mixture` holds entries with `path` and either `proportion` or `repeat` (`data.mixture`)."""
    weighted_by = {"proportion" if e.proportion is not None else "repeat" if e.repeat is not None
                   else None for e in mixture}
    if len(weighted_by) != 1 or None in weighted_by:
        raise DataError("data.mixture: give every entry a proportion, or every entry a repeat")
    streams, epoch_windows = [], 0
    for entry in mixture:
        part = read_manifest(entry.path)
        for key in MIXTURE_MUST_MATCH:
            if part.get(key) != manifest.get(key):
                raise DataError(f"data.mixture: {entry.path} was prepared with {key}="
                                f"{part.get(key)!r}, {data_dir} with {manifest.get(key)!r} (a "
                                "mixture needs one tokenizer and seq_len)")
        windows = part["splits"][split]["windows"] if split in part["splits"] else 0
        if (entry.proportion or 0) < 0 or (entry.repeat or 0) < 0 or windows == 0:
            raise DataError(f"data.mixture: {entry.path} needs a non-negative weight and "
                            f"windows in its {split} split")
        streams.append(streaming.Stream(local=_split_dir(entry.path, part, split),
                                        proportion=entry.proportion, repeat=entry.repeat))
        # Streaming's epoch size: all windows when weighted by proportion, else the repeats.
        epoch_windows += windows if entry.repeat is None else int(entry.repeat * windows)
    return streams, epoch_windows


def build_loader(data_dir: str, split: str, *, micro_batch_size: int, seed: int,
                 shuffle: bool = True, num_workers: int = 2, repeat: bool = True,
                 num_canonical_nodes: int | None = None, verify: bool = True,
                 pin_memory: bool = False, mixture=None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None) -> TokenLoader:
    """The loader of one split of a prepared dataset for this rank.

    Rank and world size come from RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (streaming
    reads them; a plain single process needs none). `seed` is streaming's `shuffle_seed`.
    `num_canonical_nodes` overrides the size-based default, e.g. for node counts that are not a
    power of two. `verify` checks shard sizes now and each shard's checksum on its first read.
    `mixture` (entries with `path` and `proportion` or `repeat`) reads that mixture of datasets'
    `split` instead of `data_dir`'s, whose manifest they must match in tokenizer and seq_len.
    A dataset in an object store (s3://) is read from this node's copy in `cache_dir` (made
    first if there is none; `cache_limit` bytes at most, e.g. "50gb": `data_pipeline.remote`).
    """
    if isinstance(cache_limit, str):
        cache_limit = streaming.base.util.bytes_to_int(cache_limit)

    def local(path: str) -> str:
        return local_copy(path, cache_dir, cache_limit) if objectstore.is_remote(path) else path

    def local_entry(entry):
        if not objectstore.is_remote(entry.path):
            return entry
        entry = copy.copy(entry)
        entry.path = local(entry.path)
        return entry

    data_dir = local(data_dir)
    mixture = [local_entry(entry) for entry in mixture or []]
    manifest = read_manifest(data_dir)
    if mixture:
        streams, num_windows = mixture_streams(data_dir, manifest, mixture, split)
        source = {"streams": streams}
        compressed = any(read_manifest(entry.path).get("compression") for entry in mixture)
    else:
        source = {"local": _split_dir(data_dir, manifest, split)}
        num_windows = manifest["splits"][split]["windows"]
        compressed = manifest.get("compression")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if num_windows < micro_batch_size * world_size:
        raise DataError(f"split {split} of {data_dir} has {num_windows} windows, fewer than one "
                        f"global batch ({micro_batch_size} x {world_size} ranks)")
    _start_resource_tracker_deaf_to_stop_signals()
    registered: list[int] = []
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # Registered before streaming's own exit handlers, so it runs after them (LIFO).
        atexit.register(_release_prefix, registered)
    with _registration_turn():
        dataset = WindowDataset(
            verify=verify, **source, batch_size=micro_batch_size, shuffle=shuffle,
            shuffle_seed=seed, predownload=max(READY_AHEAD, 8 * micro_batch_size),
            num_canonical_nodes=num_canonical_nodes or canonical_nodes_for(num_windows),
            validate_hash=SHARD_HASH if compressed else None)
    registered.append(dataset._shm_prefix_int)
    if verify:
        check_shard_sizes(dataset.shards)
    dataloader = streaming.StreamingDataLoader(
        dataset, batch_size=micro_batch_size, num_workers=num_workers, drop_last=True,
        collate_fn=stack_windows,
        # DataLoader draws its workers' base seed at every epoch start; from its own generator
        # that draw leaves the global torch RNG (the trainer's) untouched.
        generator=torch.Generator().manual_seed(seed))
    return TokenLoader(dataset, dataloader, manifest, split, repeat, pin_memory)
