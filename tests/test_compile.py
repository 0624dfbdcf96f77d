"""torch.compile, on (inductor) in every OpenWebText config, EBT's with its first-order energy
gradient (the descent compiled): each family's training forward is one graph, its compiled loss
and gradients equal eager's up to float rounding (EBT's also in a GPU's bf16), a compiled run
resumes with the uninterrupted run's losses (NRGPT and EBT), and a resume may switch a run
between compiled and eager."""
from __future__ import annotations

import copy
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import trainer_runs as runs
from numerics import assert_rounding_close
from pretrain.config import load_config, typed_model_overrides
from pretrain.models import build, model_class, resolve
from pretrain.training.engine import (COMPILE_CACHE_FILE, compiled_cpu_kernel_settings, load_compile_cache,
                                      save_compile_cache)

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "owt"

TINY = {
    "gpt": ("gpt-tiny", {"n_layer": 2}),
    "gpt_rec": ("gpt_rec-tiny", {"n_steps": 2}),
    # the OpenWebText configs' code path: full heads, ff2w, reference gradient, SDPA, the
    # released dropout placement (at their dropout of 0)
    "nrgpt": ("nrgpt-tiny", {"n_steps": 2, "dropout_placement": "attention"}),
    "transformer_pp": ("transformer_pp-tiny", {"n_layer": 2}),
}
"""One tiny model per family that the OpenWebText configs compile."""

EBT_FIRST_ORDER = {"ebt": ("ebt-tiny", {"energy_gradient": "first_order", "n_layer": 1})}
"""EBT (S1) with the first-order energy gradient, which compiles (as the OpenWebText EBT configs
set it)."""

VARIANTS = {
    "nrgpt exact (explicit scores, self term)": ("nrgpt-tiny", {"grad_mode": "exact"}, False),
    "nrgpt lowrank, strict mask, ff1 relu": ("nrgpt-tiny", {"attention": "lowrank", "mask": "strict",
                                                           "ff_energy": "ff1", "ff_act": "relu"}, False),
    "nrgpt ff2, rmsnorm, diag_gamma eta per step": ("nrgpt-tiny", {"ff_energy": "ff2", "norm": "rmsnorm",
                                                                  "learnable_gamma": True, "eta": "diag_gamma",
                                                                  "eta_per_step": True}, False),
    "nrgpt released dropout, energies logged": ("nrgpt-tiny", {"dropout": 0.1, "dropout_placement": "attention"},
                                                True),
    "nrgpt step checkpointing": ("nrgpt-tiny", {"activation_checkpointing": "step"}, True),
    "gpt dropout, block checkpointing": ("gpt-tiny", {"dropout": 0.1, "activation_checkpointing": "block"}, False),
    "transformer_pp block checkpointing": ("transformer_pp-tiny", {"activation_checkpointing": "block"}, False),
    "ebt S1 first-order": ("ebt-tiny", {"energy_gradient": "first_order"}, True),
    "ebt S1 first-order, step-conditioned (ebt-s1-small's stream)": (
        "ebt-tiny", {"energy_gradient": "first_order", "time_embed": True, "reuse_observed_stream": False}, False),
    "ebt first-order block checkpointing": ("ebt-tiny", {"energy_gradient": "first_order",
                                                         "activation_checkpointing": "block"}, False),
    "ebt first-order step checkpointing": ("ebt-tiny", {"energy_gradient": "first_order",
                                                        "activation_checkpointing": "step"}, False),
    "ebt-s2 first-order step checkpointing (Langevin noise, replay)": (
        "ebt-s2-tiny", {"energy_gradient": "first_order", "activation_checkpointing": "step"}, False),
    "ebt first-order, one attention row chunk (a GPU's default)": ("ebt-tiny", {"energy_gradient": "first_order",
                                                                                "attention_chunks": 1}, False),
}
"""Other code paths of the compiled families: (flavor, overrides, return_energies as the trainer's
logging steps ask)."""


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (and counts its own graphs: compiled frames of earlier
    tests would count against dynamo's recompile limit, past which it silently runs eagerly)
    and leaves torch's deterministic mode and the compile cache's key tag as it found them (a
    compiled CPU engine sets both)."""
    torch._dynamo.reset()
    counters.clear()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    cache_key_tag = torch.compiler.config.cache_key_tag
    yield
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.compiler.config.cache_key_tag = cache_key_tag


def training_step(model, idx, return_energies=False, autocast=False) -> torch.Tensor:
    """One forward and backward; `autocast`: the forward under bf16 autocast, the backward
    outside, as DeepSpeed's engine runs them."""
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, torch.roll(idx, -1, dims=1), return_energies=return_energies).loss
    loss.backward()
    return loss.detach()


def test_openwebtext_configs_compile_every_family_without_double_backward():
    """Every OpenWebText config compiles: each family's, EBT's with its first-order energy
    gradient (S1 and S2 faster compiled on a CPU, docs/benchmarks.md "EBT compiled")."""
    compiled = set()
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(path)
        model_config = resolve(cfg.model.flavor, typed_model_overrides(cfg))
        refused = model_class(model_config).compile_refusal(model_config)
        assert cfg.model.compile == ("off" if refused else "inductor"), path.name
        compiled.add(cfg.model.flavor.split("-")[0])
    assert compiled == set(TINY) | {"ebt"}


def compiled_step_equals_eager(family: str, **overrides) -> list[str]:
    """Inductor's loss and every parameter's gradient equal eager's up to rounding (it fuses and
    reorders float32 arithmetic), with the trainer's CPU settings; returns the generated code."""
    flavor, family_overrides = (TINY | EBT_FIRST_ORDER)[family]
    torch.manual_seed(0)
    eager = build(resolve(flavor, dict(vocab_size=64, block_size=32, **family_overrides | overrides))).train()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="inductor", fullgraph=True)
    compiled_cpu_kernel_settings()
    idx = torch.randint(0, 64, (2, 32))
    loss = training_step(eager, idx)
    # random draws (EBT's starting candidate) from eager's generator: inductor's own differ
    with torch._inductor.config.patch(fallback_random=True):
        compiled_loss, kernels = run_and_get_code(training_step, compiled, idx)
    assert_rounding_close(compiled_loss, loss)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert_rounding_close(q.grad, p.grad, msg=name)
    with torch._inductor.config.patch(fallback_random=True):
        training_step(compiled, idx)  # the next step: no recompile (the rotary tables stay out of the guards)
    return kernels


@pytest.mark.parametrize("family", TINY | EBT_FIRST_ORDER)
def test_compiled_training_step_equals_eager(family):
    """Compiled equals eager; fullgraph=True raises at a graph break. With the trainer's CPU
    setting its kernels add no floats atomically (an order that varies between runs)."""
    kernels = compiled_step_equals_eager(family)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert len(kernels) == 2 and not any("atomic_add" in code for code in kernels)  # forward, backward


def graphs_from_the_cache_in_a_compiled_step() -> int:
    """Compiles and checks a one-layer gpt's training step from nothing; returns how many of its
    compiled graphs came from inductor's caches."""
    torch._dynamo.reset()
    counters.clear()
    compiled_step_equals_eager("gpt", n_layer=1)
    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


LOWER_CAPABILITY = {"AVX512": "avx2", "AVX2": "default"}


def test_a_cache_filled_on_another_cpu_instruction_set_is_not_used():
    """Code that inductor cached for one vector instruction set is not loaded by a process that
    runs another (ATEN_CPU_CAPABILITY stands in for another CPU reading a shared cache
    directory): that process compiles its own, equal to eager, while a compile on the cache's
    own instruction set uses it. A tag of the user's, new for this test, keeps entries of earlier
    runs out (inductor's cache of compiled C++ stays warm)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in LOWER_CAPABILITY:
        pytest.skip(f"CPU capability {capability}: no lower x86 instruction set to compare with")
    user_tag = f"test-{uuid.uuid4().hex}"
    torch.compiler.config.cache_key_tag = user_tag
    assert graphs_from_the_cache_in_a_compiled_step() == 0
    assert graphs_from_the_cache_in_a_compiled_step() > 0

    # the same threads as here: inductor keys its cache on their number
    env = runs.child_env(TORCH_COMPILE_CACHE_KEY_TAG=user_tag, ATEN_CPU_CAPABILITY=LOWER_CAPABILITY[capability],
                         OMP_NUM_THREADS=str(torch.get_num_threads()),
                         PYTHONPATH=os.pathsep.join([str(runs.REPO), str(Path(__file__).parent)]))
    other_cpu = subprocess.run(
        [runs.PYTHON, "-c", "import test_compile; print(test_compile.graphs_from_the_cache_in_a_compiled_step())"],
        env=env, cwd=runs.REPO, capture_output=True, text=True, timeout=300)
    assert other_cpu.returncode == 0, other_cpu.stderr[-3000:]
    assert int(other_cpu.stdout.split()[-1]) == 0


@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
def test_first_order_ebt_compiles_whole_and_as_accurate_in_a_gpus_precision(precision):
    """A GPU trains the OpenWebText EBT configs in bf16 (precision auto). Their descent, with the
    float32 islands of the first-order gradient (silu's derivative, the attention's scores, the
    candidate's update), is one graph there too, AOTAutograd's forward and backward included,
    and its loss and gradients are as close to the float32 model's as eager's are. Not equal to
    eager's: under autocast the compiled backward rounds in other places. A graph that lost the
    islands (autocast left on inside `no_autocast`, tried) made the step size's gradient 3x
    further from float32's than eager's."""
    torch.manual_seed(0)
    reference = build(resolve("ebt-tiny", dict(vocab_size=64, block_size=16, energy_gradient="first_order",
                                               n_layer=1))).train()
    eager, compiled = copy.deepcopy(reference), copy.deepcopy(reference)
    compiled.compile(backend="aot_eager", fullgraph=True)
    idx = torch.randint(0, 64, (2, 16))
    losses = {"float32": training_step(reference, idx, return_energies=True)}
    for name, model in (("eager", eager), ("compiled", compiled)):
        # "bf16": the model cast, as DeepSpeed's bf16 runs it
        losses[name] = training_step(model.to(torch.bfloat16) if precision == "bf16" else model, idx,
                                     return_energies=True, autocast=precision == "bf16-autocast").float()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]

    def error(value, exact):
        return ((value.float() - exact).norm() / exact.norm()).item()

    assert error(losses["compiled"], losses["float32"]) <= 2 * error(losses["eager"], losses["float32"]) + 1e-3
    for (name, p), q, r in zip(eager.named_parameters(), compiled.parameters(), reference.parameters()):
        assert error(q.grad, r.grad) <= 2 * error(p.grad, r.grad), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_forward_has_no_graph_break(variant):
    """Dynamo captures the training forward (and the backward of the custom autograd Functions:
    NRGPT's GELU with its slope and the self term's mixing) whole. Only capture is checked here
    (backend "eager": no code generation); the step still computes what eager does."""
    flavor, overrides, return_energies = VARIANTS[variant]
    torch.manual_seed(0)
    eager = build(resolve(flavor, dict(vocab_size=64, block_size=16, **overrides))).train()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="eager", fullgraph=True)
    idx = torch.randint(0, 64, (2, 16))
    assert training_step(compiled, idx, return_energies) == training_step(eager, idx, return_energies)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_ebt_s2_compiles_its_descent_as_one_graph_with_the_replay_store_around_it():
    """EBT-S2 (random step counts, Langevin noise, the truncated loss, a replay store) with the
    first-order gradient, compiled: the descent is one graph per forward (fullgraph: no break),
    while the replay store's host-side bookkeeping runs eagerly around it. Over steps that fill
    the store and draw both step counts, AOTAutograd's losses and gradients equal eager's bit
    for bit, and the graphs stop growing (one per step count and batch size: the batch grows by
    the replayed rows)."""
    torch.manual_seed(0)
    eager = build(resolve("ebt-s2-tiny", dict(vocab_size=64, block_size=16, energy_gradient="first_order",
                                              n_layer=1))).train()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager", fullgraph=True)
    counts, graphs = set(), []
    for step in range(8):
        idx = torch.randint(0, 64, (4, 16))
        losses = []
        for model in (eager, compiled):
            model.seed_shared_draws(f"7/{step}/0")
            torch.manual_seed(1)
            out = model(idx, torch.roll(idx, -1, dims=1))
            out.loss.backward()
            losses.append(out.loss.detach())
            counts.add(out.diagnostics["energy"].numel())  # one energy per descent step
        assert torch.equal(*losses), step
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.equal(q.grad, p.grad), (step, name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert counts == {2, 3} and graphs[-1] == graphs[4] and not counters["graph_break"], graphs


def test_step_checkpointed_ebt_s2_recomputes_the_langevin_noise_its_forward_drew():
    """Step checkpointing recomputes each descent step in the backward. Compiled by inductor,
    whose random numbers are its own, the recompute must see the noise the forward drew: EBT-S2
    compiled with and without step checkpointing has the same loss, and gradients that agree to
    float32 rounding (other noise in the recompute would change them at the first digits)."""
    torch.manual_seed(0)
    options = dict(vocab_size=64, block_size=16, n_layer=1, energy_gradient="first_order", replay_buffer_size=0)
    plain = build(resolve("ebt-s2-tiny", options)).train()
    checkpointed = build(resolve("ebt-s2-tiny", dict(options, activation_checkpointing="step"))).train()
    checkpointed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    losses = []
    for model in (plain, checkpointed):
        model.compile(backend="inductor", fullgraph=True)
        model.seed_shared_draws("3")
        torch.manual_seed(1)
        out = model(idx, torch.roll(idx, -1, dims=1))
        out.loss.backward()
        losses.append(out.loss.detach())
    assert torch.equal(*losses)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item()), name


@pytest.mark.parametrize("flavor", ["gpt-tiny", "nrgpt-tiny"])
def test_a_compiled_model_decodes_eagerly(flavor):
    """The evaluation's text sample decodes token by token: each context length would be a new
    graph (and past dynamo's recompile limit of 8 it would silently run eagerly anyway)."""
    torch.manual_seed(0)
    eager = build(resolve(flavor, dict(vocab_size=64, block_size=32))).eval()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="eager", fullgraph=True)
    prompt = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        compiled(prompt)
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(compiled.generate(prompt, 12, temperature=0.0), eager.generate(prompt, 12, temperature=0.0))
    assert counters["stats"]["unique_graphs"] == 1


FIRST_ORDER_EBT = ["model.overrides.energy_gradient=first_order", "model.overrides.n_layer=1"]
COMPILED_RUNS = {"nrgpt": ["model.flavor=nrgpt-tiny"],
                 "ebt": ["model.flavor=ebt-tiny", *FIRST_ORDER_EBT],
                 "ebt_s2": ["model.flavor=ebt-s2-tiny", *FIRST_ORDER_EBT]}
"""The trainer runs compiled for resumption: NRGPT; EBT-S1; and EBT-S2, whose compiled descent
draws its Langevin noise from inductor's random numbers, between calls of a replay store that
resumes from its own files."""


@pytest.mark.parametrize("family", COMPILED_RUNS)
def test_compiled_run_resumes_with_the_uninterrupted_losses(family, tmp_path, monkeypatch):
    """A trainer run with model.compile=inductor (ZeRO-2, fp32 on CPU) resumed from its middle
    checkpoint logs the uninterrupted run's losses bit for bit: both compile the same graphs
    (EBT-S2's first step, with its replay store still empty, has a batch of its own, which the
    resumed run does not compile), and the engine has inductor's CPU kernels sum in a fixed
    order. Each run starts with dynamo reset, as a requeued job's fresh process would, and the
    resumed one with an empty inductor cache, as on another node: it generates no graph, but
    takes each from the compile cache the first run saved beside its checkpoints."""
    name = f"compiled-{family}"
    overrides = [*COMPILED_RUNS[family], "model.compile=inductor", "train.max_steps=6",
                 "checkpoint.interval=3", "eval.interval=0", "eval.sample_tokens=0"]
    done = runs.train_here([*overrides, f"run_name={name}"])
    assert done.returncode == 0, done.stderr[-3000:]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and not counters["graph_break"]
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "another-node"))
    resumed = runs.train_here([*overrides, f"run_name={name}-resumed",
                               f"resume={runs.run_dir(name)}/ckpt/step_{3:08d}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert counters["stats"]["unique_graphs"] == graphs - (family == "ebt_s2") and not counters["graph_break"]
    assert f"compiled graph(s) from {runs.run_dir(name) / COMPILE_CACHE_FILE}" in resumed.stdout
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and not counters["inductor"]["fxgraph_cache_miss"]
    reference = runs.scalars(name, "train/loss")
    assert sorted(reference) == list(range(1, 7))
    assert runs.scalars(f"{name}-resumed", "train/loss") == {step: reference[step] for step in range(4, 7)}


def test_a_resume_may_change_how_the_model_computes():
    """A model is compiled in place, so its checkpoint is the eager model's: a compiled run that a
    new GPU or compiler trips continues eagerly from its checkpoint (`model.compile=off`), and an
    eager one compiled. So may a resume change the other fields that choose how the same model
    computes (`EXECUTION_FIELDS`: activation checkpointing for GPUs with less memory, EBT's
    attention chunks and energy gradient), each change named on the console. EBT-S1 compiled
    (first order, as the OpenWebText configs run it), resumed at step 2 eagerly with autograd's
    double backward, checkpointed blocks and one row chunk, and that run's step-4 checkpoint
    compiled again: their losses are those of the run compiled throughout up to rounding, which
    a lost optimizer state, data position or schedule would move by orders of magnitude more."""
    common = ["model.flavor=ebt-tiny", "model.overrides.n_layer=1", "checkpoint.interval=2", "train.max_steps=6",
              "eval.interval=0", "eval.sample_tokens=0"]
    compiled = [*common, "model.overrides.energy_gradient=first_order", "model.compile=aot_eager"]
    reference = runs.train_here([*compiled, "run_name=switch"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    eager = runs.train_here([*common, "model.overrides.energy_gradient=autograd", "model.overrides.attention_chunks=1",
                             "model.activation_checkpointing=block", "model.compile=off", "run_name=switch-eager",
                             f"resume={runs.run_dir('switch')}/ckpt/step_{2:08d}"])
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert ("changed at step 2: activation_checkpointing off -> block, attention_chunks None -> 1, energy_gradient "
            "first_order -> autograd, model.compile aot_eager -> off: how the model computes") in eager.stdout
    again = runs.train_here([*compiled, "run_name=switch-again",
                             f"resume={runs.run_dir('switch-eager')}/ckpt/step_{4:08d}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert ("changed at step 4: activation_checkpointing block -> off, attention_chunks 1 -> None, energy_gradient "
            "autograd -> first_order, model.compile off -> aot_eager: how") in again.stdout
    losses = runs.scalars("switch", "train/loss")
    switched = {**runs.scalars("switch-eager", "train/loss"), **runs.scalars("switch-again", "train/loss")}
    assert sorted(switched) == [3, 4, 5, 6]
    assert_rounding_close(torch.tensor([switched[step] for step in range(3, 7)]),
                          torch.tensor([losses[step] for step in range(3, 7)]))


def test_a_compile_cache_is_kept_whole_and_one_that_cannot_be_used_costs_only_the_head_start(tmp_path, capsys):
    """The compile cache a job saves gives the next one its graphs; one that cannot be read (not
    torch's, or not a file) is reported in a line and the job generates its graphs itself, and
    one that cannot be written (no such directory, as a full disk) leaves the file that was."""
    path = tmp_path / COMPILE_CACHE_FILE
    assert load_compile_cache(path) is None  # a run's first job
    torch.compile(lambda x: x * 2 + 1, backend="inductor")(torch.ones(4))
    save_compile_cache(path)
    assert load_compile_cache(path).startswith("compile cache: ")
    kept = path.read_bytes()
    save_compile_cache(tmp_path / "gone" / COMPILE_CACHE_FILE)
    assert "the compiled graphs were not saved" in capsys.readouterr().err
    assert path.read_bytes() == kept and not (tmp_path / "gone").exists()
    path.write_bytes(b"not a compile cache")
    assert "is not a compile cache this torch reads" in load_compile_cache(path)
    assert "not read" in load_compile_cache(tmp_path)


def gradient_producers(model, idx) -> int:
    """How many nodes of a training step's backward hand the parameters their gradients. ZeRO's
    hooks run as each parameter's gradient is accumulated, so its reductions can start no
    earlier than the node that produces the gradient."""
    loss = model(idx, torch.roll(idx, -1, dims=1)).loss
    params = {id(p) for p in model.parameters()}
    producers, seen, nodes = set(), set(), [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            if hasattr(child, "variable") and id(child.variable) in params:
                producers.add(node)
            else:
                nodes.append(child)
    return len(producers)


def overlap_comment(path: Path) -> str:
    """The comment on a config's zero.overlap_comm, with its continuation lines."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("overlap_comm:"))
    comment = [lines[start].split("#", 1)[1]]
    for line in lines[start + 1:]:
        if not line.strip().startswith("#"):
            break
        comment.append(line.strip()[1:])
    return " ".join(part.strip() for part in comment)


def test_overlap_comm_comments_say_when_a_compiled_model_reduces():
    """A compiled model's backward is one node (AOTAutograd's) that returns every gradient at its
    end, so ZeRO-2's reduce-scatters follow the whole backward: overlap_comm overlaps them with
    each other, not with backward compute, which it does for an eager model, whose
    gradients come from many nodes as backward proceeds. Each OpenWebText config's comment
    says which (docs/design.md, "ZeRO for 85-127M models"). The structure is AOTAutograd's for
    every backend: aot_eager stands in for inductor, without code generation."""
    producers = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(path)
        family = cfg.model.flavor.split("-")[0]
        if (family, cfg.model.compile) not in producers:
            flavor, overrides = (TINY | EBT_FIRST_ORDER)[family]
            torch.manual_seed(0)
            shape = dict(vocab_size=64, block_size=16)
            model = build(resolve(flavor, shape | overrides | typed_model_overrides(cfg))).train()
            if cfg.model.compile != "off":
                model.compile(backend="aot_eager", fullgraph=True)
            producers[family, cfg.model.compile] = gradient_producers(model, torch.randint(0, 64, (2, 16)))
        count = producers[family, cfg.model.compile]
        assert cfg.zero.stage == 2 and cfg.zero.overlap_comm, path.name
        comment = overlap_comment(path)
        if cfg.model.compile == "off":
            assert count > 1 and "while backward continues" in comment, (path.name, count, comment)
        else:
            assert count == 1 and "after the backward" in comment, (path.name, count, comment)
    assert set(producers) == {(family, "inductor") for family in TINY | {"ebt": None}}
