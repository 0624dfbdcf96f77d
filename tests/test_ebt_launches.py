"""EBT's training step on a GPU is bound by its kernel launches: the two-stream attention there
runs in the GPU's number of row chunks (`default_chunks`), which must run far fewer ATen ops
per step than the CPU's 4 chunks and compute the same loss and gradients to rounding; and the
whole step (joined projections, hand-written RMSNorm derivatives, no no-op slices) must run at
most half the ATen ops it ran before."""
import torch

from bench.ebt import AtenOps
from pretrain.models import build, resolve
from pretrain.models.ebt_attention import CPU_CHUNKS, default_chunks, two_stream_attention
from tests.numerics import assert_rounding_close

GPU_CHUNKS = default_chunks(torch.device("cuda"))


def test_the_planner_measures_the_gpus_chunking_and_the_cpu_keeps_its_own():
    assert default_chunks(torch.device("meta")) == GPU_CHUNKS < CPU_CHUNKS == default_chunks(torch.device("cpu"))


def attention_training_passes(chunks: int) -> list[torch.Tensor]:
    """The attention's three passes in a descent step: forward, the energy gradient w.r.t. the
    predicted rows (with its graph), then the loss backward through that gradient. Returns the
    gradients of every input."""
    torch.manual_seed(0)
    rows = [torch.randn(2, 3, 16, 8, requires_grad=True) for _ in range(3)]
    observed = [torch.randn(2, 3, 17, 8, requires_grad=True) for _ in range(2)]
    out = two_stream_attention(*rows, *observed, offset=1, chunks=chunks)
    first = torch.autograd.grad(out, rows, torch.randn_like(out), create_graph=True)
    torch.autograd.backward(first, [torch.randn_like(g) for g in first])
    return [t.grad for t in rows + observed]


def test_gpu_chunking_cuts_the_attentions_ops_and_keeps_its_gradients():
    ops = {}
    for chunks in (CPU_CHUNKS, GPU_CHUNKS):
        with AtenOps() as counter:
            attention_training_passes(chunks)
        ops[chunks] = counter.total
    assert ops[CPU_CHUNKS] >= 2.5 * ops[GPU_CHUNKS], ops
    for got, expected in zip(attention_training_passes(GPU_CHUNKS), attention_training_passes(CPU_CHUNKS)):
        assert_rounding_close(got, expected)


def s1_model(chunks: int):
    """ebt-s1-small's recipe (step conditioning, 2 descent steps) scaled down to 2 layers of 64."""
    torch.manual_seed(0)
    shape = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)
    return build(resolve("ebt-s1-small", {**shape, "attention_chunks": chunks})).train()


def training_step(model, idx: torch.Tensor) -> torch.Tensor:
    """Forward and backward as the trainer runs them, from the same noise; returns the loss."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = model(idx, idx.roll(-1, 1)).loss
    loss.backward()
    return loss.detach()


def counted_step(chunks: int) -> tuple[torch.nn.Module, torch.Tensor, int]:
    """(model, loss, ATen ops) of an S1 training step at `chunks`, on the same tokens, after a
    first step that builds the rotary tables."""
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (2, 64))
    model = s1_model(chunks)
    training_step(model, idx)
    with AtenOps() as counter:
        loss = training_step(model, idx)
    return model, loss, counter.total


OPS_BEFORE = 5485
"""ATen ops of `training_step` on `s1_model` at one chunk's GPU path before the launch work
(commit 3fbf6cb: 4 row chunks on every device, one matmul per projection, autograd's RMSNorm),
counted with the pinned torch 2.13; a torch upgrade that decomposes ops differently needs this
measured again there."""


def test_an_s1_training_step_runs_at_most_half_its_former_ops():
    _, _, ops = counted_step(GPU_CHUNKS)
    assert 2 * ops <= OPS_BEFORE, (ops, OPS_BEFORE)


def test_gpu_chunking_cuts_the_ops_of_an_s1_training_step_with_the_same_loss_and_gradients():
    """The whole step's count includes the backbone's linear layers, norms and rotary
    embeddings (most of the GPU path's ops), which the chunking leaves as they are."""
    (gpu, gpu_loss, gpu_ops), (cpu, cpu_loss, cpu_ops) = counted_step(GPU_CHUNKS), counted_step(CPU_CHUNKS)
    assert cpu_ops >= 1.3 * gpu_ops, (cpu_ops, gpu_ops)
    assert_rounding_close(gpu_loss, cpu_loss)
    for (name, got), expected in zip(gpu.named_parameters(), cpu.parameters()):
        assert_rounding_close(got.grad, expected.grad, msg=name)
