"""The descent of the Energy-Based Transformer (`ebt.py`): the module that holds every parameter
of the EBT and runs the whole loop of gradient steps on the candidate, so DeepSpeed ZeRO-3 can
gather it as one leaf module (`autograd.grad` inside a forward needs the parameters whole)."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn

from pretrain.models.blocks import maybe_checkpoint, no_autocast, token_losses
from pretrain.models.common import DecodeCache
from pretrain.models.descent_plumbing import CheckpointedStep, StepSettings, energy_settled
from pretrain.models.ebt_attention import two_stream_attention
from pretrain.models.ebt_gradient import energy_and_gradient
from pretrain.models.llama import Block, RMSNorm, RotaryCache, causal_attention

MIN_ALPHA = 1e-4
"""Lower clamp of a learnable step size (as the released code), so it cannot turn into ascent."""


def stream_attention(stream: str) -> Callable:
    """The attention each of the backbone's two streams runs through, chosen by how often the
    descent differentiates it (flash SDPA kernels have no double backward):

    - "observed": causal SDPA, torch's fastest kernel for the device (flash on GPU). The energy
      gradient is taken w.r.t. the candidate only, with the observed keys and values as
      constants, so this stream is differentiated once, with or without reuse.
    - "predicted": `two_stream_attention` (`ebt_attention.py`), whose first and second
      derivatives are written out and run on every device: training differentiates these rows
      twice (the energy gradient, then the loss through it)."""
    if stream == "observed":
        return causal_attention
    if stream == "predicted":
        return two_stream_attention
    raise ValueError(f"unknown EBT attention stream {stream!r}: 'observed' or 'predicted'")


class DescentResult(NamedTuple):
    candidate: torch.Tensor
    """[B, R, V] final candidate logits y (detached)."""
    energies: torch.Tensor
    """[S, B, R] energy at the candidate entering each step (detached); [S + 1, ...] with
    `final_energy`, the last entry being the final candidate's energy."""
    token_losses: torch.Tensor | None
    """[S, B, R] cross entropy of log_softmax(y_{t+1}) per step and token (detached)."""
    loss_per_step: torch.Tensor | None
    """[S] mean cross entropy after each step (detached)."""
    loss: torch.Tensor | None
    """The training objective (mean over steps, or last step when truncated), with its graph."""
    alpha: torch.Tensor
    """The (clamped) step size parameter, detached."""
    steps_taken: torch.Tensor | None = None
    """[B, R] descent steps each position took, with a `stop_tolerance`."""


class EnergyDescent(nn.Module):
    """Every parameter of the EBT and the descent loop over them (a ZeRO-3 leaf module)."""

    def __init__(self, config: Any):
        """`config`: the model's `EBTConfig`."""
        super().__init__()
        self.config = config
        D, V = config.n_embd, config.vocab_size
        self.tok_embeddings = nn.Embedding(V, D)
        self.candidate_embedding = None if config.expected_embedding else nn.Linear(V, D, bias=False)
        self.time_embeddings = nn.Embedding(config.n_step_embeddings, D) if config.time_embed else None
        self.layers = nn.ModuleList(Block(config, joined_projections=True) for _ in range(config.n_layer))
        self.norm = RMSNorm(D, config.norm_eps)
        self.energy_head = nn.Linear(D, 1, bias=False)
        # shape [1], not 0-d: DeepSpeed broadcasts parameters as byte views, which 0-d tensors refuse
        alpha = torch.tensor([float(config.alpha)])
        if config.alpha_learnable:
            self.alpha = nn.Parameter(alpha)
        else:
            self.register_buffer("alpha", alpha)
        # candidate rows sit n_prefix + 1 positions after their token (n_prefix <= 1)
        self.rope = RotaryCache(config.head_dim, config.rope_theta, config.block_size + 2)

    def observe(self, idx: torch.Tensor, step: int, anchor: torch.Tensor | None = None,
                cache: DecodeCache | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the rotated keys and values [B, H, T (+1), hd] of the observed stream:
        causal attention over the observed tokens (after the step embedding, if any). With a
        decoding cache only the tokens of idx it has not seen run (see `observe_cached`)."""
        if cache is not None:
            return self.observe_cached(idx, step, cache)
        x = self.tok_embeddings(idx)
        if anchor is not None:
            x = x + anchor.sum()  # adds 0; see `forward`
        if self.time_embeddings is not None:
            step_index = idx.new_full((idx.size(0), 1), min(step, self.config.n_step_embeddings - 1))
            x = torch.cat([self.time_embeddings(step_index), x], dim=1)
        rope = self.rope(0, x.size(1), x)
        x = x.flatten(0, 1)  # one [B T, D] matrix, as in `energy`
        checkpointed = self.config.activation_checkpointing == "block"
        observed = []
        for layer in self.layers[:-1]:
            x, k, v = maybe_checkpoint(checkpointed, layer, x, rope, stream_attention("observed"))
            observed.append((k, v))
        # the last layer's observed outputs feed nothing: only its keys and values are needed
        last = self.layers[-1]
        observed.append(last.attention.keys_values(last.attention_norm(x), rope))
        return observed

    def observe_cached(self, idx: torch.Tensor, step: int, cache: DecodeCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`observe` for decoding: idx [k B, T] is the cache's B rows of tokens (repeated k
        times for best-of-k); the tokens the cache has not run yet go through the layers, whose
        keys and values are appended to the cache's slots. With step conditioning the stream
        differs per step embedding, so each has its own slots."""
        conditioning = min(step, self.config.n_steps - 1) if self.time_embeddings is not None else 0
        slots = [cache.slot(("observed", conditioning, i)) for i in range(len(self.layers))]
        rows = cache.tokens.size(0)
        seen = slots[0].length  # stream positions, the step embedding included
        new = idx[:rows, max(0, seen - self.config.n_prefix):]
        if new.size(1):
            x = self.tok_embeddings(new)
            if self.time_embeddings is not None and seen == 0:
                x = torch.cat([self.time_embeddings(new.new_full((rows, 1), conditioning)), x], dim=1)
            rope = self.rope(seen, x.size(1), x)
            for layer, slot in zip(self.layers[:-1], slots):
                x = layer(x, rope, slot.attend)[0]
            last = self.layers[-1]
            slots[-1].append(*last.attention.keys_values(last.attention_norm(x), rope))
        repeats = idx.size(0) // rows
        return [tuple(t.repeat(repeats, 1, 1, 1) for t in slot.contents()) for slot in slots]

    def candidate_table(self) -> torch.Tensor:
        """W_ve [V, D]: the candidate p [.., V] is embedded as p @ W_ve."""
        if self.candidate_embedding is None:
            return self.tok_embeddings.weight
        return self.candidate_embedding.weight.t()

    def energy(self, embedded: torch.Tensor, observed: list, first_row: int,
               second_order: bool = False) -> torch.Tensor:
        """Energies [B, R] of the embedded candidates p @ W_ve [B, R, D] of positions
        first_row .. first_row + R - 1; `second_order`: the training descent will differentiate
        the energy's gradient (the norms then take their hand-written derivatives). The rows
        run as one [B R, D] matrix: the linear layers then run their matmuls without the
        reshapes around each (ATen ops in every pass: this loop runs three)."""
        n_prefix = self.config.n_prefix
        rope = self.rope(first_row + 1 + n_prefix, embedded.size(1), embedded)
        checkpointed = self.config.activation_checkpointing == "block"
        x = embedded.flatten(0, 1)
        for layer, (k_obs, v_obs) in zip(self.layers, observed):
            attend = functools.partial(stream_attention("predicted"), k_obs=k_obs, v_obs=v_obs,
                                       offset=first_row + n_prefix, chunks=self.config.attention_chunks)
            x = maybe_checkpoint(checkpointed, layer, x, rope, attend, second_order)[0]
        return self.energy_head(self.norm(x, second_order)).view(embedded.shape[:2])

    def energy_gradient(self, embedded: torch.Tensor, observed: list, first_row: int,
                        second_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(E [B, R], dE/d embedded [B, R, D]), the gradient with a graph to differentiate when
        `second_order`, as `EBTConfig.energy_gradient` says."""
        if self.config.energy_gradient == "first_order":
            with torch.set_grad_enabled(second_order):
                return energy_and_gradient(self, embedded, observed, first_row)
        if not embedded.requires_grad:  # a frozen table
            embedded.requires_grad_()
        energy = self.energy(embedded, observed, first_row, second_order)
        return energy, torch.autograd.grad(energy.sum(), embedded, create_graph=second_order)[0]

    def step(self, y: torch.Tensor, observed: list, targets: torch.Tensor | None, alpha: torch.Tensor,
             settings: StepSettings):
        """One descent step from y_t [B, R, V]: (y_{t+1}, E_t [B, R] detached, per-token loss of
        y_{t+1} or None), as `settings` say (noise, second-order graph, graph through y_t)."""
        if not settings.keep_graph:
            y = y.detach()
        if settings.noise_std:
            y = y + settings.noise_std * torch.randn_like(y)
        probs = y.softmax(dim=-1)
        table = self.candidate_table()
        embedded = probs.to(table.dtype) @ table
        second_order = settings.second_order
        # dE/dp through the embedding by hand (below): a gradient w.r.t. p would need p to
        # require grad, and the training backward would then also differentiate the loss w.r.t. p
        energy, grad_embedded = self.energy_gradient(embedded, observed, settings.first_row, second_order)
        # in the candidate's dtype (at least float32), also when the model runs in bf16: the
        # candidate moves by alpha (500 in S1) times these, and it is their differences across
        # the vocabulary that matter, which bf16's rounding of each (2^-9 of its size) swamps
        with torch.set_grad_enabled(second_order), no_autocast(probs.device):
            grad = grad_embedded.to(probs.dtype) @ table.t().to(probs.dtype)
        if self.config.grad_wrt == "probs":
            y = probs - alpha * grad
        else:  # dE/dy = softmax's Jacobian (symmetric) times dE/dp
            y = y - alpha * probs * (grad - (probs * grad).sum(-1, keepdim=True))
        losses = None
        if targets is not None:
            with torch.set_grad_enabled(second_order):
                losses = token_losses(y, targets)
        return y, energy.detach(), losses

    def forward(self, idx: torch.Tensor, candidate: torch.Tensor, n_steps: int,
                anchor: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                alpha_scale: torch.Tensor | None = None, noise_std: float = 0.0,
                learning: bool = False, final_energy: bool = False,
                cache: DecodeCache | None = None, stop_tolerance: float | None = None,
                langevin: Callable[[], torch.Tensor] | None = None) -> DescentResult:
        """Descend `n_steps` from `candidate` [B, R, V], the initial logits of the last R
        positions of `idx` [B, T] (R = T for a whole sequence). `targets` [B, R] gives the
        per-step losses; `alpha_scale` [B, R, 1] multiplies the step size; `learning` builds the
        second-order graph; `final_energy` also scores the final candidate; a decoding `cache`
        keeps the observed stream's keys and values across calls (`observe_cached`).

        `stop_tolerance` (inference) stops each position on its own: once a step has changed its
        energy by less than that fraction of the energy before it, the position keeps its
        candidate (and loss) and takes no further step; the descent ends when all have stopped,
        or after n_steps. The energy after step t is the one step t + 1 computes anyway, so the
        positions still descending are untouched (tolerance 0: the fixed-step descent).

        `langevin` (inference), called once per step, gives that step's unit Gaussian noise
        [B, R, V] in place of draws from the global RNG, which depend on the batch's shape
        (`EBT.shared_langevin`).

        `anchor`, in training, is an empty tensor that requires grad, added (as 0) to the
        observed embeddings, so its gradient is the last one the backward computes. DeepSpeed
        ZeRO-3 reduces a leaf module's parameter gradients in a full backward hook, which fires
        once the gradients of the module's positional tensor inputs exist, and at once, before
        any parameter gradient, when none requires grad (token ids and noise do not)."""
        cfg = self.config
        alpha = self.alpha.clamp(min=MIN_ALPHA)
        if alpha_scale is not None:
            alpha = alpha * alpha_scale
        observed = None
        if cfg.reuse_observed_stream:
            with torch.set_grad_enabled(learning):
                observed = self.observe(idx, 0, anchor, cache)
        checkpointed = learning and cfg.activation_checkpointing == "step"
        keep_graph = learning and not cfg.detach_between_steps
        first_row = idx.size(1) - candidate.size(1)
        y, energies, losses = candidate, [], []
        descending = steps_taken = None
        if stop_tolerance is not None:
            descending = torch.ones(candidate.shape[:2], dtype=torch.bool, device=candidate.device)
            steps_taken = torch.full(candidate.shape[:2], n_steps, device=candidate.device)
        with torch.enable_grad():  # the descent differentiates, also under a no_grad caller
            for t in range(n_steps):
                step_observed = observed
                if step_observed is None:  # step conditioning: the observed stream depends on t
                    with torch.set_grad_enabled(learning):
                        # checkpointed apart from the step: inside it, the step's autograd.grad
                        # would recompute and keep these activations until the backward
                        step_observed = maybe_checkpoint(checkpointed, self.observe, idx, t, anchor, cache)
                second_order = learning and (t == n_steps - 1 or not cfg.truncate_loss)
                settings = StepSettings(first_row=first_row, noise_std=noise_std, second_order=second_order,
                                        keep_graph=keep_graph)
                if checkpointed and cfg.energy_gradient == "first_order":
                    # no autograd.grad inside the step: torch's checkpoint keeps what
                    # CheckpointedStep keeps, and torch.compile traces it into the descent's graph
                    y, energy, step_losses = maybe_checkpoint(True, self.step, y, step_observed, targets, alpha,
                                                              settings)
                elif checkpointed:
                    y, energy, step_losses = CheckpointedStep.apply(
                        self.step, settings, 2 * len(step_observed), targets, y, alpha,
                        *(tensor for kv in step_observed for tensor in kv),
                        *(p for p in self.parameters() if p.requires_grad))
                else:
                    y_in = y
                    if langevin is not None and noise_std:
                        y_in, settings = y + noise_std * langevin(), settings._replace(noise_std=0.0)
                    y_next, energy, step_losses = self.step(y_in, step_observed, targets, alpha, settings)
                    if descending is not None and t > 0:
                        settled = descending & energy_settled(energies[-1], energy, stop_tolerance)
                        steps_taken = torch.where(settled, t, steps_taken)
                        descending = descending & ~settled
                        if not descending.any():
                            break  # y holds every position's final candidate
                        y_next = torch.where(descending.unsqueeze(-1), y_next, y)
                        if step_losses is not None:
                            step_losses = torch.where(descending, step_losses, losses[-1])
                    y = y_next
                energies.append(energy)
                losses.append(step_losses)
        if final_energy:
            with torch.no_grad():
                if observed is None:
                    observed = self.observe(idx, n_steps, cache=cache)
                embedded = y.softmax(dim=-1).to(self.candidate_table().dtype) @ self.candidate_table()
                energies.append(self.energy(embedded, observed, first_row))
        loss = per_token = per_step = None
        if targets is not None:
            n_valid = (targets != -1).sum().clamp(min=1)
            step_means = torch.stack([step_losses.sum() / n_valid for step_losses in losses])
            # the last step's mean again rather than a view of step_means, which AOTAutograd
            # fails to rebuild as an output (compiled S2)
            loss = losses[-1].sum() / n_valid if cfg.truncate_loss else step_means.mean()
            per_token, per_step = torch.stack(losses).detach(), step_means.detach()
        return DescentResult(y.detach(), torch.stack(energies), per_token, per_step, loss,
                             self.alpha.detach().clamp(min=MIN_ALPHA).squeeze(0), steps_taken)
