"""A sixth model family, defined entirely in this module, goes through every public command: it
registers its spec (`FamilySpec`) and a flavor, then trains (resuming exactly), evaluates during
training, samples, plans and exports, with nothing outside `pretrain/models/` knowing it. The
commands run in this process (`trainer_runs.command_here`), where the registration is seen; the
registry is restored after the module's tests."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainer_runs as runs
from pretrain.models import FAMILIES, FLAVORS, FamilySpec, LanguageModel, ModelOutput
from pretrain.models.blocks import LMConfig
from pretrain.models.common import DecodeCache

FLAVOR = "bigram-tiny"


@dataclass
class BigramConfig(LMConfig):
    """A bigram language model: the next token's logits from the current token alone."""


class Bigram(LanguageModel):
    """Token embedding -> LayerNorm -> the embedding again as the LM head."""

    def __init__(self, config: BigramConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.ln = nn.LayerNorm(config.n_embd)
        nn.init.normal_(self.wte.weight, std=config.init_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, return_energies: bool = False,
                cache: DecodeCache | None = None) -> ModelOutput:
        """The `LanguageModel` forward; a bigram has no energies to return."""
        if cache is not None:  # nothing to keep but the tokens: a bigram looks back one token
            cache.remember(idx)
        logits = self.ln(self.wte(idx)) @ self.wte.weight.t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        return ModelOutput(loss=loss, logits=logits)

    def embedding_parameters(self) -> list[nn.Parameter]:
        return [self.wte.weight]

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        return (3 if training else 1) * 2 * self.config.n_embd * self.config.vocab_size


@pytest.fixture(scope="module", autouse=True)
def bigram_family():
    """The family and its flavor registered for this module's tests only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, "bigram", FamilySpec("bigram", BigramConfig, Bigram))
        patch.setitem(FLAVORS, FLAVOR, BigramConfig(vocab_size=512, block_size=64, n_embd=32, n_head=1))
        yield


def train(name: str, *overrides: str):
    result = runs.train_here([f"run_name={name}", f"model.flavor={FLAVOR}", "zero.stage=0", "train.max_steps=8",
                              "eval.interval=4", "eval.dynamics=false", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def bigram_run():
    train("bigram")
    return runs.run_dir("bigram")


def test_the_new_family_trains_and_resumes_exactly(bigram_run):
    middle = bigram_run / "ckpt" / "step_00000004"
    train("bigram-resumed", f"resume={middle}")
    reference, resumed = runs.scalars("bigram", "train/loss"), runs.scalars("bigram-resumed", "train/loss")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[step] == reference[step] for step in resumed)
    summary = json.loads((bigram_run / "summary.json").read_text())
    assert summary["family"] == "bigram" and summary["flavor"] == FLAVOR


def test_the_new_family_evaluates_during_training(bigram_run):
    losses = runs.scalars("bigram", "eval/loss")
    assert sorted(losses) == [4, 8] and all(0 < loss < 10 for loss in losses.values())


def test_the_new_family_samples_from_its_run_and_its_export(bigram_run, tmp_path):
    out = tmp_path / "bigram.safetensors"
    exported = runs.command_here("pretrain.export", [str(bigram_run), "--out", str(out)])
    assert exported.returncode == 0, exported.stderr[-2000:]
    texts = []
    for source in (bigram_run, out):
        result = runs.command_here("pretrain.sample", [str(source), "--prompt", "ROMEO:", "--max-new-tokens", "8",
                                                       "--temperature", "0"])
        assert result.returncode == 0, result.stderr[-2000:]
        texts.append(result.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("ROMEO:")


def test_the_new_family_is_planned(tmp_path):
    result = runs.command_here("pretrain.plan", ["--config", str(runs.base_config_file()), "--gpus", "1", "--json",
                                                 f"model.flavor={FLAVOR}", "zero.stage=0"])
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    assert plan["family"] == "bigram" and plan["fits"]
