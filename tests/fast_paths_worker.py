"""Trains gpt-tiny for a few steps through the trainer's DeepSpeed engine (ZeRO-2, fp32, one
process, synthetic tokens) with torch's multi-tensor AdamW, its fused AdamW and with the module
compiled through `engine.compile`; prints one JSON line of losses and final parameters per
variant. Run by tests/test_fast_paths.py in its own process (it initialises torch.distributed)."""
import json
import sys

import deepspeed
import torch

from bench.gpu_cases import REPO, synthetic_batches
from pretrain.config import load_config
from pretrain.training.engine import distributed_env
from pretrain.training.trainer import Trainer

STEPS = 3
MICRO_BATCH, SEQ_LEN, VOCAB_SIZE = 4, 32, 512
VARIANTS = {"foreach": {"fused": False}, "fused": {"fused": True},
            "compiled": {"fused": False, "compile": "aot_eager"}}


def main() -> None:
    torch.set_num_threads(1)
    distributed_env()
    deepspeed.init_distributed(verbose=False)
    for name, variant in VARIANTS.items():
        cfg = load_config(REPO / "configs/tiny/gpt.yaml", [
            "run_name=fast-paths", "output_root=unused", "data.path=synthetic-tokens", "data.num_workers=0",
            f"data.seq_len={SEQ_LEN}", f"data.micro_batch_size={MICRO_BATCH}",
            f"train.global_batch_size={MICRO_BATCH}", "train.precision=fp32", "optimizer.lr=1e-2",
            "schedule.warmup_steps=0", f"optimizer.fused={str(variant['fused']).lower()}",
            f"model.compile={variant.get('compile', 'off')}"])
        trainer = Trainer(cfg)
        trainer.build_engine(VOCAB_SIZE)
        trainer.feed(synthetic_batches(MICRO_BATCH, SEQ_LEN, VOCAB_SIZE, pin=False))
        initial = torch.cat([p.detach().flatten() for p in trainer.engine.module.parameters()])
        losses = []
        for _ in range(STEPS):
            losses.append(trainer.train_step(log_now=False).loss)
        params = torch.cat([p.detach().flatten() for p in trainer.engine.module.parameters()])
        print(json.dumps({"variant": name, "losses": losses, "params": params.tolist(),
                          "moved": (params - initial).abs().tolist(),
                          "fused": trainer.engine.basic_optimizer.defaults["fused"],
                          "compiled": trainer.engine.is_compiled,
                          "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}), flush=True)
        trainer.close(release_engine=True)


if __name__ == "__main__":
    sys.exit(main())
