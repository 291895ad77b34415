"""Checks of what vLLM pulls next to the weights: `config.json` and the custom code its `auto_map` names,
a tokenizer, and sub-folders it would pull for nothing; and whether a `transfer --worker` copy is complete."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from streamctl.checkpoint.files import (
    ADAPTER_CONFIG_NAME,
    CONFIG_NAME,
    MANIFEST_NAME,
    MAX_CONFIG_BYTES,
    MISTRAL_PARAMS_NAME,
    TOKENIZER_CONFIG_NAME,
    RepoKind,
    auto_map_files,
    has_tokenizer,
    repo_kind,
)
from streamctl.checkpoint.safetensors import decode_json_strictly, printable
from streamctl.dest.manifests import MAX_MANIFEST_BYTES, TransferManifest, parse_manifest
from streamctl.dest.shares import manifest_incomplete
from streamctl.storage.base import Location
from streamctl.verify.reading import Listing, Reads, read_small
from streamctl.verify.report import TRANSFER_INCOMPLETE_CODE, Findings


def check_transfer_manifest(location: Location, listing: Listing, findings: Findings, reads: Reads) -> None:
    """A `transfer --worker K/N` copy some of whose shares have not finished (streamctl.dest.shares)."""
    data = read_small(location, listing, MANIFEST_NAME, MAX_MANIFEST_BYTES, findings, reads, TRANSFER_INCOMPLETE_CODE)
    manifest = parse_manifest(TransferManifest, data) if data is not None else None
    reason = manifest_incomplete(manifest) if manifest is not None else None  # None: unreadable, nothing to say
    if reason is not None:
        findings.warning(TRANSFER_INCOMPLETE_CODE, MANIFEST_NAME, f"the copy here is not complete: {reason}")


def read_repo_kind(
    location: Location, listing: Listing, config_data: bytes | None, findings: Findings, reads: Reads
) -> RepoKind:
    """The repo's RepoKind from the config already read, `adapter_config.json` when there is one, and
    `tokenizer_config.json` only when no tokenizer file is there (its own tokenizer code may be the tokenizer)."""
    documents: dict[str, object] = {}
    if config_data is not None:
        documents[CONFIG_NAME] = decode_json_strictly(config_data, what=CONFIG_NAME).value
    wanted = [ADAPTER_CONFIG_NAME] + ([] if has_tokenizer(listing.top_level) else [TOKENIZER_CONFIG_NAME])
    for name in wanted:
        if name in listing.top_level:
            data = read_small(location, listing, name, MAX_CONFIG_BYTES, findings, reads, "config-invalid")
            documents[name] = decode_json_strictly(data, what=name).value if data is not None else None
    return repo_kind(documents)


def check_serving_files(
    listing: Listing,
    safetensors_names: Sequence[str],
    config_data: bytes | None,
    referenced: Mapping[str, str],
    findings: Findings,
    kind: RepoKind,
    location_url: str,
) -> None:
    """What vLLM pulls next to the weights: config, tokenizer, custom code, and sub-folders. An adapter
    needs neither config nor tokenizer (its base model has them): one warning says how vLLM serves it."""
    top = listing.top_level
    if kind.adapter:
        findings.warning(
            "lora-adapter",
            ADAPTER_CONFIG_NAME,
            f"an adapter of {kind.base_model or 'a base model adapter_config.json does not name'}, not a model; "
            + kind.adapter_hint(location_url),
        )
    elif CONFIG_NAME in top:
        if config_data is not None:
            check_config(config_data, listing, findings)
    elif not (MISTRAL_PARAMS_NAME in top and all(name.startswith("consolidated") for name in safetensors_names)):
        findings.error("config-missing", None, f"no {CONFIG_NAME}; vLLM needs it to build the model")
    if not kind.adapter and not kind.custom_tokenizer and not has_tokenizer(top):
        findings.warning(
            "tokenizer-missing",
            None,
            "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json + merges.txt, ...); "
            "serve with --tokenizer pointing elsewhere, or upload them",
        )
    _check_subfolders(listing, referenced, findings)


def _check_subfolders(listing: Listing, referenced: Mapping[str, str], findings: Findings) -> None:
    """Sub-folders vLLM pulls at start-up, counting only the objects no config of the model references."""
    unreferenced: dict[str, tuple[int, int]] = {}
    for name, size in listing.sizes.items():
        folder, separator, _ = name.partition("/")
        if separator and name not in referenced:
            objects, total = unreferenced.get(folder, (0, 0))
            unreferenced[folder] = (objects + 1, total + size)
    for folder, (objects, total) in sorted(unreferenced.items()):
        findings.warning(
            "subfolder-pulled",
            f"{folder}/",
            f"{objects} object{'' if objects == 1 else 's'} ({total:,} bytes) that vLLM pulls into its cache "
            "at start-up; move them elsewhere",
        )


def check_config(data: bytes, listing: Listing, findings: Findings) -> None:
    """`config.json` is a JSON object, and the code files its `auto_map` names are present."""
    document = decode_json_strictly(data, what=CONFIG_NAME)
    if document.error is not None or not isinstance(document.value, dict):
        message = document.error.message if document.error else f"{CONFIG_NAME} is not a JSON object"
        findings.error("config-invalid", CONFIG_NAME, message)
        return
    needed: dict[str, str] = {}  # file -> the first reference naming it
    for file, reference in auto_map_files(document.value, safe_only=False):
        needed.setdefault(file, reference)
    for file, reference in sorted(needed.items()):
        if file not in listing.sizes:
            findings.warning(
                "remote-code-missing",
                printable(file),
                f"auto_map in {CONFIG_NAME} names {printable(reference)!r}; --trust-remote-code needs this file",
            )
