"""The papers' recipes as the authors ran them: each option changes what it should and nothing
else. EBT S2 on one energy landscape (and the refusal of step embeddings that can never learn),
Langevin noise at eval, the released initialisation, the weight-decay sets per family, NRGPT's
released dropout placement, GPT_Rec without q/k/v bias, and exact resume with these options
(the trainer matrix of trainer_runs.py)."""
from __future__ import annotations

import math
from fnmatch import fnmatch

import pytest
import torch
import torch.nn as nn

import trainer_runs as runs
from pretrain.config import ConfigError, OptimizerSection, load_config
from pretrain.config.validation import validate
from pretrain.models import build, resolve
from pretrain.models.ebt import EBT, EBTConfig
from pretrain.training.optim import DECAY_SETS, param_groups


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY_EBT = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)


def s2(**overrides) -> EBT:
    """The S2 flavor's recipe at a float64 gradcheck size."""
    torch.manual_seed(0)
    return EBT(resolve("ebt-s2-tiny", {**TINY_EBT, "replay_buffer_size": 6, **overrides})).double()


def batch(model, seed=1, rows=3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (rows, model.config.block_size), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


# --- EBT S2: one energy landscape -----------------------------------------------------------

def test_s2_descends_one_landscape_and_trains_every_parameter():
    model = s2().train()
    assert model.descent.time_embeddings.num_embeddings == 1
    torch.manual_seed(3)
    for seed in range(3):  # 2 or 3 steps each, the replay buffer filling up
        idx, targets = batch(model, seed)
        model(idx, targets).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def loss_and_grads(idx, targets, **overrides):
    """One seeded S2 training forward and backward: (loss, parameter name -> gradient)."""
    model = s2(**overrides).train()
    torch.manual_seed(5)
    loss = model(idx, targets).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_same_training(first, second):
    (loss_a, grads_a), (loss_b, grads_b) = first, second
    assert torch.allclose(loss_a, loss_b, atol=1e-12, rtol=0)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-10, rtol=1e-8), name


def test_s2_observed_stream_reuse_is_exact_with_one_shared_step_embedding():
    idx, targets = batch(s2())
    assert_same_training(loss_and_grads(idx, targets, reuse_observed_stream=True),
                         loss_and_grads(idx, targets, reuse_observed_stream=False))


def test_s2_step_checkpointing_changes_nothing_but_memory():
    """(The S2 paper config's mode.)"""
    idx, targets = batch(s2())
    assert_same_training(loss_and_grads(idx, targets), loss_and_grads(idx, targets, activation_checkpointing="step"))


@pytest.mark.parametrize("fields", [
    dict(time_embed=True, step_embeddings="per_step", reuse_observed_stream=False, n_steps=3, min_steps=2,
         truncate_loss=True),
    dict(time_embed=True, step_embeddings="per_step", reuse_observed_stream=False, n_steps=2, truncate_loss=True),
])
def test_step_embeddings_that_never_get_a_gradient_are_refused(fields):
    with pytest.raises(ValueError, match="never receive a gradient"):
        EBTConfig(**fields)


def test_allowed_step_embedding_combinations():
    # per-step rows where every row can end a descent (min_steps=1), or every step's loss counts
    EBTConfig(time_embed=True, step_embeddings="per_step", reuse_observed_stream=False, n_steps=3,
              min_steps=1, truncate_loss=True)
    EBTConfig(time_embed=True, step_embeddings="per_step", reuse_observed_stream=False, n_steps=3)
    with pytest.raises(ValueError, match="needs time_embed=True"):
        EBTConfig(step_embeddings="shared")


def test_refused_combination_is_one_config_error_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("data: {path: somewhere}\ntrain: {max_steps: 1}\n")
    cfg = load_config(config, ["model.flavor=ebt-s2-tiny", "model.overrides.step_embeddings=per_step",
                               "model.overrides.reuse_observed_stream=false"])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=1, has_gpu=False)
    message = str(error.value)
    assert "\n" not in message and "step_embeddings" in message and "never receive a gradient" in message


# --- EBT: Langevin noise at evaluation -----------------------------------------------------

def test_eval_noise_option_changes_eval_only_reproducibly_and_leaves_the_rng_alone():
    quiet, noisy = s2(langevin_noise_eval=False), s2(langevin_noise_eval=True)
    assert noisy.eval_noise_std() == 3.0 and quiet.eval_noise_std() == 0.0
    idx, targets = batch(quiet)
    # training computes the same with either setting
    train_losses = []
    for model in (quiet, noisy):
        model.train()
        torch.manual_seed(9)
        train_losses.append(model(idx, targets).loss.item())
    assert train_losses[0] == train_losses[1]
    quiet.load_state_dict(noisy.state_dict())  # the same weights from here on
    quiet.eval(), noisy.eval()
    without = s2(langevin_noise_std=0.0)
    without.load_state_dict(quiet.state_dict())
    state = torch.get_rng_state()
    with torch.no_grad():
        noisy_loss = noisy(idx, targets).loss
        assert torch.equal(noisy(idx, targets).loss, noisy_loss)  # seeded: reproducible
        quiet_loss = quiet(idx, targets).loss
        assert torch.equal(quiet_loss, without.eval()(idx, targets).loss)  # off = no noise at all
    assert torch.equal(torch.get_rng_state(), state)
    assert (noisy_loss - quiet_loss).abs() > 1e-3
    # think follows the option unless told otherwise
    assert torch.equal(noisy.think(idx, targets=targets).loss_per_step,
                       quiet.think(idx, targets=targets, langevin_noise=True).loss_per_step)
    assert torch.equal(noisy.think(idx, targets=targets, langevin_noise=False).loss_per_step,
                       quiet.think(idx, targets=targets).loss_per_step)


def test_eval_logs_final_step_and_mean_over_steps_and_the_noise(matrix):
    for name, noise in (("ebt-z2", 0.0), ("ebt_s2-z2", 3.0)):
        final = runs.scalars(name, "eval/loss")[runs.N_STEPS]
        mean_steps = runs.scalars(name, "eval/loss_mean_steps")[runs.N_STEPS]
        assert math.isfinite(final) and math.isfinite(mean_steps) and final != mean_steps
        assert runs.scalars(name, "eval/langevin_noise_std")[runs.N_STEPS] == noise
    with pytest.raises(KeyError):
        runs.scalars("nrgpt-z2", "eval/loss_mean_steps")


# --- EBT: the released initialisation -------------------------------------------------------

def test_authors_init_is_xavier_normal_and_unit_embeddings_without_scaling():
    torch.manual_seed(0)
    fields = dict(vocab_size=512, block_size=16, n_layer=2, n_head=2, n_embd=64, time_embed=True,
                  step_embeddings="per_step", reuse_observed_stream=False)
    model = EBT(EBTConfig(**fields, init="authors"))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            fan_out, fan_in = module.weight.shape
            expected = math.sqrt(2 / (fan_in + fan_out))
            assert module.weight.std().item() == pytest.approx(expected, rel=0.2), name
        elif isinstance(module, nn.Embedding) and module.weight.numel() > 100:
            assert module.weight.std().item() == pytest.approx(1.0, rel=0.1), name
    d = model.descent
    assert torch.equal(d.norm.weight, torch.ones_like(d.norm.weight))
    # the default is unchanged: N(0, 0.02), scaled residual projections, head at 0.02 / alpha
    scaled = EBT(EBTConfig(**fields))
    assert scaled.descent.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert scaled.descent.layers[0].attention.wo.weight.std().item() == pytest.approx(0.02 / 2, rel=0.15)


# --- weight-decay sets -----------------------------------------------------------------------

MATRIX_WEIGHTS = {
    "gpt-tiny": ["blocks.*.c_attn.weight", "blocks.*.c_proj.weight", "blocks.*.c_fc.weight"],
    "gpt_rec-tiny": ["block.*.c_attn.weight", "block.*.c_proj.weight", "block.*.c_fc.weight"],
    "nrgpt-tiny": ["recurrence.block.attn.key.weight", "recurrence.block.ff.fc*.weight",
                   "recurrence.block.eta.matrix"],
    "transformer_pp-tiny": ["layers.*.w?.weight"],
    "ebt-tiny": ["descent.layers.*.w?.weight", "descent.energy_head.weight"],
    "ebt-s2-tiny": ["descent.layers.*.w?.weight", "descent.energy_head.weight", "descent.time_embeddings.weight"],
}
"""Per flavor: the weight matrices of the blocks (and heads that are not LM heads)."""
TABLES = {
    "gpt-tiny": ["wte.weight", "wpe.weight"],  # the head is tied to wte
    "gpt_rec-tiny": ["wte.weight", "wpe.weight", "lm_head.weight"],
    "nrgpt-tiny": ["wte.weight", "wpe.weight", "lm_head.weight"],
    "transformer_pp-tiny": ["tok_embeddings.weight", "output.weight"],
    "ebt-tiny": ["descent.tok_embeddings.weight", "descent.candidate_embedding.weight"],
    "ebt-s2-tiny": ["descent.tok_embeddings.weight", "descent.candidate_embedding.weight"],
}
"""Per flavor: the embedding tables and the untied LM head."""


def decayed_names(model, decay_set: str) -> set[str]:
    groups, _ = param_groups(model, OptimizerSection(weight_decay=0.1, decay=decay_set))
    ids = {id(p) for group in groups if group["weight_decay"] > 0 for p in group["params"]}
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("flavor", sorted(MATRIX_WEIGHTS))
def test_decay_sets_decay_exactly_the_documented_tensors(flavor):
    model = build(resolve(flavor, {"vocab_size": 64, "block_size": 16}))
    names = [name for name, _ in model.named_parameters()]

    def matching(patterns):
        return {n for n in names if any(fnmatch(n, pattern) for pattern in patterns)}

    step_sizes = {"descent.alpha"} & set(names)
    expected = {"matrices": matching(MATRIX_WEIGHTS[flavor]),
                "nanogpt": matching(MATRIX_WEIGHTS[flavor]) | matching(TABLES[flavor]),
                "all": set(names) - step_sizes}
    assert set(expected) == set(DECAY_SETS)
    for decay_set, names_decayed in expected.items():
        assert decayed_names(model, decay_set) == names_decayed, decay_set
    if step_sizes:  # alpha keeps its own learning rate, and never decays
        groups, infos = param_groups(model, OptimizerSection(decay="all"))
        (alpha_group,) = [g for g, info in zip(groups, infos) if info.name == "descent.alpha"]
        assert alpha_group["weight_decay"] == 0.0 and alpha_group["lr"] == pytest.approx(6e-4 * 1500)


def test_unknown_decay_set_is_refused(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("data: {path: somewhere}\ntrain: {max_steps: 1}\noptimizer: {decay: biases}\n")
    with pytest.raises(ConfigError, match="optimizer.decay"):
        validate(load_config(config), world_size=1, has_gpu=False)


# --- NRGPT: the released dropout placement -------------------------------------------------

def nrgpt(**overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=32, block_size=16, n_embd=16, n_head=2, n_steps=2, eta="scalar")
    return build(resolve("nrgpt-tiny", {**fields, **overrides})).double()


@pytest.mark.parametrize("options", [{}, dict(attention="lowrank", attention_impl="explicit"),
                                     dict(grad_mode="exact")])
def test_attention_dropout_at_zero_changes_nothing(options):
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = nrgpt(**options).train()
    placed = nrgpt(dropout_placement="attention", **options).train()
    torch.manual_seed(1)
    state = torch.get_rng_state()
    assert torch.equal(placed(idx).logits, reference(idx).logits)
    assert torch.equal(torch.get_rng_state(), state)  # no mask drawn at all


def test_attention_dropout_drops_only_the_attention_term():
    idx = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    model = nrgpt(dropout=0.5, dropout_placement="attention", n_steps=1).train()
    captured = {}
    model.recurrence.register_forward_hook(lambda module, args, out: captured.update(x=args[0], x_next=out[0]))
    torch.manual_seed(2)
    model(idx)
    x0, x_next = captured["x"], captured["x_next"]
    assert torch.equal(x0, model.wte(idx) + model.wpe(torch.arange(16)))  # no embedding dropout
    block = model.recurrence.block
    g = block.norm(x0)
    rate = torch.nn.functional.softplus(block.eta.raw_scale[0])
    attention_term = (x0 - x_next) / rate - block.s_ff * block.ff(g)  # as if the FF term were not dropped
    clean = block.attn.eval()(g)
    block.attn.train()
    zeroed = attention_term.abs() < 1e-9
    assert 0.4 < zeroed.double().mean() < 0.6  # the summed attention term, dropped at 0.5
    # the survivors are not the clean term / (1 - p): each head's probabilities were dropped too
    assert not torch.allclose(attention_term[~zeroed], clean[~zeroed] * 2, rtol=1e-6)
    # a zero attention term (keys 0): nothing else is dropped, training computes what eval does
    with torch.no_grad():
        block.attn.key.weight.zero_()
    torch.manual_seed(3)
    assert torch.allclose(model.train()(idx).logits, model.eval()(idx).logits, atol=1e-12, rtol=0)
    # the default placement drops the embeddings
    default = nrgpt(dropout=0.5)
    default.train()
    assert isinstance(default.drop, nn.Dropout) and default.drop.p == 0.5


# --- GPT_Rec: no q/k/v bias -------------------------------------------------------------------

def test_gpt_rec_without_qkv_bias_keeps_the_other_biases():
    with_bias = build(resolve("gpt_rec-tiny"))
    without = build(resolve("gpt_rec-tiny", {"qkv_bias": False}))
    names_with, names_without = dict(with_bias.named_parameters()), dict(without.named_parameters())
    assert set(names_with) - set(names_without) == {"block.attn.c_attn.bias"}
    assert with_bias.num_params() - without.num_params() == 3 * with_bias.config.n_embd
    assert "block.attn.c_proj.bias" in names_without and "block.mlp.c_fc.bias" in names_without


# --- exact resume with the new options --------------------------------------------------------

@pytest.fixture(scope="module")
def matrix():
    return runs.resume_matrix()


@pytest.mark.parametrize("cell", ["ebt_s2", "nrgpt_released"])
def test_resumed_eval_is_bit_identical_with_the_recipe_options(matrix, cell):
    """(test_train checks the training losses of every matrix cell, these included.)"""
    name = runs.reference_name(cell, 2)
    reference, resumed = runs.scalars(name, "eval/loss"), runs.scalars(name + "-resumed", "eval/loss")
    assert resumed == {runs.N_STEPS: reference[runs.N_STEPS]}


def test_paper_configs_use_their_papers_recipe():
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parent.parent / "configs" / "owt").glob("*.yaml")):
        cfg = load_config(path)
        family = cfg.model.flavor.split("-")[0]
        if family in ("ebt", "transformer_pp"):  # the EBT scripts: 0.01 on all but alpha
            assert (cfg.optimizer.decay, cfg.optimizer.weight_decay) == ("all", 0.01), path
        else:  # nanoGPT and the NRGPT authors' nanoGPT-derived script
            assert (cfg.optimizer.decay, cfg.optimizer.weight_decay) == ("nanogpt", 0.1), path
        if family == "nrgpt":
            assert cfg.model.overrides["dropout_placement"] == "attention", path
        if family == "gpt_rec":
            assert cfg.model.overrides["qkv_bias"] is False, path

