"""One sweep over the bad inputs a new user gives the command-line tools: every one ends in a
one-line error (malformed command lines too: no usage text) or an explicit warning, never a
traceback, and never exit 0 when it failed. The commands run in-process (their `main`),
the trainer as `--check`, which runs exactly the checks a launch makes before any work."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

import trainer_runs as runs
from pretrain.config import load_config
from pretrain.training import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[dict]:
    """A prepared dataset, a base config pointing at it, and run directories holding
    checkpoint markers (written as the trainer writes them; no training needed for --check)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    base = yaml.safe_load(runs.base_config_file().read_text()) | {"output_root": str(root / "runs")}
    config = root / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    cfg = load_config(config, ["run_name=done"])

    def run_with_checkpoint(name: str, *overrides: str, files: dict | None = None, precision: str | None = "fp32",
                            **model: int) -> Path:
        saved = load_config(config, [f"run_name={name}", *overrides])
        tag_dir = saved.run_dir / "ckpt" / checkpoint.tag_for(4)
        tag_dir.mkdir(parents=True)
        (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
        marker = checkpoint.Marker(step=4, world_size=1, config=saved, model_config={"vocab_size": 128, **model},
                                   files=files if files is not None else {"mp_rank_00_model_states.pt": [10, "0"]},
                                   precision=precision)
        (tag_dir / checkpoint.MARKER).write_text(marker.to_json())
        return saved.run_dir

    run_with_checkpoint("done")
    run_with_checkpoint("stage0", "zero.stage=0")
    run_with_checkpoint("torn", files={"mp_rank_00_model_states.pt": [999, "0"]})
    run_with_checkpoint("redefined", n_embd=48)  # saved when the flavor (now 32 wide) was 48 wide
    run_with_checkpoint("bf16", "train.precision=bf16", precision="bf16")
    run_with_checkpoint("autocast", "train.precision=bf16-autocast", precision="bf16-autocast")
    run_with_checkpoint("older-bf16", "train.precision=bf16", precision=None)  # from before markers recorded it
    run_with_checkpoint("older-auto", precision=None)  # auto, trained where? it does not say
    incomplete = root / "runs" / "incomplete" / "ckpt" / checkpoint.tag_for(4)
    incomplete.mkdir(parents=True)
    text_file = root / "file.txt"
    text_file.write_text("not a directory\n")
    (root / "notyaml.yaml").write_text("a: [1, 2\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    bad_jsonl = root / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{broken\n')
    small = root / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(5)))
    occupied = root / "occupied"
    occupied.mkdir()
    (occupied / "something").write_text("x")
    empty_run = root / "runs" / "empty"
    empty_run.mkdir(parents=True)
    (root / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "whole"}\n' * 100)[:-20])
    (root / "twice.yaml").write_text(config.read_text() + "model:\n  flavor: nrgpt-tiny\n")
    (root / "twice_sweep.yaml").write_text("name: twice\nbase: base.yaml\nname: again\n")
    # a live trainer: another process (a run lock is a process's own; this one's commands run here)
    live = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from pretrain.training.runlock import RunLock; RunLock(Path(sys.argv[1])).acquire(); "
         "print('held', flush=True); time.sleep(3600)", str(root / "runs" / "live")],
        env=runs.child_env(), cwd=runs.REPO, stdout=subprocess.PIPE, text=True)
    assert live.stdout.readline().strip() == "held"
    yield {"root": root, "config": config, "data": cfg.data.path, "file": text_file,
           "runs": root / "runs", "incomplete": incomplete, "bad_jsonl": bad_jsonl, "small": small,
           "occupied": occupied, "empty_run": empty_run}
    live.kill()
    live.wait()


def train(*args: str) -> tuple[str, list[str]]:
    return "pretrain.train", list(args)


def check(*overrides: str) -> tuple[str, list[str]]:
    return "pretrain.train", ["--check", "--config", "{config}", *overrides]


def prepare(*args: str) -> tuple[str, list[str]]:
    return "data_pipeline.prepare", list(args)


def sample(source: str, *args: str) -> tuple[str, list[str]]:
    return "pretrain.sample", [source, "--prompt", "Once", *args]


def evaluate(source: str, *args: str) -> tuple[str, list[str]]:
    return "pretrain.evaluate", [source, *args]


CASES = {
    # the trainer's config: file, YAML, keys, types, values, combinations
    "config file missing": (train("--config", "no/such.yaml"), "config file not found"),
    "config is a directory": (train("--config", "{root}"), "is a directory"),
    "config not YAML": (train("--config", "{root}/notyaml.yaml"), "not valid YAML"),
    "config not a mapping": (train("--config", "{root}/list.yaml"), "top level must be a mapping"),
    "config with a key twice": (train("--config", "{root}/twice.yaml"), "duplicate key 'model' at line"),
    "unknown key": (check("trian.max_steps=3"), "command line: unknown key trian"),
    "unknown nested key": (check("train.max_step=3"), "did you mean train.max_steps?"),
    "integer as text": (check("train.max_steps=ten"), "train.max_steps must be an integer"),
    "boolean as integer": (check("train.max_steps=true"), "must be an integer, got True"),
    "override without =": (check("train.max_steps"), "is not of the form key.sub=value"),
    "scalar as section": (check("seed.sub=3"), "seed is not a section"),
    "lr zero": (check("optimizer.lr=0"), "optimizer.lr=0.0: must be > 0"),
    "betas": (check("optimizer.betas=[0.9]"), "must be two numbers in [0, 1)"),
    "schedule kind": (check("schedule.kind=linear"), "schedule.kind='linear'"),
    "min lr above lr": (check("schedule.min_lr=1.0"), "must not exceed optimizer.lr"),
    "fp16 on CPU": (check("train.precision=fp16"), "fp16 needs a GPU"),
    "ZeRO stage": (check("zero.stage=5"), "must be 0, 1, 2 or 3"),
    "offload without ZeRO": (check("zero.stage=0", "zero.offload_optimizer=true"), "needs zero.stage >= 1"),
    "global batch of no sequences": (check("train.global_batch_size=0"), "train.global_batch_size=0: must be >= 1"),
    "checkpointing mode": (check("model.activation_checkpointing=all"), "must be 'off', 'step' or 'block'"),
    "fault rank": (check("fault.nan_loss_rank=4"), "must be a rank of this run"),
    "unknown flavor": (check("model.flavor=gpt-huge"), "unknown model flavor 'gpt-huge'"),
    "unknown model field": (check("model.overrides.n_layers=4"), "is not a field of GPTConfig"),
    "model field of the wrong type": (check("model.overrides.bias=maybe"), "bias must be true or false, got 'maybe'"),
    "context shorter than seq_len": (check("model.overrides.block_size=16"), "shorter than data.seq_len"),
    "compile with double backward": (check("model.flavor=ebt-tiny", "model.compile=inductor"), "double backward"),
    "resume path missing": (check("resume=no/such/run"), "must be 'auto', 'never', 'restart' or an existing"),
    "run name with a slash": (check("run_name=a/b"), "must be a plain directory name"),
    "run name with a newline": (check('run_name="a\\nb"'), "run_name='a\\nb': must not hold control characters"),
    "run name with a NUL byte": (check('run_name="a\\0b"'), "must not hold control characters"),
    "run name with white space around it": (check("run_name=' run'"), "must not begin or end with white space"),
    "hidden run name": (check("run_name=.done.lock"), "must not begin with '.'"),
    "run name too long": (check("run_name=" + "r" * 231), "is 231 bytes long; at most 230 fit"),
    "no budget": (check("train.max_steps=null", "train.max_tokens=null"), "a budget is required"),
    "val fraction": (check("data.val_fraction=2"), "must be in (0, 1)"),
    "no data path": (check("data.path="), "data.path"),
    "negative workers": (check("data.num_workers=-1"), "must be >= 0"),
    "zero eval batches": (check("eval.batches=0"), "must be >= 1"),
    # the checks before any work: output root, data, the checkpoint to resume from
    "output root is a file": (check("output_root={file}"), "is not a directory"),
    "output root under /proc": (check("output_root=/proc/nope"), "cannot create directories in /proc"),
    "run held by a live trainer": (check("run_name=live"), "is in use by another trainer (host "),
    "dataset missing": (check("data.path={root}/nothing"),
                        "prepare one with python -m data_pipeline.prepare --source SOURCE --out"),
    "data path is a split folder": (check("data.path={data}/train"), "is the train split of the dataset at"),
    "data path is a file": (check("data.path={file}"), "is a file; it must be the directory of a prepared dataset"),
    "val split smaller than a micro-batch": (check("data.micro_batch_size=1024", "train.global_batch_size=1024"),
                                             "fewer than one micro-batch on each of 1 process(es)"),
    "seq_len differs from the data": (check("data.seq_len=16"), "has windows for seq_len=32"),
    "model vocabulary too small": (check("model.overrides.vocab_size=8"), "smaller than the vocabulary"),
    "resume=never over checkpoints": (check("run_name=done", "resume=never"), "resume=restart moves it aside"),
    "model differs from checkpoint": (check("run_name=done", "model.flavor=nrgpt-tiny"), "differs from the checkpoint"),
    "seq_len differs from checkpoint": (check("run_name=done", "data.seq_len=16"), "differs from the checkpoint"),
    "flavor redefined since the checkpoint": (check("run_name=redefined"),
                                              "gives n_embd 32 (checkpoint: 48), not the model of checkpoint"),
    "flavor redefined, overridden wrongly": (check("run_name=redefined", "model.overrides.n_embd=64"),
                                             "gives n_embd 64 (checkpoint: 48), not the model of checkpoint"),
    "ZeRO-0 checkpoint into ZeRO-2": (check("run_name=stage0"), "saved without ZeRO"),
    "bf16 checkpoint resumed in fp32": (check("run_name=bf16"), "was trained in bf16, this run would continue it "
                                        "in fp32, which its saved weights and optimizer state do not fit; set "
                                        "train.precision=bf16 to resume it, or export it"),
    "fp32 checkpoint resumed in bf16": (check("run_name=done", "train.precision=bf16"),
                                        "was trained in fp32, this run would continue it in bf16"),
    "bf16-autocast checkpoint resumed in bf16": (check("run_name=autocast", "train.precision=bf16"),
                                                 "set train.precision=bf16-autocast to resume it"),
    "older bf16 checkpoint resumed in fp32": (check("run_name=older-bf16", "train.precision=fp32"),
                                              "was trained in bf16, this run would continue it in fp32"),
    "incomplete explicit checkpoint": (check("resume={incomplete}"), "checkpoint is incomplete"),
    "torn checkpoint": (check("run_name=torn"), "every one is damaged"),
    "resume from a run without checkpoints": (check("run_name=x", "resume={empty_run}"), "no complete checkpoint found"),
    "check with a bad world size": (train("--check", "--world-size", "3", "--config", "{config}"),
                                    "3 processes cannot share it evenly; use a GPU count that divides it"),
    "check with a world of no processes": (train("--check", "--world-size", "0", "--config", "{config}"),
                                           "argument --world-size: must be >= 1, got 0"),
    "check with a negative world size": (train("--check", "--world-size", "-2", "--config", "{config}"),
                                         "argument --world-size: must be >= 1, got -2"),
    # preparing data
    "unknown source": (prepare("--source", "nowhere:x", "--out", "{root}/o1"), "nowhere"),
    "missing source file": (prepare("--source", "jsonl:{root}/none.jsonl", "--out", "{root}/o2"), "none.jsonl"),
    "seq_len zero": (prepare("--source", "shakespeare", "--out", "{root}/o3", "--seq-len", "0"), "seq-len"),
    "val fraction above one": (prepare("--source", "shakespeare", "--out", "{root}/o4", "--val-fraction", "1.5"),
                               "val-fraction"),
    "output is a file": (prepare("--source", "shakespeare", "--out", "{file}"), "not a directory"),
    "output holds something else": (prepare("--source", "shakespeare", "--out", "{occupied}"), "refusing to write into it"),
    "unknown tokenizer": (prepare("--source", "shakespeare", "--out", "{root}/o5", "--tokenizer", "bpe"), "tokenizer"),
    "broken jsonl line": (prepare("--source", "jsonl:{bad_jsonl}", "--out", "{root}/o6", "--seq-len", "4",
                                  "--val-fraction", "0", "--num-proc", "1"), "bad.jsonl"),
    "small corpus, default val fraction": (prepare("--source", "jsonl:{small}", "--out", "{root}/o7", "--seq-len", "8",
                                                   "--num-proc", "1"), "--val-fraction"),
    "one document, val fraction given": (prepare("--source", "text:{file}", "--out", "{root}/o10", "--seq-len", "2",
                                                 "--val-fraction", "0.5", "--num-proc", "1"),
                                         "1 document(s) are too few to split"),
    "truncated gzip": (prepare("--source", "jsonl:{root}/cut.jsonl.gz", "--out", "{root}/o11", "--num-proc", "1"),
                       "cut.jsonl.gz"),
    "unknown compression": (prepare("--source", "shakespeare", "--out", "{root}/o8", "--compression", "rar"),
                            "compression"),
    # exporting
    "export of a missing run": (("pretrain.export", ["{root}/nothing", "--out", "{root}/m.safetensors"]),
                                "no such run directory"),
    "export of a damaged checkpoint": (("pretrain.export", ["{runs}/torn", "--out", "{root}/m.safetensors"]),
                                       "checkpoint step_00000004 is damaged"),
    "export onto a directory that holds files": (("pretrain.export", ["{runs}/done", "--out", "{occupied}"]),
                                                 "is a directory (the safetensors format writes one file"),
    "export of a run without checkpoint": (("pretrain.export", ["{empty_run}", "--out", "{root}/m.safetensors"]),
                                           "no complete checkpoint found"),
    "export below a file": (("pretrain.export", ["{runs}/done", "--out", "{file}/m.safetensors"]),
                            "file.txt is not a directory"),
    "Hugging Face export below a file": (("pretrain.export", ["{runs}/done", "--format", "hf", "--out", "{file}/hf"]),
                                         "file.txt is not a directory"),
    "Hugging Face export of a missing run": (("pretrain.export", ["{root}/nothing", "--format", "hf", "--out", "{root}/hf"]),
                                             "no such run directory"),
    "export over its own run": (("pretrain.export", ["{runs}/done", "--format", "hf", "--out", "{runs}/done",
                                                     "--overwrite"]), "is the source"),
    "export over the runs' parent": (("pretrain.export", ["{runs}/done", "--out", "{runs}", "--overwrite"]),
                                     "holds the source"),
    "export over another run": (("pretrain.export", ["{runs}/done", "--format", "hf", "--out", "{runs}/stage0",
                                                     "--overwrite"]), "is a run directory"),
    "export over a non-export directory": (("pretrain.export", ["{runs}/done", "--format", "hf", "--out", "{occupied}",
                                                                "--overwrite"]),
                                           "a directory that pretrain.export did not write"),
    "export over a non-export file": (("pretrain.export", ["{runs}/done", "--out", "{file}", "--overwrite"]),
                                      "a file that pretrain.export did not write"),
    "export into a run's ckpt": (("pretrain.export", ["{runs}/done", "--out", "{runs}/stage0/ckpt/model.safetensors"]),
                                 "which the training run manages"),
    # sampling
    "sample from a missing run": (sample("{root}/nothing"), "no such run directory"),
    "sample without a prompt": (("pretrain.sample", ["{root}/nothing"]), "give a prompt"),
    "sample top-p above one": (sample("{empty_run}", "--top-p", "2"), "--top-p must be in (0, 1]"),
    "sample top-p zero": (sample("{empty_run}", "--top-p", "0"), "--top-p must be in (0, 1]"),
    "sample negative temperature": (sample("{empty_run}", "--temperature", "-1"), "--temperature must be >= 0"),
    "sample zero tokens": (sample("{empty_run}", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
    "sample top-k zero": (sample("{empty_run}", "--top-k", "0"), "--top-k must be >= 1"),
    "sample zero samples": (sample("{empty_run}", "--num-samples", "0"), "--num-samples must be >= 1"),
    "sample with an unknown dtype": (sample("{empty_run}", "--dtype", "fp8"), "invalid choice: 'fp8'"),
    # downstream evaluation
    "evaluate an unknown task": (evaluate("{empty_run}", "--tasks", "bogus"), "unknown task 'bogus'"),
    "evaluate with limit zero": (evaluate("{empty_run}", "--tasks", "core", "--limit", "0"), "must be a whole number >= 1"),
    "evaluate zero think steps": (evaluate("{empty_run}", "--tasks", "core", "--think-steps", "0"), "step counts must be >= 1"),
    "evaluate best of zero": (evaluate("{empty_run}", "--tasks", "core", "--best-of", "0"), "must be a whole number >= 1"),
    "evaluate batch size zero": (evaluate("{empty_run}", "--tasks", "core", "--batch-size", "0"), "must be a whole number >= 1"),
    "evaluate a missing checkpoint": (evaluate("{empty_run}", "--tasks", "core", "--checkpoint", "5"),
                                      "no complete checkpoint step_00000005"),
    "evaluate on a CUDA device this machine lacks": (evaluate("{empty_run}", "--tasks", "core", "--device", "cuda:99"),
                                                     "device cuda:99: this machine has"),
    "evaluate on an unknown device": (evaluate("{empty_run}", "--tasks", "core", "--device", "gpu"),
                                      "device 'gpu': expected cpu, cuda or cuda:N"),
    "evaluate a missing run": (evaluate("{root}/nothing", "--tasks", "core"), "no such run directory"),
    # URLs of schemes the project does not read, wherever a path is taken (s3:// where it does not)
    "prepare into gs://": (prepare("--source", "jsonl:{small}", "--out", "gs://bucket/ds"),
                           "--out=gs://bucket/ds: gs:// is not supported here"),
    "data.path on hf://": (check("data.path=hf://org/ds"), "data.path=hf://org/ds: hf:// is not supported here"),
    "mixture on gs://": (check("data.mixture=[{{path: 'gs://b/d', proportion: 1}}]"),
                         "data.mixture[0].path=gs://b/d: gs:// is not supported"),
    "output_root in s3://": (check("output_root=s3://b/runs"), "checkpoint.remote=s3://... uploads the checkpoints"),
    "resume from gs://": (check("resume=gs://b/run"), "resume=gs://b/run: gs:// is not supported here"),
    "checkpoint.remote on gs://": (check("checkpoint.remote=gs://b/ck"), "checkpoint.remote=gs://b/ck: gs://"),
    "checkpoint.remote local": (check("checkpoint.remote={root}/ck"), "must be s3://bucket/prefix"),
    "data.source into s3://": (check("data.path=s3://b/d", "data.source=shakespeare"),
                               "is prepared once beforehand (python -m data_pipeline.prepare --source shakespeare"),
    "export of a gs:// run": (("pretrain.export", ["gs://b/run", "--out", "{root}/x.safetensors"]),
                              "run=gs://b/run: gs:// is not supported here"),
    "sample of an s3:// run": (sample("s3://b/run"), "python -m pretrain.fetch s3://b/run RUN_DIR"),
    "evaluate of an hf:// run": (evaluate("hf://org/run", "--tasks", "core"), "hf:// is not supported here"),
    # scaling
    "sweep file missing": (("pretrain.scaling", ["run", "{root}/nosweep.yaml"]), "nosweep.yaml"),
    "fit of a missing directory": (("pretrain.scaling", ["fit", "{root}/nothing"]), "nothing"),
    "sweep file with a key twice": (("pretrain.scaling", ["run", "{root}/twice_sweep.yaml"]),
                                    "duplicate key 'name' at line 3 (first at line 1)"),
    "trainer given a sweep file": (train("--config", "configs/scaling/isoflop.yaml"),
                                   "configs/scaling/isoflop.yaml is a scaling sweep file, not a run config"),
    "plan of a sweep file": (("pretrain.plan", ["--config", "configs/scaling/isoflop.yaml", "--gpus", "1"]),
                             "`python -m pretrain.scaling run configs/scaling/isoflop.yaml --dry-run` writes"),
    # malformed command lines, one per command
    "trainer option unknown": (train("--config", "{config}", "--bogus"), "unrecognized arguments: --bogus (see --help)"),
    "trainer without a config": (train(), "the following arguments are required: --config"),
    "prepare without a source": (prepare("--out", "{root}/o9"), "required: --source"),
    "export format unknown": (("pretrain.export", ["{runs}/done", "--format", "onnx", "--out", "{root}/x"]),
                              "invalid choice: 'onnx'"),
    "sample option unknown": (sample("{empty_run}", "--beams", "4"), "unrecognized arguments: --beams 4"),
    "evaluate without tasks": (evaluate("{empty_run}"), "required: --tasks"),
    "scaling command unknown": (("pretrain.scaling", ["sweep"]), "invalid choice: 'sweep'"),
    "models with an argument": (("pretrain.models", ["gpt"]), "unrecognized arguments: gpt"),
    "models vocab not positive": (("pretrain.models", ["--vocab", "0"]), "expected a positive number of token ids"),
    "demo with an option": (("pretrain.demo", ["--fast"]), "unrecognized arguments: --fast"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(world, case):
    (module, argv), expected = CASES[case]
    argv = [arg.format(**world) for arg in argv]
    result = runs.command_here(module, argv)
    code, err = result.returncode, result.stderr
    assert code != 0, f"{case}: exit 0\n{err[-2000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("warning:", "["))]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines == errors, f"{case}:\n{err[-3000:]}"
    assert expected in errors[0], f"{case}: {errors[0]!r} lacks {expected!r}"


def test_a_checkpoint_of_a_redefined_flavor_resumes_with_the_overrides_its_error_names(world):
    """nrgpt-ff2w-126m went from D = 1020 to 1024: its checkpoints at 1020 are refused with the
    override that resumes them (not with the trainer's shape mismatch deep in the load), and
    resume with it; a different override is a different model, a new run."""
    config = str(world["config"])
    refused = runs.command_here("pretrain.train", ["--check", "--config", config, "run_name=redefined"])
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "the flavor's definition changed since; to resume, add model.overrides.n_embd=48"), refused.stderr
    wrong = runs.command_here("pretrain.train", ["--check", "--config", config, "run_name=redefined",
                                                 "model.overrides.n_embd=64"])
    assert "start a new run" in wrong.stderr and "model.overrides.n_embd=48" not in wrong.stderr
    resumed = runs.command_here("pretrain.train", ["--check", "--config", config, "run_name=redefined",
                                                   "model.overrides.n_embd=48"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]


@pytest.mark.parametrize("run_name, precision", [("done", "bf16-autocast"), ("autocast", "fp32"),
                                                 ("autocast", "auto"), ("bf16", "bf16"), ("older-auto", "bf16")])
def test_a_resume_in_a_precision_of_the_same_state_passes_the_check(world, run_name, precision):
    """fp32 and bf16-autocast checkpoints hold the same state (fp32 weights and optimizer), so
    either resumes in the other; every precision resumes in itself; a checkpoint from before
    markers recorded the precision, of train.precision=auto, does not say which it was: let be."""
    result = runs.command_here("pretrain.train", ["--check", "--config", str(world["config"]),
                                                  f"run_name={run_name}", f"train.precision={precision}"])
    assert result.returncode == 0 and "ready for 1 process(es)" in result.stdout, result.stderr[-2000:]


def test_the_longest_run_name_is_counted_in_bytes_and_its_run_can_be_moved_aside(world, tmp_path):
    """230 bytes (here 115 two-byte characters) pass the check; the name of the directory that
    resume=restart moves the run to then has the 255 bytes a file name may have."""
    import time

    from pretrain.config import REPLACED_SUFFIX

    longest = "é" * 115
    result = runs.command_here("pretrain.train", ["--check", "--config", str(world["config"]), f"run_name={longest}"])
    assert result.returncode == 0, result.stderr[-2000:]
    (tmp_path / longest).mkdir()
    (tmp_path / longest).rename(tmp_path / (longest + time.strftime(REPLACED_SUFFIX)))  # fits
    longer = runs.command_here("pretrain.train", ["--check", "--config", str(world["config"]), f"run_name={longest}r"])
    assert longer.returncode == 2 and "is 231 bytes long; at most 230 fit" in longer.stderr, longer.stderr[-2000:]


def test_prepare_help_shows_the_defaults():
    result = runs.command_here("data_pipeline.prepare", ["--help"])
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "(default: 0.0005)" in text and "(default: 1024)" in text  # --val-fraction, --seq-len


def test_the_demo_prints_a_tensorboard_command_that_runs():
    import shlex

    from pretrain.demo import tensorboard_command

    result = subprocess.run([*shlex.split(tensorboard_command()), "--version_tb"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]


def test_a_mostly_unused_vocabulary_is_an_explicit_warning(world):
    result = runs.train_here(["--check", "model.overrides.vocab_size=50304"], world["config"])
    code, err = result.returncode, result.stderr
    assert code == 0 and "warning: the model has 50304 embeddings" in err and "can never occur" in err

