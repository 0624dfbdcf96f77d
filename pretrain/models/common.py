"""Pieces every model family shares: the output type, the base class with the bookkeeping the
trainer relies on (parameter counts, optimizer hints, generation), and the decoding cache.

Incremental decoding: `forward(idx, cache=cache)` (EBT: `next_token_logits(idx, cache)`) runs
only the new tokens `idx`, reading what the earlier tokens left in the cache (keys and values
per attention layer or recurrent step) and adding theirs; its logits equal those of a forward
over the whole sequence up to float rounding. `decode` is the one generation loop on top."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelOutput:
    loss: torch.Tensor | None
    """Mean next-token cross entropy over all positions; None when no targets are given."""
    logits: torch.Tensor
    """[B, T, V] next-token logits (for EBT: the final candidate, as log-probabilities outside
    training)."""
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    """0-d tensors are scalars to log; 1-d tensors hold one value per recurrent/descent step."""


class LanguageModel(nn.Module):
    """Base class of every family. Subclasses set `self.config` and implement `forward`,
    `embedding_parameters` and `flops_per_token`."""

    config: object

    @staticmethod
    def compile_refusal(config: object) -> str | None:
        """Why torch.compile cannot take this family's training forward under `config`, or None
        when it can: a forward that calls autograd.grad with create_graph (training then
        backpropagates through a gradient, a double backward) is not traced by dynamo."""
        return None

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Parameters counted as embeddings (excluded from the non-embedding count)."""
        raise NotImplementedError

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        raise NotImplementedError

    def num_params(self, non_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= sum(p.numel() for p in self.embedding_parameters())
        return total

    def no_weight_decay_names(self) -> set[str]:
        """Names of parameters trained without weight decay: norms, biases, scalars, embeddings."""
        embedding_ids = {id(p) for p in self.embedding_parameters()}
        return {n for n, p in self.named_parameters() if p.ndim < 2 or id(p) in embedding_ids}

    def never_decayed_names(self) -> set[str]:
        """Names of parameters no weight-decay set decays (step sizes such as EBT's alpha)."""
        return set()

    def lr_multipliers(self) -> dict[str, float]:
        """Parameter name -> learning-rate multiplier, for parameters that need their own LR."""
        return {}

    def float32_names(self) -> set[str]:
        """Names of parameters that stay float32 when a run keeps the rest of the module in bf16:
        those whose bf16 spacing near their value is coarser than their updates."""
        return set()

    def zero3_leaf_modules(self) -> list[type[nn.Module]]:
        """Module classes DeepSpeed ZeRO-3 must gather whole (e.g. loops that call autograd.grad)."""
        return []

    def seed_shared_draws(self, seed: str) -> None:
        """Seed the random draws that set how much work a training forward does (EBT's number of
        descent steps). Every rank must draw them alike: ZeRO reduces the gradients at every
        micro-step, so the rank with the most work would set every rank's pace. The trainer
        seeds them before each micro-step from the run's seed, the step and the micro-step:
        the same on every rank, and again in a resumed run. Families without such draws have
        nothing to seed."""

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None) -> torch.Tensor:
        """Sample continuations of idx [B, T0] (decoded incrementally; past the block size the
        context is the last block_size tokens)."""
        choose = functools.partial(sample_logits, temperature=temperature, top_k=top_k)
        new = list(decode(self, idx, max_new_tokens, choose))
        return torch.cat([idx, *(token[:, None] for token in new)], dim=1)

    # A compiled model decodes eagerly: each new context length would be another graph to
    # compile (dynamo's recompile limit is 8), for a few tokens of sample. The stance is set
    # per call, not by a decorator: a decorator imports dynamo (2 s) into every process that
    # imports a model, compiled or not.
    def next_token_logits(self, idx: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        """[B, V] logits for the token after `idx` (without a cache: the whole context), or
        after the tokens in `cache` followed by `idx` (which the cache then holds too); EBT
        overrides this with its descent. Nothing is recorded for autograd: inference mode costs
        less per op than no_grad, and a decoded token of a small model is a hundred small ops.
        A cache filled here is for further calls of this method only (its tensors are inference
        tensors)."""
        with torch.compiler.set_stance("force_eager"), torch.inference_mode():
            logits = self(idx, cache=cache).logits[:, -1, :]
        return logits.clone()  # an ordinary tensor, which callers may edit in place


class KVSlot:
    """What one attention layer (or one recurrent step) keeps of the tokens seen so far:
    tensors [B, H, tokens, d] (keys, values, or whatever the layer needs), in buffers that grow
    by doubling so that appending a token costs no copy of the earlier ones."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.length = 0

    def contents(self) -> tuple[torch.Tensor, ...]:
        return tuple(b[:, :, :self.length] for b in self.buffers)

    def append(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Add the new tokens' tensors (dim 2); returns every token's so far."""
        end = self.length + tensors[0].size(2)
        if not self.buffers or end > self.buffers[0].size(2):
            capacity = max(16, 2 * end)
            grown = [t.new_empty(*t.shape[:2], capacity, t.size(3)) for t in tensors]
            for new, old in zip(grown, self.buffers):
                new[:, :, :self.length] = old[:, :, :self.length]
            self.buffers = grown
        for buffer, t in zip(self.buffers, tensors):
            buffer[:, :, self.length:end] = t
        self.length = end
        return self.contents()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the new tokens' queries [B, H, n, d] over every key so far, after
        appending the new keys and values."""
        keys, values = self.append(k, v)
        n_new, n_all = q.size(2), keys.size(2)
        if n_new == n_all:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        # SDPA's is_causal aligns the mask to the first key, not to the last
        mask = None if n_new == 1 else torch.ones(n_new, n_all, dtype=torch.bool, device=q.device).tril(n_all - n_new)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class DecodeCache:
    """The state incremental decoding keeps between calls: the token ids seen so far and one
    `KVSlot` per attention layer or recurrent step (created on first use, any hashable key)."""

    def __init__(self):
        self.tokens: torch.Tensor | None = None
        """[B, length] ids of every token the cache holds."""
        self.slots: dict = {}

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else self.tokens.size(1)

    def slot(self, key) -> KVSlot:
        return self.slots.setdefault(key, KVSlot())

    def remember(self, idx: torch.Tensor) -> int:
        """Record the new tokens idx [B, n]; returns the position of the first."""
        start = self.length
        self.tokens = idx if self.tokens is None else torch.cat([self.tokens, idx], dim=1)
        return start

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` [B'] of everything held, in that order (rows may repeat).
        Hugging Face's beam search calls this, by this name, to follow the beams it keeps."""
        self.tokens = self.tokens.index_select(0, rows)
        for slot in self.slots.values():
            slot.buffers = [b.index_select(0, rows) for b in slot.buffers]


def sample_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """[B] tokens drawn from logits [B, V] (torch's global RNG): temperature 0 is greedy
    (argmax); `top_k` keeps the k most likely tokens, `top_p` the smallest set of most likely
    tokens whose probability reaches p (nucleus sampling)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # a token is dropped when the more likely ones already reach p (the first is always kept)
        dropped_in_order = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(dropped_in_order.scatter(-1, order, dropped_in_order), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1).squeeze(-1)


def window(cache: DecodeCache | None, idx: torch.Tensor, block_size: int) -> tuple[DecodeCache, torch.Tensor]:
    """(cache, tokens to feed it) for the logits after the sequence idx [B, T], given the cache of
    idx's earlier tokens: the tokens the cache has not seen; with no cache yet, or once idx
    passes the block size, a fresh cache and the last block_size tokens (no cache can slide:
    learned positions and deeper rotary keys depend on the dropped tokens)."""
    if cache is None or idx.size(1) > block_size:
        cache = DecodeCache()
    return cache, idx[:, cache.length:][:, -block_size:]


@torch.no_grad()
def decode(model: LanguageModel, prompts: torch.Tensor, max_new_tokens: int,
           choose: Callable[[torch.Tensor], torch.Tensor], prompt_lengths: list[int] | None = None,
           on_slide: Callable[[], None] | None = None, **logit_options) -> Iterator[torch.Tensor]:
    """Generate from prompts [B, T0] one position at a time with a decoding cache, yielding the
    [B] tokens of each position from the shortest prompt's length on. Prompts of different
    lengths are right-padded, with `prompt_lengths` giving each row's: a row still inside its
    prompt is fed its prompt token instead of the chosen one, so every row stays at the same
    position. The longest prompt gets `max_new_tokens` chosen tokens (shorter ones get more).
    `choose(logits [B, V]) -> [B]` picks the tokens; `logit_options` go to
    `next_token_logits` (EBT: steps, best_of, stop_tolerance, steps_taken). Once the sequence
    would pass the block size, every token recomputes the last block_size tokens into a fresh
    cache (`on_slide` is called then, once)."""
    block_size = model.config.block_size
    lengths = torch.tensor(prompt_lengths or [prompts.size(1)] * prompts.size(0), device=prompts.device)
    position = int(lengths.min())
    idx = prompts[:, :position]
    cache, slid = None, False
    for i in range(int(lengths.max()) - position + max_new_tokens):
        if i and idx.size(1) > block_size and not slid:
            slid = True
            if on_slide is not None:
                on_slide()
        cache, new = window(cache, idx, block_size)
        logits = model.next_token_logits(new, cache, **logit_options)
        token = choose(logits)
        if position < prompts.size(1):  # rows still inside their prompt keep its token
            token = torch.where(lengths > position, prompts[:, position], token)
        yield token
        idx = torch.cat([idx, token[:, None]], dim=1)
        position += 1


class StepCount:
    """Descent steps taken by predicted positions, over any number of calls: adaptive thinking's
    cost (`think` with a stop_tolerance)."""

    def __init__(self):
        self.steps = 0
        """Steps summed over the positions counted."""
        self.positions = 0
        self.most = 0
        """The most steps one position took."""

    def add(self, steps_taken: torch.Tensor) -> None:
        """Count the positions of `steps_taken` (any shape)."""
        if steps_taken.numel():
            self.steps += int(steps_taken.sum())
            self.positions += steps_taken.numel()
            self.most = max(self.most, int(steps_taken.max()))

    def merge(self, other: StepCount) -> None:
        self.steps, self.positions = self.steps + other.steps, self.positions + other.positions
        self.most = max(self.most, other.most)

    @property
    def mean(self) -> float | None:
        return self.steps / self.positions if self.positions else None
