"""bench.gpu's reports: gpu.json as it stands, gpu.md's tables, and the line the console prints
per case."""
from __future__ import annotations

import json
from pathlib import Path

from common.fileio import atomic_write_text, markdown_table

GIB = 2**30


def write_reports(out: Path, report: dict) -> None:
    """gpu.json and gpu.md, each replaced atomically."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu.json", json.dumps(report, indent=2) + "\n"), ("gpu.md", markdown(report))):
        atomic_write_text(out / name, text)


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    lines = [f"# bench.gpu ({report['mode']})", "",
             f"{report['date']}, {env.get('device', report['device'])}; torch {env.get('torch', '?')}, "
             f"DeepSpeed {env.get('deepspeed', '?')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}; "
             f"one process; synthetic tokens (vocabulary {report['vocab_size']}); "
             f"{report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget.", ""]
    columns = ("case", "status", "micro-batch x T", "tokens/s", "MFU", "TFLOP/s", "peak GiB",
               "step ms (median)", "attention: predicted / ran (calls per step)")
    rows = []
    for r in report["cases"]:
        if r["kind"] != "train":
            continue
        attention = r.get("attention", {})
        ran = ", ".join(f"{k} {v}" for k, v in attention.get("ran", {}).items()) or "none"
        holds = " **DISAGREES**" if attention.get("holds") is False else ""
        rows.append(dict(zip(columns, (
            r["case"], r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}",
            f"{r['micro_batch']} x {r['seq_len']}" if "micro_batch" in r else "",
            f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "", _percent(r.get("mfu")),
            f"{r['tflops']:.3g}" if "tflops" in r else "", _number(r.get("peak_memory_gib")),
            f"{r['step_ms_median']:.1f}" if "step_ms_median" in r else "",
            f"{attention.get('predicted')} / {ran}{holds}" if "ran" in attention else ""))))
    if rows:
        lines.append(markdown_table(rows).rstrip("\n"))
    for r in report["cases"]:
        if "replay_store" in r or "plan" in r:
            lines += ["", memory_line(r)]
        if r["kind"] == "bf16_check":
            lines += ["", bf16_line(r)]
    return "\n".join(lines) + "\n"


def memory_line(r: dict) -> str:
    line = f"**{r['case']}** ({r['status']}"
    if r["status"] != "ok":
        line += f": {r.get('error', '')}"
    line += ")"
    store = r.get("replay_store")
    if store:
        line += (f": micro-batch {r['micro_batch']} + {store['replayed_rows_per_step']} replayed rows x "
                 f"T={r['seq_len']}, store of {store['rows']} rows full, {store['bytes'] / GIB:.2f} GiB "
                 f"(planned {store['planned_bytes'] / GIB:.2f})")
    if "plan" in r:
        plan = r["plan"]
        line += (f"; plan for 1 GPU: {plan['tensors'] / GIB:.1f} GiB of tensors, {plan['total'] / GIB:.1f} with its "
                 f"margin; measured peak {_number(r.get('peak_memory_gib'))} GiB allocated, "
                 f"{_number(r.get('peak_reserved_gib'))} reserved")
        if r.get("peak_over_plan"):
            line += f" ({r['peak_over_plan']:.2f} x the plan's tensors)"
    return line + "."


def bf16_line(r: dict) -> str:
    line = f"**{r['case']}** ({r['status']}"
    if "loss_rel_err" not in r:
        return line + f": {r.get('error', '')})."
    return line + (f"): {r['n_layer']} layers, {r['micro_batch']} x {r['seq_len']} tokens, energy gradient "
                   f"{r['energy_gradient']}; relative errors: loss "
                   f"{r['loss_rel_err']:.2e}, worst gradient {r['max_grad_rel_err']:.2e} "
                   f"({r['max_grad_rel_err_param']}), energy head {r['energy_head_grad_rel_err']:.2e}; tolerance "
                   f"{r['tolerance']['loss']:g} / {r['tolerance']['grads']:g} (reference loss "
                   f"{r['reference_loss']:.4f} in float32 without TF32).")


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def summary_line(r: dict) -> str:
    if r["status"] != "ok" or r["kind"] == "bf16_check":
        return bf16_line(r) if "loss_rel_err" in r else f"{r['case']}: {r['status']} ({r.get('error', '')})"
    line = (f"{r['case']}: {r['tokens_per_s']:,.0f} tokens/s, MFU {_percent(r['mfu'])}, "
            f"peak {_number(r.get('peak_memory_gib'))} GiB, {r['step_ms_median']:.1f} ms/step")
    if r["attention"].get("holds") is False:
        line += f"; attention ran {r['attention']['ran']}, predicted {r['attention']['predicted']}: DISAGREES"
    return line
