"""Transformer++ (the Llama-style backbone): equality with an independently written Llama
forward (complex-number rotary, explicit masked attention, SwiGLU), the rotary embedding's
relative-position property, RMSNorm (and its hand-written second derivatives), the joined
projections EBT runs, parameter counts and FLOPs."""
import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.models import build, resolve
from pretrain.models.llama import (Block, RMSNorm, RotaryCache, SecondOrderRMSNorm, TransformerPPConfig, apply_rotary,
                                   rotary_tables)
from tests.numerics import assert_rounding_close


def tiny(**overrides):
    torch.manual_seed(0)
    return build(resolve("transformer_pp-tiny", overrides)).double().eval()


def rotate_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding written as complex multiplication: channel c and c + hd/2 form the
    complex number x_c + i x_{c+hd/2}, turned by angle position * theta^(-2c/hd)."""
    half = x.size(-1) // 2
    z = torch.complex(x[..., :half], x[..., half:])
    angles = positions[:, None].double() * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.size(-1))
    z = z * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


def test_transformer_pp_equals_an_independent_llama_forward():
    model = tiny()
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (2, 12))
    B, T, H, hd = 2, 12, cfg.n_head, cfg.head_dim
    positions = torch.arange(T)
    x = model.tok_embeddings(idx)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in model.layers:
        a, ff = layer.attention, layer.feed_forward
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * layer.attention_norm.weight
        q, k, v = (w(h).view(B, T, H, hd).transpose(1, 2) for w in (a.wq, a.wk, a.wv))
        q, k = rotate_complex(q, positions, cfg.rope_theta), rotate_complex(k, positions, cfg.rope_theta)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
        x = x + a.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * layer.ffn_norm.weight
        x = x + ff.w2(F.silu(ff.w1(h)) * ff.w3(h))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * model.norm.weight
    expected = model.output(x)
    out = model(idx, idx)
    assert torch.allclose(out.logits, expected, atol=1e-12, rtol=0)
    assert torch.allclose(out.loss, F.cross_entropy(expected.flatten(0, 1), idx.flatten()), atol=1e-12)


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 16, dtype=torch.float64)
    def score(i, j):
        rq = apply_rotary(q, rotary_tables(torch.tensor([i]), 16, 10000.0, torch.float64))
        rk = apply_rotary(k, rotary_tables(torch.tensor([j]), 16, 10000.0, torch.float64))
        return (rq * rk).sum()
    assert torch.allclose(score(7, 3), score(104, 100), atol=1e-12)
    assert torch.allclose(score(5, 5), (q * k).sum(), atol=1e-12)  # same position: no rotation
    assert not torch.allclose(score(7, 3), score(3, 7))
    x = torch.randn(3, 2, 9, 16, dtype=torch.float64)  # a rotation keeps norms
    rotated = apply_rotary(x, rotary_tables(torch.arange(9), 16, 10000.0, torch.float64))
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rotary_cache_slices_equal_the_positions_own_tables(dtype):
    cache = RotaryCache(head_dim=16, theta=10000.0, n_positions=64)
    like = torch.zeros(1, dtype=dtype)
    for first, length in [(0, 64), (0, 1), (37, 1), (63, 1), (5, 20), (60, 10), (100, 3)]:
        expected = rotary_tables(torch.arange(first, first + length), 16, 10000.0, dtype)
        got = cache(first, length, like)
        assert all(g.dtype == dtype and torch.equal(g, e) for g, e in zip(got, expected)), (first, length)
    assert cache.tables[(dtype, like.device)][0].size(0) == 103  # grew to the furthest position asked
    with torch.inference_mode():  # tables made there must still serve a later training step
        tables = RotaryCache(16, 10000.0, 8)(0, 8, like)
    assert not any(t.is_inference() for t in tables)


def test_rmsnorm_formula_and_bf16_stays_close_to_float32():
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 8) * 30
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.allclose(norm(x), expected, atol=1e-5)
    assert torch.allclose(norm.bfloat16()(x.bfloat16()).float(), expected, atol=0.05, rtol=0.02)


def norm_input(dtype=torch.float64):
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm, (torch.randn(2, 5, 8, dtype=dtype) * 3).requires_grad_()


def test_second_order_rmsnorm_has_autograds_first_and_second_derivatives():
    norm, x = norm_input()
    # gradcheck and gradgradcheck against finite differences, both cotangents of the gradient
    # (dx, dw) random; the descent's pattern below has only dx's
    assert torch.autograd.gradgradcheck(lambda x, w: SecondOrderRMSNorm.apply(x, w, 1e-5)[0], (x, norm.weight))
    results = []
    for second_order in (True, False):
        norm.zero_grad()
        x.grad = None
        y = norm(x, second_order)
        dx, = torch.autograd.grad(y, x, torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y),
                                  create_graph=True)
        (dx.pow(2).sum() + (dx * y).sum()).backward()
        results.append((y, dx, x.grad, norm.weight.grad))
    for got, expected in zip(*results):
        assert_rounding_close(got, expected)


def test_second_order_rmsnorm_in_bf16_rounds_once_from_float32():
    """bf16 in, bf16 out, computed in float32 (as torch's kernel): within a few bf16 roundings
    of the float64 values of the same (bf16) inputs."""
    norm, x = norm_input()
    norm_bf16 = RMSNorm(8, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(norm.weight.bfloat16())
        norm_bf16.weight.copy_(norm.weight)
        x.copy_(x.bfloat16())
    outputs = []
    for module, inputs in ((norm, x), (norm_bf16, x.detach().bfloat16().requires_grad_())):
        y = module(inputs, second_order=True)
        dx, = torch.autograd.grad(y, inputs, torch.ones_like(y), create_graph=True)
        dx.pow(2).sum().backward()
        outputs.append((y, dx, inputs.grad, module.weight.grad))
    for expected, got in zip(*outputs):
        assert got.dtype == torch.bfloat16
        assert_rounding_close(got.double(), expected, ulps=8, rounded_in=torch.bfloat16)


def test_joined_projections_compute_the_separate_ones():
    """EBT's blocks join the q/k/v and w1/w3 weights into one matmul each: outputs and
    gradients equal those of the separate projections to rounding."""
    config = TransformerPPConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    joined = Block(config, joined_projections=True).double()
    separate = Block(config).double()
    separate.load_state_dict(joined.state_dict())
    rope = RotaryCache(config.head_dim, config.rope_theta, 16)(0, 16, torch.zeros((), dtype=torch.float64))
    x = torch.randn(3, 16, 16, dtype=torch.float64)
    results = []
    for block in (joined, separate):
        out, k, v = block(x, rope)
        (out.square().sum() + k.sum() + v.sum()).backward()
        results.append([out, k, v, *(p.grad for p in block.parameters())])
    for got, expected in zip(*results):
        assert_rounding_close(got, expected)


def test_block_checkpointing_is_exact():
    idx = torch.randint(0, 512, (2, 10))
    grads = []
    for mode in ("off", "block"):
        model = tiny(activation_checkpointing=mode).train()
        model(idx, idx).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-12, rtol=0), name


def test_small_parameter_count_and_flops():
    """12L/768/12h, SwiGLU hidden = D, untied head: 12 x 7 D^2 non-embedding (+ norms) and
    two V x D tables, 126.8M at V=50304 (the EBT paper's ~126M baseline)."""
    with torch.device("meta"):
        model = build(resolve("transformer_pp-small"))
    D, V = 768, 50304
    assert model.num_params(non_embedding=True) == 12 * 7 * D * D + 25 * D
    assert model.num_params() == model.num_params(non_embedding=True) + 2 * V * D
    assert abs(model.num_params() / 126e6 - 1) < 0.01
    palm = 6 * 12 * 7 * D * D + 12 * 12 * D * 1024 + 6 * D * V
    assert model.flops_per_token(1024) == palm
    assert model.flops_per_token(1024, training=False) == palm / 3


@pytest.mark.parametrize("field, value", [("n_head", 5), ("mlp_ratio", 0.0), ("dropout", 1.0),
                                          ("activation_checkpointing", "layer")])
def test_invalid_options_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TransformerPPConfig(**{field: value})
