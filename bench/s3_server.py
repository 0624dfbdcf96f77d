"""An S3-protocol server on this machine for the tests and benchmarks of data and checkpoints in
an object store: moto's standalone server (`moto_server`, installed with moto[server]) as a
separate process, spoken to over HTTP only, as a cluster speaks to its store. It checks
credentials: its first requests make an IAM user with an access key, and every later request
must be signed with that key."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


class S3Server:
    """moto's standalone S3 server on `host` (a free port unless given), started at once; `stop()`
    ends it. Its contents live in its memory: a server started again is empty."""

    NO_AUTH_REQUESTS = 4
    """Unsigned requests moto takes before it checks credentials: the fixture's IAM set-up."""

    def __init__(self, tmp: Path, host: str = "127.0.0.1", port: int | None = None):
        import socket
        import time
        import urllib.request

        if port is None:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.endpoint = f"http://{host}:{port}"
        self.log = open(tmp / f"moto-{port}.log", "w")
        self.process = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", host, "-p", str(port)],
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(self.NO_AUTH_REQUESTS)},
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                assert self.process.poll() is None, f"moto_server exited with {self.process.returncode}"
                assert time.monotonic() < deadline, "moto_server did not start within 30 s"
                time.sleep(0.1)
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="tests")
        policy = iam.create_policy(PolicyName="everything", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        iam.attach_user_policy(UserName="tests", PolicyArn=policy["Policy"]["Arn"])
        key = iam.create_access_key(UserName="tests")["AccessKey"]
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]

    def env(self, **changes: str) -> dict[str, str]:
        """The variables a process needs to use the server (AWS tools' names, streaming's endpoint)."""
        return {"S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1", **changes}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

