"""Export round trip: `python -m pretrain.export RUN_DIR --out FILE` on the 2-process matrix
runs gives a file that `build(config)` + `load_state_dict` accept, with the trained weights."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import trainer_runs as runs
from pretrain import checkpoint, export
from pretrain.models import build, resolve


@pytest.fixture(scope="module")
def matrix():
    return runs.resume_matrix()


def run_export(run_name: str, out) -> subprocess.CompletedProcess:
    return runs.command_here("pretrain.export", [str(runs.run_dir(run_name)), "--out", str(out)])


def logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("family", runs.FAMILIES)
def test_export_of_zero2_run_has_the_trained_weights(matrix, family, tmp_path):
    name = runs.reference_name(family, 2)
    out = tmp_path / f"{name}.safetensors"
    result = run_export(name, out)
    assert result.returncode == 0, result.stderr[-2000:]
    tag_dir = checkpoint.newest_complete(runs.run_dir(name) / "ckpt")
    assert tag_dir.name == f"step_{runs.N_STEPS:08d}"

    # the reference: the module weights DeepSpeed saved (ZeRO-2 keeps them whole on rank 0),
    # loaded into the model the run's own config describes
    marker = checkpoint.Marker.read(tag_dir)
    reference = build(resolve(marker.config.model.flavor, marker.model_config))
    saved = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    reference.load_state_dict(saved, strict=True)

    exported = build(resolve(marker.config.model.flavor, marker.model_config))
    exported.load_state_dict(load_file(str(out)), strict=True)  # every key, nothing extra
    assert all(t.dtype == torch.float32 for t in load_file(str(out)).values() if t.is_floating_point())
    idx = torch.randint(0, reference.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(exported, idx), logits(reference, idx))
    assert torch.equal(logits(export.load(out), idx), logits(reference, idx))
    # and they are trained weights, not the initialisation
    initial = build(resolve(marker.config.model.flavor, marker.model_config))
    assert not torch.allclose(logits(initial, idx), logits(reference, idx))


def test_zero3_shards_consolidate_to_the_zero2_model(matrix, tmp_path):
    """ZeRO-3 partitions every parameter over the two ranks; the export merges them into the
    model that ZeRO-2 trained (equal up to the float rounding of a different reduction order)."""
    files = {}
    for stage in (2, 3):
        files[stage] = tmp_path / f"gpt-z{stage}.safetensors"
        assert run_export(runs.reference_name("gpt", stage), files[stage]).returncode == 0
    zero2, zero3 = export.load(files[2]), export.load(files[3])
    with safe_open(str(files[3]), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["flavor"] == "gpt-tiny" and metadata["step"] == str(runs.N_STEPS)
    assert json.loads(metadata["model_config"])["vocab_size"] == zero3.config.vocab_size
    for (name, a), (_, b) in zip(zero2.state_dict().items(), zero3.state_dict().items()):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), name
    idx = torch.randint(0, zero2.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(logits(zero2, idx), logits(zero3, idx), atol=1e-4)


def test_export_errors_are_one_line_and_write_nothing(tmp_path):
    (tmp_path / "empty-run").mkdir()
    result = subprocess.run([sys.executable, "-m", "pretrain.export", str(tmp_path / "empty-run"),
                             "--out", str(tmp_path / "model.safetensors")],
                            cwd=runs.REPO, env=runs.child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "no complete checkpoint" in result.stderr
    assert not (tmp_path / "model.safetensors").exists()
