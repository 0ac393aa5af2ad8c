"""Training files in an S3-compatible object store (AWS S3, MinIO, Ceph RGW, ...), through
pyarrow's S3 filesystem (the library that reads the Parquet already).

    s3://bucket/prefix/*.parquet    the format from the name: .parquet, .csv[.gz], .npz, .npy

spec.data.objectStore gives the endpoint (a URL; none: AWS) and the region. Credentials come
only from the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, which the pods get
from the Secret spec.data.objectStore.secretRef names (never from the ConfigMap). A bucket
that cannot be listed (wrong credentials, no such bucket, no endpoint) is one ConfigError
naming the bucket and the store's reason, after a couple of attempts: a job fails fast.
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any

from distbelief.runtime import contract, errors, jobspec

PREFIX = "s3://"
ACCESS_KEY_ENV, SECRET_KEY_ENV = contract.OBJECT_STORE_KEYS
FORMATS = ((".parquet", "parquet"), (".csv", "csv"), (".csv.gz", "csv"), (".npz", "npz"), (".npy", "npy"))
TIMEOUT_SECONDS = 10.0
ATTEMPTS = 2


def format_of(source: str) -> str:
    """The file format an s3:// glob names by its extension."""
    for suffix, name in sorted(FORMATS, key=lambda f: -len(f[0])):
        if source.endswith(suffix):
            return name
    raise errors.ConfigError(f"spec.data.source: {source} must end in .parquet, .csv, .csv.gz, .npz or .npy "
                             "(the files' format)")


class Bucket:
    """Listing and opening the objects of s3:// paths, credentials from the environment."""

    def __init__(self, store: jobspec.ObjectStore | None) -> None:
        import pyarrow.fs as pafs  # data plane: only a job reading a bucket needs it
        endpoint = (store.endpoint if store else None) or None
        scheme, _, host = (endpoint or "").partition("://")
        self.fs = pafs.S3FileSystem(
            access_key=os.environ.get(ACCESS_KEY_ENV) or None, secret_key=os.environ.get(SECRET_KEY_ENV) or None,
            region=(store.region if store else None) or "us-east-1",
            endpoint_override=host or None, scheme=scheme or "https",
            connect_timeout=TIMEOUT_SECONDS, request_timeout=TIMEOUT_SECONDS,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=ATTEMPTS))

    def glob(self, url: str) -> list[str]:
        """The s3:// URLs of the objects the glob matches, sorted."""
        path = url[len(PREFIX):]
        bucket = path.split("/", 1)[0]
        base = _before_glob(path)
        import pyarrow.fs as pafs
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)) \
                if base != path else [self.fs.get_file_info(path)]
        except OSError as exc:
            raise errors.ConfigError(f"spec.data.source: cannot list bucket {bucket!r} ({url}): {exc}") from exc
        return sorted(PREFIX + i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, path))

    def open(self, url: str) -> Any:
        return self.fs.open_input_file(url[len(PREFIX):])


def _before_glob(path: str) -> str:
    """The folder a glob lists: everything before the first segment with a glob character."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return "/".join(parts[:i])
    return path
