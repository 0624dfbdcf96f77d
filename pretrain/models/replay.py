"""EBT's replay buffer (S2, Sec. 3.3 of the EBT paper): the per-rank store of recent training rows
that later batches restart from, its size, and how the saved stores of one world size are dealt
out over another. The model holds a store (`EBT.replay_store`) and the checkpoint manager saves it
per rank, as the family's spec hands it over (`FamilySpec.rank_states`). A `config` here is the
model's `EBTConfig`."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from pretrain.models.blocks import wide

STORE_CHUNK_BYTES = 16 * 2**20
"""The most candidate bytes `ReplayStore.store` keeps at once, unless one row is larger."""

LEGACY_REPLAY_BUFFERS = ("replay_tokens", "replay_targets", "replay_candidates", "replay_lengths", "replay_next")
"""The registered buffers that held the replay buffer in checkpoints written before `ReplayStore`."""


def kept_probabilities(config: Any) -> int:
    """Probabilities a replay row keeps per position (`replay_top_k`); 0: the whole logits."""
    return config.replay_top_k if config.replay_top_k < config.vocab_size else 0


def replay_layout(config: Any,
                  dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the tensors of a replay store, with candidates of `dtype` (the
    training candidate's, float32 unless the model runs in float64)."""
    rows, T, V, k = config.replay_buffer_size, config.block_size, config.vocab_size, kept_probabilities(config)
    layout = {"tokens": ((rows, T), torch.long), "targets": ((rows, T), torch.long), "lengths": ((rows,), torch.long)}
    if k:
        layout.update(top_logp=((rows, T, k), dtype), top_ids=((rows, T, k), torch.int32), rest_logp=((rows, T), dtype))
    else:
        layout["logits"] = ((rows, T, V), dtype)
    return layout


def replay_store_bytes(config: Any) -> int:
    """Device bytes of one rank's replay store for `config` (0 without a replay buffer); its
    checkpoint file holds the same."""
    if not config.replay_buffer_size:
        return 0
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in replay_layout(config).values())


def replay_scratch_bytes(config: Any) -> int:
    """Device bytes `ReplayStore.store` allocates for a moment beside the store (0 without a replay
    buffer or with whole logits kept), at most: `kept` of one chunk of float32 candidates [rows,
    T, V] holds their log-probabilities (the top ids masked in place) and the logsumexp's shifted
    copy at once, with the top-k values and ids. (Decoding replayed rows, `extend`,
    happens as a step begins, far below its peak.)"""
    k = kept_probabilities(config) if config.replay_buffer_size else 0
    if not k:
        return 0
    row_bytes = config.block_size * config.vocab_size * 4
    rows = min(config.replay_buffer_size, max(1, STORE_CHUNK_BYTES // row_bytes))
    return rows * config.block_size * (2 * config.vocab_size * 4 + k * (4 + 8))


class ReplayStore:
    """The replay buffer of one rank (S2, Sec. 3.3): a ring of `replay_buffer_size` recent
    training rows, their tokens, targets and final candidates, which later batches restart from.
    Plain tensors on the device of the training batches, allocated when the first rows are
    stored, outside the module's state (so outside DeepSpeed's buffers and the exports): the
    checkpoint manager saves each rank's store in a file of its own.

    A candidate is kept as the distribution it stands for (`kept`): the `replay_top_k` largest
    log-probabilities per position with their ids, and one log-probability for every other id
    (the rest of the mass spread evenly). A replayed row restarts from these log-probabilities as
    its logits: they differ from a candidate's logits by a constant per position, which the
    softmax of a descent step, its update and the cross entropy all ignore, so the row restarts
    from exactly the kept distribution. With top-k off the logits are kept whole."""

    def __init__(self, config: Any):
        self.config = config
        self.top_k = kept_probabilities(config)
        self.tensors: dict[str, torch.Tensor] = {}
        """The tensors of `replay_layout`, empty until rows are first stored."""
        self.lengths: list[int] = []
        """Each slot's row length (0: empty) as tensors["lengths"] has it, kept on the host too:
        `extend` sizes the batch from it without waiting for the device."""
        self.next = 0
        """The slot the next row goes to: the oldest row once the ring is full."""

    def extend(self, idx: torch.Tensor, targets: torch.Tensor, candidate: torch.Tensor):
        """(idx, targets [B, T], candidate [B, T, V]) followed by round(replay_fraction x B) stored
        rows of the same length, drawn at random, starting from their stored candidates."""
        T = idx.size(1)
        stored = self.lengths.count(T)
        n = min(self.config.replayed_rows(idx.size(0)), stored)
        if n == 0:
            return idx, targets, candidate
        lengths = self.tensors["lengths"]
        # nonzero with its size known on the host: the same slots as nonzero(), without a sync
        slots = torch.nonzero_static(lengths == T, size=stored).flatten()
        pick = slots[torch.randperm(stored, device=lengths.device)[:n]]
        return (torch.cat([idx, self.tensors["tokens"][pick, :T]]),
                torch.cat([targets, self.tensors["targets"][pick, :T]]),
                torch.cat([candidate, self.candidates(pick, T).to(candidate.dtype)]))

    def candidates(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """[len(slots), length, V] logits of the candidates stored at `slots`."""
        t = self.tensors
        if not self.top_k:
            return t["logits"][slots, :length]
        rest = t["rest_logp"][slots, :length, None].expand(-1, -1, self.config.vocab_size).contiguous()
        return rest.scatter_(-1, t["top_ids"][slots, :length].long(), t["top_logp"][slots, :length])

    def kept(self, candidate: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the store keeps of candidate logits [..., V]."""
        if not self.top_k:
            return {"logits": candidate}
        logp = candidate.log_softmax(dim=-1)
        top = logp.topk(self.top_k, dim=-1, sorted=False)
        # log(the other ids' probabilities summed / their count), exact however small the rest;
        # in place (topk's values are a copy): one [..., V] of scratch fewer
        rest = logp.scatter_(-1, top.indices, -math.inf).logsumexp(dim=-1)
        rest = rest - math.log(self.config.vocab_size - self.top_k)
        return {"top_logp": top.values, "top_ids": top.indices, "rest_logp": rest}

    @torch.no_grad()
    def store(self, idx: torch.Tensor, targets: torch.Tensor, final_candidate: torch.Tensor) -> None:
        """Write the last rows of a batch (as many as the ring holds) over the oldest rows:
        idx, targets [B, T] and their final candidates [B, T, V]."""
        rows, T = idx.shape
        size = self.config.replay_buffer_size
        keep = min(rows, size)
        if not self.tensors:
            self.tensors = {name: torch.zeros(shape, dtype=dtype, device=idx.device)
                            for name, (shape, dtype) in replay_layout(self.config, final_candidate.dtype).items()}
            self.lengths = [0] * size
        # the slots computed where the rows are: an index built on the host would be a copy that waits for the device
        index = (torch.arange(keep, device=idx.device) + self.next) % size
        self.tensors["tokens"][index, :T] = idx[-keep:]
        self.tensors["targets"][index, :T] = targets[-keep:]
        self.tensors["lengths"][index] = T
        # as many rows at a time as fit STORE_CHUNK_BYTES (at least one): a few kernels for small
        # rows, and for rows over it the one row's scratch of keeping rows one by one
        rows_per_chunk = max(1, STORE_CHUNK_BYTES // final_candidate[0].nbytes)
        for slots, candidates in zip(index.split(rows_per_chunk), final_candidate[-keep:].split(rows_per_chunk)):
            for name, value in self.kept(candidates).items():
                kept = self.tensors[name]
                kept[slots, :T] = value.to(kept.dtype)  # top-k ids: int64 -> int32
        for i in range(keep):
            self.lengths[(self.next + i) % size] = T
        self.next = (self.next + keep) % size

    def youngest_first(self) -> list[int]:
        """The slots holding rows, the one stored last first."""
        lengths = self.lengths
        return [slot for slot in ((self.next - 1 - age) % len(lengths) for age in range(len(lengths))) if lengths[slot]]

    def state_dict(self) -> dict:
        """The store's layout, ring position and tensors (where they are)."""
        return {"top_k": self.top_k, "next": self.next, **self.tensors}

    @classmethod
    def saved(cls, config: Any, state: dict) -> ReplayStore:
        """The store a `state_dict` describes, in its own layout, its tensors where they are."""
        tensors = {name: value for name, value in state.items() if torch.is_tensor(value)}
        rows = tensors["lengths"].numel() if tensors else config.replay_buffer_size
        store = cls(replace(config, replay_top_k=state["top_k"], replay_buffer_size=rows))
        store.tensors, store.next = tensors, state["next"]
        store.lengths = tensors["lengths"].tolist() if tensors else []
        return store

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Take the rows of a `state_dict` onto `device`: as they are, or converted row by row
        when they were saved in another layout."""
        saved = ReplayStore.saved(self.config, state)
        if replay_layout(saved.config) == replay_layout(self.config):
            self.tensors, self.next = {name: t.to(device) for name, t in saved.tensors.items()}, saved.next
            self.lengths = saved.lengths
        else:
            self.refill([(saved, slot) for slot in reversed(saved.youngest_first())], device)

    def load_legacy(self, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        """Take the rows of the `LEGACY_REPLAY_BUFFERS` of a checkpoint from before the store
        (whole candidate logits, possibly in bf16) onto `device`, in this store's layout."""
        state = {"top_k": 0, "next": int(buffers["replay_next"]), "tokens": buffers["replay_tokens"],
                 "targets": buffers["replay_targets"], "lengths": buffers["replay_lengths"],
                 "logits": wide(buffers["replay_candidates"])}
        self.load_state_dict(state, device)

    def refill(self, rows: list[tuple[ReplayStore, int]], device: torch.device) -> None:
        """Empty the store, then store the rows (store, slot) in this order onto `device`."""
        self.tensors, self.lengths, self.next = {}, [], 0
        for source, slot in rows:
            length = source.lengths[slot]
            index = torch.tensor([slot], device=source.tensors["lengths"].device)
            self.store(source.tensors["tokens"][index, :length].to(device),
                       source.tensors["targets"][index, :length].to(device),
                       source.candidates(index, length).to(device))

    def deal(self, saved: dict[int, dict], saved_world: int, rank: int, world: int, device: torch.device) -> str:
        """This rank's rows after the world size changed from `saved_world` to `world`, from the
        saved stores of the old ranks `dealt_from` names (old rank -> state): row `age` (0 the
        youngest) of old rank r goes to rank (r + saved_world x age) mod world, so that the rows
        are dealt out evenly and none twice, and a rank keeps its youngest replay_buffer_size.
        Returns the line that says so."""
        mine = []
        for old_rank, state in saved.items():
            store = ReplayStore.saved(self.config, state)
            mine += [(age, old_rank, store, slot) for age, slot in enumerate(store.youngest_first())
                     if (old_rank + saved_world * age) % world == rank]
        mine = sorted(mine, key=lambda row: row[:2])[:self.config.replay_buffer_size]
        self.refill([(store, slot) for _, _, store, slot in reversed(mine)], device)
        return (f"EBT's replay buffers of {saved_world} process(es) are dealt out over {world}: every saved "
                f"row goes to one process, which keeps its youngest {self.config.replay_buffer_size}")

    @staticmethod
    def dealt_from(rank: int, saved_world: int, world: int) -> list[int]:
        """The old ranks whose rows `deal` can give `rank`."""
        common = math.gcd(saved_world, world)
        return [old_rank for old_rank in range(saved_world) if (rank - old_rank) % common == 0]
