"""Downstream evaluation throughput: tokens/s through the lm-eval adapter (`loglikelihood` on
requests of real text, tokenization, sorting, padding and scoring included) next to the
training forward's tokens/s (train mode, with the autograd graph, as a training step starts)
at the same batch and length, measured side by side, per family. Target: adapter / training
forward >= 0.8, i.e. the harness is not dominated by our overhead.

    python -m bench.evaluate [--families gpt,nrgpt,ebt --width 256 --heads 4 --seq-len 256 --batch 8 --rounds 3]

Time is process CPU time with one intra-op thread by default (`--threads`), the minimum over
interleaved rounds, as in bench.models: on a shared machine it measures the work done."""
from __future__ import annotations

import time

import torch

from common.cli import ArgumentParser, run_command
from common.fileio import markdown_table
from data_pipeline.sources import parse_source
from data_pipeline.tokenizer import GPT2Tokenizer
from pretrain.downstream.adapter import HarnessModel, Request
from pretrain.models import build, resolve

CONTINUATION_TOKENS = 16


def real_text_requests(tokenizer, count: int, length: int) -> list[Request]:
    """`count` (context, continuation) requests of about `length` + 1 tokens of Shakespeare."""
    requests, stream = [], []
    for scene in parse_source("shakespeare").documents():
        stream.extend(tokenizer.encode(scene).tolist())
        while len(stream) > length + 1 and len(requests) < count:
            window, stream = stream[: length + 1], stream[length + 1:]
            requests.append(Request((tokenizer.decode(window[:-CONTINUATION_TOKENS]),
                                     tokenizer.decode(window[-CONTINUATION_TOKENS:]))))
        if len(requests) == count:
            return requests
    raise RuntimeError("the corpus is too short for the requested benchmark")


def cpu_seconds(work) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def measure(flavor: str, args, requests) -> dict:
    torch.manual_seed(0)
    shape = dict(vocab_size=50304, block_size=args.seq_len, n_embd=args.width, n_head=args.heads)
    model = build(resolve(flavor, shape))
    idx = torch.randint(0, 50257, (args.batch, args.seq_len))

    def training_forward():
        model.train()
        model(idx, idx).loss.item()

    adapter = HarnessModel(model, GPT2Tokenizer(), batch_size=args.batch, progress=False)
    forward_s, adapter_s, adapter_tokens = [], [], 0
    for _ in range(args.rounds):  # interleaved, so both see the same machine
        forward_s.append(cpu_seconds(training_forward))
        before = adapter.tokens_scored
        adapter_s.append(cpu_seconds(lambda: adapter.loglikelihood(requests)))
        adapter_tokens = adapter.tokens_scored - before
    forward_rate = idx.numel() / min(forward_s)
    adapter_rate = adapter_tokens / min(adapter_s)
    return {"family": flavor.split("-")[0], "batch x length": f"{args.batch} x {args.seq_len}",
            "training forward tok/s": forward_rate, "adapter tok/s": adapter_rate,
            "adapter / forward": adapter_rate / forward_rate}


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="gpt,nrgpt,ebt")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    requests = real_text_requests(GPT2Tokenizer(), args.batch, args.seq_len)
    rows = [measure(f"{family}-tiny", args, requests) for family in args.families.split(",")]
    print(markdown_table(rows, {"training forward tok/s": ".0f", "adapter tok/s": ".0f", "adapter / forward": ".2f"}))


if __name__ == "__main__":
    run_command(main)
