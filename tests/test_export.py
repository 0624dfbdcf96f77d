"""Export round trip: `python -m pretrain.export RUN_DIR --out FILE` on the 2-process matrix
runs gives a file that `build(config)` + `load_state_dict` accept, with the trained weights."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import trainer_runs as runs
from pretrain import export
from pretrain.models import build, resolve
from pretrain.training import checkpoint
from pretrain.training.checkpoint import layout


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
    assert f"sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}" in result.stdout
    tag_dir = layout.newest_complete(runs.run_dir(name) / "ckpt")
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


# --- what an export may replace ------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A one-process gpt run of 2 steps: ckpt/, tb/, config.yaml, summary.json."""
    root = tmp_path_factory.mktemp("small")
    result = runs.train_here([f"output_root={root}", "run_name=run", "zero.stage=0", "train.max_steps=2",
                              "checkpoint.interval=2", "data.num_workers=0", "eval.sample_tokens=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


def contents(directory: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file below `directory`."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def run_copy(small_run, tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A copy of the small run next to a file of the user's, and the bytes of both."""
    run = shutil.copytree(small_run, tmp_path / "runs" / "run")
    (tmp_path / "runs" / "notes.txt").write_text("mine")
    return run, contents(tmp_path / "runs")


def refused(argv: list[str], message: str, capsys) -> str:
    """export.main(argv) exits 2 with one error line holding `message`; returns the line."""
    capsys.readouterr()
    assert export.main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_out_that_is_or_holds_the_run_is_refused_and_the_run_is_untouched(run_copy, fmt, capsys):
    run, before = run_copy
    tag = run / "ckpt" / "step_00000002"
    for source, out, message in [(run, run, "is the source"), (run, run.parent, "holds the source"),
                                 (tag, run, "holds the source"), (tag, tag, "is the source"),
                                 (run / "ckpt", run.parent.parent, "holds the source")]:
        for overwrite in ([], ["--overwrite"]):
            line = refused([source, "--format", fmt, "--out", out, *overwrite], message, capsys)
            assert "--overwrite" not in line
            assert contents(run.parent) == before


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_out_that_is_not_an_export_is_refused_without_suggesting_overwrite(run_copy, tmp_path, fmt, capsys):
    run, before = run_copy
    other_run = shutil.copytree(run, tmp_path / "other-run")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "notes.safetensors").write_text("mine")
    cases = [(other_run, "is a run directory"), (run / "ckpt" / "export", "which the training run manages"),
             (run / "tb" / "export", "which the training run manages"),
             (run / "summary.json", "did not write" if fmt == "safetensors" else "is a file"),
             (tmp_path / "mine", "did not write" if fmt == "hf" else "is a directory"),
             (tmp_path / "notes.safetensors", "did not write" if fmt == "safetensors" else "is a file")]
    theirs = {path: contents(path) if path.is_dir() else path.read_bytes()
              for path in (other_run, tmp_path / "mine", tmp_path / "notes.safetensors")}
    for out, message in cases:
        for overwrite in ([], ["--overwrite"]):
            line = refused([run, "--format", fmt, "--out", out, *overwrite], message, capsys)
            assert "--overwrite" not in line
    assert contents(run.parent) == before
    assert {path: contents(path) if path.is_dir() else path.read_bytes() for path in theirs} == theirs
    assert not (run / "ckpt" / "export").exists() and not (run / "tb" / "export").exists()


def test_export_inside_the_run_replaces_only_a_previous_export(run_copy, capsys):
    """RUN/export is a new entry of the run directory; --overwrite replaces it as long as it
    holds only what the export wrote."""
    run, before = run_copy
    out, single = run / "export", run / "model.safetensors"
    assert export.main([str(run), "--format", "hf", "--out", str(out)]) == 0
    assert export.main([str(run), "--out", str(single)]) == 0
    assert {k: v for k, v in contents(run.parent).items() if k.startswith("run/") and
            not k.startswith(("run/export/", "run/model.safetensors"))} == \
           {k: v for k, v in before.items() if k.startswith("run/")}
    first = contents(out)
    refused([run, "--format", "hf", "--out", out], "holds a previous export; pass --overwrite to replace it", capsys)
    refused([run, "--out", single], "holds a previous export; pass --overwrite to replace it", capsys)
    assert export.main([str(run), "--format", "hf", "--out", str(out), "--overwrite"]) == 0
    assert export.main([str(run), "--out", str(single), "--overwrite"]) == 0
    assert contents(out).keys() == first.keys()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no staging left

    # a file of the user's added to the export: replacing the export would delete it
    (out / "notes.txt").write_text("mine")
    with_notes = contents(out)
    line = refused([run, "--format", "hf", "--out", out, "--overwrite"], "notes.txt", capsys)
    assert "did not write" in line and "--overwrite" not in line.split("notes.txt")[1]
    assert contents(out) == with_notes
    for name, data in before.items():
        assert (run.parent / name).read_bytes() == data, name


def test_a_failed_write_names_out_in_words_and_leaves_the_previous_export(small_run, tmp_path):
    """A file size limit (RLIMIT_FSIZE, as a full disk would) stops the weights' write: the
    error says what failed at --out, not at the staging path, and the previous export stays."""
    import resource
    import signal

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, 16_000))

    for fmt, out in (("hf", tmp_path / "hf"), ("safetensors", tmp_path / "model.safetensors")):
        assert export.main([str(small_run), "--format", fmt, "--out", str(out)]) == 0
        previous = contents(tmp_path)
        result = subprocess.run([sys.executable, "-m", "pretrain.export", str(small_run), "--format", fmt,
                                 "--out", str(out), "--overwrite"], cwd=runs.REPO, env=runs.child_env(),
                                capture_output=True, text=True, timeout=300, preexec_fn=small_files)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: the export could not be written "
                                                       "(File too large)"), lines
        assert "Errno" not in lines[0] and lines[0].count(str(tmp_path)) == 2  # --out, nothing else
        assert contents(tmp_path) == previous  # the previous exports, and no staging left behind
