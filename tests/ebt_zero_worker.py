"""Worker of test_models_ebt.py's DeepSpeed test, run under `torchrun --nproc_per_node=2`:
trains a tiny EBT (S1, step-checkpointed descent with either energy gradient, and S2 with its
random step counts) for a few steps under ZeRO-2 and ZeRO-3 in the same two processes and writes
every step's loss and each rank's descent step counts, per stage and recipe, to the JSON file
named by argv[1] (rank 0)."""
import gc
import json
import sys

import deepspeed
import torch
from deepspeed.utils import set_z3_leaf_modules

from pretrain.models import build, resolve

RECIPES = {
    "s1-step-checkpointed": ("ebt-tiny", dict(activation_checkpointing="step")),
    "s1-first-order-step-checkpointed": ("ebt-tiny", dict(activation_checkpointing="step",
                                                          energy_gradient="first_order")),
    "s2": ("ebt-s2-tiny", {}),
}
SHAPE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


def train(flavor: str, overrides: dict, stage: int, rank: int) -> dict[str, list]:
    torch.manual_seed(0)
    model = build(resolve(flavor, {**SHAPE, **overrides}))
    if stage == 3:
        set_z3_leaf_modules(model, model.zero3_leaf_modules())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 2**31 - 1}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    torch.manual_seed(100 + rank)  # each rank its own data and candidate noise, the same per stage
    losses, steps = [], []
    for step in range(3):
        tokens = torch.randint(0, SHAPE["vocab_size"], (4, 17))
        engine.module.seed_shared_draws(f"0/{step}/0")  # as the trainer does, from (seed, step, micro-step)
        out = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        steps.append(out.diagnostics["loss_per_step"].numel())
    every_rank_steps = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank_steps, steps)
    # Released now, as the trainer's close does: an engine left to interpreter shutdown, after
    # the process group is gone, occasionally aborted the process at exit ("terminate called
    # without an active exception").
    del engine, optimizer, model
    gc.collect()
    return {"losses": losses, "steps": every_rank_steps}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {f"{name}/zero{stage}": train(flavor, overrides, stage, rank)
               for name, (flavor, overrides) in RECIPES.items() for stage in (2, 3)}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
