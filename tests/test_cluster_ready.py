"""The shipped configs at cluster sizes, checked as a login node checks them (`--check
--world-size N`, no GPU here): every config passes at each GPU count of 1 to 16 nodes that
divides its global batch, with the micro-batch adapted and the global batch kept, and is
refused in one line naming the nearest valid counts at the others. And a GPU config stops on a
machine without a usable GPU instead of training on its CPU."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, batch_split, describe_attention, load_config
from pretrain.train import main as train_main
from pretrain.training.engine import gpu_index

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted(str(p.relative_to(REPO)) for pattern in ("configs/owt/*.yaml", "configs/tiny/*.yaml",
                                                           "configs/scaling/base/*.yaml")
                 for p in REPO.glob(pattern))
WORLD_SIZES = (1, 2, 8, 16, 24, 32, 64, 128)


def test_the_micro_batch_adapts_and_the_global_batch_stays():
    cfg = load_config(REPO / "configs/owt/gpt_124m.yaml", ["data.micro_batch_size=16"])
    assert cfg.train.global_batch_size == 384
    expected = {1: (16, 24), 2: (16, 12), 8: (16, 3), 16: (12, 2), 24: (16, 1), 32: (12, 1),
                64: (6, 1), 128: (3, 1), 384: (1, 1)}
    for world_size, (micro, accumulation) in expected.items():
        split = batch_split(cfg, world_size)
        assert (split.micro_batch_size, split.accumulation_steps) == (micro, accumulation)
        assert micro * world_size * accumulation == 384 and micro <= 16
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=384: 40 processes cannot share it "
                                          r"evenly; use a GPU count that divides it \(24, 32, 48, 64 are "
                                          r"the nearest\)"):
        batch_split(cfg, 40)


def corpus(folder: Path, words: int) -> str:
    """Text files of made-up words: about 1.6 GPT-2 tokens a word."""
    rng = random.Random(0)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                  for _ in range(3000)]
    folder.mkdir()
    for doc in range(words // 4000):
        (folder / f"{doc:03d}.txt").write_text(" ".join(rng.choice(vocabulary) for _ in range(4000)))
    return f"text:{folder}"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[tuple[str, int], str]:
    """One prepared dataset per (tokenizer, seq_len) the configs use, each with a val split large
    enough for every process's micro-batch at 128 processes."""
    from data_pipeline.prepare import prepare

    root = tmp_path_factory.mktemp("cluster")
    small, large = corpus(root / "small", 40_000), corpus(root / "large", 560_000)
    wanted = {(load_config(REPO / path).data.tokenizer if load_config(REPO / path).data.source != "listops"
               else "listops", load_config(REPO / path).data.seq_len) for path in CONFIGS}
    made = {}
    for tokenizer, seq_len in sorted(wanted):
        out = str(root / f"{tokenizer}-{seq_len}")
        source = "listops" if tokenizer == "listops" else large if seq_len >= 1024 else small
        prepare(source, out, seq_len=seq_len, val_fraction=0.5, num_proc=1, progress_bar=False,
                tokenizer="gpt2" if tokenizer == "listops" else tokenizer)
        made[tokenizer, seq_len] = out
    return made


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_passes_check_at_every_gpu_count_that_divides_its_batch(config, datasets, tmp_path, capsys):
    cfg = load_config(REPO / config)
    tokenizer = "listops" if cfg.data.source == "listops" else cfg.data.tokenizer
    overrides = [f"data.path={datasets[tokenizer, cfg.data.seq_len]}", f"output_root={tmp_path}"]
    if config.startswith("configs/scaling/base/"):
        overrides.append("train.max_tokens=100000")  # a sweep gives each of its runs a budget
    for world_size in WORLD_SIZES:
        code = train_main(["--check", "--world-size", str(world_size), "--config", config, *overrides])
        out, err = capsys.readouterr()
        global_batch = cfg.train.global_batch_size
        if global_batch % world_size == 0:
            split = batch_split(cfg, world_size)
            assert code == 0, err
            attention = describe_attention(cfg, cfg.train.device == "cuda" or torch.cuda.is_available())
            assert out.splitlines()[-1 - len(attention):] == [
                f"{config}: ready for {world_size} process(es): global batch {global_batch} = micro-batch "
                f"{split.micro_batch_size} x {world_size} process(es) x {split.accumulation_steps} "
                "accumulation step(s)" + ("" if split.micro_batch_size == cfg.data.micro_batch_size else
                                          f" (data.micro_batch_size={cfg.data.micro_batch_size} is the most; "
                                          f"{global_batch // world_size} sequences per process split evenly "
                                          f"into micro-batches of {split.micro_batch_size})"), *attention]
        else:
            assert code == 2
            assert err.splitlines() == [err.splitlines()[0]] and err.startswith(
                f"error: train.global_batch_size={global_batch}: {world_size} processes cannot share it evenly")
    if config.startswith("configs/owt/"):  # the flagship runs launch on 1-16 nodes of 8 GPUs as they are
        assert all(cfg.train.global_batch_size % n == 0 for n in WORLD_SIZES)
        # and their attention takes a fused kernel
        assert attention[0].startswith(("attention: SDPA's flash kernel", "attention: SDPA's efficient kernel"))


def test_a_gpu_config_stops_without_a_usable_gpu_and_passes_its_check(datasets, tmp_path):
    """Here torch sees no GPU (the suite runs on CPU): the trainer stops at once in one line instead
    of training a 124M model on the CPU in fp32, while --check still validates the run as a login
    node does."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is usable here")
    config = "configs/owt/gpt_124m.yaml"
    overrides = [f"data.path={datasets['gpt2', 1024]}", f"output_root={tmp_path}"]
    result = subprocess.run([sys.executable, "-m", "pretrain.train", "--config", config, *overrides],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [result.stderr.splitlines()[0]]
    assert result.stderr.startswith("error: train.device=cuda: torch ")
    assert ("is a CPU-only build" if torch.version.cuda is None else "cannot use a GPU here") in result.stderr
    assert not (tmp_path / "owt-gpt-124m").exists()
    assert train_main(["--check", "--world-size", "16", "--config", config, *overrides]) == 0


@pytest.mark.parametrize("local_rank, visible, index", [(0, 8, 0), (5, 8, 5), (5, 1, 0), (3, 1, 0)])
def test_each_process_takes_its_own_gpu_or_the_one_it_sees(local_rank, visible, index):
    assert gpu_index(local_rank, visible) == index


def test_more_processes_than_gpus_on_a_node_is_one_error():
    with pytest.raises(ConfigError, match="^LOCAL_RANK=4, but this process sees only 4 GPUs"):
        gpu_index(4, 4)
