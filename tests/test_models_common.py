"""Properties every model family must have, checked on each registered `*-tiny` flavor:
the output contract, causality, execution fields that change nothing but how the model computes
(activation checkpointing among them, which changes memory alone); plus the paper-scale
parameter counts and the flavor table."""
import dataclasses
import itertools

import pytest
import torch

from bench.memory import peak_allocated_bytes
from pretrain.models import FAMILIES, FLAVORS, build, resolve
from pretrain.models.__main__ import flavor_rows, main

TINY = sorted(name for name in FLAVORS if name.endswith("-tiny"))


def build_tiny(flavor: str, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    return build(resolve(flavor, overrides)).to(dtype)


def run(model, idx, targets=None):
    # EBT draws its initial candidates at random: every call starts from the same seed.
    torch.manual_seed(1234)
    return model(idx, targets)


def tokens(model, batch=2, seq_len=12, seed=5):
    torch.manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq_len))


def depth_field(flavor: str) -> str:
    """The config field that sets how many steps (recurrent families) or blocks (GPT) run."""
    names = {f.name for f in dataclasses.fields(FLAVORS[flavor])}
    return "n_steps" if "n_steps" in names else "n_layer"


@pytest.mark.parametrize("flavor", TINY)
def test_output_contract(flavor):
    model = build_tiny(flavor).train()
    idx = tokens(model)
    out = run(model, idx[:, :-1], idx[:, 1:])
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.logits.shape == (2, 11, model.config.vocab_size)
    for key, value in out.diagnostics.items():
        assert key.startswith("_") or value.ndim in (0, 1), key
        assert not value.requires_grad, key
    assert run(model, idx).loss is None
    assert 0 < model.num_params(non_embedding=True) < model.num_params()
    assert model.flops_per_token(12, training=False) < model.flops_per_token(12)


@pytest.mark.parametrize("flavor", TINY)
def test_causality(flavor):
    """Changing token k changes no logit at positions < k (and does change position k)."""
    model = build_tiny(flavor).eval()
    idx = tokens(model)
    base = run(model, idx).logits
    for k in (0, 5, 11):
        changed = idx.clone()
        changed[:, k] = (changed[:, k] + 1) % model.config.vocab_size
        logits = run(model, changed).logits
        assert torch.allclose(logits[:, :k], base[:, :k], atol=1e-12, rtol=0), f"token {k} leaks"
        assert (logits[:, k] - base[:, k]).abs().max() > 1e-8


OTHER_EXECUTION = {"activation_checkpointing": ["step", "block"], "attention_chunks": [1, 3],
                   "energy_gradient": ["first_order"], "attention_impl": ["explicit"], "log_energy": [True]}
"""Values other than the tiny flavors' own for every field a family's config names in
`EXECUTION_FIELDS` (a field added there needs its alternatives here)."""
EXECUTION_CHANGES = [(flavor, field, value) for flavor in TINY for field in type(FLAVORS[flavor]).EXECUTION_FIELDS
                     for value in OTHER_EXECUTION.get(field, [None])]


def test_every_execution_field_is_a_field_with_alternatives_here():
    for spec in FAMILIES.values():
        names = {f.name for f in dataclasses.fields(spec.config_cls)}
        assert set(spec.config_cls.EXECUTION_FIELDS) <= names & OTHER_EXECUTION.keys(), spec.name


@pytest.mark.parametrize("flavor, field, value", EXECUTION_CHANGES)
def test_an_execution_field_changes_how_the_model_computes_not_what(flavor, field, value):
    """A resume may change an execution field (`pretrain.training.checkpoint.model_changes`),
    so the model must keep its parameters and buffers and compute the same loss and gradients
    (float64: up to rounding, where the fields reorder sums or take other kernels)."""
    results = {}
    for setting in (getattr(FLAVORS[flavor], field), value):
        model = build_tiny(flavor, **{field: setting}).train()
        idx = tokens(model, seq_len=13)
        out = run(model, idx[:, :-1], idx[:, 1:])
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        shapes = {n: t.shape for n, t in model.state_dict().items()}
        results[setting] = out.loss.detach(), grads, shapes
    (loss, grads, shapes), (loss_changed, grads_changed, shapes_changed) = results.values()
    assert shapes_changed == shapes and grads and grads_changed.keys() == grads.keys()
    assert torch.allclose(loss_changed, loss, atol=0, rtol=1e-12)
    for name, grad in grads.items():
        assert torch.allclose(grads_changed[name], grad, atol=1e-12 * grad.abs().max().item(), rtol=1e-9), name


@pytest.mark.parametrize("flavor", TINY)
def test_activation_checkpointing_keeps_peak_memory_flat_in_the_number_of_steps(flavor):
    """Where the unrolled graph grows with the number of steps (blocks for GPT), checkpointing
    must cut both that growth and the peak; where it does not (EBT S2 builds a graph through
    its last step only), checkpointing must keep the peak flat."""
    field = depth_field(flavor)
    mode = "step" if field == "n_steps" else "block"
    peaks = {}
    for checkpointing, depth in itertools.product(("off", mode), (2, 8)):
        model = build_tiny(flavor, dtype=torch.float32, activation_checkpointing=checkpointing,
                           **{field: depth}).train()
        idx = tokens(model, batch=4, seq_len=model.config.block_size)
        peaks[checkpointing, depth] = peak_allocated_bytes(
            lambda: run(model, idx, torch.roll(idx, -1, dims=1)).loss.backward())
    print(f"\n{flavor} peak MB at 2 / 8 {field}: off {peaks['off', 2] / 1e6:.2f} / "
          f"{peaks['off', 8] / 1e6:.2f}, {mode} {peaks[mode, 2] / 1e6:.2f} / {peaks[mode, 8] / 1e6:.2f}")
    growth_off, growth_on = peaks["off", 8] - peaks["off", 2], peaks[mode, 8] - peaks[mode, 2]
    if growth_off > 0.25 * peaks["off", 2]:
        assert growth_on < 0.25 * growth_off and peaks[mode, 8] < 0.75 * peaks["off", 8]
    else:
        assert peaks[mode, 8] < 1.1 * peaks[mode, 2]


@pytest.mark.parametrize("flavor, expected", [
    ("gpt-124m", 124.4e6), ("gpt_rec-85m", 85.2e6), ("nrgpt-ff2w-90m", 90.5e6), ("nrgpt-ff2w-126m", 126.1e6),
])
def test_paper_scale_parameter_counts(flavor, expected):
    with torch.device("meta"):
        model = build(resolve(flavor))
    assert abs(model.num_params() / expected - 1) < 0.01


def test_flavor_table_lists_every_flavor(capsys):
    main([])
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(FLAVORS) + 1
    rows = {row[0]: row for row in flavor_rows()}
    assert set(rows) == set(FLAVORS)
    name, family, context, vocab, total, non_embedding, flops = rows["gpt-124m"]
    assert (family, context, vocab) == ("GPT", 1024, 50304) and abs(total / 124.4e6 - 1) < 0.01
    assert non_embedding < total and flops > 6 * non_embedding
    # each line names the vocabulary its counts are at (gpt-tiny's own: 512)
    assert printed[0].split()[3] == "vocab"
    assert next(line for line in printed if line.startswith("gpt-tiny ")).split()[3] == "512"


def test_flavor_table_at_the_trainers_vocabulary_of_a_dataset(capsys):
    """--vocab 50257 (GPT-2's BPE): every flavor at the 50304 embedding rows the trainer pads it
    to, with the parameters of the model it builds."""
    from pretrain.config import load_config, model_config

    main(["--vocab", "50257"])
    printed = capsys.readouterr().out.splitlines()
    assert {line.split()[3] for line in printed[1:]} == {"50304"}
    rows = {row[0]: row for row in flavor_rows(50257)}
    cfg = load_config("configs/tiny/gpt.yaml")
    with torch.device("meta"):
        trained = build(model_config(cfg, 50257))
    assert rows["gpt-tiny"][3:6] == (50304, trained.num_params(), trained.num_params(non_embedding=True))
    assert rows["gpt-tiny"][4] > {row[0]: row[4] for row in flavor_rows()}["gpt-tiny"]  # not the 512 of the flavor
