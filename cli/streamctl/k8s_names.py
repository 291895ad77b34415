"""Names in the manifests streamctl prints: Kubernetes' own rules for them, the names derived from a location,
and the one check of every name a user gives (`serve --k8s`, `transfer --k8s-job`).

The rules are the API server's (k8s.io/apimachinery/pkg/util/validation: IsDNS1123Label, IsDNS1123Subdomain,
IsDNS1035Label, IsValidLabelValue), so a manifest that passes here is not refused there for a name. A derived
name ends in a short hash of the whole location: two locations that read alike (`s3://team-a/llama-8b`,
`s3://team-b/llama-8b`) or differ only past the 63rd character never share a name, so applying one never
replaces the other, and one location gives the same name on every run (`kubectl apply` is idempotent)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from streamctl.errors import UsageError
from streamctl.storage.url import format_hf_url, parse_url


@dataclass(frozen=True)
class NameRule:
    """One of the API server's name formats."""

    title: str  # what Kubernetes calls it
    pattern: re.Pattern[str]  # the apimachinery regex
    max_length: int
    characters: str  # a regex class: the characters allowed anywhere
    first: str  # ... first and last
    last: str
    reads: str  # the rule in words, for the error message

    def violation(self, value: str) -> str | None:
        """Why `value` breaks the rule (the first reason found), or None when it keeps it."""
        if not value:
            return "it is empty"
        if len(value) > self.max_length:
            return f"it has {len(value)} characters, more than {self.max_length}"
        if self.pattern.fullmatch(value):
            return None
        bad = sorted({character for character in value if not re.fullmatch(self.characters, character)})
        if bad:
            return "it holds " + ", ".join(repr(character) for character in bad)
        if not re.fullmatch(self.first, value[0]):
            return f"it starts with {value[0]!r}"
        if not re.fullmatch(self.last, value[-1]):
            return f"it ends with {value[-1]!r}"
        return "a part between dots is empty or starts or ends with '-'"


_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = NameRule(
    "a DNS-1123 label",
    re.compile(_LABEL),
    63,
    "[-a-z0-9]",
    "[a-z0-9]",
    "[a-z0-9]",
    "at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit",
)
DNS1123_SUBDOMAIN = NameRule(
    "a DNS-1123 subdomain",
    re.compile(rf"{_LABEL}(?:\.{_LABEL})*"),
    253,
    "[-a-z0-9.]",
    "[a-z0-9]",
    "[a-z0-9]",
    "lower-case letters, digits and '-' in parts joined by '.', each part starting and ending with a letter or "
    "digit, at most 253 characters in all",
)
DNS1035_LABEL = NameRule(
    "a DNS-1035 label",
    re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?"),
    63,
    "[-a-z0-9]",
    "[a-z]",
    "[a-z0-9]",
    "at most 63 lower-case letters, digits and '-', starting with a letter and ending with a letter or digit",
)
LABEL_VALUE = NameRule(
    "a label value",
    re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"),
    63,
    "[-A-Za-z0-9_.]",
    "[A-Za-z0-9]",
    "[A-Za-z0-9]",
    "at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit",
)


def check_name(option: str, value: str, what: str, rule: NameRule) -> None:
    """UsageError (exit 2) naming the option, the value and the rule when `value` breaks `rule`.

    Empty is refused under every rule (an empty label value is valid, but `--accelerator ''` means nothing)."""
    reason = rule.violation(value)
    if reason is None:
        return
    suggestion = readable_name(value, rule.max_length)
    hint = None
    if rule.violation(suggestion) is None and suggestion != value:
        hint = f"e.g. {option} {suggestion}"
    raise UsageError(
        f"{option} {value!r} is not a valid {what}: {reason} (Kubernetes wants {rule.title}: {rule.reads})",
        hint=hint,
        code="bad-option-value",
    )


# What each name option of a manifest becomes, and so the rule it must keep. --name names the Deployment and
# its Service alike, and a Service name is a DNS-1035 label; a namespace is a DNS-1123 label; Secret and
# ServiceAccount names are DNS-1123 subdomains; the accelerator is a nodeSelector value, a label value.
NAME_OPTIONS: dict[str, tuple[str, str, NameRule]] = {
    "namespace": ("--namespace", "namespace name", DNS1123_LABEL),
    "name": ("--name", "Deployment and Service name", DNS1035_LABEL),
    "service_account": ("--service-account", "ServiceAccount name", DNS1123_SUBDOMAIN),
    "secret": ("--secret", "Secret name", DNS1123_SUBDOMAIN),
    "accelerator": ("--accelerator", "nodeSelector value", LABEL_VALUE),
    "compile_cache_claim": ("--compile-cache-pvc", "PersistentVolumeClaim name", DNS1123_SUBDOMAIN),
}


def check_manifest_names(*, image: str | None = None, **given: str | None) -> None:
    """Check every name option a manifest takes from the user (keys of NAME_OPTIONS, and `image`; None:
    not given) against the rule Kubernetes applies to what it becomes: UsageError (exit 2) for the first."""
    for key, value in given.items():
        if value is not None:
            option, what, rule = NAME_OPTIONS[key]
            check_name(option, value, what, rule)
    if image is not None:
        check_image(image)


# distribution/reference's grammar, which the kubelet parses an image with: the API server takes any text,
# and a pod whose image is not [REGISTRY[:PORT]/]PATH[:TAG][@DIGEST] fails to start (InvalidImageName).
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_IMAGE_NAME = re.compile(rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*")
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_IMAGE_REFERENCE = re.compile(rf"({_IMAGE_NAME.pattern})(?::{_TAG})?(?:@{_DIGEST})?")
IMAGE_NAME_LIMIT = 255  # characters of REGISTRY/PATH


def check_image(image: str) -> None:
    """UsageError (exit 2) for an --image the kubelet could not parse."""
    match = _IMAGE_REFERENCE.fullmatch(image)
    if match and len(match.group(1)) <= IMAGE_NAME_LIMIT:
        return
    reason = "it is empty" if not image else f"its name has more than {IMAGE_NAME_LIMIT} characters"
    if image and match is None:
        reason = "it does not parse as one"
    raise UsageError(
        f"--image {image!r} is not a valid image reference: {reason} (the kubelet wants "
        "[REGISTRY[:PORT]/]PATH[:TAG][@DIGEST], the PATH in lower-case letters, digits and '._-', no spaces)",
        code="bad-option-value",
    )


def readable_name(text: str, limit: int = 63) -> str:
    """`text` as a DNS-1123 label, as far as it goes: lower case, runs of other characters as one '-', cut
    to `limit`. Lossy: many texts give one result, so a name for a location adds `location_hash`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].rstrip("-")


HASH_LENGTH = 8  # hex digits of sha256: 32 bits, ample for the models of one namespace


def normalized_location(location: str, revision: str | None = None, account: str | None = None) -> str:
    """One spelling per place, for the name's hash and the manifest's annotation: the scheme in lower case
    and in its own spelling (`GS://`, `gcs://` are `gs://`), no trailing '/'; a Hub repo with its type and
    revision (huggingface_hub's grammar; `revision`: one given apart, as `--revision`); an Azure container
    with its account (the URL's, else `account`) as https://ACCOUNT.blob.core.windows.net/. Case is kept
    elsewhere: keys and repo ids are case-sensitive."""
    parsed = parse_url(location)
    if parsed.scheme == "hf":
        chosen = revision or parsed.revision
        return format_hf_url(parsed.repo_type or "model", parsed.bucket, chosen, parsed.prefix)
    if parsed.scheme == "file":
        return parsed.bucket
    account = parsed.account or (account.lower() if account and parsed.scheme == "az" else None)
    root = f"https://{account}.blob.core.windows.net/" if account else f"{parsed.scheme}://"
    return root + "/".join(part for part in (parsed.bucket, parsed.prefix) if part)


SOURCE_ANNOTATION = "streamctl.io/source"  # the whole places a derived name stands for
DEST_ANNOTATION = "streamctl.io/dest"
ENDPOINT_ANNOTATION = "streamctl.io/s3-endpoint"  # one bucket name is another bucket on another endpoint


def place_annotations(
    locations: Mapping[str, str],
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    account: str | None = None,
) -> dict[str, str]:
    """The annotations naming the places a manifest is about, `locations` by annotation key: each location
    normalized (normalized_location), and the S3 endpoint when an s3:// location is reached through one.
    A derived name hashes their values (derived_name), so it differs whenever one of them does."""
    places = {key: normalized_location(url, revision, account) for key, url in locations.items()}
    if endpoint and any(parse_url(url).scheme == "s3" for url in locations.values()):
        places[ENDPOINT_ANNOTATION] = endpoint.rstrip("/")
    return places


def location_hash(*normalized: str) -> str:
    """A short, stable hash of normalized locations (in order): the part of a derived name that differs
    whenever a location does."""
    return hashlib.sha256("\n".join(normalized).encode()).hexdigest()[:HASH_LENGTH]


# An Indexed Job's pods are named and hostnamed NAME-INDEX: the API server refuses a Job whose last
# NAME-INDEX is no DNS-1123 label (63 characters), and before Kubernetes 1.27 any Indexed Job name over
# 63 - 11 = 52 characters. 52 fits both, for every --parallelism.
JOB_NAME_LIMIT = 52


def derived_name(prefix: str, *normalized: str, limit: int = 63) -> str:
    """`PREFIX-LASTSEGMENT-HASH` for normalized locations: a DNS-1035 label (so also a DNS-1123 label, valid
    for a Service, a Job and a label value) of at most `limit` characters, readable from the first
    location's last path segment, told apart by `location_hash` of all of them. `prefix` starts with a letter."""
    last_segment = normalized[0].rsplit("/", 1)[-1]
    readable = readable_name(f"{prefix}-{last_segment}", limit - HASH_LENGTH - 1)
    return f"{readable}-{location_hash(*normalized)}"
