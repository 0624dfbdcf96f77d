"""Export a run's checkpoint as one consolidated fp32 safetensors file.

    python -m pretrain.export RUN_DIR --out model.safetensors [--checkpoint CKPT_DIR]

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
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pretrain import checkpoint
from pretrain.models import build, resolve


def consolidated_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights (and buffers) of one checkpoint."""
    if checkpoint.read_marker(tag_dir)["config"]["zero"]["stage"] == 0:
        # without ZeRO every rank holds the whole model; the model-states file has it
        module = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu",
                            weights_only=False)["module"]
        return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def export(source: str | Path, out: str | Path) -> Path:
    """Write the newest complete checkpoint under `source` (a run directory, its `ckpt/`, or one
    checkpoint) to `out`; returns the checkpoint exported. The file appears only when complete."""
    tag_dir = checkpoint.find_checkpoint(str(source), Path(source) / "ckpt")
    if tag_dir is None:
        raise ValueError(f"{source}: no complete checkpoint found")
    marker = checkpoint.read_marker(tag_dir)
    flavor = marker["config"]["model"]["flavor"]
    model = build(resolve(flavor, marker["model_config"]))
    model.load_state_dict(consolidated_state_dict(tag_dir), strict=True)
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    metadata = {"flavor": flavor, "model_config": json.dumps(marker["model_config"]),
                "checkpoint": tag_dir.name, "step": str(marker["step"])}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_write(out, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return tag_dir


def load(path: str | Path) -> torch.nn.Module:
    """Rebuild the model of an exported file and load its weights."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    model = build(resolve(metadata["flavor"], json.loads(metadata["model_config"])))
    model.load_state_dict(load_file(str(path)), strict=True)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory (its newest complete checkpoint), or one checkpoint")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        tag_dir = export(args.run_dir, args.out)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {tag_dir} ({os.path.getsize(args.out) / 1e6:.1f} MB, fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
