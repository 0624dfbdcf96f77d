"""Data pipeline throughput, measured side by side on the same cores in one run.

    python -m bench.data [--copies 4] [--rounds 3] [--num-proc 2] [--memory | --hub-layouts]

Corpus: the bundled Shakespeare scenes, `--copies` times over (real text, ~5 MB per copy),
written as JSON Lines to a temporary directory. Each round measures, one after the other:
  raw      tiktoken `encode_ordinary_batch(num_threads=num_proc)` on the documents in memory
           (the reference), and `encode_to_numpy` (what prepare calls) in as many threads
  prepare  `prepare("jsonl:...")` end to end (read, hash split, tokenize in num_proc processes,
           pack, write MDS shards, manifest) at seq_len 1024 and at seq_len 64
  loader   `build_loader` batches at micro-batch 4 of seq_len 64 and 1024 (2 DataLoader
           workers), and of seq_len 64 read in the calling process (0 workers)
  train    one training step (forward, backward, AdamW) of `gpt-tiny` at micro-batch 4 x 64,
           with the GPT-2 vocabulary and with a character vocabulary (what tiny CPU runs do)
Ratios are taken within each round (neighbours in time) and the median over rounds reported.
Besides tokens per wall-clock second, raw and prepare report tokens per CPU-second (this process
and its children), which other jobs on a shared machine disturb much less.
Targets: prepare/raw >= 0.8 (seq_len 1024); loader >= 10x the fastest tiny training step.

`--memory` instead runs the command-line prepare on 1, 10 and 40 copies of the corpus in child
processes and prints their peak resident memory. The MDS writer buffers one shard before writing
it, so memory is bounded by the shard size, not the corpus: with 16 MB shards here, the peak must
stop growing once the corpus fills a shard (10 copies already hold ~30 MB of tokens).

`--hub-layouts` instead writes the corpus's documents in both layouts of a hub repository (see
data_pipeline/hub.py) on local disk, served through fsspec as the hub's are: OpenWebText's raw
subset tarballs (tar of xz archives of ~390 .txt documents each, OpenWebText's average) and
parquet data files, and prepares `openwebtext` from each, alternating, `--rounds` times. It
reports the tarball path's throughput against the parquet path's (target >= 0.8): the cost of
decompressing and splitting archives in the tokenizer processes against reading parquet
through `datasets` in the main one.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from common.cli import ArgumentParser, run_command
from data_pipeline.hub import HubRepo, write_tarball_layout
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.sources import parse_source
from data_pipeline.tokenizer import gpt2_encoding

LOADER_BATCHES = 400
TRAIN_STEPS = 20


def write_corpus(directory: str, copies: int) -> tuple[str, list[str]]:
    scenes = list(parse_source("shakespeare").documents())
    docs = [f"{scene}\n\n[{copy}]" for copy in range(copies) for scene in scenes]
    path = os.path.join(directory, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return path, docs


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its finished children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(work: Callable[[], int]) -> tuple[float, float]:
    """(tokens per wall-clock second, tokens per CPU-second) of `work()`, which returns tokens."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    tokens = work()
    return tokens / (time.perf_counter() - wall), tokens / (cpu_seconds() - cpu)


def raw_batch(docs: list[str], threads: int) -> int:
    ids = gpt2_encoding().encode_ordinary_batch(docs, num_threads=threads)
    return sum(map(len, ids)) + len(docs)  # + one EOT per document, as prepare stores


def raw_numpy(docs: list[str], threads: int) -> int:
    encode = gpt2_encoding().encode_to_numpy
    with ThreadPoolExecutor(threads) as pool:
        lengths = pool.map(lambda doc: len(encode(doc, disallowed_special=())), docs)
        return sum(lengths) + len(docs)


def prepared(corpus: str, out: str, seq_len: int, num_proc: int) -> int:
    manifest = prepare(f"jsonl:{corpus}", out, seq_len=seq_len, num_proc=num_proc,
                       overwrite=True, progress_bar=False)
    return sum(split["tokens"] for split in manifest["splits"].values())


def loader_tokens_per_s(data_dir: str, micro_batch_size: int, num_workers: int) -> float:
    loader = build_loader(data_dir, "train", micro_batch_size=micro_batch_size, seed=0,
                          num_workers=num_workers)
    batches = iter(loader)
    next(batches)  # worker start-up is paid once per epoch, not per batch
    start = time.perf_counter()
    tokens = 0
    for _ in range(LOADER_BATCHES):
        inputs, _ = next(batches)
        tokens += inputs.numel()
    return tokens / (time.perf_counter() - start)


def train_tokens_per_s(vocab_size: int, micro_batch_size: int, seq_len: int) -> float:
    from pretrain.models import build, resolve

    torch.manual_seed(0)
    model = build(resolve("gpt-tiny", {"vocab_size": vocab_size, "block_size": seq_len}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randint(vocab_size, (micro_batch_size, seq_len))

    def step():
        loss = model(inputs, targets=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # first-call allocations
    start = time.perf_counter()
    for _ in range(TRAIN_STEPS):
        step()
    return TRAIN_STEPS * inputs.numel() / (time.perf_counter() - start)


PEAK_RSS_OF_PREPARE = """
import sys
from data_pipeline.prepare import main
code = main(sys.argv[1:])
# VmHWM: this process's peak resident memory (Linux), in kB; prepare's workers hold one chunk each.
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
sys.exit(code)
"""


def peak_memory(copies_list: list[int], num_proc: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for copies in copies_list:
            corpus, docs = write_corpus(tmp, copies)
            megabytes = os.path.getsize(corpus) / 1e6
            done = subprocess.run(
                [sys.executable, "-c", PEAK_RSS_OF_PREPARE, "--source", f"jsonl:{corpus}",
                 "--out", os.path.join(tmp, f"ds{copies}"), "--num-proc", str(num_proc),
                 "--shard-size", "16mb"], check=True, capture_output=True, text=True)
            peak_kb = int(done.stdout.split()[-1])
            print(f"prepare of {megabytes:,.0f} MB ({len(docs)} documents): peak RSS "
                  f"{peak_kb / 1024:,.0f} MiB")


OWT_DOCS_PER_ARCHIVE = 390
"""OpenWebText's average: about 8.0M documents in 20,610 .xz archives."""


def hub_layouts(copies: int, rounds: int, num_proc: int) -> None:
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        _, docs = write_corpus(tmp, copies)
        layouts = {name: os.path.join(tmp, name) for name in ("tarballs", "parquet")}
        write_tarball_layout(layouts["tarballs"], [d.encode() for d in docs], OWT_DOCS_PER_ARCHIVE,
                             archives_per_tarball=4)
        os.makedirs(os.path.join(layouts["parquet"], "plain_text"))
        files = 4
        for k in range(files):
            part = docs[k * len(docs) // files:(k + 1) * len(docs) // files]
            pq.write_table(pa.table({"text": part}), os.path.join(
                layouts["parquet"], "plain_text", f"train-{k:05d}-of-{files:05d}.parquet"))
        megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
        print(f"corpus: {len(docs)} documents, {megabytes:.1f} MB in both layouts; "
              f"{os.cpu_count()} CPUs, num_proc {num_proc}, {rounds} rounds (median reported)")
        fingerprints: dict[str, set[str]] = {name: set() for name in layouts}
        wall: dict[str, list[float]] = {name: [] for name in layouts}
        cpu: dict[str, list[float]] = {name: [] for name in layouts}

        def prepare_from(name: str) -> int:
            repo = HubRepo("Skylion007/openwebtext", None, name, fsspec.filesystem("file"),
                           layouts[name])
            manifest = prepare("openwebtext", os.path.join(tmp, f"ds-{name}"), seq_len=1024,
                               num_proc=num_proc, overwrite=True, progress_bar=False,
                               hub_repo=repo)
            fingerprints[name].add(manifest["fingerprint"])
            return sum(split["tokens"] for split in manifest["splits"].values())

        for _ in range(rounds):
            for name in layouts:
                per_wall, per_cpu = timed(lambda: prepare_from(name))
                wall[name].append(per_wall)
                cpu[name].append(per_cpu)
    if len(fingerprints["tarballs"] | fingerprints["parquet"]) != 1:
        raise SystemExit("error: the two layouts gave different datasets")
    for name in layouts:
        print(f"prepare openwebtext from {name:9s} {statistics.median(wall[name]):>12,.0f} "
              f"tokens/s {statistics.median(cpu[name]):>12,.0f} per CPU-s   (wall range "
              f"{min(wall[name]):,.0f}-{max(wall[name]):,.0f})")
    print("tarballs/parquet: " + ", ".join(
        f"{statistics.median(a / b for a, b in zip(r['tarballs'], r['parquet'])):.2f} {kind}"
        for kind, r in (("wall", wall), ("CPU", cpu))) + "  (target >= 0.8; same dataset)")


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=4, help="copies of the corpus (~5 MB each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--memory", action="store_true",
                        help="measure peak memory of prepare on 1, 10 and 40 copies instead")
    parser.add_argument("--hub-layouts", action="store_true",
                        help="compare prepare from the tarball and parquet hub layouts instead")
    args = parser.parse_args()
    if args.memory:
        peak_memory([1, 10, 40], args.num_proc)
        return
    if args.hub_layouts:
        hub_layouts(args.copies, args.rounds, args.num_proc)
        return
    torch.set_num_threads(args.num_proc)
    procs = args.num_proc
    with tempfile.TemporaryDirectory() as tmp:
        corpus, docs = write_corpus(tmp, args.copies)
        megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
        print(f"corpus: {len(docs)} documents, {megabytes:.1f} MB; {os.cpu_count()} CPUs, "
              f"num_proc {procs}, {args.rounds} rounds (median reported)")
        path = {seq_len: os.path.join(tmp, f"ds{seq_len}") for seq_len in (1024, 64)}
        tokenizing = {  # name -> work returning tokens; timed in wall and CPU seconds
            "raw encode_ordinary_batch": lambda: raw_batch(docs, procs),
            "raw encode_to_numpy": lambda: raw_numpy(docs, procs),
            "prepare seq_len 1024": lambda: prepared(corpus, path[1024], 1024, procs),
            "prepare seq_len 64": lambda: prepared(corpus, path[64], 64, procs),
        }
        reading = {  # name -> tokens per wall-clock second
            "loader 4 x 1024, 2 workers": lambda: loader_tokens_per_s(path[1024], 4, 2),
            "loader 4 x 64, 2 workers": lambda: loader_tokens_per_s(path[64], 4, 2),
            "loader 4 x 64, 0 workers": lambda: loader_tokens_per_s(path[64], 4, 0),
            "train gpt-tiny 4 x 64, GPT-2 vocab": lambda: train_tokens_per_s(50304, 4, 64),
            "train gpt-tiny 4 x 64, char vocab": lambda: train_tokens_per_s(128, 4, 64),
        }
        wall: dict[str, list[float]] = {name: [] for name in [*tokenizing, *reading]}
        cpu: dict[str, list[float]] = {name: [] for name in tokenizing}
        for _ in range(args.rounds):
            for name, work in tokenizing.items():
                per_wall, per_cpu = timed(work)
                wall[name].append(per_wall)
                cpu[name].append(per_cpu)
            for name, measure in reading.items():
                wall[name].append(measure())
    med = {name: statistics.median(values) for name, values in wall.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    for name, value in med.items():
        per_cpu = f"{med_cpu[name]:>12,.0f} per CPU-s" if name in med_cpu else " " * 22
        print(f"{name:36s} {value:>12,.0f} tokens/s {per_cpu}   (wall range "
              f"{min(wall[name]):,.0f}-{max(wall[name]):,.0f})")

    def ratio(results: dict[str, list[float]], numerator: str, denominator: str) -> float:
        return statistics.median(a / b for a, b in zip(results[numerator], results[denominator]))

    for reference in ("raw encode_ordinary_batch", "raw encode_to_numpy"):
        print(f"prepare/{reference}: " + ", ".join(
            f"seq_len {n}: {ratio(wall, f'prepare seq_len {n}', reference):.2f} wall, "
            f"{ratio(cpu, f'prepare seq_len {n}', reference):.2f} CPU" for n in (1024, 64))
            + ("  (target >= 0.8 at 1024)" if reference.endswith("batch") else ""))
    for train in ("train gpt-tiny 4 x 64, GPT-2 vocab", "train gpt-tiny 4 x 64, char vocab"):
        print(f"loader 4 x 64 with 2 / 0 workers: "
              f"{ratio(wall, 'loader 4 x 64, 2 workers', train):,.0f}x / "
              f"{ratio(wall, 'loader 4 x 64, 0 workers', train):,.0f}x the rate of {train} "
              f"(target >= 10x)")


if __name__ == "__main__":
    run_command(main)
