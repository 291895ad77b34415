"""The bare parallel copier: the ceiling bench/transfer.py measures streamctl against (a helper, not a benchmark).

A plan (JSON: a list of {"path", "size", "url"}) is copied to `gs://BUCKET/PREFIX/` or `s3://BUCKET/PREFIX/`
with `--threads` (16) threads over all parts of all files: ranged GETs of `--part-size` (16 MiB) through one
plain `requests` session, each part uploaded as it arrives with the SDK and client settings streamctl's
backends use (google-cloud-storage on an AuthorizedSession with a 64-connection pool; boto3 with
max_pool_connections=64, path addressing). A file of one part is one upload; a larger one is an S3 multipart
upload (completed by the thread that uploads its last part) or, on GCS, one object per part composed into the
file (32 sources per compose, as a tree above that) whose part objects are then deleted. Nothing else: no
hashing, no retries beyond the SDKs' own, no byte budget, no progress, no manifest, no verify.

Prints one JSON line: {"files", "bytes", "seconds"} (seconds: the copy itself, after the imports).
Usage: python bench/bare_copy.py --plan PLAN.json --dest gs|s3 --endpoint URL --bucket B --prefix P
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

MiB = 1024 * 1024
COMPOSE_LIMIT = 32
GCS_PROJECT = "streamctl-test"


@dataclass
class FileCopy:
    """One file in flight: its parts still to land, and how to finish it once they have."""

    path: str
    key: str
    size: int
    url: str
    parts: int
    remaining: int = 0
    upload_id: str = ""
    etags: dict[int, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class GCSTarget:
    def __init__(self, endpoint: str, bucket: str, threads: int) -> None:
        import requests
        from google.auth.credentials import AnonymousCredentials
        from google.auth.transport.requests import AuthorizedSession
        from google.cloud import storage

        session = AuthorizedSession(AnonymousCredentials())
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=64)
        session.mount("http://", adapter)
        client = storage.Client(project=GCS_PROJECT, credentials=AnonymousCredentials(), _http=session,
                                client_options={"api_endpoint": endpoint})  # fmt: skip
        self.bucket = client.bucket(bucket)
        self.threads = threads

    def put(self, key: str, data: bytes) -> None:
        self.bucket.blob(key).upload_from_string(data, content_type="application/octet-stream")

    def begin(self, file: FileCopy) -> None:
        pass  # part objects need nothing created first

    def part_name(self, file: FileCopy, index: int) -> str:
        return f"{file.key}.bare-parts/{index:05d}"

    def put_part(self, file: FileCopy, index: int, data: bytes) -> None:
        self.put(self.part_name(file, index), data)

    def finish(self, file: FileCopy) -> None:
        names = [self.part_name(file, index) for index in range(file.parts)]
        temporary = list(names)
        level = 0
        while len(names) > COMPOSE_LIMIT:
            groups = [names[i : i + COMPOSE_LIMIT] for i in range(0, len(names), COMPOSE_LIMIT)]
            names = [f"{file.key}.bare-parts/c{level}-{j:05d}" for j in range(len(groups))]
            for group, target in zip(groups, names, strict=True):
                self.bucket.blob(target).compose([self.bucket.blob(name) for name in group])
            temporary += names
            level += 1
        self.bucket.blob(file.key).compose([self.bucket.blob(name) for name in names])
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda name: self.bucket.blob(name).delete(), temporary))


class S3Target:
    def __init__(self, endpoint: str, bucket: str, threads: int) -> None:
        import boto3
        from botocore.config import Config

        self.s3 = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, config=Config(max_pool_connections=64, s3={"addressing_style": "path"})
        )
        self.bucket_name = bucket

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket_name, Key=key, Body=data)

    def begin(self, file: FileCopy) -> None:
        file.upload_id = self.s3.create_multipart_upload(Bucket=self.bucket_name, Key=file.key)["UploadId"]

    def put_part(self, file: FileCopy, index: int, data: bytes) -> None:
        answer = self.s3.upload_part(Bucket=self.bucket_name, Key=file.key, UploadId=file.upload_id,
                                     PartNumber=index + 1, Body=data)  # fmt: skip
        with file.lock:
            file.etags[index] = answer["ETag"]

    def finish(self, file: FileCopy) -> None:
        parts = [{"PartNumber": index + 1, "ETag": file.etags[index]} for index in range(file.parts)]
        self.s3.complete_multipart_upload(Bucket=self.bucket_name, Key=file.key, UploadId=file.upload_id,
                                          MultipartUpload={"Parts": parts})  # fmt: skip


def copy_all(plan: list[dict[str, Any]], target: Any, prefix: str, threads: int, part_size: int) -> int:
    import requests

    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=64))

    def get(url: str, start: int, length: int) -> bytes:
        with session.get(url, headers={"Range": f"bytes={start}-{start + length - 1}",
                                       "Accept-Encoding": "identity"}, stream=True) as response:  # fmt: skip
            response.raise_for_status()
            data = response.raw.read()  # one read into one buffer (response.content joins 10 kB chunks)
        if len(data) != length:
            raise RuntimeError(f"{url}: {len(data)} bytes for a range of {length}")
        return data

    def whole(file: FileCopy) -> None:
        target.put(file.key, get(file.url, 0, file.size) if file.size else b"")

    def part(file: FileCopy, index: int) -> None:
        start = index * part_size
        target.put_part(file, index, get(file.url, start, min(part_size, file.size - start)))
        with file.lock:
            file.remaining -= 1
            last = file.remaining == 0
        if last:
            target.finish(file)

    copied = 0
    futures: list[Future[None]] = []
    with ThreadPoolExecutor(threads) as pool:
        for entry in plan:
            size = int(entry["size"])
            parts = max(1, -(-size // part_size))
            file = FileCopy(entry["path"], f"{prefix}/{entry['path']}", size, entry["url"], parts, parts)
            if parts == 1:
                futures.append(pool.submit(whole, file))
            else:
                target.begin(file)
                futures += [pool.submit(part, file, index) for index in range(parts)]
            copied += size
        for future in futures:
            future.result()
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--plan", required=True, help="JSON file: a list of {path, size, url}")
    parser.add_argument("--dest", choices=("gs", "s3"), required=True)
    parser.add_argument("--endpoint", required=True, help="the destination store's endpoint URL")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--part-size-mib", type=int, default=16)
    args = parser.parse_args(argv)
    with open(args.plan) as handle:
        plan = json.load(handle)
    target = (GCSTarget if args.dest == "gs" else S3Target)(args.endpoint, args.bucket, args.threads)
    started = time.monotonic()
    copied = copy_all(plan, target, args.prefix, args.threads, args.part_size_mib * MiB)
    print(json.dumps({"files": len(plan), "bytes": copied, "seconds": time.monotonic() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
