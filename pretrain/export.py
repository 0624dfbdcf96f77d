"""Export a run's checkpoint: one consolidated fp32 safetensors file, or a Hugging Face directory.

    python -m pretrain.export RUN_DIR|CHECKPOINT_DIR --out model.safetensors
    python -m pretrain.export RUN_DIR|CHECKPOINT_DIR --format hf --out DIR [--overwrite]

The sharded ZeRO checkpoint is merged with DeepSpeed's ZeRO-to-fp32 conversion (the fp32
master weights, whatever the training precision). The safetensors file holds every key of the
model's `state_dict()` (tied weights stored under both names), so `build(config)` followed by
`load_state_dict(safetensors.torch.load_file(FILE))` accepts it; the metadata carries the
flavor and the full model config (`load` below does both steps), and a checksum of the metadata
and tensors, which loading verifies (a changed or damaged file is refused in one line).

`--format hf` writes a directory that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load (see `pretrain.training.export_hf`): native GPT2LMHeadModel /
LlamaForCausalLM for gpt / transformer_pp, the model's own code (`trust_remote_code=True`) for
gpt_rec, nrgpt and ebt, with the tokenizer and a model card. Either output appears only when complete.

An export never deletes what it did not write: `--overwrite` replaces only a previous export
(a file with this exporter's metadata, or a directory whose training_run.json lists every file
in it), by a swap once the new one is complete. An `--out` that is or holds the source, is a
run directory or lies in a run's ckpt/ or tb/, or exists as anything but a previous export (or
an empty directory), is refused. `--out` may lie in the source's run directory otherwise
(e.g. RUN/export): it is a new entry there, and the run's files are not touched."""
from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from common.cli import ArgumentParser, run_command
from common.fileio import atomic_write, sha256_hex
from pretrain.models.weights import EXPORT_CHECKSUM, export_checksum
from pretrain.training.export_hf import check_out, export_hf, write_failure
from pretrain.training.trained import TrainedModel, load_trained


def export(source: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the newest complete checkpoint under `source` (a run directory, its `ckpt/`, or one
    checkpoint) to `out`; returns the checkpoint exported. The file appears only when complete,
    and replaces only a file exported before, with `overwrite` (see `check_out`)."""
    trained = load_trained(source)
    out = Path(out)
    check_out(out, overwrite, trained.source, directory=False)
    write_file(trained, out)
    return trained.source


def write_file(trained: TrainedModel, out: Path) -> None:
    """Write `trained` to `out` as one safetensors file (atomically): its weights, the metadata
    that `load_trained` rebuilds the model from, and their checksum, which loading verifies."""
    tensors = {name: t.detach().contiguous().clone() for name, t in trained.model.state_dict().items()}
    metadata = {"flavor": trained.flavor, "model_config": json.dumps(asdict(trained.model_config)),
                "run_config": json.dumps(trained.run_config), "checkpoint": trained.source.name,
                "step": str(trained.step)}
    metadata[EXPORT_CHECKSUM] = export_checksum(tensors, metadata)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    except (OSError, SafetensorError) as e:  # the temporary file's name would mean nothing to the user
        raise write_failure(out, e) from None


def load(path: str | Path) -> torch.nn.Module:
    """Rebuild the model of an exported file and load its weights (fp32, CPU, eval mode)."""
    return load_trained(path).model


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory (its newest complete checkpoint), or one checkpoint")
    parser.add_argument("--out", required=True, help="output .safetensors file, or directory for --format hf")
    parser.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="one safetensors file (default) or a Hugging Face directory")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous export at --out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        # before the checkpoint is read (a ZeRO merge takes a while); the export checks again
        # against the checkpoint it found
        check_out(out, args.overwrite, args.run_dir, directory=args.format == "hf")
        if args.format == "hf":
            command = shlex.join(["python", "-m", "pretrain.export", *(sys.argv[1:] if argv is None else argv)])
            trained = load_trained(args.run_dir)
            export_hf(trained, out, overwrite=args.overwrite, command=command)
            print(f"wrote {out} from {trained.source} ({trained.family}, Hugging Face format)")
            return 0
        tag_dir = export(args.run_dir, out, args.overwrite)
    except (ValueError, OSError) as e:  # LoadError, ExportError, bad model configs; disk full
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} from {tag_dir} ({os.path.getsize(out) / 1e6:.1f} MB, fp32, sha256 {sha256_hex(out)})")
    return 0


if __name__ == "__main__":
    run_command(main)
