"""Mixed precision: the bf16 hazards the models keep in float32 (each compared with float64 on the
same bf16 operands, where bf16 rounding of the intermediate would show), EBT under autocast, and
the `bf16-autocast` training precision's DeepSpeed config and memory plan. Its exact resume is a
cell of the resume matrix (trainer_runs.py)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import yaml

from numerics import assert_rounding_close
from pretrain.config import ConfigError, load_config
from pretrain.config.precision import precisions, resolve_precision
from pretrain.config.validation import validate
from pretrain.models import build, resolve
from pretrain.models.common import KVSlot
from pretrain.models.descent_plumbing import StepSettings
from pretrain.models.ebt_attention import TwoStreamAttention
from pretrain.models.nrgpt import EnergyAttention, GeluAndSlope, NRGPTConfig
from pretrain.training.engine import deepspeed_config
from pretrain.training.planner import make_plan, model_state_bytes

BF16_EPS = torch.finfo(torch.bfloat16).eps


def bf16_values(*shape: int, scale: float = 1.0, offset: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Random bf16 numbers (their float64 copies hold the same values exactly)."""
    generator = torch.Generator().manual_seed(seed)
    return (offset + scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).bfloat16()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("attention", ["full", "lowrank"])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_nrgpt_attention_scores_are_float32(attention, autocast):
    """The explicit and energy paths' scores of bf16 queries and keys (full heads: std ~15 at
    init at D=768, beta 1) are float32 products, not rounded to bf16 (up to 1/16 at that size),
    also when the matmul would run under autocast."""
    D, H, T = 64, 2, 16
    attn = EnergyAttention(NRGPTConfig(n_embd=D, n_head=H, attention=attention, attention_impl="explicit"))
    d = attn.key.out_features // H
    q, k = bf16_values(2, H, T, d, scale=4.0, seed=1), bf16_values(2, H, T, d, scale=4.0, seed=2)
    if attention == "full":  # the query of a full head is g itself, the same for every head
        q = q[:, :1].expand_as(k)
    operands = (q.float(), k.float()) if autocast else (q, k)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        scores = attn.masked_scores(*operands)
    expected = attn.double().masked_scores(q.double(), k.double())
    assert scores.dtype == torch.float32
    visible = torch.isfinite(expected)
    assert_rounding_close(scores[visible].double(), expected[visible], rounded_in=torch.float32)


def test_nrgpt_decoding_scores_are_float32():
    """The decoding cache's explicit scores (`mix_cached`: sampling and evaluation) are float32
    products, as the training paths' are. Full heads score g_A J_h g_B from the bf16 values
    themselves, so against float64 on the same values each attention weight (here the self
    weights p_AA of the exact gradient) is rounded once to bf16. Scores of std ~20 rounded to
    bf16 moved them by up to 23% here."""
    D, H, T = 64, 2, 16
    torch.manual_seed(0)
    attn = EnergyAttention(NRGPTConfig(n_embd=D, n_head=H, attention="full", grad_mode="exact"))
    with torch.no_grad():
        attn.key.weight.normal_(0.0, 0.02)
    attn = attn.bfloat16().requires_grad_(False)
    attn64 = copy.deepcopy(attn).double()
    g = bf16_values(2, T, D, scale=4.0, seed=3)
    _, mixed, p_self = attn.mix_cached(g, KVSlot())
    _, _, expected = attn64.mix_cached(g.double(), KVSlot())
    scores = attn64.masked_scores(*attn64.project(g.double()))
    assert scores[torch.isfinite(scores)].std() > 10  # the regime where bf16 scores would hurt
    assert mixed.dtype == p_self.dtype == torch.bfloat16
    assert ((p_self.double() - expected).abs() <= BF16_EPS * expected).all()


def test_gelu_and_slope_round_once_to_bf16():
    """GELU and its slope Phi(u) + u phi(u) of bf16 inputs, and their backward, are float64's up
    to rounding once to bf16 (and float32's absolute rounding near zero): the slope for u < 0 is
    a difference of nearly equal terms, which bf16 arithmetic (Phi from 1 + erf, resolved to
    2^-9) got wrong by up to 200% around its zero at u = -0.75."""
    u = torch.linspace(-8, 4, 2001, dtype=torch.float64).bfloat16().requires_grad_()
    value, slope = GeluAndSlope.apply(u)
    (value.float().sum() + slope.float().sum()).backward()
    u64 = u.detach().double().requires_grad_()
    cdf, pdf = torch.special.ndtr(u64), torch.exp(-0.5 * u64 * u64) / math.sqrt(2 * math.pi)
    value64, slope64 = u64 * cdf, cdf + u64 * pdf
    (grad64,) = torch.autograd.grad(value64.sum() + slope64.sum(), u64)
    for actual, expected in ((value, value64), (slope, slope64), (u.grad, grad64)):
        # one unit in bf16's last place of each value (correct rounding is half of one)
        torch.testing.assert_close(actual.double(), expected, rtol=BF16_EPS, atol=1e-6)


def two_stream_inputs(dtype: torch.dtype, value_offset: float = 0.0) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, R, hd] and observed k, v [B, H, T, hd] of the same bf16 values in `dtype`."""
    B, H, R, T, hd = 2, 2, 12, 12, 16
    shapes = [(B, H, R, hd)] * 3 + [(B, H, T, hd)] * 2
    tensors = [bf16_values(*s, scale=2.0, offset=value_offset if i in (2, 4) else 0.0, seed=10 + i)
               for i, s in enumerate(shapes)]
    return tuple(t.to(dtype).requires_grad_() for t in tensors)


def test_ebt_predicted_row_scores_are_float32():
    """The attention weights of EBT's predicted rows come from float32 scores: with bf16 queries
    and keys they equal float64's to float32 rounding (bf16 scores were off by 2^-9 of their
    size, a relative error of that times the score in every weight)."""
    out, *probs = TwoStreamAttention.apply(*two_stream_inputs(torch.bfloat16), 0, 2, True)
    _, *probs64 = TwoStreamAttention.apply(*two_stream_inputs(torch.float64), 0, 2, True)
    for p, p64 in zip(probs, probs64):
        assert p.dtype == torch.float32
        assert_rounding_close(p.double(), p64, rounded_in=torch.float32)


def test_ebt_score_gradient_cancellation_is_float32():
    """dS = P (A - sigma) with sigma the P-weighted mean of A = G V^T: for values with a common
    part A - sigma cancels, and sigma taken as G.out, the output mixed from weights rounded to
    bf16, lost it. The queries' gradient of bf16 inputs is now within bf16 rounding of float64's
    (0.3%; it was off by 4% here, 20% at a common part of 32)."""
    inputs = two_stream_inputs(torch.bfloat16, value_offset=8.0)
    inputs64 = two_stream_inputs(torch.float64, value_offset=8.0)
    grad_out = bf16_values(*inputs[0].shape, seed=20)
    (dq,) = torch.autograd.grad(TwoStreamAttention.apply(*inputs, 0, 2, True)[0], inputs[0], grad_out)
    (dq64,) = torch.autograd.grad(TwoStreamAttention.apply(*inputs64, 0, 2, True)[0], inputs64[0], grad_out.double())
    assert relative_error(dq, dq64) < BF16_EPS


def tiny_ebt():
    torch.manual_seed(0)
    return build(resolve("ebt-tiny", dict(vocab_size=256, block_size=16, n_layer=2, n_embd=32, n_head=2))).train()


def test_ebt_vocabulary_gradient_is_float32():
    """The descent step y - alpha dE/dp of a bf16 model: dE/dp = dE/de W_ve^T (one [V]-wide GEMM
    per row) in float32, so the step equals float64's product of the same bf16 factors to
    float32 rounding (bf16 rounded each entry by 2^-9 of its size, times alpha = 500)."""
    descent = tiny_ebt().bfloat16().descent
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    y = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(4))
    observed = descent.observe(idx, 0)
    settings = StepSettings(first_row=0, noise_std=0.0, second_order=False, keep_graph=False)
    y_next, _, _ = descent.step(y, observed, None, descent.alpha, settings)
    # the same energy gradient w.r.t. the embedded candidate, by the step's own ops
    probs = y.softmax(-1)
    table = descent.candidate_table()
    embedded = (probs.to(table.dtype) @ table).detach().requires_grad_()
    (grad_embedded,) = torch.autograd.grad(descent.energy(embedded, observed, 0).sum(), embedded)
    expected = probs.double() - descent.alpha.double() * (grad_embedded.double() @ table.double().t())
    assert_rounding_close(y_next.double(), expected.detach(), rounded_in=torch.float32)


def test_ebt_trains_under_autocast():
    """EBT's descent (second-order, through the two-stream attention's Functions) runs under
    autocast (its rotated queries and keys are float32 there, the values bf16), and its
    gradients are fp32's up to bf16 compute."""
    model = tiny_ebt()
    idx, targets = (torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    grads = {}
    for autocast in (False, True):
        replica = copy.deepcopy(model)
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = replica(idx, targets).loss
        loss.backward()
        grads[autocast] = torch.cat([p.grad.flatten() for p in replica.parameters()])
    assert torch.isfinite(grads[True]).all()
    assert relative_error(grads[True], grads[False].double()) < 0.05


def test_bf16_autocast_deepspeed_config_and_plan(tmp_path):
    """bf16-autocast is DeepSpeed's torch_autocast with fp32 weights: no bf16 mode, no gradient
    reduced in bf16, and the memory of fp32 training in the plan (master weights are the weights)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"data": {"path": "some/dataset", "seq_len": 64, "micro_batch_size": 4},
                                    "train": {"max_steps": 10, "global_batch_size": 8}}))
    cfg = load_config(path, ["train.precision=bf16-autocast"])
    validate(cfg, world_size=1, has_gpu=False)
    assert resolve_precision(cfg.train.precision, has_gpu=False).name == "bf16-autocast"
    ds = deepspeed_config(cfg, 1, precisions()["bf16-autocast"])
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["data_types"] == {}
    assert not deepspeed_config(cfg, 1, precisions()["bf16"])["torch_autocast"]["enabled"]
    n = 1_000_000
    for stage in (1, 2, 3):
        cfg.zero.stage = stage
        autocast = model_state_bytes(n, 0, deepspeed_config(cfg, 8, precisions()["bf16-autocast"]), 8)
        assert autocast == model_state_bytes(n, 0, deepspeed_config(cfg, 8, precisions()["fp32"]), 8)
        assert sum(autocast) > sum(model_state_bytes(n, 0, deepspeed_config(cfg, 8, precisions()["bf16"]), 8))
    with pytest.raises(ConfigError, match="'bf16-autocast'"):
        validate(load_config(path, ["train.precision=bf16-amp"]), world_size=1, has_gpu=False)


def test_plan_counts_bf16_autocast_as_fp32_weights_and_bf16_matmuls():
    """`pretrain.plan` under bf16-autocast: the model states of fp32 training (more than bf16's),
    activations measured in fp32 (an upper bound of autocast's mix) with bf16's attention kernel
    (flash, where fp32 takes the memory-efficient one: small outputs of their own differ), the
    bf16 tensor-core peak."""
    path = "configs/owt/gpt_124m.yaml"
    plans = {precision: make_plan(path, load_config(path, [f"train.precision={precision}"]), gpus=8,
                                  gpu="h100-80gb", find_largest=False)
             for precision in ("fp32", "bf16", "bf16-autocast")}
    autocast = plans["bf16-autocast"]
    assert autocast.precision == "bf16-autocast"
    assert autocast.parts.as_dict() == pytest.approx(plans["fp32"].parts.as_dict(), rel=1e-4)
    assert autocast.parts.total > plans["bf16"].parts.total
    assert autocast.step_time_s == plans["bf16"].step_time_s is not None


def tensors_in(state, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state (dicts, lists, tuples), by its path."""
    if isinstance(state, torch.Tensor):
        return {path: state}
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return {}
    return {k: t for key, value in items for k, t in tensors_in(value, f"{path}/{key}").items()}


def resumed_state(config, overrides: list[str]) -> tuple[dict, dict]:
    """(module state, optimizer state) of a trainer of `overrides` once set up: what it resumed
    from its checkpoint, before any step. A world of one in this process, as `runs.command_here`
    runs the trainer."""
    import trainer_runs as runs
    from pretrain.training.trainer import Trainer

    cfg = load_config(config, overrides)
    validate(cfg, 1, has_gpu=False)
    with runs.world_of_one_here():
        trainer = Trainer(cfg)
        try:
            trainer.setup()
            engine = trainer.engine
            return ({name: t.detach().clone() for name, t in engine.module.state_dict().items()},
                    {path: t.detach().clone() for path, t in tensors_in(engine.optimizer.state_dict()).items()})
        finally:
            if hasattr(trainer, "metrics"):
                trainer.metrics.close()
            trainer.close()


@pytest.mark.parametrize("stage, saved, resumed", [(0, "fp32", "bf16-autocast"), (2, "fp32", "bf16-autocast"),
                                                   (2, "bf16-autocast", "fp32")])
def test_fp32_and_bf16_autocast_checkpoints_resume_in_each_other_with_exactly_their_saved_state(
        tmp_path, stage, saved, resumed):
    """Why a resume may switch between fp32 and bf16-autocast (checkpoint.SAME_STATE_PRECISIONS):
    a trainer in one, set up from a checkpoint of the other, holds bit for bit the weights and
    optimizer state (Adam's moments, ZeRO's fp32 partitions) that the checkpoint saved."""
    import trainer_runs as runs

    run = [f"output_root={tmp_path}", f"zero.stage={stage}", "train.max_steps=2", "checkpoint.interval=2",
           "data.num_workers=0", "eval.sample_tokens=0"]
    trained = runs.train_here([*run, "run_name=saved", f"train.precision={saved}"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    tag_dir = tmp_path / "saved" / "ckpt" / "step_00000002"
    module, optimizer = resumed_state(runs.base_config_file(), [*run, "run_name=resumed", "train.max_steps=4",
                                                                f"train.precision={resumed}", f"resume={tag_dir}"])
    model_states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert module.keys() == model_states["module"].keys()
    for name, saved in model_states["module"].items():
        assert module[name].dtype == torch.float32 and torch.equal(module[name], saved), name
    saved_optimizer = tensors_in(model_states["optimizer"] if stage == 0 else torch.load(
        tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu",
        weights_only=False)["optimizer_state_dict"])
    assert saved_optimizer and optimizer.keys() == saved_optimizer.keys()
    assert any("exp_avg_sq" in path for path in saved_optimizer)
    for path, saved in saved_optimizer.items():
        assert torch.equal(optimizer[path], saved), path


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ebt_alpha_stays_float32_in_a_bf16_run_and_takes_updates_finer_than_bf16s_spacing(tmp_path, stage):
    """S1's learnable alpha (500) in a pure-bf16 run: the module keeps it in float32 beside its
    bf16 weights, so a first update smaller than bf16's spacing there (2) moves what the forward
    reads; the checkpoint holds it so, and a resumed run starts from exactly that."""
    import trainer_runs as runs

    run = [f"output_root={tmp_path}", "model.flavor=ebt-tiny", f"zero.stage={stage}", "train.precision=bf16",
           "optimizer.lr=1e-4", "schedule.min_lr=1e-5", "train.max_steps=1", "checkpoint.interval=1",
           "data.num_workers=0", "eval.sample_tokens=0"]
    trained = runs.train_here([*run, "run_name=saved"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    tag_dir = tmp_path / "saved" / "ckpt" / "step_00000001"
    saved = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    alpha, initial = saved["descent.alpha"], resolve("ebt-tiny").alpha
    spacing = BF16_EPS * 2 ** math.floor(math.log2(initial))
    assert alpha.dtype == torch.float32 and 0 < abs(alpha.item() - initial) < spacing / 2
    assert saved["descent.energy_head.weight"].dtype == torch.bfloat16
    module, _ = resumed_state(runs.base_config_file(), [*run, "run_name=resumed", "train.max_steps=2",
                                                        f"resume={tag_dir}"])
    assert module["descent.alpha"].dtype == torch.float32 and torch.equal(module["descent.alpha"], alpha)


def test_zero3_says_that_it_keeps_ebt_alpha_in_bf16(tmp_path):
    """ZeRO-3 flattens every partition into one buffer of one dtype, so S1's alpha cannot stay
    float32 beside bf16 weights there: the run says so in one line, and trains."""
    import trainer_runs as runs

    run = runs.train_here([f"output_root={tmp_path}", "run_name=zero3", "model.flavor=ebt-tiny", "zero.stage=3",
                           "train.precision=bf16", "train.max_steps=1", "data.num_workers=0", "eval.sample_tokens=0"])
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if "descent.alpha" in line]
    assert warnings == ["warning: zero.stage=3 holds every parameter in bf16, descent.alpha too, whose updates are "
                        "finer than bf16's spacing at its value; ZeRO-2 keeps it float32"]
