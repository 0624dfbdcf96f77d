"""Data and checkpoints in an object store, measured through moto's S3 server on loopback
(`bench.s3_server`, a separate process):

    python -m bench.objectstore [--windows 20000] [--steps 40] [--blob-mb 256]

1. The loader: the same prepared dataset (the bundled Shakespeare, character-level, windows of
   257 tokens) read by `build_loader` from local disk, from s3:// with a cold cache (the node's
   copy is made first, and counted) and with a warm one; the time to the first batch and the
   windows per second over one pass of --windows windows.
2. Checkpoints: the tiny GPT trained for --steps steps (one process) with a checkpoint every 2
   steps, without and with `checkpoint.remote`, and with checkpoints only at the end; the mean
   step time (TensorBoard's train/step_time_s), the run's wall time and the training process's
   CPU time (all its threads: the upload's too) of each, so the cost of a local save and of the
   background upload per checkpoint, side by side (CPU time is the figure a busy shared machine
   disturbs least; the wall times include moto's server, which shares this machine's cores).
3. Upload speed: one --blob-mb file uploaded through `common.objectstore` (bytes/s), and what
   that makes of a 124M-parameter model's checkpoint (its size from the tiny checkpoint's bytes
   per parameter)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from bench.s3_server import S3Server
from common.cli import ArgumentParser, run_command
from common.fileio import markdown_table

PARAMS_124M = 124_439_808
"""GPT-2 small's parameters (tied embeddings)."""
BYTES_PER_PARAM = 16
"""A fp32 checkpoint's bytes per parameter: the weights (4) in the model-states file, the fp32
master copy and Adam's two moments (12) in ZeRO's optimizer files; the tiny model's measured
figure is printed beside it (higher: fixed per-file overheads dominate at 0.03M parameters)."""


def loader_rate(path: str, windows: int, cache_dir: str) -> dict:
    from data_pipeline.loader import build_loader

    start = time.perf_counter()
    loader = build_loader(path, "train", micro_batch_size=16, seed=0, num_workers=1, cache_dir=cache_dir)
    seen, first = 0, None
    for inputs, _ in loader:
        first = first if first is not None else time.perf_counter() - start
        seen += inputs.shape[0]
        if seen >= windows:
            break
    elapsed = time.perf_counter() - start
    del loader
    return {"first_batch_s": first, "windows_per_s": seen / elapsed, "tokens_per_s": seen * 256 / elapsed,
            "elapsed_s": elapsed}


def training(root: Path, data: str, name: str, steps: int, **keys) -> dict:
    from pretrain.config import load_config
    from pretrain.scaling.experiments.common import scalar_curve
    from pretrain.training.trainer import run

    config = {"run_name": name, "output_root": str(root / "runs"), "seed": 7,
              "model": {"flavor": "gpt-tiny"},
              "data": {"path": data, "seq_len": 256, "micro_batch_size": 8, "num_workers": 1},
              "train": {"max_steps": steps, "global_batch_size": 8, "log_interval": 1},
              "schedule": {"warmup_steps": 2}, "eval": {"interval": 0, "sample_tokens": 0},
              "checkpoint": {"interval": 2, "keep": 2}}
    for key, value in keys.items():
        section, _, field = key.partition("__")
        config[section][field] = value
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(path)
    out = io.StringIO()
    start, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        assert run(cfg) == 0, name
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    uploads = re.search(r"checkpoint.remote: (\d+) checkpoint\(s\) uploaded to \S+, ([\d.]+) s", out.getvalue())
    step_times = [value for _, value in scalar_curve(cfg.run_dir, "train/step_time_s")][1:]  # the first compiles
    ckpt = sorted((cfg.run_dir / "ckpt").glob("step_*"))[-1]
    return {"run": name, "wall_s": wall, "cpu_s": cpu, "mean_step_ms": 1e3 * statistics.mean(step_times),
            "max_step_ms": 1e3 * max(step_times),
            "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()),
            "uploaded": int(uploads.group(1)) if uploads else 0,
            "upload_cpu_ms_each": 1e3 * float(uploads.group(2)) / int(uploads.group(1)) if uploads else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.objectstore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=20000, help="windows each loader pass reads")
    parser.add_argument("--steps", type=int, default=40, help="training steps of each checkpoint run")
    parser.add_argument("--blob-mb", type=int, default=256, help="size of the upload-speed file")
    args = parser.parse_args(argv)
    from common import objectstore
    from data_pipeline.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="bench-objectstore-") as tmp:
        root = Path(tmp)
        server = S3Server(root)
        try:
            os.environ.update(server.env())
            bucket = server.bucket("bench")
            settings = dict(seq_len=256, val_fraction=0.01, tokenizer="char", num_proc=1, progress_bar=False)
            local, remote = str(root / "data"), f"{bucket}/shakespeare-char-256"
            prepare("shakespeare", local, **settings)
            prepare("shakespeare", remote, **settings)
            rows = [{"read from": "local disk", **loader_rate(local, args.windows, str(root / "cache"))},
                    {"read from": "s3:// cold cache", **loader_rate(remote, args.windows, str(root / "cache"))},
                    {"read from": "s3:// warm cache", **loader_rate(remote, args.windows, str(root / "cache"))}]
            print(markdown_table(rows, {"first_batch_s": ".2f", "windows_per_s": ",.0f", "tokens_per_s": ",.0f",
                                        "elapsed_s": ".2f"}))

            runs = [training(root, local, "end-only", args.steps, checkpoint__interval=0),
                    training(root, local, "local", args.steps),
                    training(root, local, "local+s3", args.steps, checkpoint__remote=f"{bucket}/runs")]
            saves = args.steps // 2
            for row in runs:  # what each checkpoint added to the run, in time and in this process's CPU
                row["per_checkpoint_ms"] = 1e3 * (row["wall_s"] - runs[0]["wall_s"]) / saves
                row["per_checkpoint_cpu_ms"] = 1e3 * (row["cpu_s"] - runs[0]["cpu_s"]) / saves
            print(markdown_table(runs, {"wall_s": ".2f", "cpu_s": ".2f", "mean_step_ms": ".1f", "max_step_ms": ".1f",
                                        "checkpoint_bytes": ",", "per_checkpoint_ms": ".1f",
                                        "per_checkpoint_cpu_ms": ".1f", "upload_cpu_ms_each": ".1f"}))

            blob = root / "blob"
            blob.write_bytes(os.urandom(args.blob_mb << 20))
            start, cpu = time.perf_counter(), time.process_time()
            objectstore.upload(blob, f"{bucket}/blob")
            rate = blob.stat().st_size / (time.perf_counter() - start)
            cpu_per_gb = (time.process_time() - cpu) / (blob.stat().st_size / 1e9)
            from pretrain.models import build, resolve

            tiny_params = sum(p.numel() for p in build(resolve("gpt-tiny", {"vocab_size": 128, "block_size": 256}))
                              .parameters())
            # fp32 weights (the model-states file) + fp32 master copy and two Adam moments (ZeRO's file)
            size_124m = BYTES_PER_PARAM * PARAMS_124M
            summary = {"upload_MB_per_s": rate / 1e6, "tiny_params": tiny_params,
                       "tiny_checkpoint_bytes_per_param": runs[1]["checkpoint_bytes"] / tiny_params,
                       "checkpoint_124m_GB": size_124m / 1e9, "upload_124m_s": size_124m / rate,
                       "upload_cpu_s_per_GB": cpu_per_gb, "upload_124m_cpu_s": cpu_per_gb * size_124m / 1e9}
            print(json.dumps(summary, indent=1))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    run_command(main)
