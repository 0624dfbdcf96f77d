"""Write a trained model as a Hugging Face directory (`python -m pretrain.export RUN --format hf`).

    DIR/config.json, model.safetensors, generation_config.json   the model (fp32)
    DIR/tokenizer.json, tokenizer_config.json, ...                the training data's tokenizer
    DIR/README.md                                                 the model card
    DIR/training_run.json                                         flavor, config, step, run config, data manifest
    DIR/SHA256SUMS                                                every other file's digest (`sha256sum -c SHA256SUMS`)
    DIR/*.py                                                      gpt_rec, nrgpt, ebt: the modeling code

gpt and transformer_pp become native GPT2LMHeadModel / LlamaForCausalLM (`hf/native.py`) where
that class computes exactly our model. The others carry their code: the family's module from
pretrain/models/ and every module of that package it imports, with those imports made relative,
the generic wrapper `hf/modeling.py`, and a generated `modeling_<family>.py` that binds the two,
registered for the auto classes."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from common.fileio import atomic_directory, markdown_table, read_json, sha256_hex
from pretrain.hf import native
from pretrain.hf.load import CHECKSUM_FILE, CODE_PREFIX, RUN_FILE
from pretrain.models import build, family_name, family_spec, model_class
from pretrain.training.summary import SUMMARY_FILE
from pretrain.training.trained import (TrainedModel, inside_trainer_directory, is_run_directory, results_file,
                                      run_dir_of)

REMOTE_MODEL_TYPE = "pretrain_{family}"
"""model_type of the exports that carry their code."""
MODELS_PACKAGE = "pretrain.models"
WRAPPER_MODULE = "pretrain.hf.modeling"
CARRIED_PACKAGES = {"torch", "transformers"}
"""What carried code may import besides the standard library and its own package."""
PACKAGE_IMPORT = re.compile(r"^(\s*)from pretrain\.(?:models|hf)\.(\w+) import", re.MULTILINE)
TRAINING_ONLY = {"replay_buffer_size": 0}
"""Config fields that hold training state only (EBT's replay buffer: up to GBs of candidates),
left out of exports."""


class ExportError(ValueError):
    """The model cannot be exported as asked; the message is one line."""


def check_out(out: Path, overwrite: bool, source: str | Path, directory: bool) -> None:
    """Refuse an `out` that the export could harm, in one line. An export replaces nothing but
    a previous export (with `overwrite`): a Hugging Face directory (`directory`) that lists
    every file it holds in its training_run.json, or a safetensors file with the metadata
    pretrain.export writes. So `out` may not be, or hold, the `source` (or its run directory),
    be a run directory or lie in a run's ckpt/ or tb/, and an existing `out` must be such an
    export or an empty directory. Inside a run directory otherwise (e.g. RUN/export) an export
    is just a new entry: the run's own files are never touched."""
    nearest = next(p for p in out.absolute().parents if p.exists())
    if not nearest.is_dir():
        raise ExportError(f"--out {out}: {nearest} is not a directory")
    target, source = out.resolve(), Path(source).resolve()
    if target == source or target in source.parents:
        raise ExportError(f"--out {out} {'is' if target == source else 'holds'} the source {source}; "
                          "choose a new path for the export")
    inside = inside_trainer_directory(out)
    if inside is not None:
        raise ExportError(f"--out {out} {inside}")
    if is_run_directory(target):
        raise ExportError(f"--out {out} is a run directory; choose a new path for the export")
    if not out.exists() or (directory and out.is_dir() and not any(out.iterdir())):
        return
    refused = _not_a_previous_export(out, directory)
    if refused:
        raise ExportError(f"--out {out} {refused}; choose a new path for the export")
    if not overwrite:
        raise ExportError(f"--out {out} holds a previous export; pass --overwrite to replace it")


def _not_a_previous_export(out: Path, directory: bool) -> str | None:
    """Why the existing `out` is not a previous export that the export may replace, or None."""
    if not directory:
        if out.is_dir():
            return "is a directory (the safetensors format writes one file; --format hf writes a directory)"
        try:
            with safe_open(str(out), framework="pt") as f:
                written_here = "flavor" in (f.metadata() or {})  # what `load_trained` checks
        except (SafetensorError, OSError):
            written_here = False
        return None if written_here else "is a file that pretrain.export did not write"
    if not out.is_dir():
        return "is a file, not a directory that pretrain.export wrote"
    try:
        written = set(json.loads((out / RUN_FILE).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"is a directory that pretrain.export did not write (no readable {RUN_FILE} listing its files)"
    added = sorted(p.name for p in out.iterdir() if p.name not in written)
    if added:
        return (f"is an export holding files that pretrain.export did not write ({', '.join(added[:3])}"
                f"{', ...' if len(added) > 3 else ''}), which replacing it would delete")
    return None


def write_failure(out: Path, error: Exception) -> ExportError:
    """The line for an export that could not be written: what failed, in words, at the user's
    `out` (the error itself names the staging path, or, from safetensors, no path at all)."""
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:  # safetensors: "Error while serializing: I/O error: No space left on device (os error 28)"
        code = re.search(r"(?:os error |code: )(\d+)", str(error))
        reason = os.strerror(int(code.group(1))) if code else str(error)
    return ExportError(f"--out {out}: the export could not be written ({reason}); {out} was left as it was")


def export_hf(trained: TrainedModel, out: str | Path, overwrite: bool = False, command: str = "") -> Path:
    """Write the Hugging Face directory `out` (it appears only when complete, replacing a
    previous export only with `overwrite`: see `check_out`); returns it."""
    out = Path(out)
    check_out(out, overwrite, trained.source, directory=True)
    if trained.manifest is None:
        raise ExportError(f"{trained.source}: the training data's manifest was not found, so the "
                          "export would have no tokenizer (is the run's data.path still there?)")
    model_config = dataclasses.replace(trained.model_config, **{k: v for k, v in TRAINING_ONLY.items()
                                                               if hasattr(trained.model_config, k)})
    with torch.device("meta"):  # only the names: no memory, no draw from the caller's RNG
        kept = build(model_config).state_dict().keys()
    state = {k: t for k, t in trained.model.state_dict().items() if k in kept}
    reason = native.not_native_reason(model_config)
    eot_id = trained.manifest["eot_id"]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_directory(out) as staging:
            if reason is None:
                save_native(state, model_config, staging, eot_id)
            else:
                save_with_code(state, model_config, trained.flavor, staging, eot_id)
            save_tokenizer(trained.manifest, staging, model_config.block_size)
            (staging / "README.md").write_text(model_card(trained, model_config, reason, out, command))
            # what --overwrite may replace
            files = sorted([p.name for p in staging.iterdir()] + [RUN_FILE, CHECKSUM_FILE])
            run = {"format": "native" if reason is None else "code", "family": family_name(model_config),
                   "flavor": trained.flavor, "model_config": dataclasses.asdict(model_config), "step": trained.step,
                   "checkpoint": str(trained.source), "run_config": trained.run_config,
                   "manifest": trained.manifest, "files": files}
            (staging / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")
            (staging / CHECKSUM_FILE).write_text("".join(f"{sha256_hex(staging / name)}  {name}\n"
                                                         for name in files if name != CHECKSUM_FILE))
    except (OSError, SafetensorError) as e:
        raise write_failure(out, e) from None
    return out


def save_native(state: dict[str, torch.Tensor], model_config: Any, out: Path, eot_id: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = native.hf_model_type(model_config)
    # no pad_token_id in the model config: Llama would make it its embedding's padding_idx
    config = AutoConfig.for_model(model_type, **native.hf_config(model_config), bos_token_id=eot_id,
                                  eos_token_id=eot_id)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf_model.load_state_dict(native.to_hf(state, model_config), strict=False)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    if missing != tied or unexpected:
        raise ExportError(f"the {model_type} mapping does not cover the model: missing {missing}, "
                          f"unexpected {unexpected}")
    hf_model.generation_config.pad_token_id = eot_id
    hf_model.save_pretrained(out, safe_serialization=True)


GENERATED_MODULE = '''"""Hugging Face classes of an exported {family} model, generated by pretrain.export: the
wrapper of modeling.py bound to the family's config class ({config_module}.py)."""
from .modeling import ExportedConfig, ExportedForCausalLM
from .{config_module} import {config_class}

# From a local directory, Hugging Face copies only the modules that this file imports itself:
# one name of each further module the model's code imports.
{carried_imports}


class {prefix}HFConfig(ExportedConfig):
    model_type = "{model_type}"


class {prefix}ForCausalLM(ExportedForCausalLM):
    config_class = {prefix}HFConfig
    family_config_class = {config_class}


# save_pretrained of a loaded model then writes these files and the auto_map again
{prefix}HFConfig.register_for_auto_class()
{prefix}ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
'''


def save_with_code(state: dict[str, torch.Tensor], model_config: Any, flavor: str, out: Path, eot_id: int) -> None:
    from transformers import GenerationConfig

    from pretrain.hf.modeling import ExportedConfig

    family = family_name(model_config)
    config_cls = type(model_config)
    config_module = config_cls.__module__.rsplit(".", 1)[1]
    prefix = model_class(model_config).__name__
    module = f"modeling_{family}"
    sources = carried_sources([config_cls.__module__, WRAPPER_MODULE])
    for name, text in sources.items():
        (out / name).write_text(text)
    carried_imports = "\n".join(f"from .{name.removesuffix('.py')} import {first_definition(text)}  # noqa: F401"
                                 for name, text in sorted(sources.items())
                                 if name not in (f"{config_module}.py", "modeling.py"))
    (out / f"{module}.py").write_text(GENERATED_MODULE.format(
        family=family, config_module=config_module, config_class=config_cls.__name__, prefix=prefix,
        model_type=REMOTE_MODEL_TYPE.format(family=family), carried_imports=carried_imports))
    config = ExportedConfig(family=family, flavor=flavor, model_config=dataclasses.asdict(model_config),
                            architectures=[f"{prefix}ForCausalLM"], bos_token_id=eot_id, eos_token_id=eot_id,
                            pad_token_id=eot_id, dtype="float32",
                            auto_map={"AutoConfig": f"{module}.{prefix}HFConfig",
                                      "AutoModelForCausalLM": f"{module}.{prefix}ForCausalLM"})
    config_dict = {**config.to_diff_dict(), "model_type": REMOTE_MODEL_TYPE.format(family=family)}
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    tensors = {CODE_PREFIX + name: t.detach().clone().contiguous() for name, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id).save_pretrained(out)


def imported_modules(source: str) -> list[str]:
    """Every absolute import of a module's source, also those inside functions."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return names


def first_definition(source: str) -> str:
    """The name of the first class or function a module defines."""
    return next(node.name for node in ast.parse(source).body
                if isinstance(node, (ast.ClassDef, ast.FunctionDef)))


def carried_sources(modules: list[str]) -> dict[str, str]:
    """File name -> source of `modules` and of every pretrain.models module they import,
    transitively, with those imports made relative (one flat directory, as Hugging Face's
    dynamic modules require). Anything else they import must be the standard library, torch or
    transformers: an export must load without this repository or its training dependencies."""
    todo, sources = list(modules), {}
    while todo:
        module = todo.pop()
        file_name = module.rsplit(".", 1)[1] + ".py"
        if file_name in sources:
            continue
        text = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
        for imported in imported_modules(text):
            top = imported.split(".")[0]
            if imported.startswith(MODELS_PACKAGE + ".") and imported.count(".") == 2:
                todo.append(imported)
            elif top == "pretrain" or (top not in sys.stdlib_module_names and top not in CARRIED_PACKAGES):
                raise ExportError(f"{module} imports {imported}; exported modeling code may import only "
                                  f"the standard library, {', '.join(sorted(CARRIED_PACKAGES))} and "
                                  f"{MODELS_PACKAGE}.<module> (as 'from {MODELS_PACKAGE}.<module> import ...')")
        relative = PACKAGE_IMPORT.sub(r"\1from .\2 import", text)
        left = [m for m in imported_modules(relative) if m.split(".")[0] == "pretrain"]
        if left:
            raise ExportError(f"{module}: import of {left[0]} not in the form "
                              f"'from {MODELS_PACKAGE}.<module> import ...', which the export rewrites")
        sources[file_name] = relative
    return sources


def save_tokenizer(manifest: dict, out: Path, block_size: int) -> None:
    """The training data's tokenizer as a Hugging Face fast tokenizer: GPT-2's BPE from the same
    files the data pipeline reads, or the char / word vocabulary of the manifest."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

    from data_pipeline.tokenizer import _gpt2_files_dir, tokenizer_from_spec

    kind = manifest["tokenizer"]
    if kind == "gpt2":
        files = Path(_gpt2_files_dir())
        tokenizer = GPT2TokenizerFast(vocab_file=str(files / "encoder.json"), merges_file=str(files / "vocab.bpe"),
                                      model_max_length=block_size, clean_up_tokenization_spaces=False)
    else:
        ours = tokenizer_from_spec(manifest)
        if kind == "char":
            eot = "<|endoftext|>"
            vocab = {c: i for i, c in enumerate(ours.chars)} | {eot: ours.eot_id}
            pre_tokenizer, decoder = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"), decoders.Fuse()
        elif kind == "listops":
            eot = ours.vocab[ours.eot_id]
            vocab = dict(ours.index)
            pre_tokenizer, decoder = pre_tokenizers.WhitespaceSplit(), None  # decoding joins with spaces
        else:
            raise ExportError(f"tokenizer {kind!r} of the training data has no Hugging Face form")
        # no unknown token: text outside the vocabulary fails to encode, as in the data pipeline
        backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
        backend.pre_tokenizer = pre_tokenizer
        if decoder is not None:
            backend.decoder = decoder
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eot, bos_token=eot,
                                            model_max_length=block_size, clean_up_tokenization_spaces=False)
    tokenizer.save_pretrained(out)


def _run_summary(trained: TrainedModel) -> dict | None:
    """The run's summary.json when it describes the exported checkpoint's step."""
    run_dir = run_dir_of(trained.source)
    file = run_dir / SUMMARY_FILE if run_dir is not None else None
    if file is None or not file.is_file():
        return None
    summary = read_json(file)
    return summary if summary.get("steps") == trained.step else None


def _evaluation(trained: TrainedModel) -> dict | None:
    """The results `python -m pretrain.evaluate` wrote for the exported weights where it writes
    them by default (RUN_DIR/downstream/<tag>.json for a run's checkpoint), if any."""
    file = results_file(trained.source)
    if not file.is_file():
        return None
    report = read_json(file, ExportError)
    return report if report.get("step") == trained.step and report.get("rows") else None


def model_card(trained: TrainedModel, model_config: Any, not_native: str | None, out: Path, command: str) -> str:
    """README.md of the export: what the model is, what it was trained on, how it did."""
    family, run, model = family_name(model_config), trained.run_config, trained.model
    summary = _run_summary(trained) or {}
    manifest = trained.manifest
    data, train = run.get("data", {}), run.get("train", {})
    if "tokens_seen" in summary:
        tokens = f"{summary['tokens_seen']:,}"
    else:
        tokens = f"{trained.step * train.get('global_batch_size', 0) * data.get('seq_len', 0):,} (steps x tokens per step)"
    splits = manifest.get("splits", {})
    rows = [
        {"": "family", "value": family},
        {"": "flavor", "value": trained.flavor + (" (with overrides, see config.json)" if run.get("model", {}).get("overrides") else "")},
        {"": "parameters", "value": f"{model.num_params():,} ({model.num_params(non_embedding=True):,} non-embedding)"},
        {"": "training steps", "value": f"{trained.step:,}"},
        {"": "tokens seen", "value": tokens},
        {"": "data", "value": f"{manifest.get('source', data.get('path'))}, {manifest['tokenizer']} tokenizer "
                              f"(vocabulary {manifest['vocab_size']}), windows of {manifest.get('seq_len')} tokens"
                              + (f", {splits['train']['tokens']:,} training tokens" if "train" in splits else "")},
        {"": "final val loss", "value": _number(summary.get("final_val_loss"))},
        {"": "best val loss", "value": _number(summary.get("best_val_loss"))},
        {"": "final train loss", "value": _number(summary.get("final_train_loss"))},
    ]
    if summary.get("think_losses"):
        rows.append({"": "EBT val loss after 1..N think steps",
                     "value": " ".join(f"{x:.4f}" for x in summary["think_losses"])})
    downstream = summary.get("downstream") or {}  # `downstream/<task>/<metric>` -> value
    remote = not_native is not None
    load = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained(\"{out.name}\"{', trust_remote_code=True' if remote else ''})\n"
            f"tokenizer = AutoTokenizer.from_pretrained(\"{out.name}\")")
    architecture = (f"Native `{native.ARCHITECTURES[native.hf_model_type(model_config)]}`." if not remote else
                    f"Custom code (`modeling_{family}.py`, `modeling.py` and the model's own modules in this "
                    f"directory; they need only torch and transformers): {not_native}. `generate()` "
                    "decodes with the model's own cache: each new token runs against the cached keys and "
                    "values, and past the context length the last block_size tokens are recomputed "
                    "(`use_cache=False` recomputes the context for every token)"
                    + (f"; each token is predicted by {model_config.n_steps} descent steps (thinking)"
                       if family_spec(model_config).thinks else "") + ".")
    lines = [
        "---", "library_name: transformers", f"tags: [{family}, pretrain]", "---", "",
        f"# {trained.flavor} (step {trained.step})", "",
        f"A language model of the `{family}` family, trained with this project's pretraining pipeline. "
        f"{architecture}", "",
        markdown_table(rows), "## Use", "", "```python", load, "```", "",
        "The tokenizer gives the training data's token ids. The pipeline encodes `<|endoftext|>` inside "
        "text as ordinary text; pass `split_special_tokens=True` to the tokenizer for the same ids there.", "",
    ]
    evaluated = _evaluation(trained)
    if evaluated or downstream:
        lines += ["## Downstream results", ""]
    if evaluated:
        from pretrain.downstream.harness import Row, table

        limit = evaluated.get("limit")
        lines += [f"`python -m pretrain.evaluate` at step {evaluated['step']:,} (this checkpoint), "
                  f"{'the first ' + str(limit) if limit else 'all'} documents of each task, "
                  f"{evaluated.get('dtype', 'fp32')}; docs: documents scored.", "",
                  table([Row(**row) for row in evaluated["rows"]])]
    if downstream:
        limit = run.get("eval", {}).get("downstream", {}).get("limit")
        lines += [f"During training (`eval.downstream`) at step {trained.step:,}, the first {limit} documents of "
                  "each task:", "", markdown_table([{"task": tag.split("/")[1], "metric": tag.split("/")[2],
                                                     "value": f"{value:.4f}", "docs": limit}
                                                    for tag, value in sorted(downstream.items())])]
    lines += ["## Provenance", "",
              f"Checkpoint `{trained.source}`; `training_run.json` holds the run's resolved config, the model "
              "config and the data manifest. Trained with `python -m pretrain.train` on that config. "
              f"`sha256sum -c {CHECKSUM_FILE}` in this directory checks that every file arrived intact.", ""]
    if command:
        lines += ["Exported with:", "", "```", command, "```", ""]
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "not recorded" if value is None else f"{value:.4f}"
