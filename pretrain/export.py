"""Export a run's checkpoint as one consolidated fp32 safetensors file.

    python -m pretrain.export RUN_DIR|CHECKPOINT_DIR --out model.safetensors

The sharded ZeRO checkpoint is merged with DeepSpeed's ZeRO-to-fp32 conversion (the fp32
master weights, whatever the training precision). The file holds every key of the model's
`state_dict()` (tied weights stored under both names), so `build(config)` followed by
`load_state_dict(safetensors.torch.load_file(FILE))` accepts it; the metadata carries the
flavor and the full model config (`load` below does both steps)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from pretrain.fileio import atomic_write
from pretrain.trained import LoadError, load_trained


def export(source: str | Path, out: str | Path) -> Path:
    """Write the newest complete checkpoint under `source` (a run directory, its `ckpt/`, or one
    checkpoint) to `out`; returns the checkpoint exported. The file appears only when complete."""
    trained = load_trained(source)
    tag_dir = trained.source
    tensors = {name: t.detach().contiguous().clone() for name, t in trained.model.state_dict().items()}
    metadata = {"flavor": trained.flavor, "model_config": json.dumps(asdict(trained.model_config)),
                "run_config": json.dumps(trained.run_config), "checkpoint": tag_dir.name,
                "step": str(trained.step)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return tag_dir


def load(path: str | Path) -> torch.nn.Module:
    """Rebuild the model of an exported file and load its weights (fp32, CPU, eval mode)."""
    return load_trained(path).model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory (its newest complete checkpoint), or one checkpoint")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        tag_dir = export(args.run_dir, args.out)
    except (LoadError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {tag_dir} ({os.path.getsize(args.out) / 1e6:.1f} MB, fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
