"""The decision which SDPA kernel a GPU runs, against torch's dispatch rules, for every flavor,
and the trainer's check built on it (no GPU needed: that is the point)."""
from __future__ import annotations

import pytest
import torch

from pretrain.config import ConfigError, RunConfig, describe_attention, from_dict
from pretrain.config.precision import precisions
from pretrain.config.validation import validate
from pretrain.models import resolve
from pretrain.models.registry import FLAVORS
from pretrain.models.sdpa import sdpa_kernel

H100, A100, RTX4090, V100 = (9, 0), (8, 0), (8, 9), (7, 0)


@pytest.mark.parametrize("head_dim, precision, capability, training, dropout, kernel", [
    (64, "bf16", H100, True, False, "flash"),
    (256, "bf16", H100, True, False, "flash"),  # flash's largest head dim
    (264, "bf16", H100, True, False, "efficient"),
    (768, "bf16", H100, True, False, "efficient"),  # nrgpt-ff2w-90m's full heads
    (1024, "bf16", A100, True, False, "efficient"),  # nrgpt-ff2w-126m's
    (1020, "bf16", H100, True, False, "math"),  # its old width: not a multiple of 8
    (1020, "fp16", H100, True, False, "math"),
    (1020, "fp32", H100, True, False, "efficient"),  # fp32 GEMMs align to 4 elements
    (1022, "fp32", H100, True, False, "math"),
    (64, "fp32", H100, True, False, "efficient"),  # flash is half precision only
    (200, "bf16", RTX4090, True, False, "efficient"),  # flash's backward there stops at 192
    (200, "bf16", RTX4090, False, False, "flash"),  # inference needs no backward
    (240, "bf16", RTX4090, True, False, "flash"),
    (240, "bf16", RTX4090, True, True, "efficient"),  # above 224 only without dropout
    (64, "bf16", V100, True, False, "math"),  # bf16 needs Ampere
    (64, "fp16", V100, True, False, "efficient"),
    (1020, "fp16", V100, True, False, "math"),
])
def test_kernel_follows_torchs_rules(head_dim, precision, capability, training, dropout, kernel):
    assert sdpa_kernel(head_dim, precisions()[precision].compute_dtype, capability, training, dropout) == kernel


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_every_flavor_takes_a_fused_kernel_on_gpus_in_bf16(flavor):
    config = resolve(flavor)  # EBT: its observed stream (the predicted one is written out)
    for capability in (A100, H100):
        assert sdpa_kernel(config.sdpa_head_dim, torch.bfloat16, capability) in ("flash", "efficient"), capability


def test_models_that_skip_sdpa_say_so():
    assert resolve("nrgpt-tiny", {"attention_impl": "explicit"}).sdpa_head_dim is None
    assert resolve("nrgpt-tiny", {"grad_mode": "exact"}).sdpa_head_dim is None  # needs p_AA: explicit
    assert resolve("nrgpt-tiny", {"grad_mode": "exact", "mask": "strict"}).sdpa_head_dim == 32
    assert resolve("nrgpt-tiny", {"attention": "lowrank"}).sdpa_head_dim == 16
    assert resolve("nrgpt-ff2w-126m").sdpa_head_dim == 1024


def gpu_run(flavor: str, **overrides) -> RunConfig:
    return from_dict({"run_name": "r", "data": {"path": "unused"}, "train": {"max_steps": 10},
                                "model": {"flavor": flavor, "overrides": overrides}}, "test")


def test_a_gpu_run_that_would_take_the_math_kernel_is_refused_unless_chosen():
    slow = gpu_run("nrgpt-ff2w-126m", n_embd=1020)
    with pytest.raises(ConfigError, match=r"^model.flavor=nrgpt-ff2w-126m: attention of head dim 1020 in bf16 "
                                          r"leaves SDPA only its math kernel on the GPU .*; use a width whose "
                                          r"head dim is a multiple of 8, or set model.overrides.attention_impl"):
        validate(slow, 1, has_gpu=True)
    validate(slow, 1, has_gpu=False)  # on CPU there is no fused kernel to lose
    validate(gpu_run("nrgpt-ff2w-126m", n_embd=1020, attention_impl="sdpa"), 1, has_gpu=True)  # on purpose
    validate(gpu_run("nrgpt-ff2w-126m", n_embd=1020, attention_impl="explicit"), 1, has_gpu=True)
    with pytest.raises(ConfigError, match=r"multiple of 8$"):  # GPT has no other attention to choose
        validate(gpu_run("gpt-tiny", n_embd=300, n_head=1), 1, has_gpu=True)


def test_the_kernel_is_named_once_for_the_console():
    assert describe_attention(gpu_run("gpt-124m"), True) == [
        "attention: SDPA's flash kernel on the GPU (head dim 64, bf16)"]
    assert describe_attention(gpu_run("nrgpt-ff2w-126m"), True) == [
        "attention: SDPA's efficient kernel on the GPU (head dim 1024, bf16)"]
    assert describe_attention(gpu_run("nrgpt-ff2w-126m"), False) == []
    assert describe_attention(gpu_run("ebt-s1-small"), True) == [
        "attention: SDPA's flash kernel on the GPU (head dim 64, bf16)"]
