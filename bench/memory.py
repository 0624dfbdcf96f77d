"""Peak CPU memory of a piece of work, read from the allocator's own timeline.

Shared by the model tests and `bench.models`. The profiler records every allocation and free
with the running total of allocated bytes, so the peak is exact and unaffected by activation
checkpointing's hooks (which make a count of tensors saved for backward wrong) or by memory
the process held before (which hides small peaks in the RSS high-water mark)."""
from __future__ import annotations

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
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    return max(totals, default=0)
