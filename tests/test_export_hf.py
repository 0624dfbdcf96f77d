"""Hugging Face export (`python -m pretrain.export RUN --format hf --out DIR`) and the reverse
(`model.init_from`).

Every family is exported twice over: models of each tiny flavor with perturbed weights (biases
and norm gains away from their initial values, GPT-2's padded BPE vocabulary), and the trained
2-process matrix runs (character-level data). The exports are loaded by a separate interpreter
that cannot import this repository (`python -I` from an empty directory, no PYTHONPATH), which
must reproduce our logits (fp32, up to rounding: numerics.py) and greedy generations, gpt and
transformer_pp as native GPT2LMHeadModel / LlamaForCausalLM without remote code; the other
families' generate() decodes with their own cache and must choose what recomputing the context
chooses."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

import trainer_runs as runs
from numerics import assert_rounding_close
from pretrain import export
from pretrain.hf.load import load_pretrained_weights
from pretrain.models import build, resolve
from pretrain.training.export_hf import ExportError, carried_sources, export_hf
from pretrain.training.trained import LoadError, TrainedModel, load_trained

CASES = {"gpt": ("gpt-tiny", {}), "gpt_rec": ("gpt_rec-tiny", {}), "nrgpt": ("nrgpt-tiny", {}),
         "ebt": ("ebt-tiny", {}), "transformer_pp": ("transformer_pp-tiny", {}),
         "ebt_s2": ("ebt-s2-tiny", {}), "gpt_without_biases": ("gpt-tiny", {"bias": False})}
"""Export name -> (flavor, overrides): every family, EBT's S2 recipe (step embedding, a replay
buffer that the export leaves out) and a gpt that GPT-2 cannot express."""
CLASSES = {"gpt": "GPT2LMHeadModel", "transformer_pp": "LlamaForCausalLM", "gpt_rec": "GPTRecForCausalLM",
           "nrgpt": "NRGPTForCausalLM", "ebt": "EBTForCausalLM", "ebt_s2": "EBTForCausalLM",
           "gpt_without_biases": "GPTForCausalLM"}
NATIVE = ("gpt", "transformer_pp")
GPT2_MANIFEST = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256, "seq_len": 32, "source": "shakespeare"}
PADDED_GPT2_VOCAB = 50304
NEW_TOKENS = 6


def perturbed_model(flavor: str, overrides: dict, seed: int) -> torch.nn.Module:
    """The flavor at GPT-2's padded vocabulary, every parameter moved off its initial value."""
    torch.manual_seed(seed)
    model = build(resolve(flavor, {"vocab_size": PADDED_GPT2_VOCAB, "block_size": 32, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def greedy(model: torch.nn.Module, prompt: torch.Tensor, n_new: int, eos_id: int) -> list[int]:
    """Our model's greedy continuation (stopping after the end-of-text id, as generate does)."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n_new):
            next_id = model.next_token_logits(ids[:, -model.config.block_size:]).argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
            if next_id.item() == eos_id:
                break
    return ids[0].tolist()


@pytest.fixture(scope="module")
def built_exports(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("built")
    exports = {}
    for seed, (name, (flavor, overrides)) in enumerate(CASES.items()):
        model = perturbed_model(flavor, overrides, seed)
        trained = TrainedModel(model=model, flavor=flavor, model_config=model.config, step=12,
                               source=root / "run" / "ckpt" / "step_00000012", run_config={}, manifest=GPT2_MANIFEST)
        exports[name] = model, export_hf(trained, root / f"built-{name}")
    return exports


@pytest.fixture(scope="module")
def matrix():
    return runs.resume_matrix()


@pytest.fixture(scope="module")
def run_exports(matrix, tmp_path_factory) -> dict[str, Path]:
    """The matrix's ZeRO-2 runs: ebt through the command line, gpt and nrgpt in this process."""
    root = tmp_path_factory.mktemp("runs")
    exports = {family: root / f"run-{family}" for family in runs.FAMILIES}
    result = runs.command_here("pretrain.export", [str(runs.run_dir("ebt-z2")), "--format", "hf",
                                                   "--out", str(exports["ebt"])])
    assert result.returncode == 0, result.stderr[-3000:]
    for family in ("gpt", "nrgpt"):
        export_hf(load_trained(runs.run_dir(runs.reference_name(family, 2))), exports[family])
    return exports


LOADER = r'''
import importlib.util, json, sys
import torch
assert importlib.util.find_spec("pretrain") is None, "the repository is importable: " + repr(sys.path)
from transformers import AutoModelForCausalLM
for job in json.loads(open(sys.argv[1]).read()):
    model = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=job["remote_code"])
    ids = torch.tensor(job["ids"])
    with torch.no_grad():
        logits = model(ids).logits
    generated = model.generate(ids[:1, :8], max_new_tokens=job["new_tokens"], do_sample=False)
    result = {"class": type(model).__name__, "logits": logits, "generated": generated[0].tolist()}
    if job["remote_code"]:  # the carried cache, against recomputing the context for every token
        for use_cache in (True, False):
            past_context = model.generate(ids[:1, :8], max_new_tokens=job["past_context_tokens"], do_sample=False,
                                          use_cache=use_cache)
            beams = model.generate(ids[:, :8], max_new_tokens=job["new_tokens"], num_beams=3, do_sample=False,
                                   use_cache=use_cache)
            result[use_cache] = {"past_context": past_context[0].tolist(), "beams": beams.tolist()}
    torch.save(result, job["out"])
'''


def load_isolated(jobs: list[dict], workdir: Path) -> None:
    """Run LOADER on `jobs` in an interpreter that sees only the installed packages."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    (workdir / "loader.py").write_text(LOADER)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(workdir / "modules")}
    result = subprocess.run([sys.executable, "-I", "loader.py", "jobs.json"], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_exports_load_in_transformers_alone_with_our_logits_and_generations(built_exports, run_exports, tmp_path):
    cases = {name: (model, path, name) for name, (model, path) in built_exports.items()}
    cases["ebt run"] = (load_trained(runs.run_dir("ebt-z2")).model, run_exports["ebt"], "ebt")
    jobs, inputs = [], {}
    for name, (model, path, case) in cases.items():
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(len(jobs)))
        inputs[name] = ids
        jobs.append({"dir": str(path), "remote_code": case not in NATIVE, "ids": ids.tolist(),
                     "new_tokens": NEW_TOKENS, "past_context_tokens": model.config.block_size,
                     "out": str(tmp_path / f"{len(jobs)}.pt")})
    load_isolated(jobs, tmp_path / "isolated")
    for job, (name, (model, path, case)) in zip(jobs, cases.items()):
        result = torch.load(job["out"])
        assert result["class"] == CLASSES[case], name
        config = json.loads((path / "config.json").read_text())
        if case in NATIVE:
            assert "auto_map" not in config, name
        else:
            assert config["auto_map"]["AutoModelForCausalLM"].endswith(f".{CLASSES[case]}"), name
        with torch.no_grad():
            ours = model(inputs[name]).logits
        assert_rounding_close(result["logits"], ours, msg=name)  # computed in another interpreter
        eos_id = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
        assert result["generated"] == greedy(model, inputs[name][:1, :8], NEW_TOKENS, eos_id), name
        if case not in NATIVE:
            # generate() decodes with the model's cache, also past the context length and in beam
            # search (which reorders the cache's rows), choosing what recomputation chooses
            assert result[True] == result[False], name
            assert len(result[True]["past_context"]) == 8 + model.config.block_size, name  # no early end-of-text
            assert result[True]["past_context"] == greedy(model, inputs[name][:1, :8], model.config.block_size,
                                                          eos_id), name


def test_carried_code_imports_only_the_standard_library_torch_and_transformers(built_exports):
    for name in ("gpt_rec", "nrgpt", "ebt", "gpt_without_biases"):
        files = list(built_exports[name][1].glob("*.py"))
        family = json.loads((built_exports[name][1] / "training_run.json").read_text())["family"]
        assert {"modeling", f"modeling_{family}", "registry", "common"} <= {f.stem for f in files}
        for file in files:
            for node in ast.walk(ast.parse(file.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                for name in names:
                    top = name.split(".")[0]
                    assert top in sys.stdlib_module_names or top in ("torch", "transformers"), (file.name, name)


def test_carried_code_refuses_imports_an_export_cannot_satisfy():
    with pytest.raises(ExportError, match="pretrain.training.trainer imports .*; exported modeling code may import only"):
        carried_sources(["pretrain.training.trainer"])  # the trainer: numpy, yaml, deepspeed, ...


def test_ebt_replay_buffer_is_left_out(built_exports):
    model, path = built_exports["ebt_s2"]
    assert model.config.replay_buffer_size > 0 and model.replay_store is not None
    assert not any(k.startswith("replay_") for k in model.state_dict())  # the store is not module state
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert not any("replay_" in k for k in f.keys())
    assert json.loads((path / "config.json").read_text())["model_config"]["replay_buffer_size"] == 0


def test_gpt2_tokenizer_encodes_like_the_data_pipeline(built_exports):
    from transformers import AutoTokenizer

    from data_pipeline.sources import parse_source
    from data_pipeline.tokenizer import GPT2Tokenizer

    hf, ours = AutoTokenizer.from_pretrained(str(built_exports["gpt"][1])), GPT2Tokenizer()
    scenes = list(islice(parse_source("shakespeare").documents(), 60))
    assert sum(map(len, scenes)) > 100_000
    for text in scenes:
        ids = hf(text)["input_ids"]
        assert ids == ours.encode(text).tolist()
        assert hf.decode(ids) == text
    assert hf.eos_token_id == GPT2_MANIFEST["eot_id"] and hf.model_max_length == 32
    # the pipeline reads "<|endoftext|>" inside a document as text; the model card says how to match it
    text = "Exeunt.<|endoftext|>ROMEO: Soft!"
    assert hf(text, split_special_tokens=True)["input_ids"] == ours.encode(text).tolist()


def test_char_level_run_exports_its_vocabulary(run_exports):
    from transformers import AutoTokenizer

    from data_pipeline.sources import parse_source
    from data_pipeline.tokenizer import tokenizer_from_spec

    manifest = json.loads((runs.char_dataset() / "manifest.json").read_text())
    ours = tokenizer_from_spec(manifest)
    hf = AutoTokenizer.from_pretrained(str(run_exports["nrgpt"]))
    for text in islice(parse_source("shakespeare").documents(), 80):  # the documents the vocabulary came from
        ids = hf(text)["input_ids"]
        assert ids == ours.encode(text).tolist()
        assert hf.decode(ids) == text
    assert hf.eos_token_id == manifest["eot_id"]


@pytest.mark.parametrize("family", runs.FAMILIES)
def test_load_trained_reads_an_export_as_the_run(run_exports, family):
    run = load_trained(runs.run_dir(runs.reference_name(family, 2)))
    exported = load_trained(run_exports[family])
    assert (exported.flavor, exported.step, exported.family) == (run.flavor, run.step, family)
    assert exported.manifest == run.manifest and exported.tokenizer.decode([0, 1]) == run.tokenizer.decode([0, 1])
    idx = torch.randint(0, run.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(exported.model(idx).logits, run.model(idx).logits)


def test_model_card_describes_the_run(matrix, tmp_path):
    """A copy of the gpt run with downstream results in its summary, exported by the command."""
    run_dir = tmp_path / "gpt-run"
    shutil.copytree(runs.run_dir("gpt-z2"), run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["downstream"] = {"downstream/hellaswag/acc_norm": 0.2512}  # as eval.downstream writes it
    (run_dir / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "gpt-hf"
    assert export.main([str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    model = load_trained(out).model
    for fact in ("`gpt`", "gpt-tiny", f"{model.num_params():,}", f"{summary['tokens_seen']:,}",
                 f"{summary['final_val_loss']:.4f}", "GPT2LMHeadModel", "| hellaswag | acc_norm | 0.2512 |",
                 f"python -m pretrain.export {run_dir} --format hf --out {out}"):
        assert fact in card, fact
    assert json.loads((out / "training_run.json").read_text())["step"] == runs.N_STEPS


@pytest.mark.parametrize("name", CASES)
def test_init_from_an_export_gives_the_exported_model(built_exports, name):
    model, path = built_exports[name]
    fresh = build(model.config)
    load_pretrained_weights(fresh, path)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(fresh.eval()(idx).logits, model(idx).logits)


def test_init_from_local_gpt2_and_llama_directories(tmp_path):
    """Directories written by transformers itself (random weights, our tiny shapes): our model
    computes what theirs computes; GPT-2's own tanh GELU is loaded with a note."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    shapes = dict(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    cases = [("gpt-tiny", GPT2LMHeadModel(GPT2Config(**shapes, activation_function="gelu")), False),
             ("gpt-tiny", GPT2LMHeadModel(GPT2Config(**shapes)), True),
             ("transformer_pp-tiny", LlamaForCausalLM(LlamaConfig(
                 vocab_size=512, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)), False)]
    idx = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(6))
    for i, (flavor, hf_model, tanh_gelu) in enumerate(cases):
        torch.manual_seed(i)
        with torch.no_grad():
            for p in hf_model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        hf_model.save_pretrained(tmp_path / f"hf-{i}")
        ours = build(resolve(flavor, {}))
        notes = load_pretrained_weights(ours, tmp_path / f"hf-{i}")
        assert any("tanh" in note for note in notes) == tanh_gelu
        with torch.no_grad():
            theirs, mine = hf_model.eval()(idx).logits, ours.eval()(idx).logits
        if tanh_gelu:
            assert (theirs - mine).abs().max() < 0.05  # the GELU approximation, nothing else
        else:
            assert_rounding_close(mine, theirs)

    # the original GPT-2 release's layout: GPT2Model names (no "transformer."), causal-mask buffers
    from safetensors.torch import save_file

    exact = cases[0][1]
    original = tmp_path / "original"
    original.mkdir()
    shutil.copy(tmp_path / "hf-0" / "config.json", original)
    tensors = {k.removeprefix("transformer."): v.contiguous() for k, v in exact.state_dict().items()
               if k != "lm_head.weight"}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril() for i in range(2)})
    save_file(tensors, str(original / "model.safetensors"), metadata={"format": "pt"})
    ours = build(resolve("gpt-tiny", {}))
    load_pretrained_weights(ours, original)
    with torch.no_grad():
        assert_rounding_close(ours.eval()(idx).logits, exact(idx).logits)


def test_init_from_mismatches_name_the_tensor_or_setting(built_exports, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = build(resolve("gpt-tiny", {"vocab_size": PADDED_GPT2_VOCAB, "n_embd": 64}))
    with pytest.raises(LoadError, match=r"tensor transformer\.\S+ has shape \[.*\], the model needs \["):
        load_pretrained_weights(wider, built_exports["gpt"][1])
    with pytest.raises(LoadError, match="holds a gpt2 model; the run's family nrgpt"):
        load_pretrained_weights(build(resolve("nrgpt-tiny", {})), built_exports["gpt"][1])
    with pytest.raises(LoadError, match="model_type 'pretrain_ebt' cannot be loaded into a nrgpt model"):
        load_pretrained_weights(build(resolve("nrgpt-tiny", {})), built_exports["ebt"][1])
    grouped = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    grouped.save_pretrained(tmp_path / "gqa")
    with pytest.raises(LoadError, match="num_key_value_heads=1, the run's model needs 2"):
        load_pretrained_weights(build(resolve("transformer_pp-tiny", {})), tmp_path / "gqa")


def val_loss(model: torch.nn.Module, batches: int) -> float:
    """Mean loss over the first `batches` val micro-batches, read as a one-process run's
    evaluation reads them."""
    from data_pipeline.loader import build_loader

    loader = build_loader(str(runs.char_dataset()), "val", micro_batch_size=runs.BASE_CONFIG["data"]["micro_batch_size"],
                          seed=runs.BASE_CONFIG["seed"], shuffle=False, num_workers=0, repeat=False)
    with torch.no_grad():
        losses = [model(inputs, targets).loss.item() for inputs, targets in islice(loader, batches)]
    return sum(losses) / len(losses)


def test_training_from_an_export_starts_at_the_source_loss(run_exports):
    """A one-process run with `model.init_from` a (native GPT-2) export, one update at a
    negligible learning rate, evaluates to the source run's val loss; then a run whose shape
    does not match fails before training with one line naming the tensor."""
    for name in ("from-export", "from-export-wide"):
        shutil.rmtree(runs.run_dir(name), ignore_errors=True)
    common = ["model.flavor=gpt-tiny", "zero.stage=0", "data.num_workers=0", "eval.sample_tokens=0",
              "checkpoint.interval=0", f"model.init_from={run_exports['gpt']}"]
    result = runs.train_here([*common, "run_name=from-export", "train.max_steps=1", "optimizer.lr=1e-9",
                              "schedule.min_lr=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"init_from {run_exports['gpt']}: loaded" in result.stdout + result.stderr
    summary = json.loads((runs.run_dir("from-export") / "summary.json").read_text())
    source = load_trained(runs.run_dir("gpt-z2")).model
    expected = val_loss(source, runs.BASE_CONFIG["eval"]["batches"])
    assert summary["final_val_loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(summary["final_val_loss"] - val_loss(build(source.config).eval(), 2)) > 0.1  # not the initialisation

    result = runs.train_here([*common, "run_name=from-export-wide", "train.max_steps=1", "model.overrides.n_embd=64"])
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model.init_from: ") and "transformer." in last and "has shape" in last, last
    assert not (runs.run_dir("from-export-wide") / "ckpt").exists()


def test_export_bad_input_is_one_line_and_writes_nothing(run_exports, tmp_path, capsys):
    run = str(runs.run_dir("nrgpt-z2"))

    def fails(argv: list[str], message: str) -> None:
        capsys.readouterr()
        assert export.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err

    (tmp_path / "empty-run").mkdir()
    fails([str(tmp_path / "empty-run"), "--format", "hf", "--out", str(tmp_path / "a")], "no complete checkpoint")
    assert not (tmp_path / "a").exists()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    for overwrite in ([], ["--overwrite"]):  # what the export did not write, it never replaces
        fails([run, "--format", "hf", "--out", str(occupied), *overwrite], "a directory that pretrain.export did not write")
        assert [p.name for p in occupied.iterdir()] == ["notes.txt"]
        (tmp_path / "model.safetensors").write_text("mine")
        fails([run, "--out", str(tmp_path / "model.safetensors"), *overwrite], "a file that pretrain.export did not write")
        assert (tmp_path / "model.safetensors").read_text() == "mine"

    previous = tmp_path / "previous"
    assert export.main([run, "--format", "hf", "--out", str(previous)]) == 0
    fails([run, "--format", "hf", "--out", str(previous)], "holds a previous export; pass --overwrite")
    assert export.main([run, "--format", "hf", "--out", str(previous), "--overwrite"]) == 0
    assert (previous / "modeling_nrgpt.py").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_a_damaged_or_changed_export_is_refused_in_one_line_naming_the_file(built_exports, tmp_path, capsys):
    """Sampling, evaluation and model.init_from read exports back: a file cut short, broken, gone
    or with one byte changed is refused by name before the model is used. A directory is checked
    against its SHA256SUMS, a single-file export against the checksum in its own metadata, which
    covers its weights and its metadata (the safetensors format has no checksum of its own)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pretrain import sample

    def cut_short(file: Path) -> None:
        file.write_bytes(file.read_bytes()[:4000])

    def broken_json(file: Path) -> None:
        file.write_text('{"model_type": ')

    def flipped_last_byte(file: Path) -> None:  # a weight's last byte: the file still parses
        data = bytearray(file.read_bytes())
        data[-1] ^= 1
        file.write_bytes(data)

    def other_step(file: Path) -> None:  # the same weights, rewritten with a metadata value changed
        with safe_open(str(file), framework="pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        save_file(tensors, str(file), metadata={**metadata, "step": "13"})

    model, directory = built_exports["nrgpt"]
    damaged = []  # (source, the error's start)
    for damage, name in ((cut_short, "model.safetensors"), (flipped_last_byte, "model.safetensors"),
                         (broken_json, "config.json"), (broken_json, "training_run.json"),
                         (Path.unlink, "tokenizer.json")):
        copy = shutil.copytree(directory, tmp_path / f"{damage.__name__}-{name}")
        damage(copy / name)
        why = "missing" if damage is Path.unlink else "checksum mismatch"
        damaged.append((copy, f"{copy}: {name} ({why}) against SHA256SUMS"))
    trained = TrainedModel(model=model, flavor="nrgpt-tiny", model_config=model.config, step=12,
                           source=tmp_path / "run" / "ckpt" / "step_00000012", run_config={}, manifest=GPT2_MANIFEST)
    for damage in (cut_short, flipped_last_byte, other_step):
        single = tmp_path / f"{damage.__name__}.safetensors"
        export.write_file(trained, single)
        load_trained(single)  # intact before the damage
        damage(single)
        damaged.append((single, f"{single}: not a readable safetensors file (" if damage is cut_short
                        else f"{single}: checksum mismatch, its weights or metadata changed after the export"))
    for source, expected in damaged:
        with pytest.raises(LoadError, match=re.escape(expected)):
            load_trained(source)
        if source.is_dir():  # what init_from reads
            fresh = build(resolve("nrgpt-tiny", {"vocab_size": PADDED_GPT2_VOCAB, "block_size": 32}))
            with pytest.raises(LoadError, match=re.escape(expected)):
                load_pretrained_weights(fresh, source)
        capsys.readouterr()
        assert sample.main([str(source), "--prompt", "a"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"error: {expected}") and captured.err.count("\n") == 1


def test_a_single_file_export_without_a_checksum_still_loads(built_exports, tmp_path):
    """Exports written before the checksum was recorded carry none: they load as before."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pretrain.models.weights import EXPORT_CHECKSUM

    model, _ = built_exports["gpt"]
    trained = TrainedModel(model=model, flavor="gpt-tiny", model_config=model.config, step=12,
                           source=tmp_path / "run" / "ckpt" / "step_00000012", run_config={}, manifest=GPT2_MANIFEST)
    current, older = tmp_path / "current.safetensors", tmp_path / "older.safetensors"
    export.write_file(trained, current)
    with safe_open(str(current), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    assert len(metadata[EXPORT_CHECKSUM]) == 32  # xxh3-128 in hex
    save_file(tensors, str(older), metadata={k: v for k, v in metadata.items() if k != EXPORT_CHECKSUM})
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_trained(older).model(idx).logits, model(idx).logits)


def test_every_file_of_an_export_is_in_its_sha256sums_and_sha256sum_checks_them(built_exports, tmp_path):
    """The export's SHA256SUMS, read by the real `sha256sum -c`: it passes on the export as
    written and names the one file whose byte was flipped in a copy."""
    for _, directory in built_exports.values():
        listed = [line.split("  ", 1)[1] for line in (directory / "SHA256SUMS").read_text().splitlines()]
        assert sorted(listed) == sorted(p.name for p in directory.iterdir() if p.name != "SHA256SUMS")
        check = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=directory,
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    copy = shutil.copytree(next(iter(built_exports.values()))[1], tmp_path / "copy")
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (copy / "model.safetensors").write_bytes(weights)
    check = subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=copy, capture_output=True, text=True)
    assert check.returncode == 1 and check.stdout.strip() == "model.safetensors: FAILED"


def test_a_failing_export_leaves_out_untouched(run_exports, tmp_path):
    """The tokenizer is written after the model: a manifest whose tokenizer has no Hugging Face
    form fails there, and neither a partial directory nor the staging one remains."""
    trained = load_trained(run_exports["gpt"])
    trained.manifest = {**trained.manifest, "tokenizer": "bytes"}
    out = tmp_path / "export"
    with pytest.raises(ValueError, match="tokenizer 'bytes'"):
        export_hf(trained, out)
    assert list(tmp_path.iterdir()) == []


def test_init_from_must_name_a_hugging_face_directory(tmp_path):
    from pretrain.config import ConfigError, load_config
    from pretrain.config.validation import validate

    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  path: {tmp_path}\ntrain:\n  max_steps: 1\n")
    with pytest.raises(ConfigError, match=r"^model\.init_from='.*': must be a Hugging Face model directory"):
        validate(load_config(config, [f"model.init_from={tmp_path}"]), world_size=1, has_gpu=False)
