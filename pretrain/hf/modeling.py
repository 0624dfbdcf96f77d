"""Hugging Face classes around one of this project's models, for the families Hugging Face has no
architecture for (gpt_rec, nrgpt, ebt). `pretrain.export --format hf` writes this file into the
export directory next to the model's own source files (imports made relative), and a small
generated module subclasses the two classes for the family; the export then loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and needs only torch and
transformers.

`generate()` decodes incrementally with the model's own `DecodeCache` (passed between steps as
`past_key_values`; beam search reorders its rows), the way `pretrain.sample` does: each new token
runs alone against the cached keys and values, and past the context length every token
recomputes the last block_size tokens. `use_cache=False` recomputes the (cropped) context for
every token instead. EBT predicts each token by thinking with its configured number of descent
steps (`EBT.next_token_logits`)."""
from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from pretrain.models.common import DecodeCache, window
from pretrain.models.registry import build

IGNORE_INDEX = -100
"""Hugging Face's label for positions without a loss (ours is -1)."""


class ExportedConfig(PretrainedConfig):
    """The family's own config fields (`model_config`) and the flavor they came from."""

    model_type = "pretrain"

    def __init__(self, family: str = "", flavor: str = "", model_config: dict[str, Any] | None = None,
                 **kwargs):
        self.family = family
        self.flavor = flavor
        self.model_config = dict(model_config or {})
        if "vocab_size" in self.model_config:
            self.vocab_size = self.model_config["vocab_size"]
        kwargs.setdefault("tie_word_embeddings", False)  # the model ties its own weights, if at all
        super().__init__(**kwargs)


class ExportedForCausalLM(PreTrainedModel, GenerationMixin):
    """Our model as `self.model`: its state_dict keys are ours with the prefix "model."."""

    config_class = ExportedConfig
    base_model_prefix = "model"
    family_config_class: type = None
    """The family's config dataclass (set by the generated subclass)."""

    def __init__(self, config: ExportedConfig):
        super().__init__(config)
        self.model = build(self.family_config_class(**config.model_config))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: the family's constructor initialises its weights, and loading replaces them."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own cache: see prepare_inputs_for_generation

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: DecodeCache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool = True,
                                      **kwargs) -> dict[str, Any]:
        """The tokens the cache has not seen, or (first step, past the context length) the last
        block_size tokens into a fresh cache; without a cache, the whole context."""
        inputs = {"attention_mask": attention_mask, "logits_to_keep": 1}
        if not use_cache:
            return {**inputs, "input_ids": input_ids}
        cache, new = window(past_key_values, input_ids, self.model.config.block_size)
        return {**inputs, "input_ids": new, "past_key_values": cache}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, logits_to_keep: int = 0,
                past_key_values: DecodeCache | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, V] (the last `logits_to_keep` positions if > 0) and, given labels (the
        input ids, shifted inside as Hugging Face does), the model's own loss: its training
        objective in train mode, the next-token cross entropy in eval mode. With a cache
        (generation), input_ids are the tokens after the cached ones and the logits [B, 1, V]
        are those of the next token."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padded batches are not supported: the model attends to every position "
                             "(generate prompts of equal length, or one at a time)")
        if past_key_values is not None:
            if not isinstance(past_key_values, DecodeCache) or labels is not None:
                raise ValueError(f"past_key_values must be the {DecodeCache.__name__} that generation passes "
                                 f"between steps, without labels; got {type(past_key_values).__name__}")
            logits = self.model.next_token_logits(input_ids, past_key_values)[:, None, :]
            return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
        if labels is None and logits_to_keep == 1:
            # generation without a cache: the next token only, from the last block_size tokens
            context = input_ids[:, -self.model.config.block_size:]
            return CausalLMOutputWithPast(logits=self.model.next_token_logits(context)[:, None, :])
        targets = None
        if labels is not None:
            targets = torch.full_like(labels, -1)
            targets[:, :-1] = labels[:, 1:].masked_fill(labels[:, 1:] == IGNORE_INDEX, -1)
        out = self.model(input_ids, targets)
        logits = out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits
        return CausalLMOutputWithPast(loss=out.loss, logits=logits)
