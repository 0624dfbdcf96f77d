"""The one place mosaicml-streaming is imported.

`import streaming` imports `streaming.vision` and `streaming.multimodal`, which import torchvision
(the build streaming would pull in does not import beside a CPU torch), and `streaming.text`,
which imports transformers' tokenizer registry (seconds of start-up). We use none of the three:
registering empty stand-ins for them before the first import keeps the rest of streaming (MDS
writer, StreamingDataset/DataLoader) working unchanged.
`streaming.base.dataloader` imports transformers too (1.3 s of every training process's start),
only to recognise transformers' batch types when counting a batch's samples; its stand-in holds
`SampleCountingLoader`, the same loader without that import, as `streaming.StreamingDataLoader`.
Everything else in the project does `from data_pipeline.streaming_compat import streaming`.
"""
import sys
import types
from typing import Any, Iterator

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter


class SampleCountingLoader(DataLoader):
    """A DataLoader over a StreamingDataset that counts the samples it yielded in the current
    epoch, so that `state_dict()` is the dataset's position over all ranks, as streaming's
    StreamingDataLoader does (a dict batch counts the length of its first value, any other
    batch the length of its first element)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_samples_yielded = 0

    def __iter__(self) -> Iterator[Any]:
        self.num_samples_yielded = 0
        batches = super().__iter__()
        try:
            for batch in batches:
                self.num_samples_yielded += len(next(iter(batch.values())) if isinstance(batch, dict) else batch[0])
                yield batch
        finally:
            # Stop this iteration's workers now, also after an error. Left to garbage collection,
            # they would outlive the run: the exception torch re-raises from a worker is in a
            # reference cycle with its traceback, which holds this frame and so the iterator, and
            # at exit multiprocessing stops its children with SIGTERM, which the trainer's workers
            # ignore (`ignore_stop_signals`), then waits for them without a time limit. (A
            # persistent workers' iterator is the loader's own, stopped by `__del__`.)
            if isinstance(batches, _MultiProcessingDataLoaderIter) and batches is not self._iterator:
                batches._shutdown_workers()
                for worker in batches._workers:
                    # left by torch's SIGTERM, its last resort for a worker that did not stop
                    # within 5 s of being asked (blocked in a read or in a wait of streaming's)
                    if worker.is_alive():
                        worker.kill()
                        worker.join()

    def state_dict(self) -> dict[str, Any]:
        from streaming.base.world import World

        num_samples = self.num_samples_yielded * World.detect().num_ranks
        if self.dataset.replication is not None:  # `replication` consecutive ranks share samples
            num_samples //= self.dataset.replication
        return self.dataset.state_dict(num_samples, False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def __del__(self) -> None:
        if self._iterator is not None:  # end the workers of an iteration left unfinished
            self._iterator._shutdown_workers()


for _unused in ("streaming.vision", "streaming.multimodal", "streaming.text"):
    sys.modules.setdefault(_unused, types.ModuleType(_unused))
sys.modules.setdefault("streaming.base.dataloader", types.ModuleType("streaming.base.dataloader"))
sys.modules["streaming.base.dataloader"].StreamingDataLoader = SampleCountingLoader

import streaming  # noqa: E402  (must follow the stand-ins above)
import streaming.base.hashing  # noqa: E402,F401  (shard checksums, used by the loader)
import streaming.base.compression  # noqa: E402,F401
import streaming.base.constant  # noqa: E402,F401
import streaming.base.util  # noqa: E402,F401
import streaming.base.batching  # noqa: E402,F401  (the loader's batching method for any node count)
import streaming.base.world  # noqa: E402,F401

__all__ = ["streaming"]
