"""Datasets and checkpoints in an S3-compatible object store, against moto's standalone server
(a separate process, spoken to over HTTP only: `bench.s3_server.S3Server`): `prepare --out s3://`,
training from `data.path: s3://` with the same losses as from the same dataset on local disk,
checkpoints uploaded to `checkpoint.remote` and resumed from there into an empty run directory
with exact losses, and the store's faults, each one line."""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml

import trainer_runs as runs
from common import objectstore
from bench.s3_server import S3Server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STEPS = 8
"""Steps of the runs here; checkpoints every 4 (the base config's interval)."""


def prepare_to(url: str) -> None:
    settings = runs.CHAR_DATASET
    result = runs.command_here("data_pipeline.prepare", [
        "--source", "shakespeare", "--out", url, "--seq-len", str(settings["seq_len"]),
        "--val-fraction", str(settings["val_fraction"]), "--tokenizer", settings["tokenizer"],
        "--max-docs", str(settings["max_docs"]), "--num-proc", "1"])
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def remote_data(s3_server, tmp_path_factory):
    """The base config's character-level dataset, prepared straight into the store."""
    bucket = s3_server.bucket("data-bucket")
    url = f"{bucket}/shakespeare-char-32"
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env().items():
            env.setenv(name, value)
        prepare_to(url)
    return url


def losses(name: str) -> dict[int, float]:
    return runs.scalars(name, "train/loss")


def train(name: str, *overrides: str) -> runs.subprocess.CompletedProcess:
    return runs.train_here([f"run_name={name}", f"train.max_steps={STEPS}", "eval.dynamics=false", *overrides])


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("warning:", "["))]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


def test_prepare_writes_the_dataset_to_the_bucket_and_a_rerun_keeps_it(s3, remote_data):
    objects = objectstore.listing(remote_data)
    assert "manifest.json" in objects and "train/index.json" in objects and ".incomplete" not in objects
    assert any(key.startswith("train/shard.") for key in objects)
    local = yaml.safe_load((runs.char_dataset() / "manifest.json").read_text())
    from data_pipeline.packing import read_manifest

    assert read_manifest(remote_data)["fingerprint"] == local["fingerprint"]  # the same windows
    prepare_to(remote_data)  # kept: the same settings and source
    assert objectstore.listing(remote_data) == objects


def test_s3_data_and_checkpoints_train_and_resume_exactly(s3, remote_data, tmp_path):
    """From s3:// data, with checkpoints uploaded: the losses of the same run on the same dataset
    on local disk. Then a node with an empty run directory resumes from the store, where the
    newest checkpoint has lost its marker (an upload cut short): it is skipped, the one before
    it fetched and verified, and the losses continue exactly."""
    remote = s3.bucket("ckpt-bucket")
    assert train("s3-local").returncode == 0
    s3_run = ["data.path=" + remote_data, f"data.cache_dir={tmp_path / 'cache'}", f"checkpoint.remote={remote}"]
    result = train("s3-remote", *s3_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses("s3-remote") == losses("s3-local")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]  # one copy per node

    ckpt_url = f"{remote}/s3-remote/ckpt"
    objects = objectstore.listing(ckpt_url)
    assert {"step_00000004/complete.json", "step_00000008/complete.json"} <= set(objects)
    objectstore.delete(ckpt_url, ["step_00000008/complete.json"])
    shutil.rmtree(runs.run_dir("s3-remote"))
    checked = runs.train_here(["--check", "run_name=s3-remote", *s3_run])  # a launch's check reads the marker there
    assert checked.returncode == 0 and "ready for 1 process(es)" in checked.stdout, checked.stderr[-3000:]
    resumed = train("s3-remote", *s3_run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping incomplete checkpoint" in resumed.stderr and "fetched checkpoint step_00000004" in resumed.stdout
    assert "resuming at step 4" in resumed.stdout
    reference = losses("s3-local")
    assert losses("s3-remote") == {step: reference[step] for step in range(5, STEPS + 1)}
    assert "step_00000008/complete.json" in objectstore.listing(ckpt_url)  # uploaded again

    # the commands that read a run take a fetched copy
    fetched = runs.command_here("pretrain.fetch", [f"{remote}/s3-remote", str(tmp_path / "copy")])
    assert fetched.returncode == 0 and "fetched checkpoint step_00000008" in fetched.stdout, fetched.stderr[-2000:]
    assert (tmp_path / "copy" / "ckpt" / "step_00000008" / "complete.json").is_file()

    # nothing secret anywhere in the run directory (config.yaml, logs, TensorBoard)
    for path in runs.run_dir("s3-remote").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert s3.secret.encode() not in data and s3.key_id.encode() not in data, path


def test_the_planner_reads_the_vocabulary_of_a_dataset_in_the_store(s3, remote_data):
    planned = runs.command_here("pretrain.plan", ["--config", str(runs.base_config_file()), "--gpus", "1",
                                                  f"data.path={remote_data}"])
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert f"the dataset at {remote_data}" in planned.stdout


def test_the_store_unreachable_at_start_is_one_line(s3, remote_data, monkeypatch):
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{runs.free_port()}")
    for overrides in (["data.path=" + remote_data], ["checkpoint.remote=s3://ckpt-bucket"]):
        result = runs.train_here(["--check", "run_name=unreachable", *overrides])
        assert result.returncode == 2
        assert "cannot reach the object store" in one_error_line(result.stderr)
    result = runs.command_here("data_pipeline.prepare", ["--source", "shakespeare", "--out", remote_data + "2"])
    assert result.returncode == 1 and "cannot reach the object store" in one_error_line(result.stderr)


@pytest.mark.parametrize("fault, expected", [
    ("wrong credentials", "refused the credentials (SignatureDoesNotMatch)"),
    ("missing bucket", "bucket no-such-bucket does not exist"),
])
def test_a_refusing_store_is_one_line(s3, remote_data, monkeypatch, fault, expected):
    data, remote = remote_data, "s3://ckpt-bucket"
    if fault == "wrong credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    else:
        data, remote = "s3://no-such-bucket/ds", "s3://no-such-bucket/ck"
    for overrides in (["data.path=" + data], ["checkpoint.remote=" + remote]):
        result = runs.train_here(["--check", "run_name=refused", *overrides])
        assert result.returncode == 2 and expected in one_error_line(result.stderr)
        assert "not-the-secret" not in result.stderr


def test_a_corrupted_shard_in_the_bucket_is_named(s3, remote_data, tmp_path):
    url = f"{s3.bucket('corrupt-bucket')}/ds"
    prepare_to(url)
    shard = f"{url}/train/shard.00000.mds"
    data = bytearray(objectstore.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    objectstore.upload_bytes(bytes(data), shard)
    result = train("corrupt", "data.path=" + url, f"data.cache_dir={tmp_path}", "train.max_steps=1")
    assert result.returncode == 2
    assert f"shard {shard} is corrupted: xxh64" in one_error_line(result.stderr)
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # nothing half-copied kept


def test_the_store_gone_mid_run_keeps_the_checkpoint_and_uploads_it_later(s3, tmp_path, monkeypatch):
    """The store goes away after the first upload: the run goes on, tries the next upload again
    with backoff, says so in one line and keeps the checkpoint; the next run, with the store
    back, uploads it."""
    server = S3Server(tmp_path)
    monkeypatch.setenv("S3_ENDPOINT_URL", server.endpoint)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    remote = server.bucket("gone-bucket")
    first = f"{remote}/gone/ckpt/step_00000004/complete.json"

    def stop_after_first_upload() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if objectstore.exists(first):
                    break
            except objectstore.RemoteError:
                pass
            time.sleep(0.05)
        server.stop()

    watcher = threading.Thread(target=stop_after_first_upload)
    watcher.start()
    try:
        # slow steps (0.2 s per read), so that the store is gone well before the next save
        result = train("gone", f"checkpoint.remote={remote}", "checkpoint.upload_attempts=2",
                       "fault.slow_rank=0", "fault.slow_rank_s=0.2")
    finally:
        watcher.join()
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "step_00000008" in line]
    assert any("trying again in 1 s" in line for line in warnings), result.stderr[-3000:]
    assert any("not uploaded" in line and "cannot reach the object store" in line for line in warnings)
    assert (runs.run_dir("gone") / "ckpt" / "step_00000008" / "complete.json").is_file()

    back = S3Server(tmp_path, port=server.port)  # a new, empty store at the same address
    try:
        for name, value in back.env().items():
            monkeypatch.setenv(name, value)
        back.bucket("gone-bucket")
        again = train("gone", f"checkpoint.remote={remote}")
        assert again.returncode == 0, again.stderr[-3000:]
        assert objectstore.exists(f"{remote}/gone/ckpt/step_00000008/complete.json")
    finally:
        back.stop()


def test_the_cache_limit_evicts_the_least_recently_used_other_dataset(s3, remote_data, tmp_path):
    from data_pipeline.errors import DataError
    from data_pipeline.remote import local_copy, upload_dataset

    other = f"{remote_data}-again"
    upload_dataset(str(runs.char_dataset()), other, replace=True)  # the same windows, another URL
    size = sum(objectstore.listing(remote_data).values())
    first = Path(local_copy(remote_data, str(tmp_path), cache_limit=size + 1000))
    second = Path(local_copy(other, str(tmp_path), cache_limit=size + 1000))
    assert second.is_dir() and not first.exists()
    assert local_copy(other, str(tmp_path), cache_limit=size + 1000) == str(second)  # kept: in use
    with pytest.raises(DataError, match=r"data.cache_limit=1000 is smaller than the dataset at s3://"):
        local_copy(remote_data, str(tmp_path), cache_limit=1000)


def test_prepare_into_a_prefix_of_another_dataset_or_of_other_objects_is_refused(s3, remote_data):
    other = runs.command_here("data_pipeline.prepare", ["--source", "shakespeare", "--out", remote_data,
                                                       "--tokenizer", "char", "--seq-len", "16", "--max-docs", "5"])
    assert other.returncode == 1 and "already holds a different dataset (seq_len=32 there" in one_error_line(other.stderr)
    foreign = f"{s3.bucket('foreign-bucket')}/mine"
    objectstore.upload_bytes(b"notes", f"{foreign}/notes.txt")
    refused = runs.command_here("data_pipeline.prepare", ["--source", "shakespeare", "--out", foreign])
    assert refused.returncode == 1 and "holds 1 object(s) but no dataset" in one_error_line(refused.stderr)
    assert objectstore.listing(foreign) == {"notes.txt": 5}
