"""The two families with an exact native Hugging Face counterpart: `gpt` is GPT2LMHeadModel
and `transformer_pp` is LlamaForCausalLM. Here: which configs map exactly, the Hugging Face
config they map to, and the weight names between the two, in both directions.

The rotary layout needs no permutation: `llama.rotary_tables` pairs channel j with channel
j + head_dim / 2 (the half-split layout), which is Hugging Face's `rotate_half`; only
checkpoints in the interleaved (2j, 2j + 1) layout of the original Llama release need their
q/k rows permuted, and none of ours is one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pretrain.models import family_spec


@dataclass(frozen=True)
class WeightName:
    ours: str
    """Key in our model's state_dict."""
    theirs: str
    """Key in the Hugging Face model's state_dict."""
    transposed: bool = False
    """GPT-2's Conv1D stores linear weights as [in, out], ours (nn.Linear) as [out, in]."""


ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
"""The Hugging Face model_types that families export to natively (`FamilySpec.hf_model_type`), and their classes."""


def hf_model_type(model_config: Any) -> str | None:
    """The Hugging Face model_type the config's family exports to natively, None if none."""
    return family_spec(model_config).hf_model_type


def not_native_reason(model_config: Any) -> str | None:
    """Why this config has no exact native counterpart (then the export carries our own
    modeling code), or None when it has one. Exact means the same function in training too:
    HF's GPT-2 always has biases, its Llama no dropout on the residual branches."""
    model_type = hf_model_type(model_config)
    if model_type is None:
        return f"Hugging Face has no {family_spec(model_config).name} architecture"
    if model_type == "gpt2":
        if not model_config.bias:
            return "bias=false: GPT2LMHeadModel always has biases"
        if model_config.head_bias:
            return "head_bias=true: GPT2LMHeadModel's LM head has no bias"
    elif model_config.dropout:
        return "dropout > 0 on the residual branches, which LlamaForCausalLM does not have"
    return None


def hf_config(model_config: Any) -> dict[str, Any]:
    """The Hugging Face config (as keyword arguments) of the native counterpart."""
    c = model_config
    if hf_model_type(c) == "gpt2":
        return dict(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                    n_head=c.n_head, n_inner=4 * c.n_embd,
                    # nn.GELU() is the exact (erf) GELU: HF's "gelu", not GPT-2's default "gelu_new"
                    activation_function=c.mlp_act, resid_pdrop=c.dropout, embd_pdrop=c.dropout,
                    attn_pdrop=c.dropout, layer_norm_epsilon=1e-5, initializer_range=c.init_std,
                    tie_word_embeddings=c.tie_embeddings, scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
    return dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden,
                num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
                head_dim=c.head_dim, max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
                rope_theta=c.rope_theta, rope_scaling=None, hidden_act="silu", attention_bias=False,
                mlp_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
                initializer_range=c.init_std)


FUNCTION_KEYS = {
    "gpt2": ("n_head", "layer_norm_epsilon", "activation_function", "scale_attn_weights",
             "scale_attn_by_inverse_layer_idx"),
    "llama": ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
              "rope_scaling", "hidden_act"),
}
"""Config keys that change the function without changing any weight's shape."""
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""GELU approximations (GPT-2's own is gelu_new) of the exact GELU our gpt uses."""


def config_mismatches(source: dict[str, Any], model_config: Any) -> tuple[list[str], list[str]]:
    """(errors, notes) comparing a native Hugging Face config (as loaded by transformers, with
    its defaults filled in) to the one our model would export to."""
    model_type, wanted = source["model_type"], hf_config(model_config)
    errors, notes = [], []
    for key in FUNCTION_KEYS[model_type]:
        have, want = source.get(key), wanted[key]
        if key == "head_dim" and have is None:
            continue
        if have == want:
            continue
        if key == "activation_function" and want == "gelu" and have in TANH_GELUS:
            notes.append(f"{key}={have} (tanh approximation) is loaded into the exact GELU of our gpt")
            continue
        errors.append(f"config.json {key}={have!r}, the run's model needs {want!r}")
    return errors, notes


def weight_names(model_config: Any) -> list[WeightName]:
    """Every weight of our model (a tied LM head once, as the embedding) and its HF name."""
    c = model_config
    if hf_model_type(c) == "gpt2":
        names = [WeightName("wte.weight", "transformer.wte.weight"), WeightName("wpe.weight", "transformer.wpe.weight")]
        params = ("weight", "bias") if c.bias else ("weight",)
        for i in range(c.n_layer):
            ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
            for norm in ("ln_1", "ln_2"):
                names += [WeightName(ours + f"{norm}.{p}", theirs + f"{norm}.{p}") for p in params]
            for linear in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                names += [WeightName(ours + f"{linear}.{p}", theirs + f"{linear}.{p}", p == "weight") for p in params]
        names += [WeightName(f"ln_f.{p}", f"transformer.ln_f.{p}") for p in params]
        if not c.tie_embeddings:
            names.append(WeightName("lm_head.weight", "lm_head.weight"))
        if c.head_bias:
            names.append(WeightName("lm_head.bias", "lm_head.bias"))
        return names
    names = [WeightName("tok_embeddings.weight", "model.embed_tokens.weight")]
    layer = {"attention_norm": "input_layernorm", "attention.wq": "self_attn.q_proj",
             "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
             "attention.wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj"}
    for i in range(c.n_layer):
        names += [WeightName(f"layers.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight")
                  for ours, theirs in layer.items()]
    return names + [WeightName("norm.weight", "model.norm.weight"), WeightName("output.weight", "lm_head.weight")]


def to_hf(state: dict[str, torch.Tensor], model_config: Any) -> dict[str, torch.Tensor]:
    """Our state_dict as the native model's (every weight; HF ties GPT-2's head itself)."""
    return {n.theirs: (state[n.ours].t() if n.transposed else state[n.ours]).contiguous()
            for n in weight_names(model_config)}


IGNORED_HF_TENSORS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers older checkpoints saved (GPT-2's causal mask, Llama's rotary frequencies): no weights."""


def from_hf(tensors: dict[str, torch.Tensor], source: dict[str, Any],
            model_config: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A native checkpoint's tensors as our state_dict keys, and our key -> its name there (for
    messages). Tensors with no counterpart in our model are kept under their own name, so that
    the loader reports them."""
    tensors = {name: t for name, t in tensors.items() if not name.endswith(IGNORED_HF_TENSORS)}
    if source["model_type"] == "gpt2" and not any(name.startswith("transformer.") for name in tensors):
        # checkpoints saved from GPT2Model (as the original release) lack the prefix
        tensors = {(name if name.startswith("lm_head.") else "transformer." + name): t for name, t in tensors.items()}
    names = weight_names(model_config)
    theirs_to_ours = {n.theirs: n for n in names}
    if source.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
        # a tied source stores the LM head only as the input embedding
        embedding = names[0].theirs
        if embedding in tensors:
            tensors["lm_head.weight"] = tensors[embedding]
    ours, origin = {}, {}
    for name, t in tensors.items():
        n = theirs_to_ours.get(name)
        if n is None:
            if name == "lm_head.weight" and torch.equal(t, tensors.get(names[0].theirs, t.new_empty(0))):
                continue  # the tied head saved once more
            ours[name], origin[name] = t, name
            continue
        ours[n.ours], origin[n.ours] = (t.t() if n.transposed else t), name
    return ours, origin
