"""Trains gpt-tiny for a few steps through the trainer's DeepSpeed engine (ZeRO-2, fp32, one
process, synthetic tokens) with torch's multi-tensor AdamW, its fused AdamW and with the module
compiled through `engine.compile`; prints one JSON line of losses and final parameters per
variant. Run by tests/test_fast_paths.py in its own process (it initialises torch.distributed)."""
import json
import sys

import deepspeed
import torch

from bench.gpu import Case, Settings, run_config, synthetic_batches
from pretrain.engine import distributed_env
from pretrain.train import Trainer

STEPS = 3
VARIANTS = {"foreach": {"fused": False}, "fused": {"fused": True}, "compiled": {"fused": False, "compile": "aot_eager"}}


def main() -> None:
    torch.set_num_threads(1)
    distributed_env()
    deepspeed.init_distributed(verbose=False)
    case = Case("fast paths", "gpt-tiny", "tests", micro_batch=4, seq_len=32)
    settings = Settings(device="cpu", vocab_size=512, warmup=0, steps=STEPS, case_seconds=60, peak_tflops=None)
    for name, variant in VARIANTS.items():
        cfg = run_config(case, settings, case.micro_batch, output_root="unused")
        cfg.train.precision = "fp32"
        cfg.optimizer.lr = 1e-2
        cfg.optimizer.fused = variant["fused"]
        cfg.model.compile = variant.get("compile", "off")
        trainer = Trainer(cfg)
        trainer.build_engine(settings.vocab_size)
        trainer.batches = synthetic_batches(case.micro_batch, case.seq_len, settings.vocab_size, pin=False)
        initial = torch.cat([p.detach().flatten() for p in trainer.engine.module.parameters()])
        losses = []
        for _ in range(STEPS):
            losses.append(trainer.train_step(log_now=False).loss)
            trainer.state.step += 1
        params = torch.cat([p.detach().flatten() for p in trainer.engine.module.parameters()])
        print(json.dumps({"variant": name, "losses": losses, "params": params.tolist(),
                          "moved": (params - initial).abs().tolist(),
                          "fused": trainer.engine.basic_optimizer.defaults["fused"],
                          "compiled": trainer.engine.is_compiled,
                          "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}), flush=True)
        trainer.engine.destroy()
        trainer.close()


if __name__ == "__main__":
    sys.exit(main())
