"""Fetch a run's newest complete checkpoint from an object store into a local run directory,
for the commands that read a run (export, sample, evaluate):

    python -m pretrain.fetch s3://bucket/prefix/RUN_NAME RUN_DIR

The URL is a run under a `checkpoint.remote` prefix (its checkpoints are in URL/ckpt/). A
checkpoint without its complete.json there is skipped, as a resume skips it; the copy is checked
against the sizes and checksums its marker records. Credentials and endpoint as the trainer's
(AWS_* variables, S3_ENDPOINT_URL)."""
from __future__ import annotations

import sys
from pathlib import Path

from common import objectstore
from common.cli import ArgumentParser, run_command


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pretrain.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the run in the store: s3://bucket/prefix/RUN_NAME")
    parser.add_argument("run_dir", help="local run directory to fetch into (its ckpt/)")
    args = parser.parse_args(argv)
    from pretrain.training.checkpoint.layout import check_intact, is_complete, list_checkpoints
    from pretrain.training.checkpoint.remote import fetch_newest

    if not objectstore.is_remote(args.url):
        parser.error(f"{args.url}: not an s3:// URL")
    ckpt_dir = Path(args.run_dir) / "ckpt"
    try:
        fetched = fetch_newest(objectstore.join(args.url, "ckpt"), ckpt_dir)
    except objectstore.RemoteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    complete = [p for p in list_checkpoints(ckpt_dir) if is_complete(p)]
    if not complete:
        print(f"error: {args.url}/ckpt holds no complete checkpoint", file=sys.stderr)
        return 1
    _, damage = check_intact(complete[-1])
    if damage:
        print(f"error: checkpoint {complete[-1]} is damaged: {', '.join(damage)}", file=sys.stderr)
        return 1
    print(fetched or f"{complete[-1]} is already the newest complete checkpoint")
    return 0


if __name__ == "__main__":
    run_command(main)
