"""Hugging Face classes around one of this project's models, for the families Hugging Face has no
architecture for (gpt_rec, nrgpt, ebt). `pretrain.export --format hf` writes this file into the
export directory next to the model's own source files (imports made relative), and a small
generated module subclasses the two classes for the family; the export then loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and needs only torch and
transformers.

`generate()` recomputes the whole (cropped) context for every new token; EBT predicts each
token by thinking with its configured number of descent steps (`EBT.next_token_logits`)."""
from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

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
        return False  # no key/value cache: see prepare_inputs_for_generation

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs) -> dict[str, Any]:
        # every step sees the whole context: nothing is cached between steps
        return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": 1}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutput:
        """Logits [B, T, V] (the last `logits_to_keep` positions if > 0) and, given labels (the
        input ids, shifted inside as Hugging Face does), the model's own loss: its training
        objective in train mode, the next-token cross entropy in eval mode."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padded batches are not supported: the model attends to every position "
                             "(generate prompts of equal length, or one at a time)")
        if labels is None and logits_to_keep == 1:
            # generation: the next token only, from the last block_size tokens
            context = input_ids[:, -self.model.config.block_size:]
            return CausalLMOutput(logits=self.model.next_token_logits(context)[:, None, :])
        targets = None
        if labels is not None:
            targets = torch.full_like(labels, -1)
            targets[:, :-1] = labels[:, 1:].masked_fill(labels[:, 1:] == IGNORE_INDEX, -1)
        out = self.model(input_ids, targets)
        logits = out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits
        return CausalLMOutput(loss=out.loss, logits=logits)
