"""The one place mosaicml-streaming is imported.

`import streaming` imports `streaming.vision` and `streaming.multimodal`, which import torchvision
(the build streaming would pull in does not import beside a CPU torch), and `streaming.text`,
which imports transformers' tokenizer registry (seconds of start-up). We use none of the three:
registering empty stand-ins for them before the first import keeps the rest of streaming (MDS
writer, StreamingDataset/DataLoader) working unchanged.
Everything else in the project does `from data_pipeline.streaming_compat import streaming`.
"""
import sys
import types

for _unused in ("streaming.vision", "streaming.multimodal", "streaming.text"):
    sys.modules.setdefault(_unused, types.ModuleType(_unused))

import streaming  # noqa: E402  (must follow the stand-ins above)
import streaming.base.hashing  # noqa: E402,F401  (shard checksums, used by the loader)
import streaming.base.compression  # noqa: E402,F401
import streaming.base.constant  # noqa: E402,F401
import streaming.base.util  # noqa: E402,F401
import streaming.base.batching  # noqa: E402,F401  (the loader's batching method for any node count)
import streaming.base.world  # noqa: E402,F401

__all__ = ["streaming"]
