"""EBT: the two-stream attention and the energy against an explicit 2T-sequence reference, no
leakage, second-order gradients (gradcheck), the S1 / S2 option semantics, observed-stream
reuse, activation checkpointing, thinking on a trained model, and the paper-scale sizes."""
import functools
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pretrain.models import build, resolve
from pretrain.models import replay
from pretrain.models.blocks import token_losses
from pretrain.models.ebt import EBT, EBTConfig
from pretrain.models.ebt_attention import two_stream_attention
from pretrain.models.ebt_descent import EnergyDescent, stream_attention
from pretrain.models.llama import apply_rotary, causal_attention, rotary_tables
from pretrain.models.replay import ReplayStore, replay_store_bytes
from pretrain.models.weights import load_weights

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: a second intra-op thread buys nothing, and when other processes
    hold the cores its synchronisation makes each small matmul orders of magnitude slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


STEP_CONDITIONED = dict(time_embed=True, reuse_observed_stream=False)
S2_OPTIONS = dict(n_steps=3, min_steps=2, alpha=5.0, alpha_learnable=False, alpha_randomize=2.0,
                  langevin_noise_std=3.0, detach_between_steps=False, truncate_loss=True)


def tiny(dtype=torch.float64, **overrides) -> EBT:
    """A float64 EBT small enough for gradcheck; overrides change any EBTConfig field."""
    fields = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, alpha=20.0)
    fields.update(overrides)
    torch.manual_seed(0)
    return build(EBTConfig(**fields)).to(dtype)


def data(model, batch=2, seq_len=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def candidate(model, idx, seed=4, rows=None):
    g = torch.Generator().manual_seed(seed)
    rows = rows or idx.size(1)
    return torch.randn(idx.size(0), rows, model.config.vocab_size, generator=g, dtype=torch.float64)


def param_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict, b: dict, atol=1e-10):
    assert a and a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=1e-8), name


# --- attention and energy against explicit references ------------------------------------

def reference_mask(n_obs: int, n_rows: int, first_row: int, n_prefix: int) -> torch.Tensor:
    """[n_obs + n_rows]^2 boolean mask of the whole [observed ; predicted] sequence, written
    from the definition: observed rows are causal over observed keys; predicted row r (the
    prediction for position i = first_row + r) sees observed keys up to observed token i (after
    n_prefix prefix tokens) and itself."""
    size = n_obs + n_rows
    allowed = torch.zeros(size, size, dtype=torch.bool)
    for a in range(n_obs):
        allowed[a, : a + 1] = True
    for r in range(n_rows):
        allowed[n_obs + r, : first_row + r + n_prefix + 1] = True
        allowed[n_obs + r, n_obs + r] = True
    return allowed


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("n_obs, n_rows, first_row, n_prefix", [(6, 6, 0, 0), (7, 6, 0, 1), (6, 2, 4, 0)])
def test_two_stream_attention_equals_full_masked_attention(n_obs, n_rows, first_row, n_prefix, chunks):
    torch.manual_seed(0)
    B, H, hd = 2, 3, 4
    q_obs, k_obs, v_obs = (torch.randn(B, H, n_obs, hd, dtype=torch.float64) for _ in range(3))
    q, k, v = (torch.randn(B, H, n_rows, hd, dtype=torch.float64) for _ in range(3))
    scores = torch.cat([q_obs, q], 2) @ torch.cat([k_obs, k], 2).transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(~reference_mask(n_obs, n_rows, first_row, n_prefix), float("-inf"))
    expected = (scores.softmax(-1) @ torch.cat([v_obs, v], 2))[:, :, n_obs:]
    got = two_stream_attention(q, k, v, k_obs, v_obs, offset=first_row + n_prefix, chunks=chunks)
    assert torch.allclose(got, expected, atol=1e-13, rtol=0)


@pytest.mark.parametrize("n_rows, n_obs, offset, observed_grad, chunks", [
    (4, 5, 1, True, 4),     # one row per chunk
    (7, 7, 0, True, 4),     # chunks of uneven size, no prefix
    (6, 9, 3, True, 4),     # a prefix: the first chunk already sees several observed keys
    (5, 9, 1, True, 2),     # the last rows see 6 of the 9 observed keys
    (6, 9, 3, True, 1),     # one chunk (a GPU's), over every key
    (5, 6, 1, False, 4),    # the energy gradient: observed keys and values are constants
    (5, 6, 1, False, 1),
])
def test_two_stream_attention_first_and_second_derivatives(n_rows, n_obs, offset, observed_grad, chunks):
    """The hand-written first and second derivatives (ebt_attention.py) against finite
    differences in float64: gradcheck and gradgradcheck, which also checks the backward of the
    backward w.r.t. the incoming gradient. The row chunking and the skipped observed-key
    gradients are exercised by the shapes."""
    torch.manual_seed(0)
    inputs = [torch.randn(2, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (n_rows,) * 3]
    inputs += [torch.randn(2, 2, n_obs, 4, dtype=torch.float64, requires_grad=observed_grad) for _ in range(2)]
    fn = functools.partial(two_stream_attention, offset=offset, chunks=chunks)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("options", [{}, STEP_CONDITIONED], ids=["reuse", "step_conditioned"])
def test_each_stream_gets_an_attention_backend_with_the_derivatives_training_takes(options):
    """The backend choice (`stream_attention`): the observed stream runs through causal SDPA,
    whose fused kernel (CPU flash here, as flash on GPU) has no double backward, and the
    predicted rows through the hand-written attention, which has one. A float32 second-order
    training step then succeeds only if the observed stream is differentiated once, and every
    weight, observed-stream ones included, gets a finite gradient."""
    assert stream_attention("observed") is causal_attention
    assert stream_attention("predicted") is two_stream_attention
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    first = torch.autograd.grad(causal_attention(q, k, v).square().sum(), q, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.autograd.grad(first.sum(), k)
    model = tiny(torch.float32, **options)
    idx, targets = data(model)
    model(idx, targets).loss.backward()
    grads = dict(model.named_parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in grads.values())
    assert grads["descent.layers.0.attention.wk.weight"].grad.abs().sum() > 0
    with pytest.raises(ValueError, match="unknown EBT attention stream"):
        stream_attention("both")


def test_two_stream_attention_refuses_third_order_derivatives():
    """The hand-written second derivatives are not differentiable again: a third-order
    gradient must raise, not return numbers computed without part of the graph."""
    torch.manual_seed(0)
    inputs = [torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (5, 5, 5, 6, 6)]
    first = torch.autograd.grad(two_stream_attention(*inputs, offset=1).square().sum(), inputs, create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in first), inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="third-order|differentiable"):
        torch.autograd.grad(sum(g.square().sum() for g in second), inputs)


@pytest.mark.parametrize("chunks", [1, 4])
def test_two_stream_attention_derivatives_equal_autograd_of_the_plain_form(chunks):
    """Hessian-vector products as the EBT loss takes them (gradient w.r.t. the predicted
    stream with create_graph, then the loss through it) equal those autograd computes for the
    attention written with plain masked ops."""
    torch.manual_seed(1)
    n_rows, n_obs, offset, hd = 6, 8, 2, 4

    def plain(q, k, v, k_obs, v_obs):
        scores = q @ k_obs.transpose(-1, -2) / math.sqrt(hd)
        keys = torch.arange(n_obs)[None, :]
        scores = scores.masked_fill(keys > torch.arange(n_rows)[:, None] + offset, float("-inf"))
        self_score = (q * k).sum(-1, keepdim=True) / math.sqrt(hd)
        weights = torch.cat([scores, self_score], -1).softmax(-1)
        return weights[..., :-1] @ v_obs + weights[..., -1:] * v

    inputs = [torch.randn(2, 3, n, hd, dtype=torch.float64, requires_grad=True)
              for n in (n_rows, n_rows, n_rows, n_obs, n_obs)]
    weights = torch.randn(2, 3, n_rows, hd, dtype=torch.float64)
    results = []
    for fn in (functools.partial(two_stream_attention, offset=offset, chunks=chunks), plain):
        first = torch.autograd.grad((fn(*inputs) * weights).sum(), inputs[:3], create_graph=True)
        second = torch.autograd.grad(sum((g ** 2).sum() for g in first), inputs)
        results.append([*first, *second])
    for got, expected in zip(*results):
        assert torch.allclose(got, expected, atol=1e-12, rtol=1e-10)


def joint_reference_energy(model: EBT, idx, probs, step=0):
    """Energies from the released layout: the backbone run once over the 2T-row sequence
    [observed ; predicted] with an explicit mask, predictions at rotary positions i + 1 (after
    the step token, if any). Shares only the weights and the rotary helper with the model."""
    d, cfg = model.descent, model.config
    x_obs = d.tok_embeddings(idx)
    if cfg.time_embed:
        x_obs = torch.cat([d.time_embeddings.weight[step].expand(idx.size(0), 1, -1), x_obs], 1)
    w_ve = d.tok_embeddings.weight.t() if cfg.expected_embedding else d.candidate_embedding.weight
    x = torch.cat([x_obs, probs @ w_ve.t()], 1)
    n_obs, T, H = x_obs.size(1), probs.size(1), cfg.n_head
    first_row = idx.size(1) - T
    positions = torch.cat([torch.arange(n_obs), torch.arange(T) + first_row + 1 + cfg.n_prefix])
    rope = rotary_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    allowed = reference_mask(n_obs, T, first_row, cfg.n_prefix)
    for layer in d.layers:
        a = layer.attention
        h = layer.attention_norm(x)
        q, k, v = (w(h).view(x.size(0), -1, H, cfg.head_dim).transpose(1, 2) for w in (a.wq, a.wk, a.wv))
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim)).masked_fill(~allowed, float("-inf"))
        x = x + a.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape))
        ff = layer.feed_forward
        h = layer.ffn_norm(x)
        x = x + ff.w2(F.silu(ff.w1(h)) * ff.w3(h))
    return d.energy_head(d.norm(x[:, n_obs:])).squeeze(-1)


@pytest.mark.parametrize("overrides", [{}, STEP_CONDITIONED, dict(expected_embedding=True, n_layer=1)])
def test_energy_equals_the_joint_sequence_reference(overrides):
    model = tiny(**overrides)
    idx, _ = data(model)
    probs = candidate(model, idx).softmax(-1)
    d = model.descent
    for step in (0, 1):
        expected = joint_reference_energy(model, idx, probs, step)
        assert torch.allclose(d.energy(probs @ d.candidate_table(), d.observe(idx, step), 0), expected,
                              atol=1e-12, rtol=0)
    # the last R rows alone (generation predicts only the last position)
    expected = joint_reference_energy(model, idx, probs[:, -2:])
    assert torch.allclose(d.energy(probs[:, -2:] @ d.candidate_table(), d.observe(idx, 0), idx.size(1) - 2),
                          expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("grad_wrt", ["probs", "logits"])
def test_a_step_follows_the_gradient_of_the_reference_energy(grad_wrt):
    """y_1 = p_0 - alpha dE/dp (released code) or y_0 - alpha dE/dy (paper's pseudocode), with
    the gradient taken by autograd of the joint-sequence reference energy."""
    model = tiny(grad_wrt=grad_wrt, n_steps=1)
    idx, _ = data(model)
    start = candidate(model, idx)
    y = start.clone().requires_grad_()
    probs = y.softmax(-1)
    if grad_wrt == "probs":
        probs = probs.detach().requires_grad_()
    point = probs if grad_wrt == "probs" else y
    grad, = torch.autograd.grad(joint_reference_energy(model, idx, probs).sum(), point)
    expected = point - model.config.alpha * grad
    assert torch.allclose(model.descent(idx, start, 1).candidate, expected, atol=1e-12, rtol=0)


# --- no leakage ---------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, STEP_CONDITIONED, S2_OPTIONS])
@pytest.mark.parametrize("training", [False, True])
def test_prediction_never_sees_its_target_or_later_tokens(overrides, training):
    """Changing observed token k (the target of position k - 1) changes no output at
    positions < k: neither the final candidates nor any step's energy."""
    model = tiny(**overrides).train(training)
    idx, targets = data(model, seq_len=7)

    def outputs(tokens):
        torch.manual_seed(7)  # the same candidate noise (and training randomness) every call
        model.seed_shared_draws("7")  # and the same step count
        out = model(tokens, targets, return_energies=True)
        return out.logits, out.diagnostics["_token_energy"]

    logits, energies = outputs(idx)
    for k in (1, 4, 6):
        changed = idx.clone()
        changed[:, k] = (changed[:, k] + 1) % model.config.vocab_size
        new_logits, new_energies = outputs(changed)
        assert torch.allclose(new_logits[:, :k], logits[:, :k], atol=1e-12, rtol=0), k
        assert torch.allclose(new_energies[:, :, :k], energies[:, :, :k], atol=1e-12, rtol=0), k
        assert (new_logits[:, k:] - logits[:, k:]).abs().max() > 1e-6


@pytest.mark.parametrize("overrides", [{}, STEP_CONDITIONED])
def test_prediction_ignores_other_positions_candidates(overrides):
    model = tiny(n_steps=3, **overrides)
    idx, targets = data(model)
    start = candidate(model, idx)
    base = model.descent(idx, start, 3, targets=targets, final_energy=True)
    i = 3
    perturbed = start + 5 * torch.randn_like(start)
    perturbed[:, i] = start[:, i]
    other = model.descent(idx, perturbed, 3, targets=targets, final_energy=True)
    assert torch.allclose(other.candidate[:, i], base.candidate[:, i], atol=1e-12, rtol=0)
    assert torch.allclose(other.energies[:, :, i], base.energies[:, :, i], atol=1e-12, rtol=0)
    assert (other.candidate[:, i + 1] - base.candidate[:, i + 1]).abs().max() > 1e-6


# --- second order -------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, dict(grad_wrt="logits", **STEP_CONDITIONED)])
def test_gradcheck_of_the_loss_through_two_descent_steps(overrides):
    """The loss's gradient w.r.t. parameters, which flows through autograd.grad(create_graph)
    of two descent steps, equals finite differences (float64). The graph is kept between the
    steps: with detach (S1) the gradient is by design not the loss's full derivative."""
    model = tiny(n_layer=1, vocab_size=7, n_embd=4, n_head=1, alpha=3.0, detach_between_steps=False,
                 **overrides)
    idx, targets = data(model, batch=1, seq_len=3)
    start = candidate(model, idx)
    names = ["alpha", "energy_head.weight", "layers.0.ffn_norm.weight", "layers.0.attention.wq.weight"]
    if model.config.time_embed:
        names.append("time_embeddings.weight")
    params = dict(model.descent.named_parameters())

    def loss(*tensors):
        return torch.func.functional_call(model.descent, dict(zip(names, tensors)), (idx, start, 2),
                                          dict(targets=targets, learning=True)).loss

    inputs = [params[n].detach().clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


def one_step_grads(model, idx, start, targets):
    model.zero_grad()
    model.descent(idx, start, 1, targets=targets, learning=True).loss.backward()
    return param_grads(model)


@pytest.mark.parametrize("detach", [True, False])
def test_detach_between_steps_cuts_the_graph_between_steps(detach):
    """With detach, the 2-step S1 loss (mean of the two steps' CE) has exactly the gradient of
    two independent one-step problems: from the start, and from step 1's output as a constant.
    Keeping the graph adds the path through step 1, so the equality must then fail."""
    model = tiny(detach_between_steps=detach)
    idx, targets = data(model)
    start = candidate(model, idx)
    model.zero_grad()
    model.descent(idx, start, 2, targets=targets, learning=True).loss.backward()
    both = param_grads(model)
    after_one = model.descent(idx, start, 1).candidate
    first, second = one_step_grads(model, idx, start, targets), one_step_grads(model, idx, after_one, targets)
    separate = {n: (first[n] + second[n]) / 2 for n in first}
    if detach:
        assert_same_grads(both, separate)
    else:
        assert max((both[n] - separate[n]).abs().max() for n in both) > 1e-6


def test_truncated_loss_comes_from_the_last_step_only():
    """S2 truncation: the loss is the last step's cross entropy, and the parameters' gradient is
    that of the last step alone, started from the previous steps' output as a constant (no
    second-order graph through earlier steps). Without truncation both change."""
    model = tiny(**{**S2_OPTIONS, "langevin_noise_std": 0.0, "alpha_randomize": 1.0})
    idx, targets = data(model)
    start = candidate(model, idx)
    model.zero_grad()
    result = model.descent(idx, start, 3, targets=targets, learning=True)
    result.loss.backward()
    truncated = param_grads(model)
    last_ce = token_losses(result.candidate, targets).mean()
    assert torch.allclose(result.loss, last_ce, atol=1e-12, rtol=0)
    assert torch.allclose(result.loss, result.token_losses[-1].mean(), atol=1e-12, rtol=0)
    before_last = model.descent(idx, start, 2).candidate
    assert_same_grads(truncated, one_step_grads(model, idx, before_last, targets))

    full = tiny(**{**S2_OPTIONS, "langevin_noise_std": 0.0, "alpha_randomize": 1.0, "truncate_loss": False})
    mean_result = full.descent(idx, start, 3, targets=targets, learning=True)
    assert torch.allclose(mean_result.loss, mean_result.token_losses.mean(), atol=1e-12, rtol=0)
    assert abs(mean_result.loss - result.loss) > 1e-6


# --- S1 / S2 randomisation, Langevin noise, replay buffer ---------------------------------

def test_randomised_step_sizes_and_step_counts_cover_their_ranges():
    model = tiny(**S2_OPTIONS).train()
    torch.manual_seed(0)
    scale = torch.cat([model.sample_alpha_scale(64, 8, torch.device("cpu")) for _ in range(20)])
    assert scale.shape[1:] == (8, 1)
    alpha = model.config.alpha * scale
    assert alpha.min() >= 2.5 and alpha.max() <= 10.0  # [alpha / 2, 2 alpha], alpha = 5
    assert alpha.min() < 2.55 and alpha.max() > 9.9 and 0.4 < (alpha < 6.25).float().mean() < 0.6
    idx, targets = data(model)
    counts = [model(idx, targets).diagnostics["loss_per_step"].numel() for _ in range(30)]
    assert set(counts) == {2, 3}
    model.eval()
    assert model.sample_alpha_scale(4, 8, torch.device("cpu")) is None
    assert {model(idx, targets).diagnostics["energy"].numel() for _ in range(3)} == {3}
    assert tiny().train().sample_alpha_scale(4, 8, torch.device("cpu")) is None  # S1: fixed


def test_step_counts_come_from_the_shared_draws_not_the_global_rng():
    """Ranks differ in their global RNG (each its own candidate noise); seeded alike, as the
    trainer seeds every rank before each micro-step, they draw the same step counts, uniform
    over [min_steps, n_steps]."""
    drawn = []
    for rank in (0, 1):
        model = tiny(**S2_OPTIONS).train()
        torch.manual_seed(100 + rank)
        idx, targets = data(model)
        counts = []
        for micro in range(12):
            model.seed_shared_draws(f"7/{micro // 2}/{micro % 2}")
            counts.append(model(idx, targets).diagnostics["loss_per_step"].numel())
        drawn.append(counts)
    assert drawn[0] == drawn[1] and set(drawn[0]) == {2, 3}
    model = tiny(**{**S2_OPTIONS, "n_steps": 5}).train()
    model.seed_shared_draws("7/0/0")
    counts = torch.tensor([model.sample_num_steps() for _ in range(4000)])
    frequencies = torch.bincount(counts, minlength=6)[2:] / counts.numel()
    assert counts.min() == 2 and counts.max() == 5
    assert (frequencies - 0.25).abs().max() < 0.03  # 4.4 standard deviations of 4000 draws


def test_langevin_noise_only_in_training():
    noisy, quiet = tiny(langevin_noise_std=3.0), tiny()
    idx, targets = data(noisy)
    for model in (noisy, quiet):
        model.eval()
    assert torch.equal(noisy(idx, targets).logits, quiet(idx, targets).logits)
    outs = []
    for model in (noisy.train(), quiet.train()):
        torch.manual_seed(5)
        outs.append(model(idx, targets).logits)
    assert (outs[0] - outs[1]).abs().max() > 1e-3


def test_replay_buffer_stores_final_candidates_and_restarts_rows_from_them():
    model = tiny(replay_buffer_size=5, replay_fraction=0.5).train()
    store = model.replay_store
    assert store.top_k == 0 and store.tensors == {}  # V=11 < replay_top_k: whole logits; nothing allocated yet
    idx, targets = data(model, batch=4)
    out = model(idx, targets)
    # the buffer starts empty: nothing was replayed, all 4 rows were stored in slots 0..3
    assert store.tensors["lengths"].tolist() == [6, 6, 6, 6, 0] and store.next == 4
    assert torch.equal(store.tensors["tokens"][:4, :6], idx) and torch.equal(store.tensors["targets"][:4, :6], targets)
    assert torch.equal(store.tensors["logits"][:4, :6], out.logits)  # training: the final candidates as they are

    # restarted rows: 2 (= 0.5 x 4) stored rows, with their tokens, targets and final candidates
    fresh = candidate(model, idx)
    torch.manual_seed(0)
    all_idx, all_targets, start = store.extend(idx, targets, fresh)
    assert all_idx.shape == (6, 6) and torch.equal(start[:4], fresh)
    for row in range(4, 6):
        slot = next(s for s in range(4) if torch.equal(store.tensors["tokens"][s, :6], all_idx[row]))
        assert torch.equal(all_targets[row], store.tensors["targets"][slot, :6])
        assert torch.equal(start[row], store.tensors["logits"][slot, :6])
    assert store.extend(idx[:, :5], targets[:, :5], fresh[:, :5])[0].shape == (4, 5)  # other length

    # the next batch is extended by replayed rows and wraps the ring (slots 4, 0, 1, 2)
    out = model(idx.flip(0), targets.flip(0))
    assert out.logits.shape == (4, 6, 11) and torch.isfinite(out.loss)
    assert store.next == 3 and torch.equal(store.tensors["tokens"][4, :6], idx[3])
    # outside the module state (DeepSpeed's buffers, exports); its own state round trip carries it
    assert not any("replay" in name for name in model.state_dict())
    restored = tiny(replay_buffer_size=5, replay_fraction=0.5)
    restored.replay_store.load_state_dict(store.state_dict(), torch.device("cpu"))
    assert restored.replay_store.next == 3
    for name, tensor in store.tensors.items():
        assert torch.equal(restored.replay_store.tensors[name], tensor), name
    model.eval()
    before = store.tensors["tokens"].clone()
    model(idx, targets)
    assert torch.equal(store.tensors["tokens"], before)  # eval neither replays nor stores


def test_a_compact_store_keeps_the_top_k_probabilities_and_spreads_the_rest_evenly():
    model = tiny(replay_buffer_size=3, replay_top_k=4).train()
    store = model.replay_store
    idx, targets = data(model)
    final = 3 * candidate(model, idx)
    store.store(idx, targets, final)
    probs, restarted = final.softmax(-1), store.candidates(torch.tensor([0, 1]), 6).softmax(-1)
    # written from the definition: the 4 largest probabilities as they were, the 7 other ids
    # sharing the rest of the mass equally
    top = probs.topk(4, dim=-1)
    expected = ((1 - top.values.sum(-1, keepdim=True)) / 7).expand_as(probs).scatter(-1, top.indices, top.values)
    assert torch.allclose(restarted, expected, atol=1e-15, rtol=1e-12)
    assert (restarted - probs).abs().max() > 1e-3  # the tail is not kept
    assert store.tensors["top_ids"].dtype == torch.int32 and "logits" not in store.tensors


def test_the_store_keeps_rows_several_at_a_time_as_it_would_one_by_one(monkeypatch):
    """Rows are kept in chunks of up to STORE_CHUNK_BYTES of candidate (a few kernels for small
    rows); below one row's bytes, one row at a time (one row's scratch). Either way the same."""
    model = tiny(replay_buffer_size=5, replay_top_k=4).train()
    idx, targets = data(model, batch=4)
    final = 3 * candidate(model, idx)
    stores = []
    for chunk_bytes in (1, 3 * final[0].nbytes, 100 * final[0].nbytes):
        monkeypatch.setattr(replay, "STORE_CHUNK_BYTES", chunk_bytes)
        store = ReplayStore(model.config)
        store.store(idx, targets, final)
        store.store(idx.flip(0), targets.flip(0), final.flip(0))  # wraps the ring: slots 4, 0, 1, 2
        stores.append(store)
    for store in stores:
        assert store.lengths == [6] * 5 and store.next == 3 and store.tensors.keys() == stores[0].tensors.keys()
        assert store.youngest_first() == [2, 1, 0, 4, 3]
        for name, tensor in store.tensors.items():
            assert torch.equal(tensor, stores[0].tensors[name]), name
    for slot, row in ((3, 3), (4, 3), (0, 2), (1, 1), (2, 0)):  # slot 3 kept from the first batch
        assert torch.equal(stores[0].tensors["tokens"][slot, :6], idx[row])
        for name, value in stores[0].kept(final[row]).items():
            assert torch.equal(stores[0].tensors[name][slot, :6], value.to(stores[0].tensors[name].dtype)), name


def test_a_descent_restarts_the_same_from_any_logits_of_one_distribution():
    """Why a compact store may restart rows from log-probabilities instead of the logits: logits
    that differ by a constant per position descend alike (S2: noise, graph, truncation)."""
    model = tiny(**S2_OPTIONS).train()
    idx, targets = data(model)
    logits = 3 * candidate(model, idx)
    results = []
    for start in (logits, logits.log_softmax(-1), logits + torch.randn(2, 6, 1, dtype=torch.float64)):
        torch.manual_seed(5)
        result = model.descent(idx, start, 3, targets=targets, noise_std=3.0, learning=True)
        results.append((result.loss.detach(), result.candidate.softmax(-1)))
    for loss, probs in results[1:]:
        assert torch.allclose(loss, results[0][0], atol=0, rtol=1e-12)
        assert torch.allclose(probs, results[0][1], atol=1e-14, rtol=1e-10)


@pytest.mark.parametrize("top_k", [0, 4])
def test_the_store_is_allocated_on_the_device_of_its_rows_when_first_used(top_k):
    model = tiny(dtype=torch.float32, replay_buffer_size=3, replay_top_k=top_k).train()
    assert model.replay_store.tensors == {}  # nothing allocated by building the model
    idx, targets = data(model)
    model.replay_store.store(idx.to("meta"), targets.to("meta"), torch.zeros(2, 6, 11, device="meta"))
    assert {t.device.type for t in model.replay_store.tensors.values()} == {"meta"}
    model.replay_store.tensors = {}
    model(idx, targets)
    assert sum(t.nbytes for t in model.replay_store.tensors.values()) == replay_store_bytes(model.config)


def test_replay_store_bytes():
    assert replay_store_bytes(resolve("ebt-s2-small", {"replay_buffer_size": 0})) == 0
    small = resolve("ebt-s2-small", {})
    rows, T, V, k = 192, 1024, 50304, small.replay_top_k
    assert (small.replay_buffer_size, small.block_size, small.vocab_size) == (rows, T, V)
    # tokens and targets (int64), lengths, top-k log-probabilities (fp32) with ids (int32), rest
    assert replay_store_bytes(small) == rows * T * (16 + 8 * k + 4) + 8 * rows
    assert replay_store_bytes(small) <= 4e9 < rows * T * V * 4  # the whole fp32 logits: 39.6 GB
    exact = resolve("ebt-s2-small", {"replay_top_k": 0})
    assert replay_store_bytes(exact) == rows * T * (16 + 4 * V) + 8 * rows


def stored_rows(store: ReplayStore) -> list[int]:
    """The rows of a store (each identified by its first token), youngest first."""
    return [int(store.tensors["tokens"][slot, 0]) for slot in store.youngest_first()]


def saved_stores(config: EBTConfig, rows_per_rank: list[int]) -> dict[int, dict]:
    """Saved states of stores whose rows are tokens filled with 100 x rank + i (i-th row stored),
    their candidates random."""
    saved = {}
    g = torch.Generator().manual_seed(0)
    for rank, count in enumerate(rows_per_rank):
        store = ReplayStore(config)
        for i in range(count):
            tokens = torch.full((1, 6), 100 * rank + i)
            store.store(tokens, tokens + 1, torch.randn(1, 6, config.vocab_size, generator=g, dtype=torch.float64))
        saved[rank] = store.state_dict()
    return saved


def test_replay_rows_are_dealt_out_over_a_new_world_size_each_once():
    config = tiny(replay_buffer_size=4, replay_top_k=4).config
    saved = saved_stores(config, [6, 3])  # rank 0's ring wrapped: it holds rows 2..5
    dealt = {}
    for world in (1, 2, 3, 4):
        for rank in range(world):
            store = ReplayStore(config)
            store.deal({r: saved[r] for r in ReplayStore.dealt_from(rank, 2, world)}, 2, rank, world,
                       torch.device("cpu"))
            dealt[world, rank] = store
    # one process keeps the 4 youngest, by age then old rank
    assert stored_rows(dealt[1, 0]) == [5, 102, 4, 101]
    # more processes: every saved row exactly once, an old rank's rows going to the new ranks of its residue
    for world in (2, 3, 4):
        rows = [row for rank in range(world) for row in stored_rows(dealt[world, rank])]
        assert sorted(rows) == [2, 3, 4, 5, 100, 101, 102], world
    assert stored_rows(dealt[4, 0]) == [5, 3] and stored_rows(dealt[4, 2]) == [4, 2]
    assert stored_rows(dealt[4, 1]) == [102, 100] and stored_rows(dealt[4, 3]) == [101]
    assert ReplayStore.dealt_from(0, 2, 4) == [0] and ReplayStore.dealt_from(1, 4, 2) == [1, 3]
    # a dealt row keeps its tokens, targets and kept candidate
    original = ReplayStore.saved(config, saved[0])
    slot = next(s for s in original.youngest_first() if int(original.tensors["tokens"][s, 0]) == 4)
    store = dealt[4, 2]
    new_slot = next(s for s in store.youngest_first() if int(store.tensors["tokens"][s, 0]) == 4)
    assert torch.equal(store.tensors["targets"][new_slot], original.tensors["targets"][slot])
    assert torch.allclose(store.candidates(torch.tensor([new_slot]), 6).softmax(-1),
                          original.candidates(torch.tensor([slot]), 6).softmax(-1), atol=1e-15, rtol=1e-12)


def test_module_state_from_before_the_store_loads_its_replay_buffer_into_it():
    """Checkpoints written before the replay store held it as module buffers (DeepSpeed's model
    states, every rank's buffers): loading them fills the store, converted to its layout."""
    model = tiny(replay_buffer_size=5, replay_top_k=4).train()
    idx, targets = data(model, batch=4)
    logits = candidate(model, idx)
    legacy = {"replay_tokens": torch.zeros(5, 8, dtype=torch.long),
              "replay_targets": torch.zeros(5, 8, dtype=torch.long),
              "replay_candidates": torch.zeros(5, 8, 11, dtype=torch.float64),
              "replay_lengths": torch.tensor([6, 6, 6, 6, 0]), "replay_next": torch.tensor(4)}
    legacy["replay_tokens"][:4, :6], legacy["replay_targets"][:4, :6] = idx, targets
    legacy["replay_candidates"][:4, :6] = logits
    model.load_state_dict({**model.state_dict(), **legacy})  # strict: no unexpected keys
    reference = ReplayStore(model.config)
    reference.store(idx, targets, logits)
    assert model.replay_store.next == 4 and model.replay_store.tensors.keys() == reference.tensors.keys()
    for name, tensor in reference.tensors.items():
        assert torch.allclose(model.replay_store.tensors[name].double(), tensor.double(), atol=1e-14, rtol=0), name
    tiny().load_state_dict({**tiny().state_dict(), **legacy})  # a model without a replay buffer drops them
    for loaded in (tiny(replay_buffer_size=5, replay_top_k=4), tiny()):  # loaded for use: dropped
        load_weights(loaded, {**model.state_dict(), **legacy}, Path("old-checkpoint"))
        assert all(torch.equal(t, model.state_dict()[name]) for name, t in loaded.state_dict().items())


# --- observed-stream reuse, step conditioning, checkpointing -----------------------------

def training_run(model, idx, targets):
    model.zero_grad()
    torch.manual_seed(11)
    out = model(idx, targets)
    out.loss.backward()
    return out.loss.detach(), param_grads(model)


@pytest.mark.parametrize("overrides", [{}, {**S2_OPTIONS, "replay_buffer_size": 4}])
def test_observed_stream_reuse_equals_recompute(overrides):
    idx, targets = data(tiny())
    reuse_loss, reuse_grads = training_run(tiny(**overrides).train(), idx, targets)
    loss, grads = training_run(tiny(reuse_observed_stream=False, **overrides).train(), idx, targets)
    assert torch.allclose(reuse_loss, loss, atol=1e-12, rtol=0)
    assert_same_grads(reuse_grads, grads)
    think = [tiny(reuse_observed_stream=r, **overrides).think(idx, steps=4) for r in (True, False)]
    assert torch.allclose(think[0].energies, think[1].energies, atol=1e-12, rtol=0)


def test_step_conditioning_gives_each_step_its_own_energy_landscape():
    model = tiny(n_steps=3, **STEP_CONDITIONED).train()
    idx, targets = data(model)
    loss, grads = training_run(model, idx, targets)
    assert torch.isfinite(loss)
    assert (grads["descent.time_embeddings.weight"].abs().sum(-1) > 0).all()  # every step's row
    d = model.descent
    probs = candidate(model, idx).softmax(-1)
    energies = [d.energy(probs @ d.candidate_table(), d.observe(idx, step), 0) for step in (0, 1, 2, 5)]
    assert (energies[0] - energies[1]).abs().max() > 1e-6
    assert torch.equal(energies[2], energies[3])  # steps beyond n_steps reuse the last embedding


@pytest.mark.parametrize("overrides", [{}, {**S2_OPTIONS, **STEP_CONDITIONED, "step_embeddings": "shared"}])
@pytest.mark.parametrize("mode", ["step", "block"])
def test_activation_checkpointing_changes_nothing_but_memory(overrides, mode):
    idx, targets = data(tiny())
    loss, grads = training_run(tiny(**overrides).train(), idx, targets)
    loss_ckpt, grads_ckpt = training_run(tiny(activation_checkpointing=mode, **overrides).train(), idx, targets)
    assert torch.allclose(loss_ckpt, loss, atol=1e-12, rtol=0)
    assert_same_grads(grads, grads_ckpt)


# --- the first-order energy gradient against autograd's double backward --------------------

GRADIENT_CASES = {
    "S1": {},
    "S1, step conditioning": STEP_CONDITIONED,
    "S2, shared draws and replay": {**S2_OPTIONS, "time_embed": True, "step_embeddings": "shared",
                                    "replay_buffer_size": 4},
    "logits, expected embedding": dict(grad_wrt="logits", expected_embedding=True, n_steps=3),
}


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str):
    assert torch.allclose(got, expected, atol=1e-10, rtol=0), what


@pytest.mark.parametrize("case", GRADIENT_CASES)
@pytest.mark.parametrize("checkpointing", ["off", "block", "step"])
def test_the_first_order_energy_gradient_trains_as_autograds_double_backward(case, checkpointing):
    """Two training forwards and backwards (odd T; S2 draws its step count from the shared draws
    and replays rows in the second): the loss, the final candidates, every step's energies and
    losses (the descent's trajectory) and every parameter's gradient equal those of the
    autograd.grad(create_graph) path to 1e-10 in float64."""
    runs = {}
    for path in ("autograd", "first_order"):
        model = tiny(energy_gradient=path, activation_checkpointing=checkpointing, **GRADIENT_CASES[case]).train()
        idx, targets = data(model, seq_len=5)
        runs[path] = []
        for call in range(2):
            model.zero_grad()
            torch.manual_seed(11 + call)
            out = model(idx, targets, return_energies=True)
            out.loss.backward()
            runs[path].append((out, param_grads(model)))
    for (reference, reference_grads), (out, grads) in zip(runs["autograd"], runs["first_order"]):
        assert_same(out.loss, reference.loss, "loss")
        assert_same(out.logits, reference.logits, "final candidates")
        for name in ("_token_energy", "loss_per_step"):
            assert out.diagnostics[name].shape == reference.diagnostics[name].shape, name
            assert_same(out.diagnostics[name], reference.diagnostics[name], name)
        assert_same_grads(grads, reference_grads)


@pytest.mark.parametrize("case", ["S1", "S1, step conditioning"])
def test_the_first_order_energy_and_gradient_equal_autograds_for_the_last_rows(case):
    """The energies and dE/d(embedded) of the last 3 rows of 7 (generation's case: the rows sit
    after observed tokens they do not predict), with observed keys and values that require grad:
    their gradients through the energy gradient agree too."""
    results = []
    for path in ("autograd", "first_order"):
        model = tiny(energy_gradient=path, **GRADIENT_CASES[case])
        idx, _ = data(model, seq_len=7)
        d = model.descent
        embedded = (candidate(model, idx, rows=3).softmax(-1) @ d.candidate_table()).detach().requires_grad_()
        weights = candidate(model, idx, seed=5, rows=3)[..., :model.config.n_embd]
        observed = d.observe(idx, 1)
        energy, grad = d.energy_gradient(embedded, observed, 4, second_order=True)
        wrt = [embedded, *(t for kv in observed for t in kv)]
        results.append([energy, grad, *torch.autograd.grad((grad * weights).sum(), wrt)])
    for got, expected in zip(*results):
        assert_same(got, expected, "energy, gradient or second derivative")


@pytest.mark.parametrize("case", GRADIENT_CASES)
def test_thinking_and_decoding_take_the_first_order_gradient_as_autograds(case):
    idx, targets = data(tiny(), seq_len=5)
    results = []
    for path in ("autograd", "first_order"):
        model = tiny(energy_gradient=path, **GRADIENT_CASES[case]).eval()
        think = model.think(idx, steps=4, best_of=2, targets=targets)
        stopped = model.think(idx, steps=6, targets=targets, stop_tolerance=1e-2)
        results.append([think.logits, think.energies, think.loss_per_step, stopped.logits,
                        stopped.steps_taken.double(), model.next_token_logits(idx, best_of=2)])
    for got, expected in zip(*results):
        assert_same(got, expected, "thinking")


# --- inference -----------------------------------------------------------------------------

def test_eval_works_under_no_grad_and_builds_no_parameter_graph():
    model = tiny().eval()
    idx, targets = data(model)
    with torch.no_grad():
        out = model(idx, targets)
    assert not out.loss.requires_grad and not out.logits.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model(idx, targets).logits, out.logits)  # seeded: reproducible
    assert torch.allclose(out.loss, out.diagnostics["loss_last_step"])


def test_think_best_of_keeps_the_lowest_final_energy_and_generation_uses_the_last_row():
    model = tiny(n_steps=2)
    idx, targets = data(model)
    single = model.think(idx, steps=3, targets=targets)
    best = model.think(idx, steps=3, best_of=3, targets=targets)
    assert single.energies.shape == (4, 2, 6) and single.loss_per_step.shape == (3,)
    # per position, the chosen sample is the one of the 3 with the lowest final energy
    start = model.initial_candidate(6, 6, idx.device, seeded=True)
    samples = model.descent(idx.repeat(3, 1), start, 3, final_energy=True)
    finals = samples.energies[-1].view(3, 2, 6)
    assert torch.allclose(best.energies[-1], finals.min(0).values, atol=1e-12)
    chosen = samples.candidate.view(3, 2, 6, -1).gather(0, finals.argmin(0)[None, ..., None].expand(1, 2, 6, 11))[0]
    assert torch.allclose(best.logits, F.log_softmax(chosen, -1), atol=1e-12)
    alone = model.descent(idx, model.initial_candidate(2, 6, idx.device, seeded=True), 3, final_energy=True)
    assert torch.allclose(single.energies, alone.energies, atol=1e-12)
    # the last row alone gives the same prediction as the whole sequence's last row
    whole = model.descent(idx, start[:2], 2).candidate
    assert torch.allclose(model.descent(idx, start[:2, -1:], 2).candidate[:, 0], whole[:, -1], atol=1e-12)
    # decoding starts every row from the first sample's noise: a row predicts as it would alone
    alone = torch.cat([model.think(idx[b:b + 1], last_only=True).logits[:, -1] for b in range(2)])
    assert torch.allclose(model.next_token_logits(idx), alone, atol=1e-12)
    assert model.generate(idx[:, :3], max_new_tokens=4).shape == (2, 7)


def train_tiny_s2_ebt(seed: int, corpus: torch.Tensor) -> tuple[EBT, list[float]]:
    """A tiny EBT trained for 120 steps of 8 x 16 characters with the S2 options (randomised 2..4
    steps and step sizes, graph kept through the steps, last-step loss) without step
    conditioning, so all steps share one energy landscape; returns it and its losses."""
    torch.manual_seed(seed)
    model = build(EBTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32,
                            n_steps=4, min_steps=2, alpha=500.0, alpha_learnable=False,
                            alpha_randomize=2.0, detach_between_steps=False, truncate_loss=True,
                            grad_wrt="logits"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(120):
        starts = torch.randint(0, len(corpus) - 17, (8,))
        loss = model(torch.stack([corpus[s:s + 16] for s in starts]),
                     torch.stack([corpus[s + 1:s + 17] for s in starts])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.eval(), losses


def test_more_thinking_steps_lower_the_energy_of_a_trained_tiny_ebt():
    """Train a tiny EBT for a few seconds on a repetitive character corpus, then think with
    1..4 steps: the mean energy must fall at every step, and the loss with it (System 2).
    The candidate follows the energy's gradient w.r.t. its logits (the paper's pseudocode),
    i.e. gradient descent on E(softmax(y)), which is what makes "more steps, lower energy" a
    claim. Training at alpha 500 and lr 1e-2 is chaotic: a rounding difference between CPU
    kernels (another host, another summation order) can turn one seed's run from learning to
    stalling, so the claim is checked on the first of three seeds whose loss fell by 15%, and
    one of them must."""
    text = "the quick brown fox jumps over the lazy dog. " * 40
    vocab = sorted(set(text))
    corpus = torch.tensor([vocab.index(c) for c in text])
    for seed in range(3):
        model, losses = train_tiny_s2_ebt(seed, corpus)
        if sum(losses[-10:]) / 10 < 0.85 * sum(losses[:10]) / 10:  # it did train
            break
    else:
        pytest.fail("none of 3 seeds trained the tiny EBT (loss down by 15% over 120 steps)")
    idx = torch.stack([corpus[s:s + 16] for s in range(0, 400, 25)])
    targets = torch.stack([corpus[s + 1:s + 17] for s in range(0, 400, 25)])
    thought = model.think(idx, steps=4, targets=targets)
    energy = thought.energies.mean(dim=(1, 2))
    assert (energy.diff() < 0).all()
    assert (thought.loss_per_step.diff() < 0).all()


# --- sizes, FLOPs, configuration ----------------------------------------------------------

@pytest.mark.parametrize("flavor", ["ebt-s1-small", "ebt-s2-small"])
def test_paper_scale_parameter_counts(flavor):
    """12L/768/12h with two V x D tables at V=50304: about 126M (paper); the blocks alone
    are 12 x 7 D^2 (SwiGLU hidden = D)."""
    with torch.device("meta"):
        model = build(resolve(flavor))
    assert abs(model.num_params() / 126e6 - 1) < 0.01
    assert abs(model.num_params(non_embedding=True) / (12 * 7 * 768 ** 2) - 1) < 0.001


def test_flops_per_token_counts_what_each_option_computes():
    with torch.device("meta"):
        s1 = build(resolve("ebt-s1-small"))
        reuse = build(resolve("ebt-s1-small", dict(time_embed=False, reuse_observed_stream=True)))
        baseline = build(resolve("transformer_pp-small"))
    ratio_reuse = reuse.flops_per_token(1024) / baseline.flops_per_token(1024)
    ratio_recompute = s1.flops_per_token(1024) / baseline.flops_per_token(1024)
    assert 4.4 < ratio_reuse < 5.0 < ratio_recompute < 6.0  # paper: 6.66x (full 2T forward per step)
    # inference: the observed stream once and 2 P per step, a third of training (12 P + 3 O)
    assert reuse.flops_per_token(1024, training=False) == pytest.approx(reuse.flops_per_token(1024) / 3)


@pytest.mark.parametrize("field, value", [("grad_wrt", "energy"), ("min_steps", 3), ("alpha_randomize", 0.5),
                                          ("reuse_observed_stream", True), ("activation_checkpointing", "layer"),
                                          ("attention_chunks", 0), ("energy_gradient", "second_order"),
                                          ("dropout", 0.1)])
def test_invalid_options_are_rejected_naming_the_field(field, value):
    fields = dict(n_steps=2, time_embed=True, reuse_observed_stream=False, energy_gradient="first_order")
    fields[field] = value
    with pytest.raises(ValueError, match=field):
        EBTConfig(**fields)


def test_optimizer_hints_and_zero3_leaf():
    s1, s2 = tiny(), tiny(**S2_OPTIONS)
    assert s1.lr_multipliers() == {"descent.alpha": 1500.0}
    assert "descent.alpha" in dict(s1.named_parameters()) and "descent.alpha" in s1.no_weight_decay_names()
    assert s2.lr_multipliers() == {} and "descent.alpha" in dict(s2.named_buffers())
    assert s1.zero3_leaf_modules() == [EnergyDescent]
    assert all(name.startswith("descent.") for name, _ in s1.named_parameters())


def test_zero3_gives_the_zero2_losses_through_the_second_order_descent(tmp_path):
    """Two processes, DeepSpeed ZeRO-2 then ZeRO-3 (the descent a leaf module): the same
    per-step losses for S1 with step-checkpointed descent and for S2 (keep graph, truncation,
    replay buffer, Langevin noise, random step counts). Each rank has its own global RNG (data,
    candidate noise), yet both draw S2's step counts alike: no rank waits for another's
    longer descent at the gradient reduction."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "losses.json"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={port}",
                          str(repo / "tests" / "ebt_zero_worker.py"), str(out)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    for recipe in ("s1-step-checkpointed", "s1-first-order-step-checkpointed", "s2"):
        zero2, zero3 = results[f"{recipe}/zero2"]["losses"], results[f"{recipe}/zero3"]["losses"]
        assert len(zero2) == 3 and len(set(zero2)) == 3  # the updates change the model
        assert zero3 == pytest.approx(zero2, rel=1e-5), recipe
    for stage in (2, 3):
        rank0, rank1 = results[f"s2/zero{stage}"]["steps"]
        assert rank0 == rank1 and set(rank0) == {2, 3}, (stage, rank0, rank1)


def test_a_training_forward_normalises_candidates_only_for_its_loss():
    """A training step uses only the forward's loss: its logits are the final candidate as it is
    (the same distribution), not a log_softmax over [B, T, V] more (1.5 GiB at ebt-s1-small's
    micro-batch of 8) that nothing reads. Every log_softmax a training forward runs feeds one of
    its cross entropies, one per descent step; outside training the logits are normalised."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    model = tiny().train()
    idx, targets = data(model)
    with Ops() as ops:
        out = model(idx, targets)
    log_softmaxes = ops.names.count("aten::_log_softmax")
    assert log_softmaxes == ops.names.count("aten::nll_loss_forward") == model.config.n_steps
    assert out.logits.shape == (2, 6, 11) and not out.logits.requires_grad
    model.eval()
    assert torch.allclose(model(idx, targets).logits.exp().sum(-1), torch.ones(2, 6, dtype=torch.float64))


def test_replay_scratch_bytes_is_what_storing_rows_allocates():
    """What the memory plan adds as a training forward ends (`replay_scratch_bytes`): the peak
    the CPU allocator sees while a filled store keeps a batch's final candidates, a chunk of
    rows at a time, beside the store itself: rows of 0.5 MiB (all 8 in one chunk) and of 32 MiB
    (one by one)."""
    from bench.memory import peak_allocated_bytes
    from pretrain.models.replay import replay_scratch_bytes

    for vocab_size, block_size in ((2048, 64), (8192, 1024)):
        config = EBTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=8,
                           replay_buffer_size=8, replay_top_k=256)
        store = ReplayStore(config)
        idx = torch.randint(0, config.vocab_size, (8, config.block_size))
        final = torch.randn(8, config.block_size, config.vocab_size)
        store.store(idx, idx, final)  # allocates the store
        peak = peak_allocated_bytes(lambda: store.store(idx, idx, final))
        assert peak == pytest.approx(replay_scratch_bytes(config), rel=0.1), (vocab_size, block_size)
