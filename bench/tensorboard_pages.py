"""Screenshots of TensorBoard as a researcher first sees a logdir: `tensorboard --logdir DIR` on
loopback, and headless Chromium on each dashboard a fit's output uses (the landing page, Time
Series; HParams; Text). Checks what the page shows, not only what the event files hold.

    python -m bench.tensorboard_pages checkpoints/scaling/isoflop/fit/tb --out shots/

Needs a `chromium` on PATH (Debian: `apt-get install chromium`). Writes OUT/<dashboard>.png.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.cli import ArgumentParser, run_command

DASHBOARDS = ("timeseries", "hparams", "text")
WINDOW = "1600,1400"
PAGE_BUDGET_MS = 20000
"""Virtual time Chromium gives a page to load its data and draw before the screenshot."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(logdir: Path, port: int) -> subprocess.Popen:
    """`tensorboard --logdir` on 127.0.0.1:port, once it answers."""
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"error: tensorboard exited {server.returncode}: "
                             f"{(server.stderr.read().strip().splitlines() or [''])[-1]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2).read()
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("error: tensorboard did not answer within 60 s")


def screenshot(chromium: str, url: str, out: Path) -> None:
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WINDOW}",
                    f"--virtual-time-budget={PAGE_BUDGET_MS}", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=180)


def main() -> None:
    parser = ArgumentParser(prog="python -m bench.tensorboard_pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", type=Path, help="what `tensorboard --logdir` is given, e.g. a fit's tb/")
    parser.add_argument("--out", type=Path, default=Path("tensorboard_pages"), help="folder of the screenshots")
    args = parser.parse_args()
    if not args.logdir.is_dir():
        raise SystemExit(f"error: not a directory: {args.logdir}")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("error: no chromium on PATH; install it (Debian: apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = serve(args.logdir, port)
    try:
        for dashboard in DASHBOARDS:
            path = args.out / f"{dashboard}.png"
            screenshot(chromium, f"http://127.0.0.1:{port}/#{dashboard}", path)
            print(f"wrote {path}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    run_command(main)
