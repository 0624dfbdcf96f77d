"""Incremental decoding against full recompute: generated tokens per second of every family,
with the decoding cache and without it, at prompts of 128 and 512 tokens.

    python -m bench.sample [--prompts 128 512] [--new-tokens 64] [--block-size 640] [--rounds 5]

"Without the cache" is what generation did before it: each new token runs the model over the
whole context (for EBT, the observed stream over every token, then the descent). "With the
cache" is `pretrain.models.common.decode`: the prompt once (its time is reported apart, as
prefill), then each token runs alone against the cached keys and values. Both decode greedily
from the same untrained weights, batch 1, and must pick the same tokens (checked). Sizes: the
`-tiny` flavors, and a small shape (D=128, 4 heads, 6 layers or recurrent steps: gpt-small and
nrgpt-small, the other families overridden to it), all at vocabulary 512 with the block size
raised to hold the longest prompt and its new tokens. Time is the process's CPU time with one
intra-op thread (on a shared machine wall-clock time mostly measures the other jobs). Each
round times both ways back to back; rates and the ratio are medians over rounds, and "range" is
the spread of the rounds' ratios.

`--hf` adds Hugging Face `generate()` through the wrapper that the carried-code exports use
(gpt_rec, nrgpt, ebt), with its cache (the default) and with `use_cache=False`, each call timed
whole (prompt included)."""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable

import torch

from bench.models import print_table
from common.cli import ArgumentParser, run_command
from pretrain.models import build, resolve
from pretrain.models.common import DecodeCache, sample_logits

SMALL = {"n_embd": 128, "n_head": 4}
SIZES = {
    "tiny": [("gpt", "gpt-tiny", {}), ("gpt_rec", "gpt_rec-tiny", {}), ("nrgpt", "nrgpt-tiny", {}),
             ("transformer_pp", "transformer_pp-tiny", {}), ("ebt", "ebt-tiny", {})],
    "small": [("gpt", "gpt-small", {}), ("gpt_rec", "gpt_rec-tiny", {**SMALL, "n_steps": 6}),
              ("nrgpt", "nrgpt-small", {}), ("transformer_pp", "transformer_pp-tiny", {**SMALL, "n_layer": 6}),
              ("ebt", "ebt-tiny", {**SMALL, "n_layer": 6})],
}
FAMILIES = tuple(family for family, _, _ in SIZES["tiny"])
TARGET = 5.0
"""Cached / uncached tokens per second wanted at the 512-token prompt (all but EBT)."""


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return sample_logits(logits, temperature=0)


def uncached(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """(CPU seconds per token, tokens) of generation recomputing the whole context for every token."""
    idx = prompt
    start = time.process_time()
    for _ in range(new_tokens):
        idx = torch.cat([idx, greedy(model.next_token_logits(idx))[:, None]], dim=1)
    return (time.process_time() - start) / new_tokens, idx[:, prompt.size(1):]


def cached(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor, float]:
    """(CPU seconds per token after the first, tokens, prefill CPU seconds) with the cache: the
    first token comes from the prefill, each further one from a step of its own."""
    cache = DecodeCache()
    start = time.process_time()
    chosen = [greedy(model.next_token_logits(prompt, cache))]
    prefill = time.process_time() - start
    start = time.process_time()
    while len(chosen) < new_tokens:
        chosen.append(greedy(model.next_token_logits(chosen[-1][:, None], cache)))
    return (time.process_time() - start) / (new_tokens - 1), torch.stack(chosen, dim=1), prefill


HF_FAMILIES = ("gpt_rec", "nrgpt", "ebt")
"""The families whose exports carry their code (and its cache)."""


def hf_wrapper(model):
    """`model` inside the Hugging Face class its export loads as (same weights)."""
    from pretrain.hf.modeling import ExportedConfig, ExportedForCausalLM

    wrapper_class = type("Wrapped", (ExportedForCausalLM,), {"family_config_class": type(model.config)})
    wrapper = wrapper_class(ExportedConfig(model_config=dataclasses.asdict(model.config)))
    wrapper.model.load_state_dict(model.state_dict())
    return wrapper.eval()


def hf_generate(wrapper, prompt: torch.Tensor, new_tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    """(CPU seconds per new token of the whole generate() call, new tokens)."""
    start = time.process_time()
    out = wrapper.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, use_cache=use_cache, pad_token_id=0)
    return (time.process_time() - start) / new_tokens, out[:, prompt.size(1):]


def decoding_ways(model, new_tokens: int) -> tuple[Callable, Callable]:
    """(without the cache, with it) of `common.decode`'s loop, each a function of the prompt."""
    return tuple(functools.partial(way, model, new_tokens=new_tokens) for way in (uncached, cached))


def generate_ways(model, new_tokens: int) -> tuple[Callable, Callable]:
    """(use_cache=False, the cache) of Hugging Face generate() through the export wrapper."""
    wrapper = hf_wrapper(model)
    return tuple(functools.partial(hf_generate, wrapper, new_tokens=new_tokens, use_cache=use_cache)
                 for use_cache in (False, True))


@torch.no_grad()
def measure(args, ways, families) -> list[tuple]:
    """(family, prompt length, median ratio, table row) over the chosen families, sizes and
    prompts; the row is (family (size), prompt, uncached tok/s, cached tok/s, ratio, range,
    medians of whatever else the cached way reports)."""
    rows = []
    for size, contenders in SIZES.items():
        for family, flavor, overrides in contenders:
            if family not in args.families or family not in families or size not in args.sizes:
                continue
            torch.manual_seed(0)
            model = build(resolve(flavor, {**overrides, "block_size": args.block_size})).eval()
            without_cache, with_cache = ways(model, args.new_tokens)
            for prompt_len in args.prompts:
                prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                                       generator=torch.Generator().manual_seed(prompt_len))
                rounds = []
                for _ in range(args.rounds):
                    full_seconds, full_tokens = without_cache(prompt)
                    cached_seconds, tokens, *extra = with_cache(prompt)
                    if not torch.equal(tokens, full_tokens):
                        raise SystemExit(f"{family} {size}: the cache chose other tokens than full recompute")
                    rounds.append((full_seconds, cached_seconds, *extra))
                full, steps, *extras = zip(*rounds)
                # a round's two timings are a fraction of a second apart, so a slower minute of
                # the machine moves both alike (interleaving them token by token would not: each
                # cached step would then run cold after a full forward, unlike real decoding)
                ratios = sorted(f / c for f, c in zip(full, steps))
                ratio = statistics.median(ratios)
                row = (f"{family} ({size})", prompt_len, f"{1 / statistics.median(full):.1f}",
                       f"{1 / statistics.median(steps):.1f}", f"{ratio:.1f}x", f"{ratios[0]:.1f}-{ratios[-1]:.1f}",
                       *(statistics.median(e) for e in extras))
                print(*row, flush=True)
                rows.append((family, prompt_len, ratio, row))
    return rows


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.sample", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512], help="prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated per measurement (fewer make a tiny model's row a few ms long)")
    parser.add_argument("--block-size", type=int, default=640, help="context length the models are built with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), help="families to run")
    parser.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--hf", action="store_true",
                        help="also time Hugging Face generate() of the carried-code families")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (the cache's first token comes from the prefill)")
    if max(args.prompts) + args.new_tokens > args.block_size:
        parser.error("--block-size must hold the longest prompt and the new tokens")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch 1, {args.new_tokens} new tokens, "
          f"greedy, CPU time; target: cached >= {TARGET:.0f}x uncached at 512 (gpt, gpt_rec, nrgpt, transformer_pp)\n")
    rows = []
    for family, prompt_len, ratio, (*row, prefill) in measure(args, decoding_ways, FAMILIES):
        verdict = "" if family == "ebt" else ("ok" if ratio >= TARGET or prompt_len < 512 else "BELOW")
        rows.append((*row, f"{prefill * 1e3:.0f}", verdict))
    print()
    print_table(("family (size)", "prompt", "uncached tok/s", "cached tok/s", "cached / uncached",
                 "range", "prefill ms", "target"), rows)
    if args.hf:
        print("Hugging Face generate() (the wrapper of the carried-code exports), whole calls:\n")
        print_table(("family (size)", "prompt", "use_cache=False tok/s", "cached tok/s", "cached / uncached",
                     "range"), [row for *_, row in measure(args, generate_ways, HF_FAMILIES)])


if __name__ == "__main__":
    run_command(main)
