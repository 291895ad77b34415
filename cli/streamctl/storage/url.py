"""Parse the locations users type into (scheme, bucket, prefix, account)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from streamctl.errors import UsageError

OBJECT_SCHEMES = ("s3", "gs", "az")
_AZURE_HTTPS = re.compile(r"^https://([a-z0-9]{3,24})\.blob\.core\.windows\.net(?:/(.*))?$", re.IGNORECASE)
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


@dataclass(frozen=True)
class ParsedURL:
    scheme: str  # "file", "s3", "gs", "az", "hf"
    bucket: str  # bucket or container; for "file" the folder path; for "hf" the repo id ORG/NAME
    prefix: str  # key prefix without leading or trailing "/"
    account: str | None = None  # Azure storage account when the URL names one
    revision: str | None = None  # hf:// only: the @REV (branch, tag or commit), else None (default branch)
    repo_type: str | None = None  # hf:// only: "model" or "dataset"

    @property
    def is_remote(self) -> bool:
        return self.scheme != "file"


def _split_bucket(rest: str, url: str) -> tuple[str, str]:
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"no bucket in {url!r}", hint="write it as SCHEME://BUCKET/PREFIX")
    if not _BUCKET.match(bucket):
        raise UsageError(f"invalid bucket or container name {bucket!r} in {url!r}")
    prefix = prefix.strip("/")
    if any(part in ("..", ".") for part in prefix.split("/")) or "//" in prefix:
        raise UsageError(f"invalid prefix {prefix!r} in {url!r}", hint="remove '.', '..' and empty path segments")
    return bucket, prefix


_HF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HF_SPECIAL_REF = re.compile(r"^refs/(?:convert/[\w.-]+|pr/\d+)(?=/|$)")


def _parse_hf(rest: str, url: str) -> ParsedURL:
    """hf://[models/|datasets/]ORG/NAME[@REV][/PATH], huggingface_hub's own hf:// grammar: bucket = repo id,
    prefix = path in the repo. A revision containing '/' is written with %2F, except refs/pr/N."""
    kind, _, tail = rest.partition("/")
    repo_type = {"models": "model", "datasets": "dataset"}.get(kind)
    if repo_type is not None:
        rest = tail
    elif kind in ("spaces", "kernels", "buckets"):
        raise UsageError(f"unsupported Hugging Face repo type {kind!r} in {url!r}", hint="use a model or dataset")
    org, _, tail = rest.partition("/")
    segment, _, tail = tail.partition("/")
    name, at, revision = segment.partition("@")
    special = _HF_SPECIAL_REF.match(f"{revision}/{tail}") if at else None
    if special:  # refs/pr/N and refs/convert/NAME keep their '/', as in huggingface_hub's parser
        revision, tail = special.group(0), f"{revision}/{tail}"[special.end() :]
    revision = unquote(revision)
    repo = f"{org}/{name}"
    if org and not name:
        raise UsageError(f"no repo name in {url!r}", hint="write it as hf://ORG/NAME, e.g. hf://Qwen/Qwen3-0.6B")
    if not all(_HF_NAME.match(part) for part in (org, name)) or ".." in repo or "--" in repo:
        raise UsageError(f"invalid Hugging Face repo id {repo!r} in {url!r}", hint="write it as hf://ORG/NAME")
    if at and not revision:
        raise UsageError(f"empty revision in {url!r}", hint="write it as hf://ORG/NAME@BRANCH-TAG-OR-COMMIT")
    prefix = tail.strip("/")
    if any(part in ("..", ".") for part in prefix.split("/")) or "//" in prefix or "\\" in prefix:
        raise UsageError(f"invalid path {prefix!r} in {url!r}", hint="remove '.', '..' and empty path segments")
    return ParsedURL("hf", repo, prefix, revision=revision or None, repo_type=repo_type or "model")


def parse_url(url: str) -> ParsedURL:
    """Accept local paths, file://, s3://, gs://, az://, hf:// and https://ACCOUNT.blob.core.windows.net/..."""
    if not url or not url.strip():
        raise UsageError("empty location")
    azure = _AZURE_HTTPS.match(url)
    if azure:
        if "?" in url:
            # A pasted SAS URL: the token would otherwise become part of every object name (and leak).
            raise UsageError(
                f"query string in {url.split('?', 1)[0]!r}?...",
                hint="drop the '?...' part; pass a SAS token in AZURE_STORAGE_SAS_TOKEN instead",
            )
        bucket, prefix = _split_bucket(unquote(azure.group(2) or ""), url)
        return ParsedURL("az", bucket, prefix, azure.group(1).lower())
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", url)
    if not match:
        return ParsedURL("file", url, "")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        parts = urlparse(url)
        if parts.netloc not in ("", "localhost"):
            # file://models/x would otherwise silently mean /x.
            raise UsageError(f"{url!r} names a host", hint="write file:///ABSOLUTE/PATH, or a plain path")
        path = unquote(parts.path)
        if not path:
            raise UsageError(f"no path in {url!r}")
        return ParsedURL("file", path, "")
    if scheme == "gcs":
        scheme = "gs"
    if scheme == "hf":
        return _parse_hf(rest, url)
    if scheme not in OBJECT_SCHEMES:
        raise UsageError(
            f"unsupported scheme {scheme}:// in {url!r}",
            hint="use a local path, file://, s3://, gs://, az://, hf:// or https://ACCOUNT.blob.core.windows.net/",
        )
    bucket, prefix = _split_bucket(rest, url)
    return ParsedURL(scheme, bucket, prefix)
