"""Model families (GPT, recurrent GPT, NRGPT, EBT, Transformer++) behind one registry.

Importing this package imports every family module, which registers its flavors."""
from pretrain.models.common import LanguageModel, ModelOutput, StepCount
from pretrain.models.registry import (FAMILIES, FLAVORS, FamilySpec, build, family_name, family_spec, model_class,
                                      padded_vocab, resolve)
from pretrain.models import gpt, nrgpt  # noqa: F401  (registers flavors)
from pretrain.models import ebt, llama  # noqa: F401  (registers flavors)

__all__ = ["FAMILIES", "FLAVORS", "FamilySpec", "LanguageModel", "ModelOutput", "StepCount", "build", "family_name",
           "family_spec", "model_class", "padded_vocab", "resolve"]
