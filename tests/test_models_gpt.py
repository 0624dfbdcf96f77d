"""GPT and GPT_Rec: equality with an independent GPT-2 implementation, the parallel recurrent
block's formula, the FLOP convention, config validation and stored reference values."""
import math

import pytest
import torch
import torch.nn.functional as F

from numerics import assert_rounding_close
from pretrain.models import build, resolve
from pretrain.models.gpt import GPTConfig


def tiny(flavor, **overrides):
    torch.manual_seed(0)
    return build(resolve(flavor, overrides)).double().eval()


def test_gpt_matches_huggingface_gpt2():
    transformers = pytest.importorskip("transformers")
    model = tiny("gpt-tiny", vocab_size=64, block_size=16)
    cfg = model.config
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double().eval()
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            mine = ours[name.removeprefix("transformer.").replace("h.", "blocks.", 1)]
            # HF GPT-2 stores its block linears as Conv1D, i.e. transposed.
            conv1d = p.ndim == 2 and (".attn." in name or ".mlp." in name)
            p.copy_(mine.t() if conv1d else mine)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    expected = hf(idx).logits
    assert torch.allclose(model(idx).logits, expected, atol=1e-10, rtol=0)


def test_gpt_rec_is_one_parallel_block_applied_n_steps_times():
    model = tiny("gpt_rec-tiny", n_steps=3)
    blk, cfg = model.block, model.config
    idx = torch.randint(0, cfg.vocab_size, (2, 10))
    T, H, D = idx.size(1), cfg.n_head, cfg.n_embd

    def attention(h):  # written out independently of the model's SDPA path
        q, k, v = blk.attn.c_attn(h).split(D, dim=2)
        q, k, v = (t.view(2, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, T, D)
        return blk.attn.c_proj(y)

    def mlp(h):
        return blk.mlp.c_proj(F.relu(blk.mlp.c_fc(h)))

    x = model.wte(idx) + model.wpe(torch.arange(T))
    for _ in range(cfg.n_steps):
        x = x + attention(blk.ln_1(x)) + mlp(blk.ln_2(x))
    expected = model.lm_head(model.ln_f(x))
    assert torch.allclose(model(idx).logits, expected, atol=1e-12, rtol=0)
    # shared weights: more steps, same parameters
    assert tiny("gpt_rec-tiny", n_steps=7).num_params() == model.num_params()


def test_gpt_flops_follow_palm_convention():
    with torch.device("meta"):
        model = build(resolve("gpt-124m"))
    cfg = model.config
    n_nonembed = model.num_params(non_embedding=True)
    palm = 6 * n_nonembed + 12 * cfg.n_layer * cfg.n_embd * 1024 + 6 * cfg.n_embd * cfg.vocab_size
    # The analytic count ignores biases and norms: within 0.1% of PaLM's 6N.
    assert abs(model.flops_per_token(1024) / palm - 1) < 1e-3
    assert model.flops_per_token(1024, training=False) == pytest.approx(model.flops_per_token(1024) / 3)


@pytest.mark.parametrize("bad, message", [
    ({"mlp_act": "tanh"}, "mlp_act"), ({"n_head": 5}, "n_head"), ({"dropout": 1.0}, "dropout"),
    ({"activation_checkpointing": "layer"}, "activation_checkpointing"), ({"n_layer": 0}, "n_layer"),
    ({"head_bias": True}, "head_bias"),
])
def test_config_rejects_invalid_values(bad, message):
    with pytest.raises(ValueError, match=message):
        resolve("gpt-tiny", bad)
    with pytest.raises(ValueError, match="mlp_act"):
        GPTConfig(mlp_act="swish")


def test_sequence_longer_than_block_size_is_an_error():
    model = tiny("gpt-tiny")
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


# Computed once from these seeded tiny models (float64); guards against silent changes in
# initialisation or forward math, in the spirit of llm.c's reference-logit test.
REFERENCE = {
    "gpt-tiny": (4.15921770062357, [-0.016477226142435734, -0.017913654377885117,
                                    0.03140625564684023, 0.17790679375168722]),
    "gpt_rec-tiny": (4.159286297511976, [0.07498348099217454, 0.05674554563153761,
                                         -0.00891520354852726, -0.1680053570847062]),
}


@pytest.mark.parametrize("flavor", sorted(REFERENCE))
def test_reference_values(flavor):
    model = tiny(flavor, vocab_size=64, block_size=16)
    torch.manual_seed(1)
    idx = torch.randint(0, 64, (2, 16))
    out = model(idx[:, :-1], idx[:, 1:])
    loss, logits = REFERENCE[flavor]
    # the weights are drawn in float32, whose normal_ rounds differently by host (AVX-512, AVX2
    # or generic kernels): the float64 forward carries that rounding
    assert_rounding_close(out.loss.detach(), torch.tensor(loss, dtype=torch.float64), rounded_in=torch.float32)
    assert_rounding_close(out.logits[0, -1, :4].detach(), torch.tensor(logits, dtype=torch.float64),
                          rounded_in=torch.float32)
