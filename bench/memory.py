"""Peak CPU memory of a piece of work, read from the allocator's own event timeline.

Shared by the model tests and `bench.models`. The profiler records every allocation and free
(address, signed size); the running sum of those sizes is the memory held by tensors created
during the work, so its maximum is the peak. This is unaffected by activation checkpointing's
hooks (which make a count of tensors saved for backward wrong) and by memory the process held
before (which hides small peaks in the RSS high-water mark). The profiler's own "Total
Allocated" field is not used: with repeated gradient accumulation it misses frees and
overstates the peak (checked against glibc's mallinfo2)."""
from __future__ import annotations

import itertools
import json
import os
import tempfile
from typing import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(work: Callable[[], object]) -> int:
    """The highest number of CPU bytes allocated and not yet freed while `work()` runs,
    counted from the start of the call (memory allocated before it does not count)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    changes = sorted((e["ts"], e["args"]["Ev Idx"], e["args"]["Bytes"]) for e in events
                     if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    return max(itertools.accumulate(size for _, _, size in changes), default=0)
