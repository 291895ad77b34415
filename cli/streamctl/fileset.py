"""Which files of a model repo or folder vLLM needs to serve it, and why the others are left out.

One classification serves `transfer` (the default file set) and `shard` (the non-weight files it copies).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streamctl.progress import Progress
from streamctl.storage.base import ListingNote, Location

MANIFEST_NAME = "streamctl-manifest.json"  # written by `transfer`
SHARD_MANIFEST_NAME = "streamctl-shard-manifest.json"  # written by `shard`; `"complete": false` until it ends

TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "tekken.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "special_tokens_map.json",
        "added_tokens.json",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)
CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
OTHER_WEIGHT_FORMATS = {
    ".bin": "PyTorch pickle weights (vLLM loads the safetensors)",
    ".pt": "PyTorch pickle weights (vLLM loads the safetensors)",
    ".pth": "PyTorch pickle weights (vLLM loads the safetensors)",
    ".h5": "TensorFlow weights",
    ".msgpack": "Flax weights",
    ".onnx": "ONNX export",
    ".gguf": "GGUF export",
}


@dataclass(frozen=True)
class Selection:
    path: str
    selected: bool
    reason: str


def is_safe_relative_path(path: str) -> bool:
    """A plain relative path: no absolute paths, backslashes, '..', '.' or empty segments."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_FILES or name.endswith((".tiktoken", ".jinja"))


def _default_selection(path: str, has_auto_map: bool, indexed_shards: frozenset[str] | None) -> Selection:
    name = posixpath.basename(path)
    suffix = posixpath.splitext(name)[1].lower()
    if path.startswith("original/"):
        return Selection(path, False, "Meta original/ weights (vLLM does not use them)")
    if name == ".gitattributes" or path.startswith(".git/"):
        return Selection(path, False, "git metadata")
    if name == MANIFEST_NAME:
        return Selection(path, False, "streamctl writes its own manifest")
    if suffix in OTHER_WEIGHT_FORMATS:
        return Selection(path, False, OTHER_WEIGHT_FORMATS[suffix])
    if "/" in path:
        return Selection(path, False, "sub-folder (vLLM would pull it at start-up)")
    if name.endswith(".safetensors"):
        if indexed_shards is not None and name not in indexed_shards:
            if name.startswith("consolidated"):
                return Selection(path, False, "Mistral-format duplicate of the indexed shards")
            return Selection(path, False, "not named by the checkpoint index")
        return Selection(path, True, "weights")
    if name.endswith(".safetensors.index.json"):
        if indexed_shards is not None and name.startswith("consolidated"):
            return Selection(path, False, "index of the Mistral-format duplicate")
        return Selection(path, True, "checkpoint index")
    if name in CONFIG_FILES:
        return Selection(path, True, "model config")
    if is_tokenizer_file(name):
        return Selection(path, True, "tokenizer")
    if suffix == ".json":
        return Selection(path, True, "config (vLLM pulls every *.json)")
    if suffix == ".py":
        if has_auto_map:
            return Selection(path, True, "custom code (config.json has auto_map)")
        return Selection(path, False, "custom code not referenced by an auto_map")
    return Selection(path, False, "not needed to serve")


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)


def select_files(
    paths: Iterable[str],
    *,
    has_auto_map: bool,
    indexed_shards: frozenset[str] | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    all_files: bool = False,
) -> list[Selection]:
    """Classify every path: the default serving set, refined by --include/--exclude, or --all-files.

    `indexed_shards` is the set of shard names the (HF) index names, when there is one: other top-level
    safetensors are left out because vLLM loads every top-level safetensors it finds in a bucket.
    """
    selections = []
    for path in sorted(paths):
        if all_files:
            choice = Selection(path, path != MANIFEST_NAME, "--all-files")
        else:
            choice = _default_selection(path, has_auto_map, indexed_shards)
        if include and _matches(path, include) and not choice.selected:
            choice = Selection(path, True, "--include")
        if exclude and _matches(path, exclude):
            choice = Selection(path, False, "--exclude")
        selections.append(choice)
    return selections


def select_serving_files(paths: Iterable[str], *, has_auto_map: bool) -> list[str]:
    """The files `shard` copies next to the sharded weights: what vLLM needs to serve (config, generation
    config, tokenizer, custom code when auto_map names it), without the source's weights and its now-stale
    index (`shard` writes its own weights), `original/`, sub-folders, or any streamctl manifest."""
    return [
        selection.path
        for selection in select_files(paths, has_auto_map=has_auto_map)
        if selection.selected
        and not selection.path.endswith((".safetensors", ".safetensors.index.json"))
        and not selection.path.startswith("streamctl-")
    ]


NOTES_LOGGED = 10  # notes shown one a line in progress logs; the rest are counted (JSON keeps them all)


def listing_notes(location: Location) -> tuple[ListingNote, ...]:
    """What a listing of `location` left out (special files, links not followed) or read through a link,
    keyed by path relative to it, for plans, results and findings."""
    return tuple(dataclasses.replace(note, key=location.relative(note.key)) for note in location.notes())


def skipped_because(location: Location, name: str) -> str:
    """' (NAME is a FIFO, ...: skipped)' when the listing of `location` left `name` out, else ''."""
    key = location.key(name)
    for note in location.notes():
        if note.key == key and not note.listed:
            return f" ({name} is {note.reason})"
    return ""


def notes_to_json(notes: Sequence[ListingNote]) -> dict[str, list[dict[str, object]]]:
    return {
        "skipped": [note.to_json(note.key) for note in notes if not note.listed],
        "symlinks": [note.to_json(note.key) for note in notes if note.listed],
    }


def log_notes(notes: Sequence[ListingNote], progress: Progress, where: str = "SOURCE") -> None:
    """One progress line per note left out (and links followed), for verbs that print no plan."""
    for note in notes[:NOTES_LOGGED]:
        progress.log(f"{'read through a link' if note.listed else 'skipped'} in {where}: {note.key}: {note.reason}")
    if len(notes) > NOTES_LOGGED:
        progress.log(f"... and {len(notes) - NOTES_LOGGED} more entries of {where} skipped or read through links")
