"""GPU fast paths, checked as far as a CPU can: the peak table MFU divides by, fused AdamW and a
compiled module under DeepSpeed ZeRO-2 against the plain path (compiled EBT under ZeRO-1, 2 and
3 against eager EBT), the TF32 switch, the guard that
keeps torch.compile away from double backward, and which attention kernel each family's
attention reaches (NRGPT's explicit path against SDPA). And the host side: freed memory is
reused, not faulted in again."""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_cases import attention_kernels
from pretrain.config import ConfigError, RunConfig
from pretrain.config.precision import precisions
from pretrain.config.validation import validate
from pretrain.models import build, resolve
from pretrain.training.engine import configure_device_math
from pretrain.training.flops import mfu, peak_tflops

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H20", 148.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA GB200", 2500.0), ("Tesla T4", None), (None, None)])
def test_peak_table_matches_the_names_torch_reports(name, peak):
    assert peak_tflops(name, precisions()["bf16"]) == peak
    assert peak_tflops(name, precisions()["fp16"]) == peak


def test_mfu_is_model_flops_over_the_peak_and_fp32_has_none():
    assert peak_tflops("NVIDIA H200", precisions()["fp32"]) is None
    # GPT-124M's 45% target: 989e12 * 0.45 FLOP/s at ~0.87 GFLOP per token
    assert mfu(0.87e9, 989e12 * 0.45 / 0.87e9, world_size=1, peak=989.0) == pytest.approx(0.45)
    assert mfu(1e9, 2e5, world_size=2, peak=100.0) == pytest.approx(1.0)


def worker_runs(tmp_path, variants: list[str]) -> dict[str, dict]:
    """fast_paths_worker.py's runs of these variants, by name."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "fast_paths_worker.py"), *variants], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {r["variant"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines()
                                                     if line.startswith("{")))}


def assert_follows(run: dict, base: dict, name: str) -> None:
    """`run` gives `base`'s losses and weights up to rounding, relative to what its steps moved."""
    step_size = max(base["moved"])  # ~ lr per step: what three Adam steps moved the weights
    assert base["losses"][0] != base["losses"][-1] and step_size > 1e-2
    assert run["losses"] == pytest.approx(base["losses"], rel=1e-6), name
    drift = (torch.tensor(run["params"]) - torch.tensor(base["params"])).abs().max().item()
    # Adam's normalised step is ill-conditioned for gradients near eps: fused and multi-tensor
    # kernels order the arithmetic differently, so compare with the size of the moves
    assert drift < 1e-3 * step_size, name


def test_fused_adamw_and_compiled_module_under_zero2_follow_the_plain_path(tmp_path):
    """DeepSpeed accepts torch's fused AdamW as the client optimizer of ZeRO-2 (stepped on its
    flat fp32 partitions) and a module compiled through engine.compile; three steps of each
    give the plain path's losses and weights."""
    runs = worker_runs(tmp_path, ["foreach", "fused", "compiled"])
    assert runs["fused"]["fused"] and not runs["foreach"]["fused"]
    assert runs["compiled"]["compiled"] and runs["compiled"]["graphs"] >= 1
    for name in ("fused", "compiled"):
        assert_follows(runs[name], runs["foreach"], name)


def test_compiled_ebt_under_zero_1_2_3_follows_its_eager_run(tmp_path):
    """EBT with its first-order energy gradient, compiled through engine.compile, trains under
    each ZeRO stage as it does eagerly (three steps: losses and weights). Under ZeRO-1 and 2 its
    training forward has no graph break; ZeRO-3's hooks break the graph, as for every family,
    and there the anchor that holds back the descent's gradient reduction is made outside it."""
    stages = (1, 2, 3)
    runs = worker_runs(tmp_path, [f"ebt zero{stage}{compiled}" for stage in stages for compiled in ("", " compiled")])
    for stage in stages:
        compiled = runs[f"ebt zero{stage} compiled"]
        assert compiled["compiled"] and compiled["graphs"] >= 1, stage
        assert compiled["graph_breaks"] == 0 or stage == 3, stage
        assert_follows(compiled, runs[f"ebt zero{stage}"], f"zero{stage}")


def test_tf32_switch_applies_on_gpu_only():
    before = torch.get_float32_matmul_precision()
    try:
        cfg = RunConfig()
        torch.set_float32_matmul_precision("highest")
        configure_device_math(cfg, on_gpu=False)
        assert torch.get_float32_matmul_precision() == "highest"  # CPU runs keep torch's default
        configure_device_math(cfg, on_gpu=True)
        assert torch.get_float32_matmul_precision() == "high"
        cfg.train.tf32 = False
        configure_device_math(cfg, on_gpu=True)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


PAGE_FAULTS_PER_STEP = """
import resource, torch
from pretrain.training.engine import keep_freed_host_memory
def faults_per_step():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):  # a 100 MB tensor made and freed, as a CPU step's logits are
        torch.ones(25_000_000).sum()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 10
before = faults_per_step()
keep_freed_host_memory()
faults_per_step()  # the heap grows to hold the block once
print(before, faults_per_step())
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="needs glibc's mallopt")
def test_freed_host_memory_is_reused_instead_of_faulted_in_again():
    result = subprocess.run([sys.executable, "-c", PAGE_FAULTS_PER_STEP], cwd=REPO, capture_output=True,
                            text=True, check=True)
    before, after = map(float, result.stdout.split())
    assert before > 20_000  # glibc maps each 100 MB block anew: ~24k pages of 4 KB
    assert after < before / 20


def test_compile_is_refused_for_families_with_double_backward():
    """Refused for EBT's autograd energy gradient, with the setting that compiles it."""
    cfg = RunConfig(run_name="run")
    cfg.data.path = "data"
    cfg.train.max_steps = 1
    cfg.model.flavor, cfg.model.compile = "gpt-tiny", "aot_eager"
    validate(cfg, world_size=1, has_gpu=False)
    cfg.model.flavor = "ebt-tiny"
    with pytest.raises(ConfigError, match="model.compile.*double backward.*set model.overrides.energy_gradient: "
                                          "first_order, or use 'off'$"):
        validate(cfg, world_size=1, has_gpu=False)
    cfg.model.overrides = {"energy_gradient": "first_order"}
    validate(cfg, world_size=1, has_gpu=False)
    cfg.model.overrides = {}
    cfg.model.flavor, cfg.model.compile = "gpt-tiny", "no-such-backend"
    with pytest.raises(ConfigError, match="model.compile"):
        validate(cfg, world_size=1, has_gpu=False)


def train_step(model, idx):
    model.zero_grad(set_to_none=True)
    model(idx, torch.roll(idx, -1, dims=1)).loss.backward()


@pytest.mark.parametrize("options", [
    dict(attention="full", mask="inclusive"), dict(attention="full", mask="strict"),
    dict(attention="lowrank", mask="inclusive"), dict(attention="lowrank", mask="strict")])
def test_nrgpt_explicit_attention_matches_sdpa(options):
    """The explicit path (scores and softmax as plain matmuls, for head dims the fused GPU
    kernels do not take) computes what SDPA computes, gradients included, and really runs
    without SDPA."""
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 12))
    shape = dict(vocab_size=64, block_size=12, n_embd=16, n_head=2, n_steps=2, **options)
    models = {}
    for impl in ("sdpa", "explicit"):
        torch.manual_seed(1)
        models[impl] = build(resolve("nrgpt-tiny", {**shape, "attention_impl": impl})).double()
        train_step(models[impl], idx)
    logits = {impl: m(idx).logits for impl, m in models.items()}
    torch.testing.assert_close(logits["explicit"], logits["sdpa"], rtol=1e-10, atol=1e-10)
    for (name, p), q in zip(models["sdpa"].named_parameters(), models["explicit"].parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert attention_kernels(lambda: train_step(models["sdpa"], idx))
    assert attention_kernels(lambda: train_step(models["explicit"], idx)) == {}


def test_nrgpt_explicit_attention_in_bf16_stays_close_to_float32():
    """bf16 scores and probabilities (the softmax accumulates in float32) stay close to float32."""
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 32))
    model = build(resolve("nrgpt-tiny", dict(vocab_size=64, block_size=32, n_embd=32, n_head=2,
                                            attention_impl="explicit")))
    reference = model(idx).logits
    low = model.to(torch.bfloat16)(idx).logits.float()
    assert ((low - reference).norm() / reference.norm()).item() < 2e-2


@pytest.mark.parametrize("flavor", ["gpt-tiny", "gpt_rec-tiny", "transformer_pp-tiny", "nrgpt-tiny"])
def test_sdpa_families_reach_a_fused_kernel_forward_and_backward(flavor):
    """Causal attention without an explicit mask, which is what the flash and cuDNN kernels
    take on GPU: on a CPU it reaches the flash kernel for CPUs, never the math fallback."""
    model = build(resolve(flavor, dict(vocab_size=64, block_size=16)))
    kernels = attention_kernels(lambda: train_step(model, torch.randint(0, 64, (2, 16))))
    assert kernels.get("flash (cpu)", 0) > 0 and kernels.get("flash (cpu) backward", 0) > 0, kernels
    assert "math" not in kernels
