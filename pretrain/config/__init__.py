"""The run configuration: one typed tree of dataclasses, read from a YAML file plus
`key.sub=value` command-line overrides, checked completely before any work starts.

    cfg = load_config("configs/tiny/gpt.yaml", ["train.max_steps=50", "zero.stage=3"])
    validate(cfg, world_size=2, has_gpu=False)   # pretrain.config.validation: can it run here

Every mistake (unknown key, wrong type, impossible combination) raises `ConfigError` with one
line naming the key and where it came from. `engine.deepspeed_config` turns the tree into
DeepSpeed's JSON; `to_dict` gives the resolved form written into the run directory and into
every checkpoint."""
from __future__ import annotations

import dataclasses
import math
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pretrain.config.precision import PrecisionSetting, resolve_precision
from pretrain.config.typed import YAMLError, load_yaml, parse_override, read_typed

RESUME_MODES = ("auto", "never", "restart")
"""`resume` is one of these or a path to a run directory / checkpoint."""
PREPARATION_KEYS = {"data.source", "data.tokenizer", "data.val_fraction"}
"""Overrides that ask for a dataset to be prepared from a source (see `load_config`)."""


class ConfigError(ValueError):
    """A configuration mistake; the message is one line naming the key and its origin."""


@dataclass
class ModelSection:
    flavor: str = "gpt-tiny"
    """Registered model flavor (`python -m pretrain.models` lists them)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of the flavor's config to change, e.g. {n_steps: 4}. Unless given here,
    `vocab_size` comes from the dataset (padded up to a multiple of 64) and `block_size` from
    `data.seq_len`."""
    activation_checkpointing: str | None = None
    """"off", "step" (each unrolled recurrent/descent step) or "block" (each transformer block),
    recomputed in backward; None keeps the flavor's setting."""
    init_from: str | None = None
    """A local Hugging Face directory to start from instead of the random initialisation
    (continued pretraining, fine-tuning): GPT-2 for gpt, Llama for transformer_pp, or an export
    of the run's family (`pretrain.export --format hf`). Every weight must match the run's model
    in name and shape. A resumed run continues from its checkpoint instead."""
    compile: str = "off"
    """torch.compile the model through DeepSpeed's engine.compile: "off", or a torch.compile
    backend ("inductor" for generated kernels; "aot_eager" traces without generating code, for
    debugging). Off by default: not yet measured to pay on GPU (docs/benchmarks.md). Refused where
    the forward differentiates itself (EBT's energy_gradient 'autograd'), which it does not trace."""


@dataclass
class MixtureEntry:
    path: str = ""
    """Prepared dataset directory whose train split is part of the mixture (same tokenizer and
    seq_len as `data.path`)."""
    proportion: float | None = None
    """Relative share of each epoch's training windows (normalized over the entries; an epoch
    holds as many windows as the datasets together). Give every entry a proportion, or every
    entry a repeat."""
    repeat: float | None = None
    """Instead of a proportion: how often each epoch reads this dataset (2: every window twice,
    0.5: a fresh random half each epoch)."""


@dataclass
class DataSection:
    path: str = ""
    """Prepared dataset directory (manifest.json, train/, val/), relative to the working directory,
    or a dataset in an object store, s3://bucket/prefix (read from a node-local copy in
    `cache_dir`; credentials and endpoint from the AWS_* variables and S3_ENDPOINT_URL)."""
    source: str | None = None
    """If set and `path` holds no dataset yet, prepare it from this source first (e.g.
    "shakespeare"); None means the dataset must already exist. A `data.path=DIR` override on the
    command line without data.source/tokenizer/val_fraction overrides sets it to None: DIR's
    prepared dataset is used as it is."""
    seq_len: int = 1024
    """Tokens per training sequence (the dataset's windows hold seq_len + 1 tokens)."""
    tokenizer: str = "gpt2"
    """Tokenizer used when preparing from `source`: "gpt2" or "char"."""
    val_fraction: float = 0.0005
    """Fraction of documents held out for validation when preparing from `source`."""
    micro_batch_size: int = 8
    """The most sequences one process passes forward and backward at once (what fits on one
    GPU). The trainer uses the largest micro-batch up to this that splits the global batch
    evenly at the run's world size (see `batch_split`)."""
    num_workers: int = 2
    """Data loader worker processes per training process."""
    allow_change: bool = False
    """Resume onto a dataset other than the checkpoint's (continued pretraining on new data): the
    loader then starts at the new data's beginning. Off: such a resume is refused."""
    revision: str | None = None
    """Hub sources: the branch, tag or commit `source` is prepared from (None: default branch)."""
    overwrite: bool = False
    """Rebuild the dataset at `path` from `source` when it was prepared with other settings or
    from another state of the source (the default refuses to start)."""
    mixture: list[MixtureEntry] = field(default_factory=list)
    """Train on a mixture of prepared datasets instead of `path`'s train split (evaluation
    still reads `path`'s val split); empty: no mixture."""
    cache_dir: str = ""
    """Where a node keeps its copies of s3:// datasets, one per dataset shared by all its ranks
    and jobs (a node-local disk); empty: `pretrain-data-cache` in the temp directory ($TMPDIR,
    else /tmp)."""
    cache_limit: str | None = None
    """The most bytes the copies in `cache_dir` may take, e.g. "50gb": the least recently used
    other datasets are removed to make room; None: no limit."""


DECAY_SETS = {
    "matrices": "tensors of 2 or more dimensions except the embedding tables and an untied LM head",
    "nanogpt": "every tensor of 2 or more dimensions, embeddings and LM head included (nanoGPT)",
    "all": "every parameter except step sizes such as EBT's alpha (the EBT and NRGPT ListOps scripts)",
}
"""`optimizer.decay` -> the parameters it decays (with `optimizer.weight_decay`)."""


@dataclass
class OptimizerSection:
    lr: float = 6e-4
    """Peak learning rate (AdamW)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to the parameters of the `decay` set."""
    decay: str = "matrices"
    """Which parameters weight decay applies to: a name of `DECAY_SETS`."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    fused: bool | None = None
    """Use torch AdamW's fused kernel (the whole update in a few kernel launches) instead of
    the multi-tensor one; None: fused on GPU, not on CPU. DeepSpeedCPUAdam replaces AdamW with
    `zero.offload_optimizer`."""
    lr_multipliers: dict[str, float] = field(default_factory=dict)
    """Extra learning-rate multipliers, glob pattern over parameter names -> factor, applied on
    top of the model's own (`lr_multipliers()`, e.g. EBT's alpha). Each gets its own group."""


ScheduleKind = Literal["cosine", "exponential", "constant"]
LengthChangeSchedule = Literal["recompute", "continue"]
SpikeSkipping = Literal["auto", "on", "off"]
TrainingDevice = Literal["auto", "cuda"]
ZeroStage = Literal[0, 1, 2, 3]
"""The choices of `schedule.kind`, `schedule.on_length_change`, `train.skip_spikes`,
`train.device` and `zero.stage`, which `validate` checks and names (`train.precision`'s are
`precision.PrecisionSetting`)."""


@dataclass
class ScheduleSection:
    kind: ScheduleKind = "cosine"
    """"cosine" (to min_lr), "exponential" (geometric decay to min_lr, the NRGPT paper's) or
    "constant", each after a linear warmup."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `optimizer.lr`."""
    min_lr: float = 0.0
    """Learning rate reached at the end of the decay (must be > 0 for "exponential")."""
    decay_steps: int | None = None
    """Step at which the decay reaches `min_lr` (held afterwards); None: the end of the budget."""
    on_length_change: LengthChangeSchedule = "recompute"
    """What the learning rate does when a resume changes the run's length (a larger
    `train.max_steps` to extend a finished run, say): "recompute" plans the schedule afresh for
    the new length (the LR jumps to where that plan stands), "continue" decays from the LR the
    run stands at to `min_lr` at the new end, with the same kind of decay. Recorded at that
    resume, so that later resumes keep it whatever this says then."""


@dataclass
class TrainSection:
    max_steps: int | None = None
    """Budget in optimizer steps; with `max_tokens` too, whichever comes first."""
    max_tokens: int | None = None
    """Budget in training tokens (rounded up to whole optimizer steps)."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all processes. Fixed whatever the world size: the
    micro-batch and gradient accumulation adapt to it (see `batch_split`); it must be divisible
    by the number of processes."""
    device: TrainingDevice = "auto"
    """"auto": a GPU when torch can use one, else the CPU; "cuda": a GPU, or stop with an error
    (a cluster run that silently trained on CPU in fp32 would waste its allocation)."""
    precision: PrecisionSetting = "auto"
    """"auto" (bf16 on GPU, fp32 on CPU: pure bf16, whose val losses at paper depth matched
    bf16-autocast's and fp32's within the seed spread at half the weight memory;
    docs/benchmarks.md), "fp32", "bf16" (weights, activations and gradients in bf16, DeepSpeed's
    bf16 mode, with fp32 master weights in the optimizer), "bf16-autocast" (fp32 weights,
    gradients and optimizer, the forward's matmuls in bf16 under torch.autocast, as the papers'
    nanoGPT-style code trains) or "fp16" (GPU only)."""
    log_interval: int = 10
    """Optimizer steps between console lines and TensorBoard points."""
    max_consecutive_skips: int = 3
    """After this many consecutive updates skipped for a non-finite loss or gradient norm,
    reload the last good checkpoint."""
    max_reloads: int = 2
    """Checkpoint reloads allowed for non-finite updates before the run stops with an error."""
    skip_spikes: SpikeSkipping = "auto"
    """Skip an update whose loss or gradient norm (before clipping) is a spike: more than
    `spike_sigmas` standard deviations above the mean of the last `spike_window` updates'.
    "auto": on for NRGPT (its training spikes at learning rates near the best), "on" or "off"."""
    spike_window: int = 100
    """Updates the spike statistics are taken over; no update is judged before there are this many."""
    spike_sigmas: float = 6.0
    """How many standard deviations above the rolling mean make a spike."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for MFU; None looks the device up in pretrain.training.flops."""
    tf32: bool = True
    """On GPU, let float32 matmuls use TF32 tensor cores (fp32 runs, and the float32 parts of
    bf16 runs); no effect on CPU."""
    collective_timeout: float = 1800.0
    """Seconds a collective waits for the other processes before the run stops with one line
    naming the lost peer (a node that failed or was cut off). A process that dies is noticed at
    once; a silent one only after this. Sized for a first step that compiles the model on a slow
    node while the others wait; lower it to learn of a cut-off node sooner."""
    hang_factor: float = 20.0
    """The watchdog: a rank on which no step completes within this many times the slowest step
    it has run (and at least `hang_min_s`) writes every thread's stack to its log and exits
    with code 124, which the launcher's in-job restart treats as a crash. 0 turns it off."""
    hang_min_s: float = 300.0
    """The least time the watchdog waits for a step, however fast the steps were."""
    hang_first_s: float = 1800.0
    """What the watchdog waits for a job's first two steps (compiling, the first batches) and
    for an evaluation, a checkpoint save or a reload."""
    straggler_factor: float = 1.5
    """A rank whose own part of a step (its data wait and computation, before it waits for the
    others) takes more than this many times the median rank's, and 50 ms more, at
    `straggler_intervals` log intervals in a row, is named in a warning. 0 turns the warning off
    (the TensorBoard scalars train/slowest_rank_ms and train/straggler_ratio stay)."""
    straggler_intervals: int = 3
    """Log intervals in a row that a rank must be slow at to be named."""


@dataclass
class ZeroSection:
    stage: ZeroStage = 2
    """ZeRO stage: 0 (plain data parallel), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)."""
    offload_optimizer: bool = False
    """Keep optimizer states in CPU memory and step there (DeepSpeedCPUAdam); stage >= 1."""
    overlap_comm: bool = False
    """Overlap gradient reduction with the backward pass."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_bucket_size: int = 500_000_000
    """Elements reduced at once."""
    allgather_bucket_size: int = 500_000_000
    """Elements all-gathered at once (stages 1-2)."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: elements of parameters fetched ahead of use."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: parameters smaller than this stay unpartitioned."""


@dataclass
class CheckpointSection:
    interval: int = 1000
    """Optimizer steps between checkpoints; 0 saves only at the end (and on preemption)."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    remote: str = ""
    """An object store to upload every checkpoint to, s3://bucket/prefix (the run's checkpoints
    go to REMOTE/RUN_NAME/ckpt/, `keep` applying there too), uploaded in the background once
    complete locally, its complete.json last. A run whose run directory has no newer complete
    checkpoint resumes from the newest complete one there (`resume=auto`); empty: none."""
    upload_attempts: int = 5
    """Tries of a checkpoint upload while the object store cannot be reached, the waits between
    them doubling from 1 s; after the last, the checkpoint stays local and the next save (or the
    end of the run, or the next run) uploads the newest one."""


@dataclass
class DownstreamSection:
    """lm-evaluation-harness tasks evaluated during training (pretrain.downstream)."""

    tasks: list[str] = field(default_factory=list)
    """Suites or task names (as `python -m pretrain.evaluate --tasks`); empty: off."""
    limit: int = 20
    """Documents per task: the first `limit`, the same subset at every evaluation."""
    interval: int = 0
    """Optimizer steps between downstream evaluations (checked at each evaluation, so a
    multiple of eval.interval); 0: only at the end of the run."""
    batch_size: int = 8
    """Sequences per forward pass."""


@dataclass
class EvalSection:
    interval: int = 1000
    """Optimizer steps between evaluations; 0 evaluates only at the end (and not at all on a
    dataset without a val split, prepared with --val-fraction 0)."""
    batches: int = 20
    """Validation micro-batches per process per evaluation."""
    think_steps: int = 4
    """EBT: the thinking curve reports the val loss after 1..think_steps inference steps."""
    sample_tokens: int = 64
    """Length of the generated text sample logged at each evaluation; 0 disables it."""
    sample_temperature: float = 0.8
    """Sampling temperature of the text sample."""
    dynamics: bool = False
    """Also measure the descent's cheap scalars (gpt_rec, NRGPT: the loss when reading out after
    each step, NRGPT's share of tokens whose energy never rises; EBT: energy-loss rank
    correlation) on each process's first val micro-batch, into TensorBoard (`eval/dynamics/...`)
    and summary.json (`dynamics`); other families have no descent and get none."""
    downstream: DownstreamSection = field(default_factory=DownstreamSection)
    """Downstream tasks evaluated on every rank; values to TensorBoard and summary.json."""


@dataclass
class FaultSection:
    """Test-only fault injection; leave empty in real runs."""

    nan_loss_steps: list[int] = field(default_factory=list)
    """Optimizer steps whose loss is made NaN on rank `nan_loss_rank`, the first time each is run
    in a process (so a step replayed after a checkpoint reload runs clean, like a transient fault)."""
    nan_loss_rank: int = 0
    """The rank that sees the injected NaN."""
    spike_loss_steps: list[int] = field(default_factory=list)
    """Optimizer steps whose loss is multiplied by `spike_loss_factor` on every rank, the first
    time each is run in a process: a loss and gradient-norm spike."""
    spike_loss_factor: float = 1000.0
    """The factor of an injected spike."""
    checkpoint_stall_file: str = ""
    """While this file exists, every rank waits after writing its checkpoint files, before the
    checkpoint is marked complete: the window in which a test loses a node mid-checkpoint."""
    step_stall_file: str = ""
    """While this file exists, every rank waits before optimizer step `step_stall_from` and each
    one after it, outside any collective, until a stop signal: a test holds a run at a known
    step, however fast it trains, to cut, kill or preempt a node there."""
    step_stall_from: int = 0
    """The first step that `step_stall_file` holds."""
    hang_read_rank: int = -1
    """This rank blocks forever in its data read before optimizer step `hang_read_step`, as a
    read from a stuck network file system would, in a job's first start of its ranks only (an
    in-job restart runs clean); -1: none."""
    hang_read_step: int = 0
    """The step whose data read `hang_read_rank` blocks."""
    slow_rank: int = -1
    """This rank sleeps `slow_rank_s` before each of its data reads: a straggler; -1: none."""
    slow_rank_s: float = 0.0
    """How long `slow_rank` sleeps per read."""


REPLACED_SUFFIX = ".replaced-%Y%m%d-%H%M%S"
"""`resume=restart` moves a run directory aside to its name plus this suffix (strftime's format)."""
FILE_NAME_MAX = 255
"""The most bytes a file name may have (NAME_MAX of Linux file systems)."""


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot name a run directory, or None. Besides the run directory itself, its
    name goes into OUTPUT_ROOT/.<name>.lock (the run's lock) and <name>.replaced-TIME (where
    `resume=restart` moves it), into log and Slurm file names and onto command lines, so it must
    be one plain, visible file name that still fits once the longest of those is added."""
    if name in ("", ".", ".."):
        return "must be a plain directory name"
    if "/" in name:
        return "must be a plain directory name, without '/' (put directories into output_root)"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "must not hold control characters (a newline, a tab, a NUL byte)"
    if name != name.strip():
        return "must not begin or end with white space"
    if name.startswith("."):
        return "must not begin with '.' (the output root's dot-names are the runs' locks and staging directories)"
    extra = len(time.strftime(REPLACED_SUFFIX, time.gmtime(0)))  # fixed width: digits only
    if len(name.encode()) + extra > FILE_NAME_MAX:
        return (f"is {len(name.encode())} bytes long; at most {FILE_NAME_MAX - extra} fit (a file name has at "
                f"most {FILE_NAME_MAX}, and resume=restart adds {extra} to it)")
    return None


@dataclass
class RunConfig:
    run_name: str = ""
    """Name of the run directory under `output_root`; empty: the config file's name."""
    output_root: str = "checkpoints"
    """Directory holding run directories."""
    resume: str = "auto"
    """"auto" (the run directory's newest intact checkpoint, if any), "never" (a fresh start,
    refused if the run directory holds checkpoints), "restart" (move an existing run directory
    aside to RUN_DIR.replaced-TIME, never deleting it, and start fresh), or a path to a run
    directory or to one checkpoint to start from."""
    seed: int = 1337
    """Seed of the model initialisation, the data order and each process's RNGs."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    fault: FaultSection = field(default_factory=FaultSection)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_root) / self.run_name

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.data.seq_len

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: the smaller of the two budgets."""
        return self.total_steps_after(step=0, tokens_seen=0)

    def total_steps_after(self, step: int, tokens_seen: int) -> int:
        """Optimizer steps of the whole run for one that has taken `step` steps and consumed
        `tokens_seen` tokens, possibly at another global batch: `train.max_steps`, or the steps
        that consume what is left of `train.max_tokens` at this global batch, whichever is smaller."""
        budgets = []
        if self.train.max_steps is not None:
            budgets.append(self.train.max_steps)
        if self.train.max_tokens is not None:
            left = max(0, self.train.max_tokens - tokens_seen)
            budgets.append(step + math.ceil(left / self.tokens_per_step))
        return min(budgets)


# ---------------------------------------------------------------------------------------------
# Reading: YAML + overrides -> typed tree


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read `path`, apply `key.sub=value` overrides (values parsed as YAML scalars) and build the
    typed tree. Raises ConfigError naming the key and the file (or the command line)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--config {path} is a directory; give one of its YAML files")
    try:
        raw = load_yaml(path.read_text(), str(path)) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except YAMLError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    if "families" in raw:  # a key of sweep files only: say so instead of naming it an unknown key
        raise ConfigError(
            f"{path} is a scaling sweep file, not a run config; `python -m pretrain.scaling run {path} "
            "--dry-run` writes each of its runs' config into the directory it names, and --config takes "
            "one of those")
    from_command_line = set()
    override_keys = {item.partition("=")[0].strip() for item in overrides}
    if "data.path" in override_keys and not override_keys & PREPARATION_KEYS:
        # a dataset named on the command line is used as it was prepared; the config's own
        # preparation settings describe its default dataset, not this one
        raw.setdefault("data", {})
        if isinstance(raw["data"], dict):
            raw["data"]["source"] = None
    for item in overrides:
        key, value = parse_override(item, ConfigError)
        _set_dotted(raw, key, value)
        from_command_line.add(key)

    def origin(key: str) -> str:
        # a key the command line set, inside one it set, or a section only it introduced
        by_command_line = any(key == k or key.startswith(k + ".") or k.startswith(key + ".")
                              for k in from_command_line)
        return "command line" if by_command_line else str(path)

    cfg = read_typed(RunConfig, raw, origin, ConfigError)
    if not cfg.run_name:
        cfg.run_name = path.stem
    return cfg


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for i, name in enumerate(parents):
        child = node.setdefault(name, {})
        if not isinstance(child, dict):
            raise ConfigError(f"command line: {'.'.join(parents[:i + 1])} is not a section, "
                              f"cannot set {key}")
        node = child
    node[leaf] = value


def to_dict(cfg: RunConfig) -> dict:
    """The resolved config as plain data (what config.yaml and checkpoints hold)."""
    return dataclasses.asdict(cfg)


def from_dict(raw: dict, origin: str = "checkpoint") -> RunConfig:
    """Rebuild a config written by `to_dict` (e.g. from a run directory's config.yaml)."""
    return read_typed(RunConfig, raw, lambda key: origin, ConfigError)


# ---------------------------------------------------------------------------------------------
# Checking: impossible values and combinations, before any work


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's global batch is split: global = micro x world x accumulation."""
    micro_batch_size: int
    accumulation_steps: int


def batch_split(cfg: RunConfig, world_size: int) -> BatchSplit:
    """The split of the global batch at `world_size` processes with the largest micro-batch up
    to data.micro_batch_size: the global batch (the science) stays as configured at any GPU count
    that divides it. Raises ConfigError naming the nearest GPU counts that do."""
    global_batch = cfg.train.global_batch_size
    if global_batch % world_size:
        divisors = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        fewer = [n for n in divisors if n < world_size][-2:]
        more = [n for n in divisors if n > world_size][:2]
        raise ConfigError(
            f"train.global_batch_size={global_batch}: {world_size} processes cannot share it evenly; "
            f"use a GPU count that divides it ({', '.join(map(str, fewer + more))} are the nearest), "
            "or a global batch that the GPU count divides")
    per_process = global_batch // world_size
    micro = max(m for m in range(1, min(cfg.data.micro_batch_size, per_process) + 1) if per_process % m == 0)
    return BatchSplit(micro_batch_size=micro, accumulation_steps=per_process // micro)


def describe_batch_split(cfg: RunConfig, world_size: int) -> str:
    """The split for the console: the trainer's choice, and why when it is not the configured one."""
    split = batch_split(cfg, world_size)
    line = (f"global batch {cfg.train.global_batch_size} = micro-batch {split.micro_batch_size} x "
            f"{world_size} process(es) x {split.accumulation_steps} accumulation step(s)")
    if split.micro_batch_size < cfg.data.micro_batch_size:
        line += (f" (data.micro_batch_size={cfg.data.micro_batch_size} is the most; "
                 f"{cfg.train.global_batch_size // world_size} sequences per process split evenly "
                 f"into micro-batches of {split.micro_batch_size})")
    return line


def gpu_attention(cfg: RunConfig, config: Any = None) -> tuple[str, int, str] | None:
    """(kernel, head dim, precision) of the attention that training of `cfg` (its model config
    `config`, resolved here if not given) runs through SDPA on the GPUs (`models.sdpa`): on this
    node's GPU, or where a login node checks a GPU run, on an H100-class one (A100s take the same
    kernels); None for a model without SDPA attention."""
    import torch

    from pretrain.models import resolve
    from pretrain.models.sdpa import sdpa_kernel
    config = config or resolve(cfg.model.flavor, typed_model_overrides(cfg))
    if config.sdpa_head_dim is None:
        return None
    precision = resolve_precision(cfg.train.precision, has_gpu=True)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    kernel = sdpa_kernel(config.sdpa_head_dim, precision.compute_dtype, capability, dropout=config.dropout > 0)
    return kernel, config.sdpa_head_dim, precision.compute_name


def describe_attention(cfg: RunConfig, on_gpu: bool) -> list[str]:
    """The console's line on the GPU attention kernel (none on CPU or without SDPA)."""
    attention = gpu_attention(cfg) if on_gpu else None
    if attention is None:
        return []
    kernel, head_dim, precision = attention
    return [f"attention: SDPA's {kernel} kernel on the GPU (head dim {head_dim}, {precision})"]


def get_key(node: RunConfig | dict, key: str) -> Any:
    """The value at dotted `key` of a config or of its `to_dict` form."""
    for name in key.split("."):
        node = node[name] if isinstance(node, dict) else getattr(node, name)
    return node


def model_config(cfg: RunConfig, dataset_vocab_size: int) -> Any:
    """The model's config: the flavor with `model.overrides`, the dataset's vocabulary (padded
    up to a multiple of 64 for fast matmuls) and `data.seq_len` as context unless overridden."""
    from pretrain.models import padded_vocab, resolve

    overrides = {"vocab_size": padded_vocab(dataset_vocab_size), "block_size": cfg.data.seq_len}
    if cfg.model.activation_checkpointing is not None:
        overrides["activation_checkpointing"] = cfg.model.activation_checkpointing
    overrides.update(typed_model_overrides(cfg))
    return resolve(cfg.model.flavor, overrides)


def typed_model_overrides(cfg: RunConfig) -> dict[str, Any]:
    """`model.overrides` read against the flavor's config fields (the section itself is untyped,
    as flavors differ): `bias: no` is the word "no" in YAML 1.2 until it meets a true/false field.
    Unknown flavors and fields are left to `resolve` to name."""
    from pretrain.models import FLAVORS

    flavor = FLAVORS.get(cfg.model.flavor)
    hints = typing.get_type_hints(type(flavor)) if flavor is not None else {}
    return {key: read_typed(hints[key], value, lambda _: "model.overrides", ConfigError, key)
            if key in hints else value for key, value in cfg.model.overrides.items()}
