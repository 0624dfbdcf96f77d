"""One lm-evaluation-harness model for every family: `HarnessModel(model, tokenizer, ...)`.

Requests become token sequences, sorted longest first and scored in batches of `batch_size`,
right-padded (every family is causal, so padding after a row cannot change its scores). A
sequence longer than the model's block keeps its last `block_size + 1` tokens. EBT scores with
its inference descent (`think`), `think_steps` steps from `best_of` noise samples, or with
`think_until` at most that many, each position stopping once its energy settles; its starting
and Langevin noise depend on the position only, so a request scores the same in any batch, on
any rank. With `think_until` the adapter counts the descent steps of the scored tokens per task
(`step_counts`)."""
from __future__ import annotations

import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from data_pipeline.tokenizer import decode_padded
from pretrain.models.common import StepCount

TEXT_TOKENIZERS = ("gpt2",)
"""Tokenizers that can encode arbitrary English text (the char and ListOps vocabularies cannot)."""
DEFAULT_MAX_GEN_TOKS = 256


class Request(NamedTuple):
    """A request as lm-eval hands it to a model (the adapter reads `args` only)."""

    args: tuple


def step_tasks(requests) -> list[str | None]:
    """The task each request's descent steps count for: lm-eval's task name ("" for a caller's
    own `Request`), or None for a request object already in the list, which counts once (lm-eval
    pads a rank's share with copies of its last request)."""
    seen: set[int] = set()
    tasks = []
    for request in requests:
        tasks.append(None if id(request) in seen else getattr(request, "task_name", None) or "")
        seen.add(id(request))
    return tasks


class HarnessModel(LM):
    def __init__(self, model: torch.nn.Module, tokenizer, *, batch_size: int = 8,
                 think_steps: int | None = None, best_of: int = 1, think_until: float | None = None,
                 split_over_ranks: bool = True, progress: bool = True):
        """`model`: any family's model (eval mode is set per call); `tokenizer`: the one it was
        trained with (encode -> ids, decode, eot_id). `think_steps`/`best_of`/`think_until` are
        EBT's inference options (None: the model's n_steps; `think_until`: `think`'s
        stop_tolerance, think_steps then being the most a position takes). `split_over_ranks`:
        under torch.distributed, lm-eval gives each rank a share of the documents and gathers the
        metrics; False scores everything on every rank (identical calls, as ZeRO-3 needs)."""
        super().__init__()
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.thinks = hasattr(model, "think")
        if (think_steps is not None or best_of != 1 or think_until is not None) and not self.thinks:
            raise ValueError(f"{type(model).__name__} does not think: think steps, best-of and "
                             "think-until apply to EBT only")
        self.think_steps, self.best_of, self.think_until, self.progress = think_steps, best_of, think_until, progress
        self.block_size = model.config.block_size
        self._device = next(model.parameters()).device
        if split_over_ranks and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self.tokens_scored = 0
        """Input tokens through the model so far (for throughput measurements)."""
        self._steps_by_task: dict[str, StepCount] = {}
        """With think_until: this rank's descent steps of the scored (or generated) tokens, per task."""
        self._noise: torch.Tensor | None = None

    # --- lm-eval's distributed hooks (the defaults are single-process no-ops) ---------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        parts = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, parts, dst=dst)
        return parts

    def barrier(self) -> None:
        dist.barrier()

    def step_counts(self) -> dict[str, StepCount]:
        """With think_until: the descent steps of the tokens scored so far, per task (lm-eval's
        task names; "" for direct `Request`s), over every rank (a collective when split over
        ranks)."""
        if self.world_size == 1:
            return self._steps_by_task
        parts = [None] * self.world_size
        dist.all_gather_object(parts, self._steps_by_task)
        merged: dict[str, StepCount] = {}
        for part in parts:
            for task, count in part.items():
                merged.setdefault(task, StepCount()).merge(count)
        return merged

    def _count_steps(self, task: str | None, steps_taken: torch.Tensor | None) -> None:
        if task is not None and steps_taken is not None:
            self._steps_by_task.setdefault(task, StepCount()).add(steps_taken)

    # --- scoring ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).tolist()

    def continuation_tokens(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of a request: the pair is encoded whole and split
        after the context's own tokens, so that the continuation is tokenized as it would be in
        running text; whitespace ending the context moves to the continuation (BPE attaches a
        space to the word after it). An empty context is the end-of-document token."""
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        whole = self.encode(stripped + continuation)
        context_ids = self.encode(stripped) if stripped else []
        return context_ids or [self.tokenizer.eot_id], whole[len(context_ids):]

    def _logits(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T, V] next-token logits of the model for ids [B, T] (EBT's are log-probabilities),
        and with think_until the descent steps [B, T] of each position."""
        if not self.thinks:
            return self.model(idx).logits, None
        if torch.is_inference_mode_enabled():
            raise RuntimeError("EBT predicts by gradient descent on its energy and cannot run under "
                               "torch.inference_mode(); call it under torch.no_grad() instead")
        if self._noise is None:  # [best_of, block, V]: row-independent starting candidates
            self._noise = self.model.initial_candidate(self.best_of, self.block_size, self.device, seeded=True)
        rows, length = idx.shape
        candidate = self._noise[:, :length].repeat_interleave(rows, dim=0)
        langevin = self.model.shared_langevin(self.best_of, rows, length, self.block_size, self.device)
        out = self.model.think(idx, steps=self.think_steps, best_of=self.best_of, candidate=candidate,
                               langevin=langevin, stop_tolerance=self.think_until)
        return out.logits, out.steps_taken

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]], desc: str = "scoring",
              tasks: list[str | None] | None = None) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the
        continuation) for each (context ids, continuation ids) pair; with think_until the
        continuation's descent steps count for the pair's task (`step_tasks`; default "")."""
        tasks = tasks or [""] * len(pairs)
        sequences = []
        for context, continuation in pairs:
            tokens = (context + continuation)[-(self.block_size + 1):]
            sequences.append((tokens, min(len(continuation), len(tokens) - 1)))
        order = sorted(range(len(pairs)), key=lambda i: -len(sequences[i][0]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in tqdm(range(0, len(order), self.batch_size), desc=desc, leave=False,
                              disable=not self.progress or self.rank != 0):
                batch = order[start:start + self.batch_size]
                width = len(sequences[batch[0]][0]) - 1
                idx = torch.zeros(len(batch), width, dtype=torch.long)
                for row, i in enumerate(batch):
                    tokens = sequences[i][0]
                    idx[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
                logits, steps_taken = self._logits(idx.to(self.device))
                self.tokens_scored += idx.numel()
                for row, i in enumerate(batch):
                    tokens, n = sequences[i]
                    end = len(tokens) - 1
                    self._count_steps(tasks[i], None if steps_taken is None else steps_taken[row, end - n:end])
                    targets = torch.tensor(tokens[end - n + 1:], device=self.device)
                    # normalised at the scored positions only: a [B, T, V] softmax would dominate
                    rows = F.log_softmax(logits[row, end - n:end].float(), dim=-1)
                    picked = rows.gather(-1, targets[:, None]).squeeze(-1)
                    results[i] = (picked.sum().item(), bool((rows.argmax(-1) == targets).all()))
        finally:
            self.model.train(was_training)
        return results

    # --- lm-eval's request types ------------------------------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self.continuation_tokens(*request.args) for request in requests]
        return self.score(pairs, desc="loglikelihood", tasks=step_tasks(requests))

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Log-likelihood of whole documents, every token predicted once: disjoint windows of up
        to block_size predicted tokens, each after the tokens before it (the first after the
        end-of-document token)."""
        pairs, owners, tasks = [], [], []
        for n, (request, task) in enumerate(zip(requests, step_tasks(requests))):
            windows = get_rolling_token_windows(self.encode(request.args[0]), prefix_token=self.tokenizer.eot_id,
                                                max_seq_len=self.block_size, context_len=1)
            for window in windows:
                pairs.append(make_disjoint_window(window))
                owners.append(n)
                tasks.append(task)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self.score(pairs, desc="loglikelihood_rolling", tasks=tasks)):
            totals[n] += logprob
        return totals

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        """Greedy (or, with do_sample and a temperature, sampled) continuations, batched: each
        step runs the rows' last block_size tokens, right-padded, and appends to each row the
        token predicted at its own end; a row stops at a stop string, the end-of-document token
        or max_gen_toks. Sampling draws from a generator seeded by the row's prompt, so a
        continuation does not depend on its batch or rank."""
        outputs = [""] * len(requests)
        tasks = step_tasks(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].args[0]))
        was_training = self.model.training
        self.model.eval()
        try:
            for start in tqdm(range(0, len(order), self.batch_size), desc="generate_until", leave=False,
                              disable=not self.progress or self.rank != 0):
                batch = order[start:start + self.batch_size]
                texts = self._generate([requests[i].args for i in batch], [tasks[i] for i in batch])
                for i, text in zip(batch, texts):
                    outputs[i] = text
        finally:
            self.model.train(was_training)
        return outputs

    def _generate(self, args: list[tuple[str, dict]], tasks: list[str | None]) -> list[str]:
        kwargs = dict(args[0][1])  # lm-eval batches a task's requests, which share their settings
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        rows = [self.encode(context) or [self.tokenizer.eot_id] for context, _ in args]
        generators = [torch.Generator(device=self.device).manual_seed(zlib.crc32(context.encode()))
                      for context, _ in args]
        prompt_lengths = [len(r) for r in rows]
        done = [False] * len(rows)
        texts = [""] * len(rows)
        for _ in range(max_new):
            live = [n for n in range(len(rows)) if not done[n]]
            if not live:
                break
            windows = [rows[n][-self.block_size:] for n in live]
            width = max(len(w) for w in windows)
            idx = torch.zeros(len(live), width, dtype=torch.long)
            for r, w in enumerate(windows):
                idx[r, : len(w)] = torch.tensor(w)
            logits, steps_taken = self._logits(idx.to(self.device))
            self.tokens_scored += idx.numel()
            ends = torch.tensor([len(w) - 1 for w in windows])
            last = logits[torch.arange(len(live)), ends].float()
            for r, n in enumerate(live):
                self._count_steps(tasks[n], None if steps_taken is None else steps_taken[r, ends[r]])
            if temperature > 0:
                probs = (last / temperature).softmax(-1)
                tokens = [torch.multinomial(probs[r], 1, generator=generators[n]) for r, n in enumerate(live)]
            else:
                tokens = last.argmax(-1)
            for r, n in enumerate(live):
                token = int(tokens[r])
                if token == self.tokenizer.eot_id:
                    done[n] = True
                    continue
                rows[n].append(token)
                texts[n] = decode_padded(self.tokenizer.decode, rows[n][prompt_lengths[n]:],
                                         self.tokenizer.vocab_size)
                cut = min((texts[n].find(s) for s in until if s in texts[n]), default=-1)
                if cut >= 0:
                    texts[n], done[n] = texts[n][:cut], True
        return texts
