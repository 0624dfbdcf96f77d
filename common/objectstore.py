"""Datasets and checkpoints in an S3-compatible object store, for the data pipeline and the
checkpoints alike: which URLs the project takes, one client per process, and every failure of
the store as one line that says what to fix.

A path is local unless it has a URL scheme; `s3://bucket/prefix` is the only scheme supported,
and any other (`gs://`, `hf://`, ...) is refused where the path is taken (`unsupported_url`),
never written to as a local directory named `gs:`.

Credentials and the endpoint come from where the AWS tools and mosaicml-streaming look for
them: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (or `AWS_PROFILE`, `~/.aws`), the region from
`AWS_DEFAULT_REGION`, and the endpoint of a store other than AWS from `S3_ENDPOINT_URL`
(streaming's name) or `AWS_ENDPOINT_URL` (boto3's). None of them is ever written anywhere: the
messages name the variables, not their values."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SUPPORTED = "s3"
ENDPOINT_VARIABLES = ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")
"""Where the endpoint of an S3-compatible store other than AWS is read from, in this order."""
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
CLIENT_ATTEMPTS = 3
"""botocore's own attempts per request (its standard retry mode, with jittered backoff) for
throttling and transient errors; an endpoint that stays away is `with_retries`'s business."""

T = TypeVar("T")


class RemoteError(RuntimeError):
    """The object store failed or refused a request; the message is one line naming the URL,
    the cause and what to fix."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient
        """The store could not be reached (worth retrying later), as opposed to a refusal."""


def url_scheme(path: str | os.PathLike) -> str | None:
    match = SCHEME.match(str(path))
    return match.group(1).lower() if match else None


def is_remote(path: str | os.PathLike | None) -> bool:
    """Whether `path` is an `s3://` URL (a str: pathlib would fold its '//')."""
    return path is not None and url_scheme(path) == SUPPORTED


def unsupported_url(path: str | os.PathLike | None, key: str, remote_ok: bool = True) -> str | None:
    """The one line refusing `path` given as `key` when it is a URL this project does not read
    (`remote_ok`: s3:// is fine here), else None."""
    scheme = url_scheme(path) if path is not None else None
    if scheme is None or (scheme == SUPPORTED and remote_ok):
        return None
    takes = "a local path or s3://bucket/prefix" if remote_ok else "a local path"
    return f"{key}={path}: {scheme}:// is not supported here; give {takes}"


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(part.strip("/") for part in parts if part)])


def endpoint() -> str | None:
    return next((os.environ[name] for name in ENDPOINT_VARIABLES if os.environ.get(name)), None)


@dataclass(frozen=True)
class Location:
    """An `s3://bucket/key` URL taken apart."""

    bucket: str
    key: str

    @classmethod
    def of(cls, url: str) -> Location:
        if not is_remote(url):
            raise ValueError(f"not an s3:// URL: {url}")
        bucket, _, key = url[len("s3://"):].partition("/")
        if not bucket:
            raise RemoteError(f"{url}: no bucket named (s3://bucket/prefix)")
        return cls(bucket, key.strip("/"))

    def url(self, key: str | None = None) -> str:
        return f"s3://{self.bucket}/{self.key if key is None else key}"


CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
_clients: dict[tuple, object] = {}
"""The client of the process, by what it was made with (held in memory only)."""


def client():
    """The process's S3 client for the current endpoint and credentials (a forked process makes its
    own: a client's connection pool is not to be shared across a fork)."""
    import boto3
    from botocore.config import Config

    signature = (os.getpid(), endpoint(), *(os.environ.get(name) for name in CREDENTIAL_VARIABLES))
    if signature not in _clients:
        config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                        retries={"mode": "standard", "max_attempts": CLIENT_ATTEMPTS})
        _clients.clear()
        _clients[signature] = boto3.session.Session().client("s3", endpoint_url=endpoint(), config=config)
    return _clients[signature]


AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken",
              "403", "Forbidden", "AuthorizationHeaderMalformed"}


def explain(error: Exception, url: str, doing: str) -> RemoteError:
    """`error` of boto3 while `doing` something to `url` as one line, without the credentials."""
    from botocore import exceptions as be

    where = endpoint() or "AWS"
    if isinstance(error, (be.EndpointConnectionError, be.ConnectTimeoutError, be.ReadTimeoutError,
                          be.ConnectionClosedError)):
        return RemoteError(f"{doing} {url}: cannot reach the object store at {where} "
                           f"({type(error).__name__}); check S3_ENDPOINT_URL and the network", transient=True)
    if isinstance(error, (be.NoCredentialsError, be.PartialCredentialsError)):
        return RemoteError(f"{doing} {url}: no credentials for the object store; set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    if isinstance(error, be.ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code in AUTH_CODES:
            return RemoteError(f"{doing} {url}: the object store at {where} refused the credentials ({code}); "
                               "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
        if code == "NoSuchBucket":
            return RemoteError(f"{doing} {url}: bucket {Location.of(url).bucket} does not exist at {where}; "
                               "create it first (e.g. aws s3 mb s3://BUCKET)")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return RemoteError(f"{doing} {url}: the object store at {where} answered {code or status}",
                           transient=status >= 500)
    if isinstance(error, be.BotoCoreError):
        return RemoteError(f"{doing} {url}: {' '.join(str(error).split())}")
    raise error


def _call(url: str, doing: str, request: Callable[[], T]) -> T:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return request()
    except (BotoCoreError, ClientError) as e:
        raise explain(e, url, doing) from None


def check_bucket(url: str) -> None:
    """That the store answers, takes the credentials and has the bucket of `url`."""
    where = Location.of(url)
    _call(url, "reaching", lambda: client().list_objects_v2(Bucket=where.bucket, Prefix=where.key, MaxKeys=1))


def listing(url: str) -> dict[str, int]:
    """Key (relative to `url`'s prefix) -> size of every object under the prefix `url`/."""
    where = Location.of(url)
    prefix = where.key + "/" if where.key else ""
    found: dict[str, int] = {}

    def pages() -> Iterator[dict]:
        return iter(client().get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix))

    def collect() -> None:
        for page in pages():
            for item in page.get("Contents", []):
                found[item["Key"][len(prefix):]] = item["Size"]

    _call(url, "listing", collect)
    return found


def exists(url: str) -> bool:
    where = Location.of(url)
    return _unless_missing(url, lambda: client().head_object(Bucket=where.bucket, Key=where.key)) is not None


def read_bytes(url: str) -> bytes | None:
    """The object's bytes, None if there is no such object."""
    where = Location.of(url)
    return _unless_missing(url, lambda: client().get_object(Bucket=where.bucket, Key=where.key)["Body"].read())


def _unless_missing(url: str, request: Callable[[], T]) -> T | None:
    """`request()` on the object at `url`: its result, None when there is no such object; any
    other failure explained in one line."""
    from botocore.exceptions import ClientError

    try:
        return request()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise explain(e, url, "reading") from None
    except Exception as e:  # noqa: BLE001  (botocore's other errors, explained or re-raised)
        raise explain(e, url, "reading") from None


SINGLE_REQUEST_BYTES = 8 << 20
"""Files up to this size go up in one request; larger ones in parts, several at once (boto3's
transfer manager, whose threads and per-part bookkeeping cost more than they save on small ones)."""


def upload(path: str | Path, url: str) -> None:
    where = Location.of(url)
    if os.path.getsize(path) <= SINGLE_REQUEST_BYTES:
        def put() -> None:
            with open(path, "rb") as f:
                client().put_object(Bucket=where.bucket, Key=where.key, Body=f)

        _call(url, "uploading to", put)
        return
    _call(url, "uploading to", lambda: client().upload_file(str(path), where.bucket, where.key))


def upload_bytes(data: bytes, url: str) -> None:
    where = Location.of(url)
    _call(url, "uploading to", lambda: client().put_object(Bucket=where.bucket, Key=where.key, Body=data))


def download(url: str, path: str | Path) -> None:
    """The object into `path`, which appears only whole (a temporary name next to it first)."""
    where = Location.of(url)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.part{os.getpid()}")
    try:
        _call(url, "downloading", lambda: client().download_file(where.bucket, where.key, str(tmp)))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def delete(url: str, keys: list[str]) -> None:
    """Delete `keys` (relative to `url`'s prefix)."""
    where = Location.of(url)
    prefix = where.key + "/" if where.key else ""
    for start in range(0, len(keys), 1000):  # the most one request deletes
        batch = [{"Key": prefix + key} for key in keys[start:start + 1000]]
        _call(url, "deleting under", lambda: client().delete_objects(Bucket=where.bucket, Delete={"Objects": batch}))


def with_retries(attempts: int, first_delay_s: float, work: Callable[[], T],
                 on_retry: Callable[[RemoteError, float], None] = lambda error, delay: None) -> T:
    """work(), tried again after a store that could not be reached, up to `attempts` times in
    all, waiting `first_delay_s` and doubling it each time; the last failure is raised. A
    refusal (credentials, a missing bucket) is raised at once: waiting does not fix it."""
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return work()
        except RemoteError as e:
            if not e.transient or attempt == attempts:
                raise
            on_retry(e, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")
