"""Sample text from a trained model, streamed to stdout as it is produced.

    python -m pretrain.sample RUN_DIR|CHECKPOINT|EXPORT --prompt TEXT [--prompt TEXT ...]
        [--prompt-file FILE ...] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
        [--seed S] [--num-samples M] [--think-steps N] [--best-of K] [--think-until TOL]
        [--device cpu|cuda] [--dtype fp32|bf16]

Every prompt (each --prompt, and each --prompt-file's whole text) is sampled --num-samples
times, all rows as one batch, decoded incrementally (`pretrain.models.common.decode`). The first
row streams as its tokens arrive; with several rows, each is headed by a line naming its prompt
and sample, and a row is printed once the rows before it are done. The same arguments and seed
give the same text. Temperature 0 is greedy decoding. EBT models predict each token by their
descent: --think-steps sets its steps (default: the model's n_steps) and --best-of the number of
initial candidates, of which the lowest final energy wins; --think-until TOL stops each token's
descent once a step changed its energy by less than TOL times the energy before it (--think-steps
is then the most it takes) and says on stderr how many steps the tokens took. Every row thinks
from the same noise, so its logits do not depend on the rows sampled with it. Past the model's
context the window slides: each further token recomputes the last block_size tokens (said once
on stderr). Bad input is one line on stderr (`error: ...`) and exit status 2."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.cli import ArgumentParser, run_command
from pretrain.models.common import StepCount, decode, sample_logits
from pretrain.models.weights import LoadError
from pretrain.training.trained import DTYPES, TrainedModel, load_trained

EBT_OPTIONS = ("think_steps", "best_of", "think_until")


class SampleError(ValueError):
    """Bad input to the sampling command; the message is one line."""


@dataclass
class Row:
    """One sample being produced: its prompt's ids and the tokens chosen after them."""

    label: str
    """Header line naming the prompt and sample (shown when there are several rows)."""
    prompt_ids: list[int]
    prompt_text: str
    """The prompt as shown before the continuation."""
    new_ids: list[int] = field(default_factory=list)
    shown: int = 0
    """Characters of the continuation written so far."""


class StreamPrinter:
    """Writes the rows in order: the current row's text as its tokens arrive (holding back a
    trailing replacement character, which may be half of a multi-byte character), the next row
    once it is complete."""

    def __init__(self, rows: list[Row], tokenizer, max_new_tokens: int, out=sys.stdout):
        self.rows, self.tokenizer, self.max_new_tokens, self.out = rows, tokenizer, max_new_tokens, out
        self.current = 0
        self.started = False

    def continuation(self, row: Row) -> str:
        prefix = self.tokenizer.decode(row.prompt_ids)
        return self.tokenizer.decode(row.prompt_ids + row.new_ids)[len(prefix):]

    def update(self) -> None:
        while self.current < len(self.rows):
            row = self.rows[self.current]
            if not self.started:
                if len(self.rows) > 1:
                    self.out.write(("\n" if self.current else "") + row.label + "\n")
                self.out.write(row.prompt_text)
                self.started = True
            done = len(row.new_ids) >= self.max_new_tokens
            text = self.continuation(row)
            visible = text if done else text.rstrip("\ufffd")
            self.out.write(visible[row.shown:])
            row.shown = max(row.shown, len(visible))
            self.out.flush()
            if not done:
                return
            self.out.write("\n")
            self.current, self.started = self.current + 1, False
        self.out.flush()


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    for file in args.prompt_file or []:
        try:
            prompts.append(Path(file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise SampleError(f"--prompt-file {file}: {e}") from None
    if not prompts:
        raise SampleError("give a prompt: --prompt TEXT or --prompt-file FILE")
    return prompts


def check_options(args) -> None:
    """The options' ranges, before anything is loaded."""
    if args.temperature < 0:
        raise SampleError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise SampleError(f"--top-p must be in (0, 1], got {args.top_p}")
    for name in ("max_new_tokens", "num_samples", "top_k", "think_steps", "best_of"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SampleError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.think_until is not None and not args.think_until >= 0:
        raise SampleError(f"--think-until must be >= 0 (a relative change of the energy), got {args.think_until}")


def encode_prompts(trained: TrainedModel, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt (an empty prompt starts from the end-of-document token), each
    leaving room in the context for at least one generated token."""
    tokenizer = trained.tokenizer
    block_size = trained.model_config.block_size
    encoded = []
    for number, text in enumerate(prompts, start=1):
        try:
            ids = [int(i) for i in tokenizer.encode(text)] or [tokenizer.eot_id]
        except ValueError as e:
            raise SampleError(f"prompt {number}: {e}") from None
        if len(ids) >= block_size:
            raise SampleError(f"prompt {number} is {len(ids)} tokens and the model's context is {block_size}: "
                              "no room to generate (shorten the prompt)")
        encoded.append(ids)
    return encoded


def sample(args, out=sys.stdout, err=sys.stderr) -> None:
    check_options(args)
    prompts = read_prompts(args)
    trained = load_trained(args.source, device=args.device, dtype=args.dtype)
    ebt_options = {name: getattr(args, name) for name in EBT_OPTIONS if getattr(args, name) is not None}
    if ebt_options and not trained.spec.thinks:
        raise SampleError(f"--think-steps, --best-of and --think-until apply to EBT models only; {args.source} "
                          f"is a {trained.family} model")
    logit_options = {}
    steps_taken: list[torch.Tensor] = []
    if trained.spec.thinks:
        logit_options = {"steps": ebt_options.get("think_steps"), "best_of": ebt_options.get("best_of", 1),
                         "stop_tolerance": args.think_until}
        if args.think_until is not None:
            logit_options["steps_taken"] = steps_taken
    tokenizer = trained.tokenizer
    rows = [Row(label=f"--- prompt {p + 1}, sample {s + 1} ---", prompt_ids=ids,
                prompt_text=prompts[p])
            for p, ids in enumerate(encode_prompts(trained, prompts)) for s in range(args.num_samples)]
    width = max(len(row.prompt_ids) for row in rows)
    device = torch.device(args.device)
    batch = torch.tensor([row.prompt_ids + [0] * (width - len(row.prompt_ids)) for row in rows], device=device)
    lengths = [len(row.prompt_ids) for row in rows]

    def choose(logits: torch.Tensor) -> torch.Tensor:
        # ids past the tokenizer's (the model's vocabulary is padded) decode to nothing
        logits = logits.clone()
        logits[:, tokenizer.vocab_size:] = float("-inf")
        return sample_logits(logits, args.temperature, args.top_k, args.top_p)

    def say_slide() -> None:
        block_size = trained.model_config.block_size
        err.write(f"note: the text passed the model's context of {block_size} tokens; each further token "
                  f"recomputes the last {block_size} without the cache (positions shift)\n")

    printer = StreamPrinter(rows, tokenizer, args.max_new_tokens, out)
    torch.manual_seed(args.seed)
    position = min(lengths)
    thinking = StepCount()
    for tokens in decode(trained.model, batch, args.max_new_tokens, choose, lengths, say_slide, **logit_options):
        token_steps = steps_taken.pop() if steps_taken else None
        for number, (row, token) in enumerate(zip(rows, tokens.tolist())):
            if len(row.prompt_ids) <= position and len(row.new_ids) < args.max_new_tokens:
                row.new_ids.append(token)
                if token_steps is not None:
                    thinking.add(token_steps[number])
        position += 1
        printer.update()
    if args.think_until is not None:
        cap = args.think_steps or trained.model_config.n_steps
        err.write(f"thinking until the energy changes by less than {args.think_until:g}: {thinking.mean:.2f} "
                  f"descent steps per generated token on average, at most {thinking.most} (of up to {cap})\n")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pretrain.sample", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="run directory (its newest complete checkpoint), one checkpoint, or an export")
    parser.add_argument("--prompt", action="append", help="prompt text (repeat for several prompts)")
    parser.add_argument("--prompt-file", action="append", help="file whose whole text is one prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens generated per sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    parser.add_argument("--top-p", type=float, help="sample among the most likely tokens of total probability p")
    parser.add_argument("--seed", type=int, default=0, help="random seed (the same seed, the same text)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--think-steps", type=int, help="EBT: descent steps per token (default: the model's)")
    parser.add_argument("--best-of", type=int, help="EBT: initial candidates per token, lowest energy wins")
    parser.add_argument("--think-until", type=float, metavar="TOL",
                        help="EBT: stop a token's descent once a step changes its energy by less than TOL "
                        "times the energy (--think-steps is then the most it takes)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    try:
        sample(args, sys.stdout, sys.stderr)
    except (SampleError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_command(main)
