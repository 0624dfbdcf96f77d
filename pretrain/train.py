"""Train a model.

    python -m pretrain.train --config configs/tiny/nrgpt.yaml [key.sub=value ...]
    torchrun --nproc_per_node=2 -m pretrain.train --config ... zero.stage=3
    python -m pretrain.train --check --world-size N --config ...   (the checks alone, no work)

Each process is one rank running the training loop (`pretrain.training.trainer`). Exit codes: 0
done, 2 bad configuration or data, 1 an unrecoverable training error (a damaged checkpoint with
no intact one, repeated non-finite updates), 75 (EX_TEMPFAIL) checkpoint saved after
SIGTERM/SIGUSR1/Ctrl-C: rerun or requeue to resume, 130 Ctrl-C twice (not saved), 124 hung (the
watchdog found no step completing in time: `pretrain.training.watchdog`)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from common.cli import EXIT_DIR_VARIABLE, ArgumentParser, write_exit_file
from pretrain.config import ConfigError, describe_attention, describe_batch_split, load_config
from pretrain.config.precision import resolve_precision
from pretrain.config.validation import validate
from pretrain.training.checkpoint import CheckpointError, CheckpointManager
from pretrain.training.engine import distributed_env, lost_peer_line
from pretrain.training.preflight import preflight
from pretrain.training.stopping import Aborted, StoppedInSetup, stopped_line
from pretrain.training.trainer import NonFiniteError, SummaryError, run


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pretrain.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config (configs/...)")
    parser.add_argument("--check", action="store_true",
                        help="only check the config, the data and the checkpoint to resume from, then exit")
    parser.add_argument("--world-size", type=int, default=None,
                        help="with --check: the number of processes the run will have")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="with --check: this node's rank in a multi-node launch; the nodes after "
                             "the first leave out whether another trainer holds the run (node 0 asks)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, values parsed as YAML (e.g. zero.stage=3)")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"argument --world-size: must be >= 1, got {args.world_size}")
    from data_pipeline.errors import DataError, DataWorkerError

    error, lost_peer, cfg = "", None, None
    try:
        world_size = args.world_size if args.check and args.world_size else distributed_env()[1]
        cfg = load_config(args.config, args.overrides)
        # a login node checks a GPU run (train.device=cuda) as the GPU nodes will run it
        validate(cfg, world_size, on_gpu := cfg.train.device == "cuda" or torch.cuda.is_available())
        if args.check:
            # checked as this node's first rank: only rank 0 asks whether a trainer holds the run
            first_rank = 0 if args.node_rank == 0 else 1
            precision = resolve_precision(cfg.train.precision, on_gpu)
            preflight(cfg, CheckpointManager(cfg, rank=first_rank, world_size=world_size, precision=precision.name),
                      checking_only=True)
            ready = f"{args.config}: ready for {world_size} process(es): {describe_batch_split(cfg, world_size)}"
            print("\n".join([ready, *describe_attention(cfg, on_gpu)]))
        code = 0 if args.check else run(cfg)
    except (ConfigError, DataError, DataWorkerError, NonFiniteError, CheckpointError, SummaryError) as e:
        error = f"error: {e}"
        code = 2 if isinstance(e, (ConfigError, DataError)) else 1
    except (Aborted, StoppedInSetup, KeyboardInterrupt) as stop:  # KeyboardInterrupt: before the first step
        error, code = stopped_line(stop)
    except RuntimeError as e:  # a lost peer or a dead data loader worker is one line; anything else is a bug
        from data_pipeline.loader import data_worker_error

        lost_peer = lost_peer_line(e, cfg.train.collective_timeout if cfg else 0)
        # torch reports a dead worker from its SIGCHLD handler, wherever the step is at the time
        worker_died = data_worker_error(e)
        if lost_peer is None and worker_died is None:
            raise
        error, code = lost_peer or f"error: {worker_died}", 1
    # Rank 0 says why the job ended; after a lost peer every rank says so in its own log (under
    # torchrun the launcher says it once per node, from the exit files, or rather the failure of
    # the rank that was lost where that node has it).
    rank_0, under_launcher = int(os.environ.get("RANK", "0")) == 0, bool(os.environ.get(EXIT_DIR_VARIABLE))
    if error and (rank_0 and not lost_peer or lost_peer and not under_launcher):
        print(error, file=sys.stderr, flush=True)
    if dist.is_initialized() and not lost_peer:  # with a peer gone, tearing down could wait on it
        dist.destroy_process_group()
    write_exit_file(code, error)
    return code


if __name__ == "__main__":
    sys.exit(main())
