"""Run config: loading, overrides, every kind of bad input, DeepSpeed JSON, parameter groups,
LR schedules. All in-process except one command-line check of the error path."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pretrain.config import (ConfigError, OptimizerSection, ScheduleSection, from_dict, load_config, model_config,
                             to_dict)
from pretrain.config.precision import precisions
from pretrain.config.validation import validate
from pretrain.models import build, resolve
from pretrain.training import optim
from pretrain.training.engine import deepspeed_config

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIGS = sorted((REPO / "configs" / "tiny").glob("*.yaml"))
OWT_CONFIGS = sorted((REPO / "configs" / "owt").glob("*.yaml"))


def write(tmp_path: Path, tree: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def minimal(tmp_path) -> Path:
    return write(tmp_path, {"data": {"path": "some/dataset", "seq_len": 64, "micro_batch_size": 4},
                            "train": {"max_steps": 10, "global_batch_size": 8}})


def test_yaml_and_overrides_are_typed(minimal):
    # PyYAML reads 3e-4 (no dot) as a string: number fields take such strings too
    assert load_config(minimal, ["optimizer.lr=3e-4"]).optimizer.lr == 3e-4
    cfg = load_config(minimal, ["train.max_steps=50", "optimizer.betas=[0.9, 0.99]",
                                "optimizer.lr=1e-3", "train.max_tokens=null", "zero.stage=3",
                                "model.overrides.n_layer=4", "eval.interval=7"])
    assert cfg.run_name == "run"  # defaults to the config file's name
    assert cfg.train.max_steps == 50 and cfg.train.max_tokens is None
    assert cfg.optimizer.betas == [0.9, 0.99] and cfg.optimizer.lr == 1e-3
    assert isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.zero.stage == 3 and cfg.model.overrides == {"n_layer": 4}
    assert cfg.total_steps == 50 and cfg.tokens_per_step == 8 * 64
    validate(cfg, world_size=2, has_gpu=False)


def test_token_budget_rounds_up_to_whole_steps(minimal):
    cfg = load_config(minimal, ["train.max_steps=null", "train.max_tokens=1000"])
    assert cfg.total_steps == math.ceil(1000 / (8 * 64))
    both = load_config(minimal, ["train.max_steps=1", "train.max_tokens=100000"])
    assert both.total_steps == 1


def test_resolved_config_round_trips(minimal, tmp_path):
    cfg = load_config(minimal, ["seed=3", "optimizer.lr_multipliers={'*.bias': 2.0}"])
    again = load_config(write(tmp_path, to_dict(cfg), "resolved.yaml"))
    assert to_dict(again) == to_dict(cfg)
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)


@pytest.mark.parametrize("tree, overrides, message", [
    ({"trian": {}}, [], "unknown key trian (did you mean train?)"),
    ({"train": {"max_step": 5}}, [], "unknown key train.max_step (did you mean train.max_steps?)"),
    ({}, ["zero.stag=2"], "command line: unknown key zero.stag"),
    ({"train": {"max_steps": "ten"}}, [], "train.max_steps must be an integer, got 'ten'"),
    ({"train": {"max_steps": True}}, [], "train.max_steps must be an integer, got True"),
    ({"optimizer": {"lr": "fast"}}, [], "optimizer.lr must be a number"),
    ({"zero": {"offload_optimizer": 1}}, [], "zero.offload_optimizer must be true or false"),
    ({"optimizer": {"betas": 0.9}}, [], "optimizer.betas must be a list"),
    ({"optimizer": {"betas": [0.9, "x"]}}, [], "optimizer.betas[1] must be a number"),
    ({"model": {"overrides": [1, 2]}}, [], "model.overrides must be a mapping"),
    ({"data": 5}, [], "data must be a mapping"),
    ({}, ["train.max_steps"], "command line: override 'train.max_steps' is not of the form key.sub=value"),
    ({"data": {"path": "x"}}, ["data.path.sub=3"], "command line: data.path is not a section"),
    ({"data": {"val_fraction": "a lot"}}, [], "data.val_fraction must be a number, got 'a lot'"),
])
def test_bad_keys_and_types_name_the_key_and_origin(tmp_path, tree, overrides, message):
    path = write(tmp_path, tree)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    text = str(err.value)
    assert message in text and "\n" not in text
    assert text.startswith("command line" if "command line" in message else str(path))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    # two model sections: last-wins would silently train the second flavor
    path = tmp_path / "twice.yaml"
    path.write_text("model:\n  flavor: nrgpt-tiny\ndata:\n  path: d\n  seq_len: 64\n"
                    "model:\n  flavor: gpt-tiny\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: duplicate key 'model' at line 6 (first at line 1); a second one "
                              "would silently replace the first: merge them")
    path.write_text("train:\n  max_steps: 3\n  max_steps: 4\n")
    with pytest.raises(ConfigError, match="duplicate key 'max_steps' at line 3 \\(first at line 2\\)"):
        load_config(path)


def test_text_keys_take_yamls_boolean_words_as_the_words(minimal, tmp_path):
    # YAML 1.1 reads off/no/on/yes as booleans; `model.compile=off` is the documented value
    cfg = load_config(minimal, ["model.compile=off", "model.activation_checkpointing=off", "resume=auto"])
    validate(cfg, world_size=1, has_gpu=False)
    assert (cfg.model.compile, cfg.model.activation_checkpointing) == ("off", "off")
    in_file = tmp_path / "file.yaml"
    in_file.write_text(minimal.read_text() + "model:\n  compile: off\n  activation_checkpointing: off\n")
    cfg = load_config(in_file)
    assert (cfg.model.compile, cfg.model.activation_checkpointing) == ("off", "off")
    # true/false keys still take all of YAML 1.1's words
    cfg = load_config(minimal, ["data.overwrite=yes", "data.allow_change=on", "zero.overlap_comm=no"])
    assert (cfg.data.overwrite, cfg.data.allow_change, cfg.zero.overlap_comm) == (True, True, False)
    # and so do the model's own fields, which reach it untyped through model.overrides
    cfg = load_config(minimal, ["model.overrides.bias=no", "model.overrides.n_layer=3"])
    validate(cfg, world_size=1, has_gpu=False)
    assert model_config(cfg, 100).bias is False and model_config(cfg, 100).n_layer == 3
    with pytest.raises(ConfigError, match="^model.overrides: bias must be true or false, got 'maybe'$"):
        validate(load_config(minimal, ["model.overrides.bias=maybe"]), world_size=1, has_gpu=False)
    with pytest.raises(ConfigError, match="^model.overrides: n_layer must be an integer, got 'four'$"):
        validate(load_config(minimal, ["model.overrides.n_layer=four"]), world_size=1, has_gpu=False)


@pytest.mark.parametrize("overrides, world_size, has_gpu, message", [
    (["train.precision=fp16"], 1, False, "train.precision='fp16': fp16 needs a GPU"),
    (["train.global_batch_size=12"], 5, False,
     "train.global_batch_size=12: 5 processes cannot share it evenly; use a GPU count that divides it "
     "(3, 4, 6, 12 are the nearest)"),
    (["zero.stage=4"], 1, False, "zero.stage=4: must be 0, 1, 2 or 3"),
    (["zero.stage=0", "zero.offload_optimizer=true"], 1, False, "zero.offload_optimizer=True: needs zero.stage >= 1"),
    (["train.max_steps=null"], 1, False, "train.max_steps=None: a budget is required"),
    (["train.max_steps=0"], 1, False, "train.max_steps=0: must be > 0"),
    (["data.micro_batch_size=0"], 1, False, "data.micro_batch_size=0: must be >= 1"),
    (["data.path=''"], 1, False, "data.path='': is required"),
    (["schedule.kind=linear"], 1, False, "schedule.kind='linear': must be"),
    (["schedule.kind=exponential"], 1, False, "schedule.min_lr=0.0: must be > 0 for the exponential"),
    (["schedule.min_lr=1.0"], 1, False, "schedule.min_lr=1.0: must not exceed optimizer.lr"),
    (["optimizer.betas=[0.9]"], 1, False, "optimizer.betas=[0.9]: must be two numbers"),
    (["train.precision=fp8"], 1, False, "train.precision='fp8'"),
    (["resume=no/such/run"], 1, False, "resume='no/such/run': must be 'auto', 'never', 'restart' or an existing"),
    (["run_name=a/b"], 1, False, "run_name='a/b': must be a plain directory name"),
    (["model.flavor=gpt-huge"], 1, False, "model: unknown model flavor 'gpt-huge'"),
    (["model.overrides={n_layerz: 3}"], 1, False, "model: model override 'n_layerz' is not a field"),
    (["model.overrides={n_layer: 0}"], 1, False, "model: GPTConfig.n_layer must be > 0"),
    (["model.overrides={block_size: 32}"], 1, False, "block_size=32 is shorter than data.seq_len=64"),
    (["model.activation_checkpointing=sometimes"], 1, False, "model.activation_checkpointing='sometimes'"),
    (["fault.nan_loss_rank=2"], 2, False, "fault.nan_loss_rank=2: must be a rank of this run (0..1)"),
])
def test_impossible_values_fail_before_any_work(minimal, overrides, world_size, has_gpu, message):
    cfg = load_config(minimal, overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size, has_gpu)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fp16_is_fine_on_a_gpu(minimal):
    validate(load_config(minimal, ["train.precision=fp16"]), world_size=1, has_gpu=True)


def test_command_line_error_is_one_line_and_writes_nothing(minimal, tmp_path):
    result = subprocess.run([sys.executable, "-m", "pretrain.train", "--config", str(minimal),
                             "zero.stage=4", f"output_root={tmp_path / 'out'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: zero.stage=4: must be 0, 1, 2 or 3"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", TINY_CONFIGS + OWT_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_configs_are_valid(path):
    cfg = load_config(path)
    world_size = 2 if path.parent.name == "tiny" else 8
    validate(cfg, world_size, has_gpu=path.parent.name == "owt")
    assert cfg.model.flavor.split("-")[0] in path.stem or path.stem.startswith(cfg.model.flavor.split("-")[0])


def test_paper_scale_configs_follow_the_papers():
    for path in OWT_CONFIGS:
        cfg = load_config(path)
        assert cfg.data.seq_len == 1024, path
        assert 393_216 <= cfg.tokens_per_step <= 491_520, path
        if cfg.model.flavor.startswith("nrgpt"):
            assert cfg.total_steps == 100_000, path


def test_tiny_configs_cover_every_family():
    names = {p.stem for p in TINY_CONFIGS}
    assert {"gpt", "gpt_rec", "nrgpt", "ebt", "transformer_pp"} <= names


def test_model_config_takes_vocab_and_context_from_the_data(minimal):
    cfg = load_config(minimal, ["model.activation_checkpointing=block"])
    model_cfg = model_config(cfg, dataset_vocab_size=65)
    assert model_cfg.vocab_size == 128 and model_cfg.block_size == 64
    assert model_cfg.activation_checkpointing == "block"
    pinned = model_config(load_config(minimal, ["model.overrides={vocab_size: 100, block_size: 80}"]), 65)
    assert pinned.vocab_size == 100 and pinned.block_size == 80


def test_deepspeed_json_follows_the_config(minimal):
    cfg = load_config(minimal, ["train.global_batch_size=32", "zero.stage=3",
                                "zero.reduce_bucket_size=1000", "optimizer.grad_clip=0.5"])
    for world_size, accumulation in ((1, 8), (2, 4), (8, 1)):
        ds = deepspeed_config(cfg, world_size, precisions()["fp32"])
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
                ds["gradient_accumulation_steps"]) == (32, 4, accumulation)
        assert ds["train_batch_size"] == 4 * accumulation * world_size
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert "allgather_bucket_size" not in ds["zero_optimization"]
    assert ds["gradient_clipping"] == 0.5
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert deepspeed_config(cfg, 1, precisions()["bf16"])["bf16"]["enabled"]
    # without ZeRO the guarded AdamW clips (after its non-finite check), not DeepSpeed
    assert deepspeed_config(load_config(minimal, ["zero.stage=0"]), 1, precisions()["fp32"])["gradient_clipping"] == 0
    offload = deepspeed_config(load_config(minimal, ["zero.offload_optimizer=true"]), 1, precisions()["fp32"])
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_param_groups_split_decay_and_multipliers():
    model = build(resolve("gpt-tiny"))
    groups, infos = optim.param_groups(model, OptimizerSection(lr=1e-3, weight_decay=0.1))
    by_name = {info.name: group for info, group in zip(infos, groups)}
    assert set(by_name) == {"decay", "no_decay"}
    params = dict(model.named_parameters())
    decayed = {id(p) for p in by_name["decay"]["params"]}
    for name, p in params.items():
        # matrices decay; biases, norms and the (tied) embeddings do not
        expected = p.ndim >= 2 and "wte" not in name and "wpe" not in name and "lm_head" not in name
        assert (id(p) in decayed) == expected, name
    assert by_name["no_decay"]["weight_decay"] == 0.0 and by_name["decay"]["weight_decay"] == 0.1
    assert sum(len(g["params"]) for g in groups) == len(params)

    extra = OptimizerSection(lr=1e-3, lr_multipliers={"blocks.0.*": 3.0})
    groups, infos = optim.param_groups(model, extra)
    names = [info.name for info in infos]
    assert "blocks.0.*/decay" in names and "blocks.0.*/no_decay" in names
    for info, group in zip(infos, groups):
        assert group["lr"] == pytest.approx(1e-3 * info.lr_mult)
        assert info.lr_mult == (3.0 if info.name.startswith("blocks.0.") else 1.0)
    with pytest.raises(ConfigError, match="matches no parameter"):
        optim.param_groups(model, OptimizerSection(lr_multipliers={"nothing.*": 2.0}))


def test_model_lr_multipliers_get_their_own_group():
    flavor = "ebt-tiny"
    model = build(resolve(flavor))
    multipliers = model.lr_multipliers()
    assert multipliers, f"{flavor} should expose its alpha's LR multiplier"
    groups, infos = optim.param_groups(model, OptimizerSection(lr=1e-3))
    for name, mult in multipliers.items():
        (info,) = [i for i in infos if i.name == name]
        group = groups[infos.index(info)]
        assert info.lr_mult == mult and group["weight_decay"] == 0.0
    optimizer = torch.optim.AdamW(groups)
    lrs = optim.set_lr(optimizer, infos, 2e-3)
    assert all(g["lr"] == pytest.approx(2e-3 * i.lr_mult) for g, i in zip(optimizer.param_groups, infos))
    assert lrs == {i.name: 2e-3 * i.lr_mult for i in infos}


def test_schedules():
    lr, total = 1.0, 110
    cosine = ScheduleSection(kind="cosine", warmup_steps=10, min_lr=0.1)
    factors = [optim.lr_factor(s, cosine, lr, total) for s in range(total)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)  # linear warmup
    assert factors[59] == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert factors[-1] == pytest.approx(0.1)  # the last update runs at min_lr
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))

    exponential = ScheduleSection(kind="exponential", warmup_steps=0, min_lr=0.01)
    assert optim.lr_factor(49, exponential, lr, 100) == pytest.approx(0.1)  # geometric mid-point
    assert optim.lr_factor(99, exponential, lr, 100) == pytest.approx(0.01)
    ratios = [optim.lr_factor(s + 1, exponential, lr, 100) / optim.lr_factor(s, exponential, lr, 100)
              for s in range(99)]
    assert ratios == pytest.approx([0.01 ** (1 / 100)] * 99)  # a constant factor per step

    held = ScheduleSection(kind="cosine", decay_steps=20, min_lr=0.0)
    assert optim.lr_factor(19, held, lr, 100) == optim.lr_factor(90, held, lr, 100) == 0.0
    assert optim.lr_factor(57, ScheduleSection(kind="constant"), lr, 100) == 1.0


def test_guarded_adamw_skips_non_finite_and_clips_like_torch():
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    reference = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    guarded = optim.GuardedAdamW([{"params": weights}], max_grad_norm=0.5, lr=0.1, weight_decay=0.1)
    plain = torch.optim.AdamW([{"params": reference}], lr=0.1, weight_decay=0.1)
    for step in range(3):
        grads = [torch.randn_like(w) * 3 for w in weights]
        if step == 1:
            grads[1][0] = math.nan
        for w, r, g in zip(weights, reference, grads):
            w.grad, r.grad = g.clone(), g.clone()
        before = [w.detach().clone() for w in weights]
        guarded.step()
        if step == 1:  # skipped: weights and optimizer state untouched
            assert guarded.overflow and math.isnan(guarded._global_grad_norm)
            assert all(torch.equal(b, w) for b, w in zip(before, weights))
            continue
        norm = torch.nn.utils.clip_grad_norm_(reference, 0.5)
        plain.step()
        assert not guarded.overflow and guarded._global_grad_norm == pytest.approx(norm.item())
        assert torch.nn.utils.get_total_norm([w.grad for w in weights]).item() == pytest.approx(0.5)
        assert all(torch.allclose(w, r) for w, r in zip(weights, reference))
    assert guarded.state[weights[0]]["step"] == 2


def test_a_dataset_named_on_the_command_line_is_used_as_prepared():
    """data.path=DIR on the command line drops the config's own preparation settings (they
    describe its default dataset), unless the command line also gives some of them."""
    tiny = REPO / "configs" / "tiny" / "gpt.yaml"
    assert load_config(tiny).data.source == "shakespeare"
    assert load_config(tiny, ["data.path=mine"]).data.source is None
    assert load_config(tiny, ["data.path=mine", "data.tokenizer=char"]).data.source == "shakespeare"
