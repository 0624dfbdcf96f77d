"""Incremental decoding and the sampling command.

The decoding cache must change nothing but speed: for every family (both NRGPT masks, both grad
modes, both attention forms; EBT with and without step conditioning, with its fixed candidate
noise) the logits of cached decoding equal those of a full forward over the whole sequence, and
greedy decoding picks the same tokens. The command runs end to end on a tiny trained run."""
from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer_runs as runs
from numerics import assert_rounding_close
from pretrain import export, sample
from pretrain.models import build, resolve
from pretrain.models.common import DecodeCache, decode, sample_logits

CASES = {
    "gpt": ("gpt-tiny", {}),
    "gpt_rec": ("gpt_rec-tiny", {}),
    "transformer_pp": ("transformer_pp-tiny", {}),
    "nrgpt-inclusive-reference": ("nrgpt-tiny", {}),
    "nrgpt-inclusive-exact": ("nrgpt-tiny", {"grad_mode": "exact"}),
    "nrgpt-strict-reference": ("nrgpt-tiny", {"mask": "strict"}),
    "nrgpt-strict-exact": ("nrgpt-tiny", {"mask": "strict", "grad_mode": "exact"}),
    "nrgpt-lowrank-inclusive-exact": ("nrgpt-tiny", {"attention": "lowrank", "grad_mode": "exact",
                                                     "eta": "diag_gamma", "learnable_gamma": True}),
    "nrgpt-lowrank-strict": ("nrgpt-tiny", {"attention": "lowrank", "mask": "strict", "eta_per_step": True}),
    "ebt": ("ebt-tiny", {}),
    "ebt-step-conditioned": ("ebt-s2-tiny", {"replay_buffer_size": 0}),
}


def build_case(name: str, dtype=torch.float64, **extra):
    flavor, overrides = CASES[name]
    torch.manual_seed(0)
    return build(resolve(flavor, {**overrides, **extra})).to(dtype).eval()


def tokens(model, batch=2, length=20, seed=3):
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CASES)
def test_cached_logits_equal_full_recompute(name):
    """The next-token logits after each chunk fed to one cache (a 6-token prompt, single
    tokens, then 4 at once) equal those of the whole prefix without a cache (for EBT a descent
    of its own from the same fixed noise)."""
    model = build_case(name)
    idx = tokens(model, length=14)
    cache, end = DecodeCache(), 0
    with torch.no_grad():
        for size in [6, 1, 1, 1, 1, 4]:
            cached = model.next_token_logits(idx[:, end:end + size], cache)
            end += size
            reference = model.next_token_logits(idx[:, :end])
            assert torch.allclose(cached, reference, atol=1e-10, rtol=0), (end, (cached - reference).abs().max())
    assert cache.length == idx.size(1)


@pytest.mark.parametrize("name", [name for name in CASES if not name.startswith("ebt")])
def test_cached_chunk_gives_every_position(name):
    """A cached chunk's logits at every position (not only the last) equal the full forward's;
    for float32 models within float32 rounding. (EBT predicts one new position per call.)"""
    model = build_case(name, dtype=torch.float32)
    idx = tokens(model, length=16)
    with torch.no_grad():
        full = model(idx).logits
        cache = DecodeCache()
        parts = [model(idx[:, a:b], cache=cache).logits for a, b in ((0, 1), (1, 9), (9, 10), (10, 16))]
    assert_rounding_close(torch.cat(parts, dim=1), full)


@pytest.mark.parametrize("name", CASES)
def test_reordered_cache_continues_as_a_cache_of_the_reordered_rows(name):
    """What beam search does: after `reorder_cache(rows)` (rows repeated and permuted) the next
    logits equal those of the full forward over the reordered sequences."""
    model = build_case(name)
    idx = tokens(model, batch=3, length=10)
    rows = torch.tensor([2, 0, 2, 1])
    cache = DecodeCache()
    with torch.no_grad():
        model.next_token_logits(idx[:, :9], cache)
        cache.reorder_cache(rows)
        cached = model.next_token_logits(idx[rows, 9:], cache)
        reference = model.next_token_logits(idx[rows])
    assert torch.allclose(cached, reference, atol=1e-10, rtol=0), (cached - reference).abs().max()
    assert cache.tokens.equal(idx[rows])


@pytest.mark.parametrize("name", CASES)
def test_greedy_generation_picks_the_full_recompute_tokens(name):
    """generate() (the cached loop) against argmax over full recomputes, also across the
    context length (block_size 8: the window slides for the last two tokens)."""
    model = build_case(name, block_size=8)
    prompt = tokens(model, length=3)
    with torch.no_grad():
        generated = model.generate(prompt, 8, temperature=0)
        expected = prompt
        for _ in range(8):
            next_token = model.next_token_logits(expected[:, -8:]).argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(generated, expected)


def test_window_slides_once_noted_and_rows_of_other_lengths_decode_as_alone():
    model = build_case("nrgpt-strict-exact", block_size=10)
    idx = tokens(model, batch=3, length=9)
    lengths = [3, 7, 5]
    slides = []
    with torch.no_grad():
        batch = torch.stack(list(decode(model, idx, 8, sample_logits_greedy, lengths, lambda: slides.append(1))), 1)
        for row, length in enumerate(lengths):
            alone = torch.stack(list(decode(model, idx[row:row + 1, :length], 8, sample_logits_greedy)), 1)[0]
            assert torch.equal(batch[row, length - 3:length - 3 + 8], alone)
            assert torch.equal(batch[row, :length - 3], idx[row, 3:length])  # its prompt, untouched
    assert slides == [1]  # 7 + 8 tokens pass the context of 10: said once


def sample_logits_greedy(logits):
    return sample_logits(logits, temperature=0)


def test_ebt_think_options_reach_the_cached_descent():
    model = build_case("ebt")
    idx = tokens(model, length=8)
    with torch.no_grad():
        cached = model.next_token_logits(idx, DecodeCache(), steps=4, best_of=3)
        # decoding gives every row the same 3 starting samples
        candidate = model.initial_candidate(3, 1, idx.device, seeded=True).repeat_interleave(2, dim=0)
        direct = model.think(idx, steps=4, best_of=3, last_only=True, candidate=candidate).logits[:, -1]
        default = model.next_token_logits(idx, DecodeCache())
    assert torch.allclose(cached, direct, atol=1e-10, rtol=0)
    assert not torch.allclose(cached, default)


def think_until(model, prompts, new_tokens: int, tolerance: float, cached: bool):
    """Greedy decoding of prompts [B, T0] with adaptive thinking (at most 6 steps): the logits
    [B, new_tokens, V] and steps [B, new_tokens] of every generated token, through `decode` (a
    decoding cache) or by recomputing the whole context for each token."""
    steps_taken, logits = [], []

    def greedy(token_logits):
        logits.append(token_logits)
        return token_logits.argmax(-1)

    options = dict(steps=6, stop_tolerance=tolerance, steps_taken=steps_taken)
    with torch.no_grad():
        if cached:
            list(decode(model, prompts, new_tokens, greedy, **options))
        else:
            idx = prompts
            for _ in range(new_tokens):
                idx = torch.cat([idx, greedy(model.next_token_logits(idx, **options))[:, None]], dim=1)
    return torch.stack(logits, dim=1), torch.stack(steps_taken, dim=1)


@pytest.mark.parametrize("name, tolerance", [("ebt", 0.1), ("ebt-step-conditioned", 0.4)])
def test_ebt_thinking_until_settled_decodes_a_row_as_alone(name, tolerance):
    """Adaptive thinking per token: a row's logits and steps are the same in a batch of two as
    alone, with the decoding cache and without (ebt-step-conditioned adds Langevin noise at
    eval: the same for every row); tolerance 0 is the fixed-step descent, a huge one stops
    every token after one step."""
    model = build_case(name)
    prompts = tokens(model, batch=2, length=5)
    batch, batch_steps = think_until(model, prompts, 6, tolerance, cached=True)
    assert len(batch_steps.unique()) > 1  # tokens stopped after different step counts
    for cached in (True, False):
        for row in range(2):
            alone, alone_steps = think_until(model, prompts[row:row + 1], 6, tolerance, cached)
            assert torch.equal(alone_steps[0], batch_steps[row]), (cached, row)
            assert_rounding_close(alone[0], batch[row])
    zero = []
    assert torch.equal(model.next_token_logits(prompts, steps=6, best_of=2, stop_tolerance=0.0, steps_taken=zero),
                       model.next_token_logits(prompts, steps=6, best_of=2))
    assert (zero[0] == 6).all()
    one = []
    assert torch.equal(model.next_token_logits(prompts, steps=6, stop_tolerance=1e30, steps_taken=one),
                       model.next_token_logits(prompts, steps=1))
    assert (one[0] == 1).all()


def test_sample_logits_top_k_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    torch.manual_seed(0)
    nucleus = sample_logits(logits, top_p=0.7)  # 0.5 + 0.3 reach 0.7: the rest never
    assert set(nucleus.tolist()) == {0, 1}
    assert abs((nucleus == 0).float().mean().item() - 0.5 / 0.8) < 0.03
    assert set(sample_logits(logits, top_k=3).tolist()) == {0, 1, 2}
    assert set(sample_logits(logits, top_p=0.4).tolist()) == {0}  # the first token is always kept
    assert set(sample_logits(logits, top_p=1.0).tolist()) == {0, 1, 2, 3}
    assert torch.equal(sample_logits(torch.tensor([[0.1, 2.0, -1.0]]), temperature=0), torch.tensor([1]))


def test_stream_printer_writes_as_tokens_arrive_and_holds_half_characters():
    from data_pipeline.tokenizer import GPT2Tokenizer

    tokenizer = GPT2Tokenizer()
    prompt, continuation = "The actor", " wears a mask \U0001F3AD here"
    new_ids = [int(i) for i in tokenizer.encode(continuation)]
    # the emoji's four UTF-8 bytes come as three byte-level tokens
    split = [i for i in new_ids if "\ufffd" in tokenizer.decode([i])]
    assert len(split) == 3
    out = io.StringIO()
    rows = [sample.Row("one", [int(i) for i in tokenizer.encode(prompt)], prompt)]
    printer = sample.StreamPrinter(rows, tokenizer, len(new_ids), out)
    seen = []
    for token in new_ids:
        rows[0].new_ids.append(token)
        printer.update()
        seen.append(out.getvalue())
    assert all("\ufffd" not in text for text in seen)
    assert len(set(seen)) >= len(new_ids) - len(split)  # text grew with (nearly) every token
    assert out.getvalue() == prompt + continuation + "\n"


# --- the command, end to end ------------------------------------------------------------------

def command(*args: str) -> subprocess.CompletedProcess:
    return runs.command_here("pretrain.sample", list(args))


def train_tiny(flavor: str, steps: int) -> Path:
    """A tiny character-level run trained for `steps` steps in one process (block size 32)."""
    name = f"sample-{flavor}"
    result = runs.train_here([f"run_name={name}", f"model.flavor={flavor}", "zero.stage=0",
                              f"train.max_steps={steps}", f"checkpoint.interval={steps}", "eval.sample_tokens=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    return runs.run_dir(name)


@pytest.fixture(scope="module")
def trained_run():
    return train_tiny("gpt-tiny", 4)


def greedy_text(source, prompt: str, new_tokens: int, **logit_options) -> str:
    """The prompt and its greedy continuation by full recompute, over the tokenizer's ids."""
    from pretrain.training.trained import load_trained

    trained = load_trained(source)
    tokenizer, model = trained.tokenizer, trained.model
    idx = torch.tensor([[int(i) for i in tokenizer.encode(prompt)]])
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model.next_token_logits(idx, **logit_options)
            logits[:, tokenizer.vocab_size:] = float("-inf")  # the padded ids decode to nothing
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return tokenizer.decode(idx[0].tolist())


def test_command_greedy_output_is_the_models_greedy_text(trained_run, tmp_path):
    result = command(str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_text(trained_run, "ROMEO:", 12) + "\n"
    # an exported file samples the same text
    exported = tmp_path / "model.safetensors"
    export.export(trained_run, exported)
    again = command(str(exported), "--prompt", "ROMEO:", "--max-new-tokens", "12", "--temperature", "0")
    assert again.returncode == 0 and again.stdout == result.stdout


def test_command_batch_is_deterministic_for_a_seed_and_slides_past_the_context(trained_run, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("JULIET:\nO ")
    args = [str(trained_run), "--prompt", "ROMEO:", "--prompt-file", str(prompt_file), "--num-samples", "2",
            "--max-new-tokens", "40", "--temperature", "1.0", "--top-p", "0.9", "--top-k", "20"]
    first, second, other = command(*args, "--seed", "1"), command(*args, "--seed", "1"), command(*args, "--seed", "2")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout != other.stdout
    blocks = first.stdout.split("--- prompt ")[1:]
    assert [b.split(" ---\n")[0] for b in blocks] == ["1, sample 1", "1, sample 2", "2, sample 1", "2, sample 2"]
    texts = [b.split(" ---\n", 1)[1] for b in blocks]
    assert texts[0].startswith("ROMEO:") and texts[2].startswith("JULIET:\nO ")
    assert texts[0] != texts[1]  # two samples of one prompt differ
    # 6 + 40 characters pass the block size of 32: one note, printed once
    assert first.stderr.count("note: the text passed the model's context of 32 tokens") == 1


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x" * 32], "prompt 1 is 32 tokens and the model's context is 32: no room to generate"),
    (["--prompt", "a", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt", "a", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--prompt", "a", "--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--prompt", "a", "--think-steps", "3"], "--think-steps, --best-of and --think-until apply to EBT models only"),
    (["--prompt", "a", "--think-until", "0.1"], "is a gpt model"),
    (["--prompt", "a", "--think-until", "-0.5"], "--think-until must be >= 0"),
    (["--prompt", "a", "--best-of", "2"], "is a gpt model"),
    (["--prompt", "\u4e2d"], "prompt 1: character '\u4e2d' is not in the char vocabulary"),
    ([], "give a prompt"),
])
def test_bad_input_is_one_line_and_prints_nothing(trained_run, args, message, capsys):
    assert sample.main([str(trained_run), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and message in captured.err


@pytest.fixture(scope="module")
def ebt_run():
    return train_tiny("ebt-tiny", 1)


def test_command_thinks_with_the_ebt_options(ebt_run):
    result = command(str(ebt_run), "--prompt", "ROMEO:", "--max-new-tokens", "6", "--temperature", "0",
                     "--think-steps", "3", "--best-of", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_text(ebt_run, "ROMEO:", 6, steps=3, best_of=2) + "\n"
    assert "descent steps" not in result.stderr


def test_command_thinks_until_the_energy_settles(ebt_run):
    """--think-until: tolerance 0 samples the fixed-step text and says every token took the
    cap; a huge tolerance stops every token after one step (and samples the one-step text)."""
    args = [str(ebt_run), "--prompt", "ROMEO:", "--prompt", "JULIET:", "--max-new-tokens", "6", "--temperature", "0"]
    fixed = command(*args, "--think-steps", "3")
    zero = command(*args, "--think-steps", "3", "--think-until", "0")
    assert zero.returncode == 0, zero.stderr
    assert zero.stdout == fixed.stdout
    assert "3.00 descent steps per generated token on average, at most 3 (of up to 3)" in zero.stderr
    huge = command(*args, "--think-until", "1e30")
    assert huge.returncode == 0, huge.stderr
    assert huge.stderr.count("1.00 descent steps per generated token") == 1
    one_step = greedy_text(ebt_run, "ROMEO:", 6, steps=1)
    assert huge.stdout.split("--- prompt 2")[0] == "--- prompt 1, sample 1 ---\n" + one_step + "\n\n"


def test_command_output_is_the_text_alone_for_a_zero_checkpoint():
    """DeepSpeed narrates the consolidation of a ZeRO checkpoint on stdout: none of it may reach
    the command's output, which is the text."""
    runs.resume_matrix()
    run = runs.run_dir(runs.reference_name("gpt", 2))
    result = command(str(run), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_text(run, "ROMEO:", 8) + "\n"
    assert result.stderr == ""


def start_sampling(run: Path) -> subprocess.Popen:
    """The command in a process of its own, generating for much longer than a test waits."""
    return subprocess.Popen([sys.executable, "-m", "pretrain.sample", str(run), "--prompt", "ROMEO:",
                             "--max-new-tokens", "1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=runs.child_env(), cwd=runs.REPO, start_new_session=True,
                            preexec_fn=runs.terminal_sigint)


def test_ctrl_c_ends_the_command_with_one_line(trained_run):
    proc = start_sampling(trained_run)
    proc.stdout.read(200)  # it is generating
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode().strip().splitlines()[-1] == "error: interrupted" and b"Traceback" not in err


def test_a_closed_output_pipe_ends_the_command_quietly(trained_run):
    proc = start_sampling(trained_run)
    proc.stdout.read(200)
    proc.stdout.close()  # like `| head`
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141
    assert all(line.startswith("note: ") for line in err.decode().splitlines())  # no error, no traceback


def test_run_without_complete_checkpoint_is_refused(trained_run, tmp_path):
    incomplete = tmp_path / "run"
    (incomplete / "ckpt" / "step_00000004").mkdir(parents=True)  # a checkpoint cut off before its marker
    result = command(str(incomplete), "--prompt", "ROMEO:")
    assert result.returncode == 2 and result.stdout == ""
    # the checkpoint lookup warns about what it skipped; the error is one line, the last
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]
    assert "no complete checkpoint" in lines[-1]
