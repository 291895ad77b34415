"""Parse the locations users type into (scheme, bucket, prefix, account)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlparse

from streamctl.errors import UsageError
from streamctl.storage.base import Location, unsafe_path_reason
from streamctl.storage.schemes import ALIASES, OBJECT_SCHEMES, SCHEMES

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
        return not SCHEMES[self.scheme].local


def _split_bucket(rest: str, url: str) -> tuple[str, str]:
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"no bucket in {url!r}", hint="write it as SCHEME://BUCKET/PREFIX")
    if not _BUCKET.match(bucket):
        raise UsageError(f"invalid bucket or container name {bucket!r} in {url!r}")
    prefix = prefix.strip("/")
    if prefix and unsafe_path_reason(prefix, allow_backslash=True) is not None:
        raise UsageError(f"invalid prefix {prefix!r} in {url!r}", hint="remove '.', '..' and empty path segments")
    return bucket, prefix


_HF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HF_SPECIAL_REF = re.compile(r"^refs/(?:convert/[\w.-]+|pr/\d+)(?=/|$)")
_HF_WHOLE_SPECIAL_REF = re.compile(r"^refs/(?:convert/[\w.-]+|pr/\d+)$")


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
    if prefix and unsafe_path_reason(prefix) is not None:
        raise UsageError(f"invalid path {prefix!r} in {url!r}", hint="remove '.', '..' and empty path segments")
    return ParsedURL("hf", repo, prefix, revision=revision or None, repo_type=repo_type or "model")


# C0 controls, DEL and C1 controls: a pasted line break, a CR from a file saved on Windows, a tab. In a
# location they are never meant, and would become part of a folder's name or an object's key.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# Every scheme the table knows (and its aliases), and the https:// of Azure's URLs: written with one colon
# and no `//` they are typos, which would otherwise name a local folder such as `./s3:` silently.
_KNOWN_SCHEMES = frozenset(SCHEMES) | frozenset(ALIASES) | {"https"}
_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)(.*)$", re.DOTALL)
_FILE_SHORT_FORM = re.compile(r"^file:/(?!/)", re.IGNORECASE)  # RFC 8089's file:/ABSOLUTE/PATH


def _with_slashes(url: str) -> str | None:
    """`url` with a known scheme's `//` put back (`s3:/bkt/x`, `S3:bkt/x` -> `s3://bkt/x`; `file:x` ->
    `file:///x`), or None when it does not start with a known scheme and a colon."""
    match = _SCHEME_WITHOUT_SLASHES.match(url)
    if match is None or match.group(1).lower() not in _KNOWN_SCHEMES:
        return None
    scheme, rest = match.group(1).lower(), match.group(2).lstrip("/")
    return f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"


def _refuse_typos(url: str) -> None:
    """UsageError (exit 2) naming the likely meaning, for a location holding control characters or
    starting with a known scheme and a colon but not `//`. RFC 8089's `file:/ABSOLUTE/PATH` is a location."""
    control = _CONTROL.search(url)
    if control is not None:
        cleaned = _CONTROL.sub("", url).strip()
        meant = _with_slashes(cleaned) or cleaned
        raise UsageError(
            f"location {url!r} holds the control character {control.group(0)!r} (at offset {control.start()})"
            + (f": did you mean {meant!r}?" if meant else ""),
            hint="locations never hold control characters (a pasted line break, a CR from a file saved on Windows)",
        )
    with_slashes = _with_slashes(url)
    if with_slashes is not None and not _FILE_SHORT_FORM.match(url):
        raise UsageError(
            f"location {url!r} has a scheme but no '//': did you mean {with_slashes!r}?",
            hint=f"write SCHEME://...; for a local folder of that name write ./{url}",
        )


def parse_url(url: str) -> ParsedURL:
    """Accept local paths, file://, s3://, gs://, az://, hf:// and https://ACCOUNT.blob.core.windows.net/..."""
    if not url or not url.strip():
        raise UsageError("empty location")
    _refuse_typos(url)
    if _FILE_SHORT_FORM.match(url):
        return ParsedURL("file", unquote(url[len("file:") :]), "")
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
    scheme = ALIASES.get(scheme, scheme)
    if scheme == "hf":
        return _parse_hf(rest, url)
    if scheme not in OBJECT_SCHEMES:
        raise UsageError(
            f"unsupported scheme {scheme}:// in {url!r}",
            hint="use a local path, file://, s3://, gs://, az://, hf:// or https://ACCOUNT.blob.core.windows.net/",
        )
    bucket, prefix = _split_bucket(rest, url)
    return ParsedURL(scheme, bucket, prefix)


def format_hf_url(repo_type: str, repo_id: str, revision: str | None = None, path: str = "") -> str:
    """The hf:// URL that `_parse_hf` reads back (huggingface_hub's own grammar): a revision containing '/'
    is written with %2F, except refs/pr/N and refs/convert/NAME."""
    url = "hf://" + ("datasets/" if repo_type == "dataset" else "") + repo_id
    if revision is not None:
        url += "@" + (revision if _HF_WHOLE_SPECIAL_REF.match(revision) else quote(revision, safe=""))
    return f"{url}/{path}" if path else url


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")


def resolve_source_url(text: str, repo_type: str | None = None) -> str:
    """`org/name[@REV]` means a Hugging Face repo unless a local folder of that name exists."""
    if "://" in text or text.startswith(("/", ".", "~")) or os.path.exists(text):
        return text
    if _REPO_ID.match(text):
        repo_id, _, revision = text.partition("@")
        return format_hf_url(repo_type or "model", repo_id, revision or None)
    return text


def pinned_source(location: Location) -> str:
    """For manifests that record one string: a Hub source as the URL of the commit its revision resolved
    to (`hf://ORG/NAME@SHA[/PATH]`, which opens those exact files again); other sources as they are."""
    commit: str | None = getattr(location.store, "commit", None)
    return source_identity(location, commit) if commit else location.url


def source_identity(location: Location, commit: str | None = None) -> str:
    """What the manifest records as the source: the repo without its revision (the commit is separate),
    or pinned to `commit`."""
    repo_id = getattr(location.store, "repo_id", None)
    if repo_id is None:
        return location.url
    return format_hf_url(getattr(location.store, "repo_type", "model"), repo_id, commit, location.prefix)
