"""Plan a `vllm serve` launch with the Run:ai Model Streamer: arguments, environment, sizing.

Pure planning: `plan_launch` turns options plus what the pre-flight (serve/preflight.py) learned into a
`LaunchPlan` (argv, the environment streamctl adds, warnings); serve/run.py prints it or becomes vLLM.
vLLM 0.33 validates `--model-loader-extra-config` strictly while older versions silently ignore bad keys
or types, so everything is validated here first, either way.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from streamctl.common.limits import MAX_CONCURRENCY, MAX_MEMORY_LIMIT, check_count, check_parallel_sizes
from streamctl.common.redact import MASK, mask_credentials, printable
from streamctl.common.sizes import parse_size
from streamctl.errors import UsageError
from streamctl.serve.vllm_args import masked_arguments, takes
from streamctl.storage.azure_auth import choose_auth, connection_string_account, connection_string_fields
from streamctl.storage.base import StorageOptions
from streamctl.storage.url import ParsedURL, parse_url

LOAD_FORMAT = "runai_streamer"
LOAD_FORMAT_SHARDED = "runai_streamer_sharded"
DEFAULT_CONCURRENCY_LOCAL = 16  # the streamer's own defaults: file system vs object store
DEFAULT_CONCURRENCY_OBJECT_STORE = 8
STREAMER_DEFAULT_MEMORY_LIMIT = 40 * 10**9  # what the streamer stages when no limit is given
UNLIMITED = -1
LARGEST_TENSOR = 0
# Values of these never appear in printed commands, JSON or manifests.
SECRET_ENV = frozenset(
    {
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_CLIENT_SECRET",
        "VLLM_API_KEY",
    }
)
EXPERIMENTAL_ENGRAM_ENV = {
    "VLLM_RUNAI_SINGLE_ENGRAM_READER": "1",
    "VLLM_RUNAI_BORROWED_WEIGHTS": "1",
    "VLLM_RUNAI_USE_LOCAL_WEIGHT_INDEX": "1",
    "RUNAI_STREAMER_PARTITION_POLICY": "spans",
    "VLLM_USE_RUST_FRONTEND": "0",
}


def parse_memory_limit(text: str) -> int:
    """`5GiB`, `512MB`, plain bytes, `-1` (unlimited) or `0` (the largest tensor), as the streamer takes them."""
    stripped = text.strip()
    if stripped in ("-1", "0"):
        return int(stripped)
    return parse_size(stripped, "--memory-limit", MAX_MEMORY_LIMIT)


def normalize_model(model: str) -> str:
    """Lower-case the scheme: the streamer compares `s3://`, `gs://`, `az://` case-sensitively."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", model)
    if match and match.group(1) != match.group(1).lower():
        return match.group(1).lower() + model[len(match.group(1)) :]
    return model


@dataclass(frozen=True)
class EngramOptions:
    """The experimental DeepSeek V4.1 CPU Engram recipe (seed 000): off unless cpu_weight_files is set."""

    cpu_weight_files: tuple[str, ...] = ()
    cpu_memory_limit: int | None = None
    engram_globs: tuple[str, ...] = ()

    @classmethod
    def parse(
        cls, cpu_weight_files: str | None, cpu_memory_limit: str | None, engram_globs: Sequence[str]
    ) -> EngramOptions:
        """From the command line: `F1,F2` (blanks dropped), a size, the globs."""
        return cls(
            cpu_weight_files=tuple(name.strip() for name in (cpu_weight_files or "").split(",") if name.strip()),
            cpu_memory_limit=parse_memory_limit(cpu_memory_limit) if cpu_memory_limit else None,
            engram_globs=tuple(engram_globs),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_weight_files)

    def validate(self) -> None:
        if not self.enabled and (self.cpu_memory_limit is not None or self.engram_globs):
            raise UsageError("--cpu-memory-limit and --engram need --cpu-weight-files")
        if self.enabled and not self.engram_globs:
            raise UsageError(
                "--cpu-weight-files needs --engram GLOB naming the Engram tensors",
                hint="the recipe is only safe once the index is checked to place them in those files",
            )
        if self.enabled and self.cpu_memory_limit is None:
            raise UsageError("--cpu-weight-files needs --cpu-memory-limit SIZE (the seed uses 100GiB)")


@dataclass(frozen=True)
class ServeOptions:
    """What `streamctl serve` was asked for; `storage` as the user gave it (serve/run.py follows links)."""

    model: str
    tensor_parallel_size: int = 1
    concurrency: int | None = None
    memory_limit: int | None = None  # bytes, UNLIMITED or LARGEST_TENSOR
    distributed: bool | None = None
    sharded: bool | None = None
    pattern: str | None = None
    storage: StorageOptions = field(default_factory=StorageOptions)
    engram: EngramOptions = field(default_factory=EngramOptions)
    vllm_args: tuple[str, ...] = ()
    preflight: bool = True
    tune: bool = False

    def validate(self) -> None:
        """UsageError for what no checkpoint could make right (sizes, flags vLLM must not get after --)."""
        check_parallel_sizes(self.tensor_parallel_size, None)
        if self.concurrency is not None:
            check_count("--concurrency", self.concurrency, MAX_CONCURRENCY)
        if self.memory_limit is not None and self.memory_limit < UNLIMITED:
            raise UsageError(f"--memory-limit must be -1, 0 or a size, got {self.memory_limit}")
        for flag in ("--load-format", "--model-loader-extra-config", "--tensor-parallel-size", "-tp"):
            # as vLLM reads them: --load_format, --load-f and --tensor-parallel-size=2 are these flags too
            named = next((arg for arg in self.vllm_args if takes(arg, flag)), None)
            if named is not None:
                shown = named.split("=", 1)[0]
                raise UsageError(
                    f"pass {flag} to streamctl, not after -- (vLLM reads {shown} as {flag})",
                    hint="streamctl sets and checks it",
                )
        if self.pattern is not None and self.sharded is False:
            raise UsageError("--pattern names sharded files; it cannot go with --not-sharded")
        self.engram.validate()


@dataclass(frozen=True)
class CheckpointFacts:
    """What one header pass (the pre-flight) learned about the checkpoint."""

    total_bytes: int
    largest_tensor_bytes: int
    files: int
    sharded_ranks: int | None = None  # TP ranks found in a sharded layout


@dataclass(frozen=True)
class LaunchPlan:
    """One `vllm serve` launch: what to run, and the parsed values that sized it."""

    argv: tuple[str, ...]
    env: Mapping[str, str]  # the variables streamctl adds or changes; the rest of the environment passes through
    load_format: str
    extra_config: Mapping[str, object]
    warnings: tuple[str, ...]
    experimental: bool = False
    memory_limit: int | None = None  # the streamer's staging limit as asked (in extra_config or env as text)
    distributed: bool = False  # one streamer reads and broadcasts to the TP workers (else each stages its own)
    # Secrets the streamer needs in a form it reads, for a launch on this host only (never in a manifest):
    # see azure_streamer_credentials. Shown by name, masked.
    credentials: Mapping[str, str] = field(default_factory=dict, repr=False)
    notes: tuple[str, ...] = ()  # suggestions, not problems (an MoE checkpoint's faster ways to load)

    def launch_env(self) -> dict[str, str]:
        """What `vllm serve` (and the tune probes) get on top of the inherited environment."""
        return {**self.credentials, **self.env}

    def masked_argv(self) -> list[str]:
        """argv for display: secret vLLM options however spelled, and URL credentials, masked."""
        return masked_arguments(self.argv)

    def masked_env(self) -> dict[str, str]:
        return {
            name: (MASK if name in SECRET_ENV else mask_credentials(value))
            for name, value in sorted(self.launch_env().items())
        }

    def shell_line(self) -> str:
        """A copy-pasteable command line, secrets masked, control characters escaped the way bash reads them."""
        assignments = [f"{name}={shell_word(value)}" for name, value in self.masked_env().items()]
        return " ".join([*assignments, *(shell_word(arg) for arg in self.masked_argv())])

    def to_json(self) -> dict[str, object]:
        return {
            "argv": self.masked_argv(),
            "env": self.masked_env(),
            "load_format": self.load_format,
            "extra_config": dict(self.extra_config),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "experimental": self.experimental,
        }


def shell_word(text: str) -> str:
    """`text` quoted for a POSIX shell; with control characters, as bash's $'...' with visible escapes."""
    if printable(text) == text:
        return shlex.quote(text)
    return "$'" + printable(text.replace("\\", "\\\\").replace("'", "\\'")) + "'"


def _storage_env(
    parsed: ParsedURL, options: ServeOptions, environ: Mapping[str, str], warnings: list[str]
) -> dict[str, str]:
    """The variables the streamer needs for this store; user values are kept unless an option says otherwise."""
    wanted: dict[str, tuple[str, bool]] = {}  # name -> (value, explicitly asked for)
    storage = options.storage
    if parsed.scheme == "s3":
        endpoint = storage.endpoint_url or environ.get("AWS_ENDPOINT_URL")
        if endpoint:  # S3-compatible store; on AWS itself none of these apply (metadata-off breaks IRSA)
            wanted["AWS_ENDPOINT_URL"] = (endpoint, storage.endpoint_url is not None)
            path_style = storage.path_style if storage.path_style is not None else True
            wanted["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = (
                "0" if path_style else "1",
                storage.path_style is not None,
            )
            wanted["AWS_EC2_METADATA_DISABLED"] = ("true", False)
        elif storage.path_style is not None:
            wanted["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = ("0" if storage.path_style else "1", True)
    elif parsed.scheme == "gs":
        emulator = environ.get("STORAGE_EMULATOR_HOST")
        if emulator:  # the streamer's native GCS client reads only this name; with the other it hangs
            wanted["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = (emulator, False)
    elif parsed.scheme == "az":
        account = (
            parsed.account
            or storage.azure_account
            or environ.get("AZURE_STORAGE_ACCOUNT_NAME")
            or connection_string_account(environ.get("AZURE_STORAGE_CONNECTION_STRING", ""))
        )
        if not account:
            raise UsageError(
                f"no Azure storage account for {options.model}",
                hint="pass --azure-account, set AZURE_STORAGE_ACCOUNT_NAME, or use https://ACCOUNT.blob.core.windows.net/...",
            )
        wanted["AZURE_STORAGE_ACCOUNT_NAME"] = (
            account,
            parsed.account is not None or storage.azure_account is not None,
        )
    env: dict[str, str] = {}
    for name, (value, explicit) in wanted.items():
        current = environ.get(name)
        if current is None or current == value:
            env[name] = value
        elif explicit:
            env[name] = value
            warnings.append(f"{name} is set to {current!r}; using {value!r} as asked")
        else:
            warnings.append(f"keeping your {name}={current!r} (streamctl would set {value!r})")
    return env


# The Run:ai streamer (0.17) authenticates to Azure with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, else
# DefaultAzureCredential. It reads neither AZURE_STORAGE_CONNECTION_STRING (only in its Azurite test builds) nor
# AZURE_STORAGE_KEY, which streamctl's own Azure store reads (storage/azure_auth.py).
STREAMER_AZURE_KEY, STREAMER_AZURE_SAS = "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"
POD_SECRET_WARNING = "the pod's --secret must hold"  # moot for a pod with a cloud identity (serve --identity)


def azure_streamer_credentials(
    parsed: ParsedURL, options: ServeOptions, environ: Mapping[str, str], for_kubernetes: bool, warnings: list[str]
) -> dict[str, str]:
    """The secret streamctl's own store authenticates with, under the name the streamer reads, where it
    differs: a connection string's AccountKey or SharedAccessSignature, or AZURE_STORAGE_KEY.

    Without it, streamctl's pre-flight passes while vLLM's streamer finds no credentials and fails after the
    GPUs were taken. A manifest never gets the value: the warning says what the pod's --secret must hold."""
    if any(environ.get(name) for name in (STREAMER_AZURE_KEY, STREAMER_AZURE_SAS)):
        return {}  # the streamer reads the user's own
    auth = choose_auth(parsed.account, options.storage.azure_account, environ)
    variable, what, passed = "", "", {}
    if auth.method == "connection string" and auth.secret:
        fields = connection_string_fields(auth.secret)
        if fields.get("BlobEndpoint"):
            warnings.append(
                f"AZURE_STORAGE_CONNECTION_STRING names BlobEndpoint={mask_credentials(fields['BlobEndpoint'])}: "
                "vLLM's streamer builds https://ACCOUNT.blob.core.windows.net itself and will not use it"
            )
        for part, name in (("AccountKey", STREAMER_AZURE_KEY), ("SharedAccessSignature", STREAMER_AZURE_SAS)):
            if fields.get(part):
                variable, what, passed = "AZURE_STORAGE_CONNECTION_STRING", f"its {part}", {name: fields[part]}
                break
    elif auth.method == "account key" and auth.secret:
        variable, what, passed = "AZURE_STORAGE_KEY", "the key", {STREAMER_AZURE_KEY: auth.secret}
    if not passed:
        return {}
    if for_kubernetes:
        warnings.append(
            f"vLLM's streamer does not read {variable}: {POD_SECRET_WARNING} {STREAMER_AZURE_KEY} or "
            f"{STREAMER_AZURE_SAS}"
        )
        return {}
    warnings.append(f"vLLM's streamer does not read {variable}: {what} goes to it as {next(iter(passed))}")
    return passed


def plan_launch(
    options: ServeOptions,
    facts: CheckpointFacts | None,
    *,
    sharded: bool,
    environ: Mapping[str, str],
    cuda_available: bool,
    host_memory_bytes: int | None,
    executable: str = "vllm",
    for_kubernetes: bool = False,
) -> LaunchPlan:
    """argv + env for `vllm serve`. `facts` is None when the pre-flight was skipped; `for_kubernetes`: the
    launch runs in a pod, so no secret of this host's goes into it."""
    options.validate()
    model = normalize_model(options.model)
    parsed = parse_url(model)
    warnings: list[str] = []
    env = _storage_env(parsed, options, environ, warnings)
    credentials = (
        azure_streamer_credentials(parsed, options, environ, for_kubernetes, warnings) if parsed.scheme == "az" else {}
    )
    concurrency = options.concurrency or (
        DEFAULT_CONCURRENCY_OBJECT_STORE if parsed.is_remote else DEFAULT_CONCURRENCY_LOCAL
    )
    distributed = _distributed_streaming(options, cuda_available, warnings)
    _check_memory_limit(options, facts, distributed, host_memory_bytes, warnings)
    if sharded:
        load_format = LOAD_FORMAT_SHARDED
        extra_config = _sharded_loader_config(options, facts, parsed, concurrency, env, warnings)
    else:
        load_format = LOAD_FORMAT
        extra_config = _streamer_loader_config(options, concurrency, distributed)
    experimental = options.engram.enabled
    if experimental:
        env.update(_engram_env(options.engram))
        warnings.append("EXPERIMENTAL: DeepSeek V4.1 CPU Engram loading needs vLLM's experimental patch")
    tp = str(options.tensor_parallel_size)
    argv = [executable, "serve", model, "--load-format", load_format, "--tensor-parallel-size", tp]
    if extra_config:
        argv += ["--model-loader-extra-config", json.dumps(extra_config, separators=(",", ":"))]
    argv += list(options.vllm_args)
    return LaunchPlan(
        tuple(argv),
        env,
        load_format,
        extra_config,
        tuple(warnings),
        experimental,
        memory_limit=options.memory_limit,
        distributed=bool(distributed) and not sharded,  # the sharded loader has no distributed mode
        credentials=credentials,
    )


EP_WEIGHT_FILTER = "--enable-ep-weight-filter"  # vLLM 0.33+: ParallelConfig.enable_ep_weight_filter
EXPERT_PARALLEL = "--enable-expert-parallel"


def expert_notes(options: ServeOptions, experts: int, *, sharded: bool) -> tuple[list[str], list[str]]:
    """(notes, warnings) for a mixture of experts served without pre-sharded files: with TP > 1 every rank
    reads every expert. vLLM 0.33's --enable-ep-weight-filter (with --enable-expert-parallel) skips other
    ranks' experts, in its default loader only (model_loader/default_loader.py; the streamer's loaders never
    look at it); `streamctl shard --enable-expert-parallel` writes each rank's own files instead."""
    tp = options.tensor_parallel_size
    asked = any(takes(arg, EP_WEIGHT_FILTER) for arg in options.vllm_args)
    warnings = []
    if asked:
        warnings.append(
            f"{EP_WEIGHT_FILTER} applies to vLLM's default loader only: with --load-format "
            f"{LOAD_FORMAT_SHARDED if sharded else LOAD_FORMAT} every rank still reads what the streamer gives it"
        )
    if experts <= 0 or sharded or tp == 1:
        return [], warnings
    model = options.model.rstrip("/")
    shown = shell_word(model)
    dest = shell_word(f"{model}-tp{tp}-ep")
    note = (
        f"{model} is a mixture of experts ({experts} per layer) without pre-sharded files: each of the {tp} ranks "
        f"reads every expert. Either serve it with vLLM's default loader and {EP_WEIGHT_FILTER} (vLLM 0.33 or "
        f"later, with {EXPERT_PARALLEL}; each rank reads only its own experts, where they are tensors of their own, "
        f"not one fused 3D tensor): vllm serve {shown} "
        f"--tensor-parallel-size {tp} {EXPERT_PARALLEL} {EP_WEIGHT_FILTER}; or shard it once per rank and "
        f"stream that: streamctl shard {shown} {dest} -tp {tp} {EXPERT_PARALLEL}, then streamctl serve {dest} "
        f"-tp {tp} -- {EXPERT_PARALLEL}"
    )
    return [note], warnings


def _distributed_streaming(options: ServeOptions, cuda_available: bool, warnings: list[str]) -> bool:
    """Whether the streamer streams once and broadcasts to the TP workers: as asked, else on with TP > 1 and CUDA."""
    tp = options.tensor_parallel_size
    if options.distributed is None:
        if tp > 1 and not cuda_available:
            warnings.append("no CUDA device found: distributed streaming stays off (it needs CUDA or ROCm)")
        return tp > 1 and cuda_available  # the GCS guide's advice; CUDA/ROCm only
    if options.distributed and not cuda_available:
        warnings.append("--distributed asked for, but no CUDA device was found here; vLLM will refuse it on CPU")
    return options.distributed


def _check_memory_limit(
    options: ServeOptions,
    facts: CheckpointFacts | None,
    distributed: bool,
    host_memory_bytes: int | None,
    warnings: list[str],
) -> None:
    """UsageError for a limit below the largest tensor; a warning when the TP workers' staging outgrows the host."""
    memory_limit = options.memory_limit
    explicit = memory_limit is not None and memory_limit not in (UNLIMITED, LARGEST_TENSOR)
    if facts is not None and explicit and memory_limit is not None and memory_limit < facts.largest_tensor_bytes:
        raise UsageError(
            f"--memory-limit {memory_limit:,} bytes is below the largest tensor ({facts.largest_tensor_bytes:,} bytes)",
            hint=f"use at least {facts.largest_tensor_bytes:,}, or 0 (= the largest tensor), or -1 (unlimited)",
        )
    if not host_memory_bytes or distributed:
        return
    # Without distributed streaming every TP worker stages its own copy (run-ai#76: OOM-killed pods).
    tp = options.tensor_parallel_size
    staged = (
        staging_bytes(facts, memory_limit)
        if facts is not None
        else (memory_limit if memory_limit is not None and memory_limit > 0 else None)
    )
    if staged is not None and tp * staged > host_memory_bytes:
        warnings.append(
            f"{tp} workers x {staged:,} bytes of staging = {tp * staged:,} bytes, more than this host's "
            f"{host_memory_bytes:,} bytes of RAM: lower --memory-limit or use --distributed"
        )


def _sharded_loader_config(
    options: ServeOptions,
    facts: CheckpointFacts | None,
    parsed: ParsedURL,
    concurrency: int,
    env: dict[str, str],
    warnings: list[str],
) -> dict[str, object]:
    """`runai_streamer_sharded`'s extra config; its tuning goes into `env`, the only way vLLM lets it through."""
    tp = options.tensor_parallel_size
    # vLLM rejects every key but `pattern` here (vllm#30100): tuning goes through the environment.
    extra_config: dict[str, object] = {"pattern": options.pattern} if options.pattern else {}
    env["RUNAI_STREAMER_CONCURRENCY"] = str(concurrency)
    if options.memory_limit is not None:
        env["RUNAI_STREAMER_MEMORY_LIMIT"] = str(options.memory_limit)
    if options.distributed:
        warnings.append("the sharded loader has no distributed mode; --distributed is ignored")
    if parsed.scheme in ("gs", "az"):
        warnings.append(
            f"vLLM 0.33 lists sharded files in buckets only for s3:// ({parsed.scheme}:// finds none, vllm#38568)"
        )
    if facts is not None and facts.sharded_ranks is not None and facts.sharded_ranks != tp:
        raise UsageError(
            f"the sharded checkpoint has {facts.sharded_ranks} ranks but --tensor-parallel-size is {tp}",
            hint=f"pass --tensor-parallel-size {facts.sharded_ranks}, or re-shard with streamctl shard",
        )
    return extra_config


def _streamer_loader_config(options: ServeOptions, concurrency: int, distributed: bool) -> dict[str, object]:
    """`runai_streamer`'s extra config: vLLM passes these keys to the streamer."""
    if options.pattern:
        raise UsageError("--pattern applies to sharded checkpoints only")
    extra_config: dict[str, object] = {"concurrency": concurrency}
    if options.memory_limit is not None:
        extra_config["memory_limit"] = options.memory_limit
    if distributed or options.distributed is not None:
        extra_config["distributed"] = bool(distributed)
    return extra_config


def _engram_env(engram: EngramOptions) -> dict[str, str]:
    """The experimental recipe's variables (read by vLLM's patch, not by the streamer)."""
    assert engram.cpu_memory_limit is not None  # EngramOptions.validate
    return {
        **EXPERIMENTAL_ENGRAM_ENV,
        "VLLM_RUNAI_CPU_WEIGHT_FILES": ",".join(engram.cpu_weight_files),
        "VLLM_RUNAI_CPU_MEMORY_LIMIT": str(engram.cpu_memory_limit),
    }


def host_memory_bytes() -> int | None:
    """Total RAM from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cuda_available(environ: Mapping[str, str]) -> bool:
    """A CUDA device is visible: a /dev/nvidia* node and CUDA_VISIBLE_DEVICES not emptied."""
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(os.path.exists(f"/dev/nvidia{index}") for index in range(16))


def find_vllm(environ: Mapping[str, str]) -> str | None:
    return shutil.which("vllm", path=environ.get("PATH"))


def staging_bytes(facts: CheckpointFacts, memory_limit: int | None) -> int:
    """CPU bytes one streamer stages at most: its limit, bounded by the checkpoint itself."""
    if memory_limit == LARGEST_TENSOR:
        return facts.largest_tensor_bytes
    if memory_limit is None:
        return min(STREAMER_DEFAULT_MEMORY_LIMIT, facts.total_bytes)
    if memory_limit == UNLIMITED:
        return facts.total_bytes
    return min(memory_limit, facts.total_bytes)
