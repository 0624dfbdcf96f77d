"""Which rank holds the job back. At every log interval the ranks share their own part of one
step (computation and data wait up to the step's last backward, before the gradient reduction
makes every rank wait for the slowest; carried in the step's one all-reduce). TensorBoard gets
the slowest rank's time and its ratio to the median rank's; a rank slower than
`train.straggler_factor` times the median at `train.straggler_intervals` log intervals in a row
is named in one warning line, with its host (a throttled GPU, a noisy neighbour, a slow disk)."""
from __future__ import annotations

MIN_LAG_S = 0.05
"""A rank counts as slow only when it also lags the median rank by this much: below it the gap is
the operating system's scheduling on a busy host (a 2-core host showed 1.2-2x ratios at steps
of 10-20 ms, none sustained), not a rank that holds the job back."""


class Stragglers:
    def __init__(self, factor: float, intervals: int, hosts: list[str]):
        self.factor, self.intervals, self.hosts = factor, intervals, hosts
        self.slow_in_a_row = [0] * len(hosts)

    def observe(self, rank_times: list[float]) -> tuple[dict[str, float], list[str]]:
        """The scalars and warning lines of one log step, from every rank's computation times
        followed by every rank's data waits (seconds)."""
        world_size = len(self.hosts)
        compute, wait = rank_times[:world_size], rank_times[world_size:]
        own = [c + w for c, w in zip(compute, wait)]
        # the lower median: with 2 ranks, the faster one, which the slower is compared with
        median = sorted(own)[(world_size - 1) // 2]
        slowest = max(range(world_size), key=own.__getitem__)
        ratio = own[slowest] / median if median > 0 else 1.0
        scalars = {"train/slowest_rank_ms": own[slowest] * 1e3, "train/straggler_ratio": ratio}
        lines = []
        for rank in range(world_size):
            slow = bool(self.factor) and own[rank] > self.factor * median and own[rank] - median >= MIN_LAG_S
            self.slow_in_a_row[rank] = self.slow_in_a_row[rank] + 1 if slow else 0
            if self.slow_in_a_row[rank] == self.intervals:
                lines.append(
                    f"warning: rank {rank} on {self.hosts[rank]} is a straggler: its own part of a step took "
                    f"{own[rank] / median:.1f}x the median rank's ({own[rank] * 1e3:.0f} ms: {compute[rank] * 1e3:.0f} "
                    f"computing, {wait[rank] * 1e3:.0f} waiting for data; median {median * 1e3:.0f} ms) at "
                    f"{self.intervals} log intervals in a row (train.straggler_factor={self.factor:g}); every "
                    "other rank waits for it at each step")
        return scalars, lines
