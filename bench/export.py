"""What verifying an export costs next to loading it, at GPT-2 124M.

    python -m bench.export [--dir DIR] [--rounds 3]

Writes a gpt-124m model (random weights, GPT-2's padded vocabulary) once as a single-file export
and as a Hugging Face export into DIR (a temporary directory by default; an existing DIR from an
earlier run is reused), then times, in interleaved rounds, `load_trained` of each (which
verifies) and the verification alone: for the file, `export_checksum` of its tensors (xxh3-128
over the tensors that loading has read anyway), for the directory `verify_checksums` (SHA-256 of
every file, read from disk: the page cache, after the first round). Wall-clock and process CPU
seconds, the minimum over rounds."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from common.cli import ArgumentParser, run_command
from common.fileio import markdown_table
from pretrain.export import write_file
from pretrain.hf.load import verify_checksums
from pretrain.models import build, resolve
from pretrain.models.weights import export_checksum, read_safetensors
from pretrain.training.export_hf import export_hf
from pretrain.training.trained import TrainedModel, load_trained

FLAVOR = "gpt-124m"
MANIFEST = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256, "seq_len": 1024, "source": "openwebtext"}


def write_exports(directory: Path) -> tuple[Path, Path]:
    """(single file, Hugging Face directory) of a gpt-124m in `directory`, written unless there."""
    single, hf = directory / f"{FLAVOR}.safetensors", directory / f"{FLAVOR}-hf"
    if single.is_file() and hf.is_dir():
        return single, hf
    torch.manual_seed(0)
    model = build(resolve(FLAVOR, {"vocab_size": 50304})).eval()
    trained = TrainedModel(model=model, flavor=FLAVOR, model_config=model.config, step=0,
                           source=directory / "run" / "ckpt" / "step_00000000", run_config={}, manifest=MANIFEST)
    write_file(trained, single)
    export_hf(trained, hf)
    return single, hf


def timed(work) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where the exports are written once (default: a temporary one)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        directory = Path(args.dir or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        single, hf = write_exports(directory)
        tensors, metadata = read_safetensors(single)
        work = {"file: load_trained": lambda: load_trained(single),
                "file: export_checksum": lambda: export_checksum(tensors, metadata),
                "directory: load_trained": lambda: load_trained(hf),
                "directory: verify_checksums": lambda: verify_checksums(hf)}
        best = {name: (float("inf"), float("inf")) for name in work}
        for _ in range(args.rounds):
            for name, run in work.items():
                wall, cpu = timed(run)
                best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
        sizes = {"file": single.stat().st_size, "directory": sum(p.stat().st_size for p in hf.iterdir())}
    params = sum(t.numel() for name, t in tensors.items() if name != "lm_head.weight")
    print(f"{FLAVOR}: {params / 1e6:.1f}M parameters; file {sizes['file'] / 1e6:.0f} MB, "
          f"directory {sizes['directory'] / 1e6:.0f} MB; minimum of {args.rounds} rounds")
    rows = [{"what": name, "wall s": wall, "CPU s": cpu} for name, (wall, cpu) in best.items()]
    for kind, check in (("file", "file: export_checksum"), ("directory", "directory: verify_checksums")):
        rows.append({"what": f"{kind}: verification / load", "wall s": best[check][0] / best[f"{kind}: load_trained"][0],
                     "CPU s": best[check][1] / best[f"{kind}: load_trained"][1]})
    print(markdown_table(rows, {"wall s": ".3f", "CPU s": ".3f"}))
    return 0


if __name__ == "__main__":
    run_command(main)
