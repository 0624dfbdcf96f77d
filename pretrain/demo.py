"""The README's demo (`make demo`): a few minutes on a 2-core CPU.

1. prepare the bundled Shakespeare corpus (GPT-2 BPE) unless it is there already;
2. train tiny `gpt`, `nrgpt` and `ebt` models with `torchrun --nproc_per_node=2` and ZeRO-2,
   stopping `nrgpt` with SIGTERM (as a cluster's preemption would) after its first checkpoint
   and resuming it;
3. print a summary table and the command that opens the TensorBoard curves.

Runs go to checkpoints/demo/ (replaced on every demo)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.cli import ArgumentParser, run_command
from pretrain.config import load_config

OUTPUT_ROOT = Path("checkpoints/demo")


@dataclass
class DemoRun:
    family: str
    """Model family; its config is configs/tiny/<family>.yaml."""
    steps: int
    """Optimizer steps."""
    micro_batch_size: int = 4
    """Sequences per process and step (EBT's second-order steps cost several times a GPT's)."""
    interrupt: bool = False
    """Stop it with SIGTERM after its first checkpoint, then resume it."""

    @property
    def config(self) -> Path:
        return Path("configs/tiny") / f"{self.family}.yaml"

    @property
    def name(self) -> str:
        return f"demo-{self.family}"

    @property
    def run_dir(self) -> Path:
        return OUTPUT_ROOT / self.name


RUNS = [DemoRun("gpt", steps=300), DemoRun("nrgpt", steps=300, interrupt=True),
        DemoRun("ebt", steps=200, micro_batch_size=2)]
CHECKPOINT_INTERVAL = 50


def command(run: DemoRun) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "pretrain.train", "--config", str(run.config), f"output_root={OUTPUT_ROOT}",
            f"run_name={run.name}", f"train.max_steps={run.steps}", "zero.stage=2",
            f"data.micro_batch_size={run.micro_batch_size}", f"train.global_batch_size={2 * run.micro_batch_size}",
            f"checkpoint.interval={CHECKPOINT_INTERVAL}", f"eval.interval={CHECKPOINT_INTERVAL * 2}"]


def launch(run: DemoRun, attempt: int) -> subprocess.Popen:
    log = open(OUTPUT_ROOT / f"{run.name}.stderr{attempt}.log", "w")
    # the trainer's console lines go straight through; DeepSpeed's chatter to a log file
    return subprocess.Popen(command(run), stdout=sys.stdout, stderr=log, env=_env())


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}


def train(run: DemoRun) -> None:
    print(f"\n=== {run.name}: {run.steps} steps of {load_config(run.config).model.flavor}, "
          f"2 processes, ZeRO-2 ===", flush=True)
    proc = launch(run, 0)
    if run.interrupt:
        first = run.run_dir / "ckpt" / f"step_{CHECKPOINT_INTERVAL:08d}" / "complete.json"
        while not first.exists() and proc.poll() is None:
            time.sleep(0.2)
        if proc.poll() is None:
            print(f"--- demo: sending SIGTERM to torchrun (like a preemption); the trainers finish "
                  f"their step, save a checkpoint and exit with code 75", flush=True)
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        print(f"--- demo: relaunching the same command; it resumes from the latest checkpoint",
              flush=True)
        proc = launch(run, 1)
    if proc.wait() != 0:
        logs = sorted(OUTPUT_ROOT.glob(f"{run.name}.stderr*.log"))
        tail = logs[-1].read_text()[-3000:] if logs else ""
        raise SystemExit(f"{run.name} failed (exit code {proc.returncode}):\n{tail}")


def first_loss(run_dir: Path) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars("train/loss")[0].value


def summary_table(runs: list[DemoRun]) -> str:
    header = ("model", "params", "tokens", "first loss", "final train loss", "val loss", "tokens/s")
    rows = [header]
    for run in runs:
        s = json.loads((run.run_dir / "summary.json").read_text())
        rows.append((s["flavor"], f"{s['params'] / 1e6:.2f}M", f"{s['tokens_seen']:,}",
                     f"{first_loss(run.run_dir):.3f}", f"{s['final_train_loss']:.3f}",
                     f"{s['final_val_loss']:.3f}", f"{s['tokens_per_s']:,.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    from data_pipeline.prepare import ensure_prepared

    # no options; `--help` describes the demo instead of starting it
    ArgumentParser(prog="python -m pretrain.demo", description=__doc__.split("\n\n")[0]).parse_args(argv)
    start = time.perf_counter()
    data = load_config(RUNS[0].config).data
    print(f"=== preparing {data.path} from the bundled Shakespeare ({data.tokenizer}) if needed ===", flush=True)
    manifest = ensure_prepared(data.path, data.source, seq_len=data.seq_len, tokenizer=data.tokenizer,
                               val_fraction=data.val_fraction)
    print(f"{manifest['splits']['train']['tokens']:,} training tokens, "
          f"{manifest['splits']['val']['tokens']:,} validation tokens", flush=True)
    for run in RUNS:
        shutil.rmtree(run.run_dir, ignore_errors=True)
    OUTPUT_ROOT.mkdir(parents=True, exist_ok=True)
    for run in RUNS:
        train(run)
    print(f"\n=== summary (demo took {(time.perf_counter() - start) / 60:.1f} min) ===")
    print(summary_table(RUNS))
    print(f"\nTraining curves: {tensorboard_command()} --logdir {OUTPUT_ROOT} --host 127.0.0.1 --port 6006")
    return 0


def tensorboard_command() -> str:
    """TensorBoard as this interpreter's environment has it (its bin/ is rarely on PATH)."""
    script = Path(sys.executable).parent / "tensorboard"
    return str(script) if script.is_file() else f"{sys.executable} -m tensorboard.main"


if __name__ == "__main__":
    run_command(main)
