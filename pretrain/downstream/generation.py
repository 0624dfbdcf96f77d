"""Generation quality on OpenWebText-style prompts, the NRGPT paper's second measure: the model
continues the first PROMPT_TOKENS tokens of windows of its own validation split (OpenWebText
for the paper-scale configs) and the continuations are scored for diversity (distinct-1/2:
distinct word n-grams / all word n-grams, over all continuations) and, given a reference model,
for fluency (the reference's perplexity per token of the continuations, after their prompts).

Under torch.distributed each rank continues its share of the windows (the loader splits the
split by rank in the order of one process) and rank 0 pools them: sampling is seeded per prompt,
so the pooled continuations, and the figures, are those of one process."""
from __future__ import annotations

import math

import torch.distributed as dist

from pretrain.downstream.adapter import HarnessModel, Request
from pretrain.downstream.harness import GENERATION_TASK as TASK
from pretrain.downstream.harness import Row

PROMPT_TOKENS = 32
NEW_TOKENS = 64
TEMPERATURE = 1.0


def validation_prompts(data_dir: str, count: int) -> list[list[int]]:
    """The first PROMPT_TOKENS tokens of this rank's share of the first `count` val windows
    (rank r of W reads windows r, r + W, ...)."""
    from data_pipeline.loader import build_loader

    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    share = len(range(rank, count, world_size))
    loader = build_loader(data_dir, "val", micro_batch_size=1, seed=0, shuffle=False, num_workers=0, repeat=False)
    prompts: list[list[int]] = []
    if share == 0:
        return prompts
    for inputs, _ in loader:
        prompts.append(inputs[0, :PROMPT_TOKENS].tolist())
        if len(prompts) == share:
            break
    return prompts


def distinct(words: list[list[str]], n: int) -> float:
    grams = [tuple(w[i:i + n]) for w in words for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def generation_quality(model: HarnessModel, prompts: list[list[int]], reference: HarnessModel | None,
                       ) -> tuple[list[Row], list[dict]] | None:
    """Rows (distinct_1, distinct_2, and reference_ppl with a reference) and the continuations
    ({prompt, text}) pooled over the ranks; None on ranks other than 0."""
    settings = {"until": [], "max_gen_toks": NEW_TOKENS, "do_sample": True, "temperature": TEMPERATURE}
    texts = [model.tokenizer.decode(p) for p in prompts]
    continuations = model.generate_until([Request((t, settings)) for t in texts])
    scored = []
    for prompt, text in zip(texts, continuations):
        record = {"prompt": prompt, "text": text}
        if reference is not None:
            context_ids, continuation_ids = reference.continuation_tokens(prompt, text)
            (logprob, _), = reference.score([(context_ids, continuation_ids)], desc="reference")
            # tokens scored: a continuation longer than the reference's block keeps its last ones
            record.update(reference_logprob=logprob,
                          reference_tokens=min(len(continuation_ids), reference.block_size))
        scored.append(record)
    if model.world_size > 1:
        parts = model.gather_object(scored)
        if model.rank != 0:
            return None
        scored = [record for part in parts for record in part]
    words = [record["text"].split() for record in scored]
    note = f"{len(scored)} continuations of {NEW_TOKENS} tokens at temperature {TEMPERATURE}"
    rows = [Row(TASK, f"distinct_{n}", distinct(words, n), None, len(scored), note=note) for n in (1, 2)]
    if reference is not None:
        tokens = sum(r["reference_tokens"] for r in scored)
        nll = -sum(r["reference_logprob"] for r in scored) / max(tokens, 1)
        rows.append(Row(TASK, "reference_ppl", math.exp(min(nll, 50.0)), None, len(scored),
                        note="perplexity per token under the reference model"))
    return rows, scored
