"""Which files of a model repo or folder vLLM needs to serve it, and why the others are left out.

One classification serves `transfer` (the default file set) and `shard` (the non-weight files it copies).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamctl.checkpoint.index import MAX_INDEX_BYTES, InvalidIndex, parse_index
from streamctl.checkpoint.model_types import KNOWN_MODEL_TYPES
from streamctl.checkpoint.safetensors import decode_json_strictly
from streamctl.errors import NotFoundError

if TYPE_CHECKING:
    from streamctl.storage.base import Location

from streamctl.progress import Progress
from streamctl.storage.base import ListingNote, Location, is_safe_relative_path

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
# Any one of these is a usable tokenizer for vLLM on its own; `vocab.json` needs `merges.txt` beside it.
STANDALONE_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tekken.json",
    "spiece.model",
    "vocab.txt",
    "tokenizer.tiktoken",
)
# The tokenizer files of Mistral's own format, as vLLM 0.33 looks for them (vllm/tokenizers/registry.py,
# `resolve_tokenizer_args`: `tekken.json`, `tokenizer.model.v*`; mistral_common then takes tekken.json or the
# highest `tokenizer.model.v3`, `.v7m1`, ...). Matched against the file name, as vLLM does.
MISTRAL_TOKENIZER_PATTERNS = ("tekken.json", "tokenizer.model.v*")
CONFIG_NAME = "config.json"
MISTRAL_PARAMS_NAME = "params.json"  # Mistral-format config next to consolidated*.safetensors
MAX_CONFIG_BYTES = 10_000_000
CONFIG_FILES = frozenset({CONFIG_NAME, "generation_config.json"})
OTHER_WEIGHT_FORMATS = {
    ".bin": "PyTorch pickle weights (vLLM loads the safetensors)",
    ".pt": "PyTorch pickle weights (vLLM loads the safetensors)",
    ".pth": "PyTorch pickle weights (vLLM loads the safetensors)",
    ".h5": "TensorFlow weights",
    ".msgpack": "Flax weights",
    ".onnx": "ONNX export",
    ".gguf": "GGUF export",
}


TRAINER_STATE_PREFIXES = ("training_args", "optimizer", "scheduler", "rng_state")  # .bin/.pt, not weights


def other_weight_format(name: str) -> str | None:
    """What a weights file in another format than safetensors is (OTHER_WEIGHT_FORMATS), None for anything
    else (a trainer's saved state is not weights)."""
    base = name.rsplit("/", 1)[-1]
    if base.startswith(TRAINER_STATE_PREFIXES):
        return None
    return next((what for suffix, what in OTHER_WEIGHT_FORMATS.items() if base.endswith(suffix)), None)


@dataclass(frozen=True)
class WeightsElsewhere:
    """Where the weights of a listing without top-level safetensors are: safetensors in sub-folders (a repo
    of several variants, a diffusers pipeline), or files of another format at the top (GGUF, pickle)."""

    folders: tuple[str, ...]  # sub-folders holding .safetensors, outermost first
    other: tuple[tuple[str, tuple[str, ...]], ...]  # (suffix, top-level files) per other weights format

    def describe(self, shown: int = 3) -> str:
        parts = []
        if self.folders:
            parts.append(f"*.safetensors in sub-folder{'s' if len(self.folders) > 1 else ''} "
                         + ", ".join(f"{folder}/" for folder in self.folders[:shown])
                         + (f" and {len(self.folders) - shown} more" if len(self.folders) > shown else ""))  # fmt: skip
        for suffix, files in self.other:
            what = OTHER_WEIGHT_FORMATS[suffix].split(" (")[0]
            more = f" and {len(files) - shown} more" if len(files) > shown else ""
            parts.append(f"{what} ({', '.join(files[:shown])}{more})")
        return "; ".join(parts)

    def transfer_hint(self, source_url: str) -> str:
        """The commands that copy them: the sub-folder as SOURCE, or --include for the format."""
        commands = [f"transfer {source_url.rstrip('/')}/{folder} DEST" for folder in self.folders[:1]]
        commands += [f"--include '*{suffix}'" for suffix, _ in self.other]
        return "to copy them: " + ", or ".join(commands)


def weights_file(path: str) -> bool:
    """A top-level weights file of any format: what makes a copy a checkpoint to check."""
    return "/" not in path and (path.endswith(".safetensors") or other_weight_format(path) is not None)


# Mistral's own format: consolidated*.safetensors, consolidated.safetensors.index.json
CONSOLIDATED_PREFIX = "consolidated"
MISTRAL_DUPLICATE = "Mistral-format duplicate of the HF shards"


def is_consolidated(name: str) -> bool:
    """A file of Mistral's own format (its weights or their index), by name as vLLM's selection matches it."""
    return name.startswith(CONSOLIDATED_PREFIX)


@dataclass(frozen=True)
class WeightsChoice:
    """Which top-level `.safetensors` of a listing are the checkpoint's weights: the one rule every verb uses.

    vLLM loads every top-level `*.safetensors` of a prefix, and a `consolidated*` file among HF shards
    switches it to Mistral-format loading. The HF shards are the weights where there are any (what `shard`
    reads, `transfer` copies and `serve --tune` samples); `consolidated*` beside them is a duplicate (left
    out by `transfer`, an error for `verify-index`); alone, `consolidated*` are the weights in Mistral's own
    format (`shard` refuses them, `verify-index` then needs no config.json when params.json is there)."""

    hf: tuple[str, ...]  # top-level *.safetensors not named consolidated*, sorted
    consolidated: tuple[str, ...]  # top-level consolidated*.safetensors, sorted

    @property
    def weights(self) -> tuple[str, ...]:
        return self.hf or self.consolidated

    @property
    def duplicate(self) -> tuple[str, ...]:
        """The Mistral-format files beside HF shards (MISTRAL_DUPLICATE); empty when there is one format."""
        return self.consolidated if self.hf else ()

    @property
    def mistral_format(self) -> bool:
        """Only Mistral's own format: consolidated* and no HF shards."""
        return bool(self.consolidated) and not self.hf

    @property
    def listed(self) -> tuple[str, ...]:
        """Every top-level `.safetensors`, both formats: what vLLM lists under a prefix and verify-index reads."""
        return tuple(sorted(self.hf + self.consolidated))


def choose_weights(paths: Iterable[str]) -> WeightsChoice:
    """The WeightsChoice of a listing (relative paths; sub-folders are not weights vLLM loads)."""
    names = sorted(path for path in paths if "/" not in path and path.endswith(".safetensors"))
    return WeightsChoice(
        tuple(name for name in names if not is_consolidated(name)),
        tuple(name for name in names if is_consolidated(name)),
    )


def weights_elsewhere(paths: Iterable[str]) -> WeightsElsewhere | None:
    """WeightsElsewhere for a listing (relative paths) without top-level `.safetensors`; None when it has some,
    or no weights at all."""
    names = sorted(paths)
    if any("/" not in name and name.endswith(".safetensors") for name in names):
        return None
    folders = sorted({name.rpartition("/")[0] for name in names if "/" in name and name.endswith(".safetensors")},
                     key=lambda folder: (folder.count("/"), folder))  # fmt: skip
    other: dict[str, list[str]] = {}
    for name in names:
        if "/" not in name and other_weight_format(name) is not None:
            other.setdefault(posixpath.splitext(name)[1].lower(), []).append(name)
    if not folders and not other:
        return None
    return WeightsElsewhere(tuple(folders), tuple((suffix, tuple(files)) for suffix, files in sorted(other.items())))


# Configs whose contents name other files the model needs: sentence-transformers modules, custom code
# (`auto_map`, also for tokenizers and processors), tokenizer side files. Read before choosing files.
REFERENCING_CONFIGS = (
    CONFIG_NAME,
    "modules.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "feature_extractor_config.json",
    "image_processor_config.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
# transformers loads every template in this folder next to chat_template.jinja, unasked.
CHAT_TEMPLATES_FOLDER = "additional_chat_templates/"
_MAX_REFERENCE_DEPTH = 8  # how deep into a config's JSON file names are looked for


@dataclass(frozen=True)
class Selection:
    path: str
    selected: bool
    reason: str


def is_mistral_tokenizer_file(name: str) -> bool:
    """A tokenizer file of Mistral's own format, as vLLM's selection matches it (MISTRAL_TOKENIZER_PATTERNS)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MISTRAL_TOKENIZER_PATTERNS)


def is_tokenizer_file(name: str) -> bool:
    """Whether a top-level file name is one a tokenizer loader reads (HF, Mistral's own format, tiktoken)."""
    return name in TOKENIZER_FILES or name.endswith((".tiktoken", ".jinja")) or is_mistral_tokenizer_file(name)


def has_tokenizer(top_level: Iterable[str]) -> bool:
    """Whether these top-level names hold a tokenizer vLLM can load on its own: one of
    STANDALONE_TOKENIZER_FILES, a Mistral-format file (`tokenizer.model.v3`, ...), a tiktoken file (read by
    the repo's own tokenizer code, `qwen.tiktoken`), or `vocab.json` with `merges.txt`."""
    names = set(top_level)
    return (
        any(name in STANDALONE_TOKENIZER_FILES or name.endswith(".tiktoken") for name in names)
        or any(is_mistral_tokenizer_file(name) for name in names)
        or {"vocab.json", "merges.txt"} <= names
    )


def needs_mistral_tokenizer_mode(top_level: Iterable[str]) -> bool:
    """Whether `vllm serve` must be told `--tokenizer-mode mistral` to choose the tokenizer it chose on the
    source. vLLM's auto mode picks Mistral's own tokenizer only when a Mistral-format tokenizer file sits beside
    `consolidated*.safetensors` (`resolve_tokenizer_args`); a copy of a repo in both formats (Mistral-7B-
    Instruct-v0.3) keeps the tokenizer file but not that 14 GB duplicate of the HF shards, so auto would fall
    back to the HF tokenizer there."""
    names = set(top_level)
    weights = choose_weights(names)
    return any(is_mistral_tokenizer_file(name) for name in names) and bool(weights.hf) and not weights.consolidated


def _module_path(reference: str, safe_only: bool) -> str | None:
    """`configuration_x.XConfig` or `models.x.Y` -> the `.py` file; None for code in another repo (`org/repo--m.C`)
    and, with `safe_only`, for a path that would leave the folder."""
    if "--" in reference or "." not in reference:
        return None
    module = reference.rsplit(".", 1)[0]
    path = module.replace(".", "/") + ".py"
    return path if not safe_only or is_safe_relative_path(path) else None


def auto_map_files(document: Any, *, safe_only: bool = True) -> list[tuple[str, str]]:
    """(file, reference) for every `module.Class` an `auto_map` names (values: a string or a list). With
    `safe_only` False, also the files whose paths are unsafe (verify reports them missing)."""
    auto_map = document.get("auto_map") if isinstance(document, dict) else None
    if not isinstance(auto_map, dict):
        return []
    found: list[tuple[str, str]] = []
    for value in auto_map.values():
        for item in value if isinstance(value, list) else [value]:
            path = _module_path(item, safe_only) if isinstance(item, str) else None
            if path is not None:
                found.append((path, item))
    return found


ADAPTER_CONFIG_NAME = "adapter_config.json"  # PEFT's: a LoRA (or other) adapter, served on its base model
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
TRUST_REMOTE_CODE = "--trust-remote-code"


@dataclass(frozen=True)
class RepoKind:
    """What kind of repo a listing is, beyond its weights: a PEFT adapter, or a model that runs its own code.

    `custom_code` says why vLLM needs --trust-remote-code: without it, vLLM refuses a config whose `auto_map`
    names an `AutoConfig` for a `model_type` neither it nor transformers knows (KNOWN_MODEL_TYPES; Qwen-7B's
    `QWenConfig`), and transformers a tokenizer that is the repo's own class (`AutoTokenizer` in an auto_map)."""

    adapter: bool = False
    base_model: str | None = None  # adapter_config.json's `base_model_name_or_path`, when a string
    custom_code: str | None = None  # "auto_map in config.json names configuration_qwen.QWenConfig", or None
    custom_tokenizer: bool = False  # the tokenizer is the repo's own code, reading files of its own choosing
    experts: int = 0  # routed experts per MoE layer, as vLLM reads config.json (0: not a mixture of experts)

    def adapter_hint(self, location: str) -> str:
        """How vLLM serves the adapter at `location`: on its base model, with LoRA enabled."""
        base = self.base_model or "BASE_MODEL"
        name = posixpath.basename(location.rstrip("/")) or "adapter"
        return f"serve the base model with it: vllm serve {base} --enable-lora --lora-modules {name}={location}"


def _auto_map_entry(document: Any, key: str) -> str | None:
    auto_map = document.get("auto_map") if isinstance(document, dict) else None
    value = auto_map.get(key) if isinstance(auto_map, dict) else None
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, str) and item:
            return item
    return None


# vLLM 0.33's names for a config's expert count (transformers_utils/config.py CONFIG_FIELD_ALIASES), looked up
# in the config or its text_config as vLLM's hf_text_config does; the first one present counts.
EXPERT_COUNT_FIELDS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


def expert_count(config: Any) -> int:
    """Routed experts per MoE layer from a parsed config.json (a list: its first, as vLLM takes Ernie VL's)."""
    if not isinstance(config, dict):
        return 0
    text_config = config.get("text_config")
    for document in (text_config, config) if isinstance(text_config, dict) else (config,):
        for name in EXPERT_COUNT_FIELDS:
            value = document.get(name)
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def repo_kind(documents: Mapping[str, Any]) -> RepoKind:
    """The RepoKind of a repo from the parsed JSON of its ADAPTER_CONFIG_NAME, CONFIG_NAME and
    TOKENIZER_CONFIG_NAME (those present and readable)."""
    adapter = documents.get(ADAPTER_CONFIG_NAME)
    base = adapter.get("base_model_name_or_path") if isinstance(adapter, dict) else None
    config = documents.get(CONFIG_NAME)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    # vLLM builds the config of a model_type it or transformers knows with their own class, auto_map or not.
    config_code = None if model_type in KNOWN_MODEL_TYPES else _auto_map_entry(config, "AutoConfig")
    tokenizer_code = _auto_map_entry(documents.get(TOKENIZER_CONFIG_NAME), "AutoTokenizer") or _auto_map_entry(
        documents.get(CONFIG_NAME), "AutoTokenizer"
    )
    custom = None
    if config_code is not None:
        custom = f"auto_map in {CONFIG_NAME} names {config_code}, for a model_type vLLM does not know: {model_type!r}"
    elif tokenizer_code is not None:
        custom = f"auto_map names the tokenizer {tokenizer_code}"
    return RepoKind(
        adapter=ADAPTER_CONFIG_NAME in documents,
        base_model=base if isinstance(base, str) and base else None,
        custom_code=custom,
        custom_tokenizer=tokenizer_code is not None,
        experts=expert_count(config),
    )


def read_repo_kind(location: Location, sizes: Mapping[str, int]) -> RepoKind:
    """`repo_kind` of a listing (`sizes`: relative path -> bytes), reading its small configs from `location`.
    A config that is not JSON tells nothing (verify-index says what is wrong with it)."""
    documents: dict[str, Any] = {}
    for name in (ADAPTER_CONFIG_NAME, CONFIG_NAME, TOKENIZER_CONFIG_NAME):
        size = sizes.get(name)
        if size is None or size > MAX_CONFIG_BYTES:
            continue
        try:
            data = location.store.read_range(location.key(name), 0, size)
        except NotFoundError:
            continue
        document = decode_json_strictly(data, what=name)
        documents[name] = document.value if document.error is None else None
    return repo_kind(documents)


def _strings(value: Any, depth: int = 0) -> Iterable[str]:
    if depth > _MAX_REFERENCE_DEPTH:
        return
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item, depth + 1)


def config_references(documents: Mapping[str, Any], paths: Iterable[str]) -> dict[str, str]:
    """Every file of `paths` that the model's own configs point to, with why: path -> reason.

    `documents` holds the parsed JSON of the REFERENCING_CONFIGS present. Covered: the sentence-transformers
    module folders `modules.json` lists (`1_Pooling/`, `2_Dense/`, ...: vLLM reads the pooling from them),
    the code every `auto_map` names (config, tokenizer, processor), any file a config names by its path
    (`tokenizer_file`, `vocab_file`, ...), and `additional_chat_templates/`.
    """
    available = set(paths)
    references: dict[str, str] = {}
    modules = documents.get("modules.json")
    for module in modules if isinstance(modules, list) else []:
        folder = module.get("path") if isinstance(module, dict) else None
        if not isinstance(folder, str) or not folder.strip("/") or not is_safe_relative_path(folder.strip("/")):
            continue
        prefix = folder.strip("/") + "/"
        inside = sorted(path for path in available if path.startswith(prefix))
        has_safetensors = any(path.endswith(".safetensors") for path in inside)
        kind = module.get("type") if isinstance(module.get("type"), str) else "module"
        for path in inside:
            if has_safetensors and posixpath.splitext(path)[1].lower() in OTHER_WEIGHT_FORMATS:
                continue  # the module's safetensors are loaded; its pickle copy is not
            references.setdefault(path, f"{kind} module named by modules.json")
    for config_name, document in sorted(documents.items()):
        for path, reference in auto_map_files(document):
            if path in available:
                references.setdefault(path, f"custom code: auto_map in {config_name} names {reference}")
        for value in _strings(document):
            weights = posixpath.splitext(value)[1].lower() in OTHER_WEIGHT_FORMATS
            if value in available and value != config_name and not weights and is_safe_relative_path(value):
                references.setdefault(value, f"named by {config_name}")
    for path in available:
        if path.startswith(CHAT_TEMPLATES_FOLDER) and path.endswith((".jinja", ".json")):
            references.setdefault(path, "chat template (transformers loads this folder)")
    return references


def read_index_contents(location: Location, sizes: Mapping[str, int]) -> dict[str, frozenset[str] | None]:
    """The files each top-level weights index of a listing names (`sizes`: relative path -> bytes); None for
    one that is too large or not an index (verify-index says why)."""
    contents: dict[str, frozenset[str] | None] = {}
    for path, size in sizes.items():
        if weight_index_suffix(path) is None:
            continue
        contents[path] = None
        if size > MAX_INDEX_BYTES:
            continue
        try:
            contents[path] = frozenset(parse_index(path, location.store.read_range(location.key(path), 0, size)).files)
        except (InvalidIndex, NotFoundError):
            pass
    return contents


def read_config_references(
    location: Location, sizes: Mapping[str, int], known: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """`config_references` for a listing (`sizes`: relative path -> bytes): reads each referencing config
    present (small JSON) from `location`, except those in `known` (already parsed by the caller). A config
    that is not JSON points to nothing."""
    documents: dict[str, Any] = dict(known or {})
    for name in REFERENCING_CONFIGS:
        size = sizes.get(name)
        if name in documents or size is None or size > MAX_CONFIG_BYTES:
            continue
        try:
            data = location.store.read_range(location.key(name), 0, size)
        except NotFoundError:
            continue  # gone since the listing: it points to nothing
        # verify-index's rule for JSON (nested too deeply, a JSON bomb, not UTF-8): such a config points to nothing.
        document = decode_json_strictly(data, what=name)
        if document.error is None:
            documents[name] = document.value
    return config_references(documents, sizes)


def _default_selection(
    path: str,
    has_auto_map: bool,
    indexed_shards: frozenset[str] | None,
    referenced: Mapping[str, str],
    weights: WeightsChoice,
) -> Selection:
    name = posixpath.basename(path)
    suffix = posixpath.splitext(name)[1].lower()
    # What the configs point to, except git metadata, manifests and top-level weights (the index decides those).
    top_level_weights = "/" not in path and name.endswith(".safetensors")
    if path in referenced and name != MANIFEST_NAME and not path.startswith(".git/") and not top_level_weights:
        return Selection(path, True, referenced[path])
    if path.startswith("original/"):
        return Selection(path, False, "Meta original/ weights (vLLM does not use them)")
    if name == ".gitattributes" or path.startswith(".git/"):
        return Selection(path, False, "git metadata")
    if name == MANIFEST_NAME:
        return Selection(path, False, "streamctl writes its own manifest")
    weights_format = other_weight_format(name)
    if weights_format is not None:
        return Selection(path, False, weights_format)
    if suffix in OTHER_WEIGHT_FORMATS:  # other_weight_format says a trainer's saved state is not weights
        return Selection(path, False, "trainer state (not needed to serve)")
    if "/" in path:
        return Selection(path, False, "sub-folder (vLLM would pull it at start-up)")
    if name.endswith(".safetensors"):
        if indexed_shards is not None and name in indexed_shards:
            return Selection(path, True, "weights")
        if name in weights.duplicate or (indexed_shards is not None and is_consolidated(name)):
            return Selection(path, False, MISTRAL_DUPLICATE)
        if indexed_shards is not None:
            return Selection(path, False, "not named by the checkpoint index")
        return Selection(path, True, "weights")
    if name.endswith(".safetensors.index.json"):
        if is_consolidated(name) and (indexed_shards is not None or weights.duplicate):
            return Selection(path, False, "index of the Mistral-format duplicate")
        return Selection(path, True, "checkpoint index")
    if name in CONFIG_FILES:
        return Selection(path, True, "model config")
    if is_tokenizer_file(name) or suffix == ".model":
        return Selection(path, True, "tokenizer")
    if suffix == ".json":
        return Selection(path, True, "config (vLLM pulls every *.json)")
    if suffix == ".py":
        if has_auto_map:
            return Selection(path, True, "custom code (config.json has auto_map)")
        return Selection(path, False, "custom code not referenced by an auto_map")
    return Selection(path, False, "not needed to serve")


INDEX_SUFFIX = ".index.json"


def weight_index_suffix(path: str) -> str | None:
    """The weights suffix of a top-level index (`pytorch_model.bin.index.json` -> `.bin`,
    `model.safetensors.index.json` -> `.safetensors`), None for any other file."""
    if "/" in path or not path.endswith(INDEX_SUFFIX):
        return None
    suffix = posixpath.splitext(path[: -len(INDEX_SUFFIX)])[1].lower()
    return suffix if suffix == ".safetensors" or suffix in OTHER_WEIGHT_FORMATS else None


def _drop_dangling_indexes(
    selections: list[Selection], index_contents: Mapping[str, frozenset[str] | None]
) -> list[Selection]:
    """An index travels only with the files it names: one whose files are all left out would send loaders
    after files that are not there (`pytorch_model.bin.index.json` without its `.bin` shards). The files it
    names are `index_contents[path]` when it could be read, else the top-level files of its weights suffix.
    An index asked for by name (--include, --all-files) stays."""
    selected = {selection.path for selection in selections if selection.selected}
    kept = []
    for selection in selections:
        suffix = weight_index_suffix(selection.path)
        if suffix is not None and selection.selected and selection.reason not in ("--include", "--all-files"):
            named = index_contents.get(selection.path)
            if named is None:
                named = frozenset(p for p in (s.path for s in selections) if "/" not in p and p.endswith(suffix))
            if not named & selected:
                selection = Selection(selection.path, False, f"index of {suffix} files that are not copied")
        kept.append(selection)
    return kept


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)


def select_files(
    paths: Iterable[str],
    *,
    has_auto_map: bool,
    indexed_shards: frozenset[str] | None = None,
    referenced: Mapping[str, str] | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    all_files: bool = False,
    index_contents: Mapping[str, frozenset[str] | None] | None = None,
) -> list[Selection]:
    """Classify every path: the default serving set, refined by --include/--exclude, or --all-files.

    `indexed_shards` is the set of shard names the (HF) index names, when there is one: other top-level
    safetensors are left out because vLLM loads every top-level safetensors it finds in a bucket.
    `referenced` (from `config_references`) selects what the model's configs point to, sub-folders included.
    `index_contents`: the files each top-level index names (None: unreadable); an index whose files all stay
    behind stays behind too (`_drop_dangling_indexes`).
    """
    selections = []
    paths = sorted(paths)
    weights = choose_weights(paths)
    for path in paths:
        if all_files:
            choice = Selection(path, path != MANIFEST_NAME, "--all-files")
        else:
            choice = _default_selection(path, has_auto_map, indexed_shards, referenced or {}, weights)
        if include and _matches(path, include) and not choice.selected:
            choice = Selection(path, True, "--include")
        if exclude and _matches(path, exclude):
            choice = Selection(path, False, "--exclude")
        selections.append(choice)
    return _drop_dangling_indexes(selections, index_contents or {})


def select_serving_files(
    paths: Iterable[str], *, has_auto_map: bool, referenced: Mapping[str, str] | None = None
) -> list[str]:
    """The files `shard` copies next to the sharded weights: what vLLM needs to serve (config, generation
    config, tokenizer, custom code when auto_map names it, what the configs reference such as
    sentence-transformers module folders), without the source's top-level weights and its now-stale index
    (`shard` writes its own weights), `original/`, other sub-folders, or any streamctl manifest."""
    return [
        selection.path
        for selection in select_files(paths, has_auto_map=has_auto_map, referenced=referenced)
        if selection.selected
        and not ("/" not in selection.path and selection.path.endswith((".safetensors", ".safetensors.index.json")))
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
