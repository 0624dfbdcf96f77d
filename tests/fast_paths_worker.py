"""Trains a tiny model for a few steps through the trainer's DeepSpeed engine (fp32, one process,
synthetic tokens) in each variant named on the command line: gpt-tiny under ZeRO-2 with torch's
multi-tensor AdamW, its fused AdamW and with the module compiled through `engine.compile`, and
EBT (first-order energy gradient) under ZeRO-1, 2 and 3, eager and compiled. Prints one JSON line
of losses and final parameters per variant. Run by tests/test_fast_paths.py in its own process
(it initialises torch.distributed)."""
import json
import sys

import deepspeed
import torch
from torch._dynamo.utils import counters

from bench.gpu_cases import REPO, synthetic_batches
from pretrain.config import load_config
from pretrain.training.engine import distributed_env
from pretrain.training.trainer import Trainer

STEPS = 3
MICRO_BATCH, SEQ_LEN, VOCAB_SIZE = 4, 32, 512
EBT = ["model.flavor=ebt-tiny", "model.overrides.n_layer=1", "model.overrides.energy_gradient=first_order", "optimizer.fused=false"]
VARIANTS = {
    "foreach": ["optimizer.fused=false"],
    "fused": ["optimizer.fused=true"],
    "compiled": ["optimizer.fused=false", "model.compile=aot_eager"],
    **{f"ebt zero{stage}{compiled}": [*EBT, f"zero.stage={stage}", f"model.compile={backend}"]
       for stage in (1, 2, 3) for compiled, backend in (("", "off"), (" compiled", "aot_eager"))},
}
"""Overrides of configs/tiny/gpt.yaml per variant."""


def parameters(trainer: Trainer) -> torch.Tensor:
    """Every parameter, flat, gathered whole from ZeRO-3's partitions."""
    params = list(trainer.engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().flatten() for p in params])


def main(variants: list[str]) -> None:
    torch.set_num_threads(1)
    distributed_env()
    deepspeed.init_distributed(verbose=False)
    for name in variants:
        cfg = load_config(REPO / "configs/tiny/gpt.yaml", [
            "run_name=fast-paths", "output_root=unused", "data.path=synthetic-tokens", "data.num_workers=0",
            f"data.seq_len={SEQ_LEN}", f"data.micro_batch_size={MICRO_BATCH}",
            f"train.global_batch_size={MICRO_BATCH}", "train.precision=fp32", "optimizer.lr=1e-2",
            "schedule.warmup_steps=0", *VARIANTS[name]])
        torch._dynamo.reset()
        counters.clear()
        trainer = Trainer(cfg)
        trainer.build_engine(VOCAB_SIZE)
        trainer.feed(synthetic_batches(MICRO_BATCH, SEQ_LEN, VOCAB_SIZE, pin=False))
        initial = parameters(trainer)
        losses = []
        for _ in range(STEPS):
            losses.append(trainer.train_step(log_now=False).loss)
        params = parameters(trainer)
        print(json.dumps({"variant": name, "losses": losses, "params": params.tolist(),
                          "moved": (params - initial).abs().tolist(),
                          "fused": trainer.engine.basic_optimizer.defaults["fused"],
                          "compiled": trainer.engine.is_compiled,
                          "graphs": counters["stats"]["unique_graphs"],
                          "graph_breaks": sum(counters["graph_break"].values())}), flush=True)
        trainer.close(release_engine=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
