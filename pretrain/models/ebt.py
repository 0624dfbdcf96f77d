"""Energy-Based Transformer (EBT) for autoregressive language modelling: "Energy-Based Transformers
are Scalable Learners and Thinkers" (arXiv 2507.02092; section numbers below are those of v1), as
its released code computes it.

A Llama-style transformer scores a candidate distribution over the next token with one scalar
energy per position. The prediction is found by gradient descent on the candidate:

    y_0 ~ N(0, candidate_init_std)                         [B, T, V] candidate logits
    p_t = softmax(y_t [+ Langevin noise])
    E_t = EnergyHead(Backbone([observed tokens ; p_t @ W_ve]))   [B, T]
    y_{t+1} = p_t - alpha * dE_t/dp_t       (dE/dp as a differentiable value: `ebt_gradient`)

and training backpropagates the next-token cross entropy of log_softmax(y_{t+1}) through the
descent (through the energy gradient, a second derivative of E): Sec. 3.2, Eq. (1) and Algorithm 1 (the paper writes the gradient w.r.t.
the logits, see `grad_wrt`). The landscape regularisers (replay buffer, Langevin noise,
randomised step size and step count) are Sec. 3.3, Eq. (2); thinking longer and best-of-N
self-verification (`think`) are Sec. 3.3 and Algorithm 2.

The backbone runs two streams with the same weights: the observed tokens with ordinary causal
attention, and one predicted row per position i that attends to observed tokens 0..i and to
itself only (never to observed token i+1, its target, nor to other predictions): Sec. 3.4 and
Appendix C.3, Eq. (3). Row i takes the rotary position of the token it predicts, i + 1 (as the
released code). Without step conditioning the observed stream does not depend on the
candidate: its keys and values are computed once per batch and every descent step runs only
the predicted rows.

The descent, with every parameter, is `ebt_descent.EnergyDescent`; here are the config, the
model around it (training, thinking, decoding) and its registration.
"""
from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.models.blocks import check_choice, check_positive
from pretrain.models.common import DecodeCache, LanguageModel, ModelOutput
from pretrain.models.descent_plumbing import seeded_rng
from pretrain.models.ebt_descent import EnergyDescent
from pretrain.models.llama import LlamaConfig, block_flops, check_length, init_weights
from pretrain.models.registry import FamilySpec, register_family, register_flavor
from pretrain.models.replay import LEGACY_REPLAY_BUFFERS, ReplayStore, replay_scratch_bytes, replay_store_bytes


@dataclass
class EBTConfig(LlamaConfig):
    """EBT on the Llama backbone. The paper's S1 (scaling) and S2 (thinking) recipes are combinations of the
    options below (see the registered flavors)."""

    n_steps: int = 2
    """Descent steps per forward; the maximum when `min_steps` randomises them, and always the
    number used at eval."""
    min_steps: int = 0
    """If > 0, training draws the number of steps uniformly from [min_steps, n_steps] once per
    batch (S2: 2..3), the same on every rank (`seed_shared_draws`)."""
    alpha: float = 500.0
    """Descent step size (the initial value when learnable): the released S1 recipe starts at
    500, S2 keeps 5."""
    alpha_learnable: bool = True
    """Learn alpha (an nn.Parameter, S1) or keep it fixed (a buffer, S2)."""
    alpha_lr_mult: float = 1500.0
    """Learning-rate multiplier of a learnable alpha, exposed through `lr_multipliers()` (the
    released S1 recipe uses 1500: Adam's steps of ~LR would not move a value of ~500)."""
    alpha_randomize: float = 1.0
    """Training draws each (sample, position)'s step size uniformly from
    [alpha / alpha_randomize, alpha * alpha_randomize], once per batch; 1 = off (S2: 2)."""
    candidate_init_std: float = 1.0
    """Std of the Gaussian noise the candidate logits start from."""
    langevin_noise_std: float = 0.0
    """Std of the Gaussian noise added to the candidate before each step, in training only
    (S2: 3)."""
    detach_between_steps: bool = True
    """Cut the graph between steps (S1): each step's loss reaches the parameters only through
    its own energy gradient. False keeps the graph through the candidate (S2)."""
    truncate_loss: bool = False
    """Loss from the last step only, and only the last step builds the second-order graph
    (S2); otherwise the mean cross entropy over steps (S1)."""
    replay_buffer_size: int = 0
    """Rows of the replay buffer (0 = off): tokens, targets and final candidate of recent training
    rows, per rank, on the device (`ReplayStore`; its size: `replay_store_bytes`)."""
    replay_top_k: int = 1024
    """How the replay buffer keeps a candidate distribution, per position: its replay_top_k
    largest probabilities with their ids, the rest of the mass spread evenly over the other ids
    (1024: replayed rows' loss as from the whole logits, measured by `bench.replay`); 0 (or
    >= vocab_size) keeps the whole candidate logits."""
    replay_fraction: float = 0.25
    """With a replay buffer, each training batch is extended by this fraction of its rows,
    drawn from the buffer and restarted from their stored final candidates."""
    time_embed: bool = False
    """Step conditioning: a learned embedding of the step index is prepended to the observed
    stream as token 0 (the released scripts' "time_embed")."""
    step_embeddings: str = "per_step"
    """With time_embed: one row per step index ("per_step", steps beyond n_steps reuse the last;
    the observed stream then depends on the step) or one row for every step ("shared", the
    released S2 script: all its 2-3 steps descend one energy landscape). Per-step rows with
    truncate_loss are refused unless min_steps = 1: rows that never end a training descent
    would never receive a gradient."""
    reuse_observed_stream: bool = True
    """Compute the observed stream's keys/values once per batch and reuse them in every step
    (exact unless the step embedding changes per step). False recomputes them per step, as
    the released code."""
    expected_embedding: bool = False
    """Embed the candidate with the input embedding table (p @ W_e) instead of a learned V x D
    matrix W_ve."""
    grad_wrt: str = "probs"
    """Differentiate the energy w.r.t. the probabilities p and update y <- p - alpha dE/dp
    (released code), or w.r.t. the logits y and update y <- y - alpha dE/dy ("logits", the
    paper's pseudocode)."""
    eval_seed: int = 0
    """Seed of the initial candidate noise at eval and in `think` (eval_seed + 1: their Langevin
    noise), so that evaluation is reproducible and does not consume the training RNG."""
    langevin_noise_eval: bool = False
    """Add the Langevin noise at eval and in `think` too, as the released code's validation
    does; False adds it in training only."""
    attention_chunks: int | None = None
    """Row chunks of the predicted rows' attention (`ebt_attention`): more skip more of the
    causally masked [rows, keys] area, fewer launch fewer kernels. None chooses by device
    (`default_chunks`: 4 on the CPU, 1 on a GPU, whose step is launch-bound)."""
    energy_gradient: str = "autograd"
    """How a descent step takes dE/dp: "autograd", torch.autograd.grad with create_graph inside
    the forward (the loss is then a second-order graph); "first_order", the predicted stream's
    backward written out as ordinary operations (`ebt_gradient`), the same values (to 1e-10 in
    float64; to rounding in float32 and bf16) differentiated once, which torch.compile could
    trace, and far less memory with block checkpointing. The default is the model every earlier
    checkpoint was trained with, so those resume to the bit. The first has no dropout in its
    backward: it needs dropout 0."""
    init: str = "scaled"
    """"scaled": N(0, init_std) weights, residual projections at init_std / sqrt(2 n_layer),
    energy head at init_std / alpha; "authors": the released code's Xavier-normal for every
    linear map (candidate embedding and energy head included), N(0, 1) token and step
    embeddings, no scaling."""

    EXECUTION_FIELDS: ClassVar[tuple[str, ...]] = (*LlamaConfig.EXECUTION_FIELDS, "attention_chunks",
                                                    "energy_gradient")

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "n_steps", "alpha", "alpha_lr_mult", "alpha_randomize", "candidate_init_std")
        if self.attention_chunks is not None and self.attention_chunks < 1:
            raise ValueError(f"EBTConfig.attention_chunks must be >= 1 or None, got {self.attention_chunks}")
        check_choice(self, "grad_wrt", ("probs", "logits"))
        check_choice(self, "step_embeddings", ("per_step", "shared"))
        check_choice(self, "init", ("scaled", "authors"))
        check_choice(self, "energy_gradient", ("first_order", "autograd"))
        if self.energy_gradient == "first_order" and self.dropout:
            raise ValueError("EBTConfig.dropout needs energy_gradient='autograd': the first-order gradient "
                             "has no dropout")
        if not 0 <= self.min_steps <= self.n_steps:
            raise ValueError(f"EBTConfig.min_steps must be in [0, n_steps={self.n_steps}], got {self.min_steps}")
        if self.alpha_randomize < 1:
            raise ValueError(f"EBTConfig.alpha_randomize must be >= 1, got {self.alpha_randomize}")
        if self.langevin_noise_std < 0 or self.replay_buffer_size < 0 or self.replay_top_k < 0:
            raise ValueError("EBTConfig.langevin_noise_std, replay_buffer_size and replay_top_k must be >= 0")
        if not 0 < self.replay_fraction <= 1:
            raise ValueError(f"EBTConfig.replay_fraction must be in (0, 1], got {self.replay_fraction}")
        if self.step_embeddings == "shared" and not self.time_embed:
            raise ValueError("EBTConfig.step_embeddings='shared' needs time_embed=True")
        per_step = self.time_embed and self.step_embeddings == "per_step"
        if per_step and self.reuse_observed_stream:
            raise ValueError("EBTConfig.reuse_observed_stream needs time_embed=False or step_embeddings="
                             "'shared': per-step conditioning makes the observed stream depend on the step")
        shortest = self.min_steps or self.n_steps
        if per_step and self.truncate_loss and shortest > 1:
            raise ValueError(f"EBTConfig.step_embeddings='per_step' with truncate_loss and at least {shortest} "
                             f"training steps: step embedding rows 0..{shortest - 2} never end a descent, so "
                             "they never receive a gradient; use step_embeddings='shared' or min_steps=1")

    @property
    def n_prefix(self) -> int:
        """Tokens before the observed sequence in the observed stream (the step embedding)."""
        return 1 if self.time_embed else 0

    def replayed_rows(self, batch_size: int) -> int:
        """Rows a training batch of `batch_size` is extended by from a full replay store."""
        if self.replay_buffer_size == 0:
            return 0
        return min(round(self.replay_fraction * batch_size), self.replay_buffer_size)

    @property
    def n_step_embeddings(self) -> int:
        """Rows of the step embedding table (with time_embed)."""
        return 1 if self.step_embeddings == "shared" else self.n_steps


class ThinkOutput(NamedTuple):
    logits: torch.Tensor
    """[B, R, V] log-probabilities of the chosen final candidates."""
    energies: torch.Tensor
    """[steps + 1, B, R] energy before each step and of the final candidate (chosen samples)."""
    loss_per_step: torch.Tensor | None
    """[steps] mean cross entropy after 1..steps steps (chosen samples), given targets."""
    steps_taken: torch.Tensor | None = None
    """[B, R] descent steps each position took (chosen samples), with a `stop_tolerance`."""
    token_losses: torch.Tensor | None = None
    """[steps, B, R] cross entropy per position after each step (chosen samples), given targets."""


def take_legacy_replay_buffers(model: EBT, state_dict: dict, prefix: str, *_) -> None:
    """Load-state hook: module state from before `ReplayStore` holds the replay buffer as buffers,
    which go into the model's store (in its layout) instead of being unexpected keys."""
    legacy = {name: state_dict.pop(prefix + name) for name in LEGACY_REPLAY_BUFFERS if prefix + name in state_dict}
    if legacy and model.replay_store is not None:
        model.replay_store.load_legacy(legacy, model.descent.energy_head.weight.device)


class EBT(LanguageModel):
    @staticmethod
    def compile_refusal(config: EBTConfig) -> str | None:
        if config.energy_gradient == "first_order":
            return None
        return ("its energy gradient (energy_gradient='autograd') differentiates inside the forward (double "
                "backward), which torch.compile does not support; set model.overrides.energy_gradient: first_order")

    def __init__(self, config: EBTConfig):
        super().__init__()
        self.config = config
        self.descent = EnergyDescent(config)
        if config.init == "authors":
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_normal_(module.weight)
                elif isinstance(module, nn.Embedding):
                    nn.init.normal_(module.weight, std=1.0)
        else:
            init_weights(self, config)
            # The first step moves the candidate by alpha * dE/dp, which is proportional to the
            # energy head: scaling it by 1/alpha keeps that first move the size it has at alpha = 1
            # (with N(0, init_std), ebt-s1-small's first-step loss was 1054 nats, ~100 ln V).
            nn.init.normal_(self.descent.energy_head.weight, std=config.init_std / config.alpha)
        self.replay_store = ReplayStore(config) if config.replay_buffer_size else None
        self.seed_shared_draws("0")  # until the trainer seeds them: models built alike draw alike
        self.register_load_state_dict_pre_hook(take_legacy_replay_buffers)

    # --- randomness -----------------------------------------------------------------------

    def initial_candidate(self, rows: int, length: int, device: torch.device, seeded: bool) -> torch.Tensor:
        """[rows, length, V] Gaussian logits in at least float32 (the candidate stays wide
        when the model runs in bf16). Training draws from the global RNG; `seeded` draws
        from a generator seeded with eval_seed, so evaluation is reproducible."""
        generator = torch.Generator(device=device).manual_seed(self.config.eval_seed) if seeded else None
        return self.gaussian(rows, length, device, generator) * self.config.candidate_init_std

    def gaussian(self, rows: int, length: int, device: torch.device,
                 generator: torch.Generator | None) -> torch.Tensor:
        """[rows, length, V] standard Gaussian noise in the candidate's dtype (at least float32)."""
        dtype = torch.promote_types(self.descent.energy_head.weight.dtype, torch.float32)
        shape = (rows, length, self.config.vocab_size)
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def shared_langevin(self, best_of: int, rows: int, length: int, span: int,
                        device: torch.device) -> Callable[[], torch.Tensor]:
        """The Langevin noise of an inference descent over `rows` rows of `length` positions that
        gives a row the same noise in any batch (`think(langevin=)`): each step draws [best_of,
        span, V] (span >= length, the positions a caller ever asks for, so that a position's
        noise does not depend on the batch's length either) from a generator seeded with
        eval_seed + 1, and every row takes its first `length` positions (sample-major)."""
        generator = torch.Generator(device=device).manual_seed(self.config.eval_seed + 1)
        return lambda: self.gaussian(best_of, span, device, generator)[:, :length].repeat_interleave(rows, dim=0)

    def seed_shared_draws(self, seed: str) -> None:
        self.shared_draws = random.Random(seed)

    def sample_num_steps(self) -> int:
        """Training: uniform in [min_steps, n_steps] when randomised (from the draws every rank
        shares, not the global RNG); n_steps otherwise."""
        cfg = self.config
        if self.training and cfg.min_steps:
            return self.shared_draws.randint(cfg.min_steps, cfg.n_steps)
        return cfg.n_steps

    def sample_alpha_scale(self, rows: int, length: int, device: torch.device) -> torch.Tensor | None:
        """Training: a factor [rows, length, 1] uniform in [1/r, r] for the step size."""
        r = self.config.alpha_randomize
        if not self.training or r == 1:
            return None
        return 1 / r + torch.rand(rows, length, 1, device=device) * (r - 1 / r)

    def eval_noise_std(self) -> float:
        """Std of the Langevin noise outside training (0 unless `langevin_noise_eval`)."""
        return self.config.langevin_noise_std if self.config.langevin_noise_eval else 0.0

    def eval_noise_rng(self, noise_std: float, device: torch.device):
        """Context of a descent outside training: with Langevin noise, the global RNG seeded
        with eval_seed + 1 (reproducible, the training RNG untouched); otherwise nothing."""
        return seeded_rng(self.config.eval_seed + 1, device) if noise_std else contextlib.nullcontext()

    # --- model interface ------------------------------------------------------------------

    def compile(self, *args, **kwargs) -> None:
        """torch.compile the descent (`EnergyDescent`), where the training step's work is, as
        one graph per forward. The rest of the forward runs eagerly around it: the starting
        noise, the replay store's bookkeeping (a ring position and slot lengths on the host,
        which a graph would recompile for at every step) and the diagnostics. Static shapes
        unless asked otherwise: the descent unrolls its step count, which dynamo would otherwise
        make symbolic once it has seen two (S2), and a graph per count and batch size is
        what a descent needs."""
        self.descent.compile(*args, **{"dynamic": False, **kwargs})

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                return_energies: bool = False) -> ModelOutput:
        """Training: loss = the S1/S2 objective (mean CE over steps, or last step when
        truncated) over the batch and any replayed rows. Eval: loss = the cross entropy of the
        final candidate, the model's prediction, so it compares with a plain LM's. `logits` are
        log_softmax of the final candidate (detached); in training the final candidate itself, the
        same distribution unnormalised, which costs no pass over [B, T, V] (a training step uses
        only the loss). Diagnostics: `energy` [S], `alpha`, and with targets `loss_per_step` [S],
        `loss_first_step`, `loss_last_step`; per-token energies [S, B, T] under `_token_energy`
        when `return_energies`."""
        cfg = self.config
        B, T = idx.shape
        check_length(cfg, T)
        candidate = self.initial_candidate(B, T, idx.device, seeded=not self.training)
        replay = self.training and self.replay_store is not None and targets is not None
        all_idx, all_targets = idx, targets
        if replay:
            all_idx, all_targets, candidate = self.replay_store.extend(idx, targets, candidate)
        learning = self.training and torch.is_grad_enabled()
        # ZeRO-3's hook order (see `EnergyDescent.forward`)
        anchor = torch.zeros(0, device=idx.device, requires_grad=True) if learning else None
        noise_std = cfg.langevin_noise_std if self.training else self.eval_noise_std()
        with contextlib.nullcontext() if self.training else self.eval_noise_rng(noise_std, idx.device):
            result = self.descent(
                all_idx, candidate, self.sample_num_steps(), anchor, targets=all_targets,
                alpha_scale=self.sample_alpha_scale(all_idx.size(0), T, idx.device),
                noise_std=noise_std, learning=learning)
        if replay:
            self.replay_store.store(idx, targets, result.candidate[:B])
        diagnostics = {"energy": result.energies.mean(dim=(1, 2)), "alpha": result.alpha}
        loss = None
        if targets is not None:
            loss_per_step = result.loss_per_step
            diagnostics.update(loss_per_step=loss_per_step, loss_first_step=loss_per_step[0],
                               loss_last_step=loss_per_step[-1])
            loss = result.loss if self.training else loss_per_step[-1]
        if return_energies:
            diagnostics["_token_energy"] = result.energies[:, :B]
        final = result.candidate[:B]
        return ModelOutput(loss=loss, logits=final if self.training else F.log_softmax(final, dim=-1),
                           diagnostics=diagnostics)

    @torch.no_grad()
    def think(self, idx: torch.Tensor, steps: int | None = None, best_of: int = 1,
              targets: torch.Tensor | None = None, last_only: bool = False,
              langevin_noise: bool | None = None, cache: DecodeCache | None = None,
              candidate: torch.Tensor | None = None, stop_tolerance: float | None = None,
              langevin: Callable[[], torch.Tensor] | None = None) -> ThinkOutput:
        """Inference with `steps` descent steps (default n_steps; more is "thinking longer")
        from `best_of` seeded noise samples per position, keeping per position the sample with
        the lowest final energy. No training randomness; Langevin noise (seeded) if
        `langevin_noise`, default `langevin_noise_eval`. `targets` [B, T] adds the loss after
        each step (the eval "thinking curve"); `last_only` predicts only the last position; a
        decoding `cache` holding idx's tokens gives the observed stream of those it has run.
        `candidate` [best_of x B, R, V] (sample-major) replaces the seeded starting noise, e.g.
        by noise that depends on the position only, so a row's result does not depend on its batch;
        `langevin` does the same for the Langevin noise (`shared_langevin`).
        `stop_tolerance` stops each position's descent once its energy settles (see
        `EnergyDescent.forward`), and then `steps` is the most it may take."""
        steps = steps or self.config.n_steps
        B, T = idx.shape
        check_length(self.config, T)
        rows = 1 if last_only else T
        if candidate is None:
            candidate = self.initial_candidate(best_of * B, rows, idx.device, seeded=True)
        if targets is not None:
            targets = targets[:, T - rows:].repeat(best_of, 1)
        noise_std = self.eval_noise_std() if langevin_noise is None else \
            (self.config.langevin_noise_std if langevin_noise else 0.0)
        # a compiled descent thinks eagerly: each decoded length or step count would be a graph
        with self.eval_noise_rng(noise_std, idx.device), torch.compiler.set_stance("force_eager"):
            result = self.descent(idx.repeat(best_of, 1), candidate, steps, targets=targets,
                                  noise_std=noise_std, final_energy=True, cache=cache,
                                  stop_tolerance=stop_tolerance, langevin=langevin)
        choice = result.energies[-1].view(best_of, B, rows).argmin(dim=0)  # [B, rows]

        def chosen(x: torch.Tensor, sample_dim: int) -> torch.Tensor:
            """x with its (best_of x B) dimension `sample_dim` reduced to the chosen samples."""
            x = x.unflatten(sample_dim, (best_of, B))
            index = choice.view((1,) * (sample_dim + 1) + choice.shape + (1,) * (x.dim() - sample_dim - 3))
            return torch.take_along_dim(x, index, dim=sample_dim).squeeze(sample_dim)

        loss_per_step = per_token = None
        if targets is not None:
            n_valid = (targets[:B] != -1).sum().clamp(min=1)
            per_token = chosen(result.token_losses, 1)
            loss_per_step = per_token.sum(dim=(1, 2)) / n_valid
        steps_taken = None if result.steps_taken is None else chosen(result.steps_taken, 0)
        return ThinkOutput(F.log_softmax(chosen(result.candidate, 0), dim=-1), chosen(result.energies, 1),
                           loss_per_step, steps_taken, per_token)

    def next_token_logits(self, idx: torch.Tensor, cache: DecodeCache | None = None, steps: int | None = None,
                          best_of: int = 1, stop_tolerance: float | None = None,
                          steps_taken: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Thinking with `steps` descent steps (default n_steps; with a `stop_tolerance` the
        most a row takes, see `think`) from `best_of` candidates, for the new position only:
        with a cache, the observed stream runs idx's tokens alone. Every row starts from the
        same seeded noise, and draws the same Langevin noise, so a row's logits do not depend on
        its batch. With a stop_tolerance, `steps_taken` receives the [B] descent steps of this
        call's rows."""
        if cache is not None:
            cache.remember(idx)
            idx = cache.tokens
        rows = idx.size(0)
        candidate = self.initial_candidate(best_of, 1, idx.device, seeded=True).repeat_interleave(rows, dim=0)
        langevin = self.shared_langevin(best_of, rows, 1, 1, idx.device)
        out = self.think(idx, steps, best_of, last_only=True, cache=cache, candidate=candidate,
                         stop_tolerance=stop_tolerance, langevin=langevin)
        if steps_taken is not None:
            steps_taken.append(out.steps_taken[:, -1])
        return out.logits[:, -1, :]

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The input embedding and the candidate embedding W_ve (the two V x D tables)."""
        d = self.descent
        return [d.tok_embeddings.weight] + ([] if d.candidate_embedding is None else [d.candidate_embedding.weight])

    def lr_multipliers(self) -> dict[str, float]:
        return {"descent.alpha": self.config.alpha_lr_mult} if self.config.alpha_learnable else {}

    def never_decayed_names(self) -> set[str]:
        return {"descent.alpha"} if self.config.alpha_learnable else set()

    def float32_names(self) -> set[str]:
        # bf16's spacing near S1's 500 is 2: its forward would read a step size that lags the
        # optimizer's float32 copy by up to 1 and moves in jumps of 2
        return {"descent.alpha"} if self.config.alpha_learnable else set()

    def zero3_leaf_modules(self) -> list[type[nn.Module]]:
        return [EnergyDescent]

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token of what this implementation computes (2 per multiply-add,
        PaLM attention convention; norms, softmaxes and checkpointing's recomputation not
        counted), with steps = n_steps, or the mean (min_steps + n_steps) / 2 of randomised
        training steps:

        - observed stream O: (n_layer - 1) blocks over T (+1 with time_embed) keys plus the
          last layer's key/value projections (4 D^2); once per batch with reuse, once per step
          without;
        - predicted rows P (per step): candidate embedding 2 D V + n_layer blocks attending to
          T keys + the energy head;
        - the energy gradient dE/dp needs input gradients only: ~P again;
        - training backpropagates through both (2x), so a step with a second-order graph costs
          3 (P + P) and the observed stream 3 O; truncated S2 steps before the last cost 2 P;
        - a replay buffer adds replay_fraction rows per training row.

        S1 (2 steps) with reuse is 12 P + 3 O, about 5x a Transformer++ training step (3x its
        forward); recomputing O per step (time_embed) gives 12 P + 6 O, about 6x. The paper
        counts 6.66x for S1 (a full 2T forward per step; Appendix D.5); at inference one step
        costs ~2x a forward with reuse (paper: 3.33x)."""
        cfg = self.config
        D = cfg.n_embd
        observed_rows = (seq_len + cfg.n_prefix) / seq_len
        observed = observed_rows * ((cfg.n_layer - 1) * block_flops(cfg, seq_len + cfg.n_prefix) + 4 * D * D)
        predicted = 2 * D * cfg.vocab_size + cfg.n_layer * block_flops(cfg, seq_len + cfg.n_prefix + 1) + 2 * D
        steps = (cfg.min_steps + cfg.n_steps) / 2 if training and cfg.min_steps else cfg.n_steps
        if not training:
            observed_passes = 1 if cfg.reuse_observed_stream else steps
            return observed_passes * observed + steps * 2 * predicted
        graph_steps = 1 if cfg.truncate_loss else steps
        total = graph_steps * 6 * predicted + (steps - graph_steps) * 2 * predicted
        if cfg.reuse_observed_stream:
            total += 3 * observed
        else:
            total += graph_steps * 3 * observed + (steps - graph_steps) * observed
        return total * (1 + cfg.replay_fraction if cfg.replay_buffer_size else 1)


def replay_stores(model: EBT) -> dict[str, Any]:
    """The model's replay store, the per-rank state each checkpoint keeps (replay_store_NNNNN.pt)."""
    return {} if model.replay_store is None else {"replay_store": model.replay_store}


def largest_step(config: EBTConfig) -> EBTConfig:
    """The config of a run's largest training step: the randomised number of descent steps at its
    maximum, and no replay store (which the meta device cannot index: the planner gives the
    replayed rows as extra rows of the micro-batch and counts the store's bytes apart)."""
    config = copy.copy(config)  # fields set directly: the values are valid, they only fix a draw
    config.min_steps = config.replay_buffer_size = 0
    return config


register_family(FamilySpec(
    "ebt", EBTConfig, EBT, thinks=True, rank_states=replay_stores, rank_state_bytes=replay_store_bytes,
    rank_state_scratch_bytes=replay_scratch_bytes, replayed_rows=EBTConfig.replayed_rows, largest_step=largest_step,
    stale_buffers=LEGACY_REPLAY_BUFFERS))

# The paper's recipes at "small" (12L/768/12h; 126.8M with the two V x D tables at V=50304), as the
# released scripts (the S1/S2 kinds: Appendix C.2; their hyperparameters: Tables D.3 and D.4).
# S1: a step embedding per step, 2 steps, learnable alpha 500 with LR x1500, detach, mean CE.
# S2 (`--mcmc_num_steps 1 --randomize_mcmc_num_steps 2 --randomize_mcmc_num_steps_min 2`): one
# step embedding shared by 2..3 steps (3 at eval), so every step descends one landscape and the
# observed stream is computed once; fixed alpha 5 randomised in [2.5, 10]; Langevin noise 3, at
# eval too; graph kept through the steps; last-step loss; half the batch again replayed from a
# FIFO of the last 192 rows (kept as top-k distributions: `replay_store_bytes`, docs/benchmarks.md).
S1 = dict(n_steps=2, alpha=500.0, alpha_learnable=True, alpha_lr_mult=1500.0)
S2 = dict(n_steps=3, min_steps=2, alpha=5.0, alpha_learnable=False, alpha_randomize=2.0,
          langevin_noise_std=3.0, langevin_noise_eval=True, detach_between_steps=False, truncate_loss=True,
          time_embed=True, step_embeddings="shared", replay_fraction=0.5)
STEP_CONDITIONED = dict(time_embed=True, step_embeddings="per_step", reuse_observed_stream=False)
register_flavor("ebt-s1-small", EBTConfig(**S1, **STEP_CONDITIONED))
register_flavor("ebt-s2-small", EBTConfig(**S2, replay_buffer_size=192))
# CPU sizes (the trainer sets vocab_size from data). ebt-tiny is S1 on the fast path (observed
# stream reused, no step embedding); ebt-s2-tiny is the S2 recipe with a FIFO of 48 rows (six
# batches of 8, the released ratio of 192 rows to batches of 32).
TINY = dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32)
register_flavor("ebt-tiny", EBTConfig(**TINY, **S1))
register_flavor("ebt-s2-tiny", EBTConfig(**TINY, **S2, replay_buffer_size=48))
register_flavor("ebt-mini", EBTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=64, **S1))
