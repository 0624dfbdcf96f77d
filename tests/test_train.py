"""The training loop on 2 processes: exact resume for every family under ZeRO 1, 2 and 3, ZeRO-3
against ZeRO-2, TensorBoard contents, and the non-finite update guard.

The matrix runs come from one torchrun launch (see trainer_runs.py); the other tests here
launch their own short runs."""
from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

import trainer_runs as runs
from pretrain.config import load_config
from pretrain.training.evaluation import PROMPT_END

MATRIX = runs.matrix_cells()


@pytest.fixture(scope="module")
def matrix():
    return runs.resume_matrix()


@pytest.mark.parametrize("family, stage", MATRIX, ids=[f"{f}-zero{s}" for f, s in MATRIX])
def test_resume_gives_identical_losses(matrix, family, stage):
    name = runs.reference_name(family, stage)
    reference = runs.scalars(name, "train/loss")
    resumed = runs.scalars(name + "-resumed", "train/loss")
    assert sorted(reference) == list(range(1, runs.N_STEPS + 1))
    assert sorted(resumed) == list(range(runs.RESUME_STEP + 1, runs.N_STEPS + 1))
    for step, loss in resumed.items():
        assert loss == reference[step], f"step {step}: resumed {loss!r} != uninterrupted {reference[step]!r}"
    # and the runs learn something: the loss goes clearly down from its starting value
    assert reference[runs.N_STEPS] < reference[1] - 0.3


@pytest.mark.parametrize("family", runs.FAMILIES)
def test_zero3_matches_zero2(matrix, family):
    zero2 = runs.scalars(runs.reference_name(family, 2), "train/loss")
    zero3 = runs.scalars(runs.reference_name(family, 3), "train/loss")
    zero1 = runs.scalars(runs.reference_name(family, 1), "train/loss")
    steps = sorted(zero2)
    # same math, different reduction order: equal up to float32 rounding
    assert [zero3[s] for s in steps] == pytest.approx([zero2[s] for s in steps], rel=1e-5, abs=1e-5)
    assert [zero1[s] for s in steps] == pytest.approx([zero2[s] for s in steps], rel=1e-5, abs=1e-5)


def test_resumed_run_records_the_whole_run(matrix):
    name = runs.reference_name("gpt", 2)
    summary = json.loads((runs.run_dir(name + "-resumed") / "summary.json").read_text())
    reference = json.loads((runs.run_dir(name) / "summary.json").read_text())
    tokens_per_step = 8 * 32
    for record in (summary, reference):
        assert record["steps"] == runs.N_STEPS and record["world_size"] == 2
        assert record["tokens_seen"] == runs.N_STEPS * tokens_per_step
        assert record["train_flops"] == pytest.approx(record["flops_per_token"] * record["tokens_seen"])
        assert record["family"] == "gpt" and record["flavor"] == "gpt-tiny"
    assert summary["final_train_loss"] == reference["final_train_loss"]
    assert summary["final_val_loss"] == pytest.approx(reference["final_val_loss"], rel=1e-6)
    ckpt = runs.run_dir(name) / "ckpt"
    # keep=5: all three checkpoints kept, `latest` names the last
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000008", "step_00000012"]
    assert (ckpt / "latest").read_text() == "step_00000012"


EXPECTED_SCALARS = {
    "train/loss", "train/lr/decay", "train/lr/no_decay", "train/grad_norm", "train/tokens_seen",
    "train/tokens_per_s", "train/step_time_s", "train/data_wait_frac", "train/tflops",
    "train/peak_mem_gb", "train/skipped_steps", "eval/loss", "eval/ppl",
}
FAMILY_SCALARS = {
    "gpt": set(),
    "nrgpt": {"model/nrgpt/s_ff", "model/nrgpt/eta_scale"} | {f"model/nrgpt/energy/step_{i:02d}" for i in range(3)}
    | {f"eval/dynamics/depth_loss/step_{s:02d}" for s in (1, 2, 3)} | {"eval/dynamics/monotone_fraction"},
    "ebt": {"model/ebt/alpha", "model/ebt/loss_first_step", "model/ebt/loss_last_step", "train/lr/descent.alpha"}
    | {f"model/ebt/energy/step_{i:02d}" for i in range(2)} | {f"eval/think_loss/step_{k:02d}" for k in (1, 2, 3)}
    | {"eval/dynamics/energy_loss_spearman"},
}
"""With eval.dynamics on (the base config): the descent's scalars of the families with one."""


@pytest.mark.parametrize("family", runs.FAMILIES)
def test_the_dynamics_scalars_agree_across_zero_stages_and_resume(matrix, family):
    """`eval.dynamics` on 2 processes: summary.json holds the scalars TensorBoard has, the same
    to rounding under ZeRO-3 (whose forward gathers the parameters the readouts use) and after
    a resume; a family without a descent has none."""
    def dynamics(name):
        return json.loads((runs.run_dir(name) / "summary.json").read_text())["dynamics"]

    reference = dynamics(runs.reference_name(family, 2))
    if family == "gpt":
        assert reference is None
        return
    assert {f"eval/dynamics/{key}" for key in reference} == {
        tag for tag in FAMILY_SCALARS[family] if tag.startswith("eval/dynamics/")}
    assert all(math.isfinite(value) for value in reference.values())
    for key, value in reference.items():
        assert runs.scalars(runs.reference_name(family, 2), f"eval/dynamics/{key}")[runs.N_STEPS] == \
            pytest.approx(value)
    # counts over the 2 x 2 x 32 probed tokens: rounding may flip a token whose energy rise is at
    # the slack (1/128), or swap the ranks of a few near-tied tokens (1e-3 is about 20 swaps)
    tolerance = {"monotone_fraction": 1 / 128, "energy_loss_spearman": 1e-3}
    for other in (runs.reference_name(family, 3), runs.reference_name(family, 2) + "-resumed"):
        got = dynamics(other)
        assert got.keys() == reference.keys()
        for key, value in got.items():
            assert value == pytest.approx(reference[key], rel=1e-5, abs=tolerance.get(key, 1e-5)), (other, key)


@pytest.mark.parametrize("family", runs.FAMILIES)
def test_tensorboard_holds_the_listed_scalars(matrix, family):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name = runs.reference_name(family, 2)
    events = EventAccumulator(str(runs.run_dir(name) / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert EXPECTED_SCALARS | FAMILY_SCALARS[family] <= tags
    assert "train/mfu" not in tags  # no peak to compare with on a CPU

    def series(tag):
        return {e.step: e.value for e in events.Scalars(tag)}

    n = runs.N_STEPS
    assert sorted(series("train/loss")) == list(range(1, n + 1))  # the optimizer step is the step
    assert series("train/tokens_seen")[n] == n * 8 * 32
    assert series("train/skipped_steps")[n] == 0
    lrs = series("train/lr/decay")
    assert lrs[1] == pytest.approx(1.5e-3) and lrs[2] == pytest.approx(3e-3)  # warmup over 2 steps
    assert lrs[n] == pytest.approx(3e-4)  # the cosine ends at min_lr
    assert all(v > 0 for v in series("train/tokens_per_s").values())
    assert all(0 <= v <= 1 for v in series("train/data_wait_frac").values())
    assert all(math.isfinite(v) and v > 0 for v in series("train/grad_norm").values())
    assert series("eval/ppl")[n] == pytest.approx(math.exp(series("eval/loss")[n]), rel=1e-5)
    if family == "ebt":
        assert series("train/lr/descent.alpha")[n] == pytest.approx(lrs[n] * 1500.0)
        curve = [series(f"eval/think_loss/step_{k:02d}")[n] for k in (1, 2, 3)]
        assert all(math.isfinite(x) for x in curve)
    assert "eval/sample/text_summary" in events.Tags()["tensors"]  # the text sample
    (sample,) = events.Tensors("eval/sample/text_summary")
    assert PROMPT_END.encode() in sample.tensor_proto.string_val[0]  # where the model's text begins
    # hyperparameters through the hparams plugin
    plugin = events.PluginTagToContent("hparams")
    assert plugin and any(b"model.flavor" in content for content in plugin.values())


def _optimizer_shards(ckpt_dir, step):
    tag = ckpt_dir / f"step_{step:08d}"
    shards = []
    for rank in (0, 1):
        state = torch.load(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                           map_location="cpu", weights_only=False)["optimizer_state_dict"]
        shards.append(torch.cat([t.flatten() for t in state["single_partition_of_fp32_groups"]]))
    return shards


def test_nonfinite_loss_on_one_rank_is_skipped_everywhere_and_recovers():
    """Rank 1's loss is NaN at step 3 (a transient fault: once per process) and at steps 6 and
    7, which, two in a row, reload the newest checkpoint (step 6's: a skipped update leaves the
    weights as they were) and replay step 7 cleanly."""
    name = "nonfinite"
    overrides = runs.run_overrides("gpt", 2) + [
        f"run_name={name}", "checkpoint.interval=1", "checkpoint.keep=20", "fault.nan_loss_steps=[3, 6, 7]",
        "fault.nan_loss_rank=1", "train.max_consecutive_skips=2", "train.max_reloads=1"]
    result = subprocess.run(runs.train_command(overrides), env=runs.child_env(), cwd=runs.REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reloading step_00000006" in result.stdout
    ckpt = runs.run_dir(name) / "ckpt"
    # Step 3 was skipped on both ranks: each rank's fp32 master partition and the module weights
    # are unchanged by it; the next step is applied again.
    before, after, later = (_optimizer_shards(ckpt, s) for s in (2, 3, 4))
    for rank in (0, 1):
        assert torch.equal(before[rank], after[rank]), f"rank {rank} applied the skipped update"
        assert not torch.equal(after[rank], later[rank]), f"rank {rank} did not resume updating"
    summary = json.loads((runs.run_dir(name) / "summary.json").read_text())
    assert summary["skipped_steps"] == 3 and summary["reloads"] == 1 and summary["steps"] == runs.N_STEPS
    assert math.isfinite(summary["final_train_loss"])
    losses = runs.scalars(name, "train/loss")
    # skipped steps log no loss; step 7 was replayed after the reload
    assert sorted(losses) == [s for s in range(1, runs.N_STEPS + 1) if s not in (3, 6)]
    assert all(math.isfinite(v) for v in losses.values())
    assert runs.scalars(name, "train/skipped_steps")[runs.N_STEPS] == 3
    assert runs.scalars(name, "train/reloads")[6] == 1


def test_nonfinite_updates_that_keep_coming_stop_with_a_clear_error():
    """Without ZeRO (stage 0) the trainer itself drops non-finite gradients; two skips in a row
    with no reloads allowed end the run with a one-line error."""
    name = "nonfinite-stop"
    overrides = ["model.flavor=gpt-tiny", "zero.stage=0", f"run_name={name}",
                 "fault.nan_loss_steps=[5, 6]", "train.max_consecutive_skips=2", "train.max_reloads=0"]
    result = subprocess.run(runs.train_command(overrides, nproc=1), env=runs.child_env(), cwd=runs.REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert ("error: 2 consecutive non-finite updates up to step 6, after 0 reload(s) of the last good "
            "checkpoint (train.max_reloads); lower optimizer.lr or check the data") in result.stderr
    assert not (runs.run_dir(name) / "summary.json").exists()


def test_a_loss_spike_is_skipped_everywhere_and_a_resumed_run_judges_alike():
    """NRGPT guards against spikes by default. With statistics over 4 updates, an injected
    spike (every rank's loss x 1000 at step 8, so its gradients too) is judged before the
    update: every rank's fp32 master partition stays as it was, the next update is applied. A
    run resumed from step 6 carries the statistics in its checkpoint, so it judges step 8 alike
    and logs the uninterrupted run's losses exactly."""
    name = "spike"
    overrides = runs.run_overrides("nrgpt", 2) + [
        "checkpoint.interval=1", "checkpoint.keep=20", "train.spike_window=4", "fault.spike_loss_steps=[8]"]
    for run, extra in ((name, []), (name + "-resumed", [f"resume={runs.run_dir(name) / 'ckpt' / 'step_00000006'}"])):
        result = subprocess.run(runs.train_command(overrides + [f"run_name={run}", *extra]), env=runs.child_env(),
                                cwd=runs.REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "step 8: loss " in result.stdout and ": a spike, update skipped on all ranks" in result.stdout
        summary = json.loads((runs.run_dir(run) / "summary.json").read_text())
        assert summary["spike_skips"] == 1 and summary["skipped_steps"] == 0
        assert runs.scalars(run, "train/spike_skips")[runs.N_STEPS] == 1
    before, after, later = (_optimizer_shards(runs.run_dir(name) / "ckpt", s) for s in (7, 8, 9))
    for rank in (0, 1):
        assert torch.equal(before[rank], after[rank]), f"rank {rank} applied the spike"
        assert not torch.equal(after[rank], later[rank]), f"rank {rank} did not resume updating"
    reference, resumed = runs.scalars(name, "train/loss"), runs.scalars(name + "-resumed", "train/loss")
    assert reference[8] > 100 * reference[7]  # the spike is logged: it was a real loss
    assert sorted(resumed) == list(range(7, runs.N_STEPS + 1))
    assert all(resumed[step] == reference[step] for step in resumed), (resumed, reference)


def test_config_in_run_directory_is_the_resolved_one(matrix):
    name = runs.reference_name("nrgpt", 1)
    cfg = load_config(runs.run_dir(name) / "config.yaml")
    assert cfg.model.flavor == "nrgpt-tiny" and cfg.zero.stage == 1 and cfg.run_name == name


def test_zero_launches_use_torchs_current_collectives(matrix):
    """DeepSpeed's backend gathered with torch.distributed.all_gather_into_tensor (and
    reduce-scattered with reduce_scatter_tensor), which torch deprecates for all_gather_single:
    a FutureWarning from every process of every 2-process ZeRO launch."""
    deprecated = [line for line in matrix.stderr.splitlines()
                  if "FutureWarning" in line and "torch.distributed" in line]
    assert deprecated == [], deprecated


def test_a_micro_batch_drops_the_logits_before_its_backward(tmp_path):
    """The memory plan counts what one micro-batch's forward and backward hold
    (`plan.micro_batch_pass`); the trainer keeps the loss and diagnostics past the forward, not
    the logits ([B, T, V]: 4.6 GiB for GPT-124M at micro-batch 48), which its backward does not
    need. When the backward reaches the model's loss, of each of the step's two micro-batches,
    nothing holds them any more. A world of one in this process, as `runs.command_here` runs the
    trainer."""
    import weakref

    import deepspeed

    from bench.gpu_cases import synthetic_batches
    from pretrain.training.engine import distributed_env
    from pretrain.training.trainer import Trainer

    micro_batch, vocab = 4, 512
    cfg = load_config("configs/tiny/gpt.yaml", [
        "run_name=no-logits", f"output_root={tmp_path}", "data.path=synthetic-tokens", "data.num_workers=0",
        f"data.micro_batch_size={micro_batch}", f"train.global_batch_size={2 * micro_batch}",
        "train.precision=fp32"])
    held = []

    def watch(module, args, output):
        logits = weakref.ref(output.logits)
        output.loss.register_hook(lambda grad: held.append(logits() is not None))

    with runs.world_of_one_here():
        distributed_env()
        deepspeed.init_distributed(verbose=False)
        trainer = Trainer(cfg)
        try:
            trainer.build_engine(vocab)
            trainer.feed(synthetic_batches(micro_batch, cfg.data.seq_len, vocab, pin=False))
            trainer.engine.module.register_forward_hook(watch)
            result = trainer.train_step(log_now=True)
            assert math.isfinite(result.loss)
            assert held == [False, False]
        finally:
            trainer.close()
