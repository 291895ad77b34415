"""Plan a `vllm serve` launch with the Run:ai Model Streamer: arguments, environment, sizing, pre-flight.

Pure planning: `plan_launch` turns options plus what the pre-flight learned into a `LaunchPlan` (argv, the
environment streamctl adds, warnings). The command layer prints it or replaces itself with vLLM (exec).
vLLM 0.33 validates `--model-loader-extra-config` strictly while older versions silently ignore bad keys
or types, so everything is validated here first, either way.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field

from streamctl.errors import UsageError
from streamctl.redact import MASK, mask_credentials, printable
from streamctl.limits import MAX_CONCURRENCY, MAX_MEMORY_LIMIT, check_count, check_parallel_sizes
from streamctl.checkpoint.sharded_names import default_pattern
from streamctl.sizes import parse_size
from streamctl.storage.url import ParsedURL, parse_url
from streamctl.serve.vllm_args import masked_arguments, takes

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
    model: str
    tensor_parallel_size: int = 1
    concurrency: int | None = None
    memory_limit: int | None = None
    distributed: bool | None = None
    sharded: bool | None = None
    pattern: str | None = None
    endpoint_url: str | None = None
    path_style: bool | None = None
    azure_account: str | None = None
    engram: EngramOptions = field(default_factory=EngramOptions)
    vllm_args: tuple[str, ...] = ()

    def validate(self) -> None:
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
                raise UsageError(f"pass {flag} to streamctl, not after -- (vLLM reads {shown} as {flag})",
                                 hint="streamctl sets and checks it")
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
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the variables streamctl adds or changes; the rest of the environment passes through
    load_format: str
    extra_config: Mapping[str, object]
    warnings: tuple[str, ...]
    experimental: bool = False

    def masked_argv(self) -> list[str]:
        """argv for display: secret vLLM options however spelled, and URL credentials, masked."""
        return masked_arguments(self.argv)

    def masked_env(self) -> dict[str, str]:
        return {
            name: (MASK if name in SECRET_ENV else mask_credentials(value)) for name, value in sorted(self.env.items())
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
    if parsed.scheme == "s3":
        endpoint = options.endpoint_url or environ.get("AWS_ENDPOINT_URL")
        if endpoint:  # S3-compatible store; on AWS itself none of these apply (metadata-off breaks IRSA)
            wanted["AWS_ENDPOINT_URL"] = (endpoint, options.endpoint_url is not None)
            path_style = options.path_style if options.path_style is not None else True
            wanted["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = ("0" if path_style else "1", options.path_style is not None)
            wanted["AWS_EC2_METADATA_DISABLED"] = ("true", False)
        elif options.path_style is not None:
            wanted["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = ("0" if options.path_style else "1", True)
    elif parsed.scheme == "gs":
        emulator = environ.get("STORAGE_EMULATOR_HOST")
        if emulator:  # the streamer's native GCS client reads only this name; with the other it hangs
            wanted["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = (emulator, False)
    elif parsed.scheme == "az":
        connection = dict(
            part.split("=", 1) for part in environ.get("AZURE_STORAGE_CONNECTION_STRING", "").split(";") if "=" in part
        )
        account = (
            parsed.account
            or options.azure_account
            or environ.get("AZURE_STORAGE_ACCOUNT_NAME")
            or connection.get("AccountName")
        )
        if not account:
            raise UsageError(
                f"no Azure storage account for {options.model}",
                hint="pass --azure-account, set AZURE_STORAGE_ACCOUNT_NAME, or use https://ACCOUNT.blob.core.windows.net/...",
            )
        wanted["AZURE_STORAGE_ACCOUNT_NAME"] = (account, parsed.account is not None or options.azure_account is not None)
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


def plan_launch(
    options: ServeOptions,
    facts: CheckpointFacts | None,
    *,
    sharded: bool,
    environ: Mapping[str, str],
    cuda_available: bool,
    host_memory_bytes: int | None,
    executable: str = "vllm",
) -> LaunchPlan:
    """argv + env for `vllm serve`. `facts` is None when the pre-flight was skipped."""
    options.validate()
    model = normalize_model(options.model)
    parsed = parse_url(model)
    warnings: list[str] = []
    env = _storage_env(parsed, options, environ, warnings)
    tp = options.tensor_parallel_size
    concurrency = options.concurrency or (
        DEFAULT_CONCURRENCY_OBJECT_STORE if parsed.is_remote else DEFAULT_CONCURRENCY_LOCAL
    )
    memory_limit = options.memory_limit

    distributed = options.distributed
    if distributed is None:
        distributed = tp > 1 and cuda_available  # the GCS guide's advice; CUDA/ROCm only
        if tp > 1 and not cuda_available:
            warnings.append("no CUDA device found: distributed streaming stays off (it needs CUDA or ROCm)")
    elif distributed and not cuda_available:
        warnings.append("--distributed asked for, but no CUDA device was found here; vLLM will refuse it on CPU")

    if facts is not None and memory_limit not in (None, UNLIMITED, LARGEST_TENSOR):
        assert memory_limit is not None
        if memory_limit < facts.largest_tensor_bytes:
            raise UsageError(
                f"--memory-limit {memory_limit:,} bytes is below the largest tensor ({facts.largest_tensor_bytes:,} bytes)",
                hint=f"use at least {facts.largest_tensor_bytes:,}, or 0 (= the largest tensor), or -1 (unlimited)",
            )
    if host_memory_bytes and not distributed:
        # Without distributed streaming every TP worker stages its own copy (run-ai#76: OOM-killed pods).
        staged = staging_bytes(facts, memory_limit) if facts is not None else (
            memory_limit if memory_limit is not None and memory_limit > 0 else None
        )
        if staged is not None and tp * staged > host_memory_bytes:
            warnings.append(
                f"{tp} workers x {staged:,} bytes of staging = {tp * staged:,} bytes, more than this host's "
                f"{host_memory_bytes:,} bytes of RAM: lower --memory-limit or use --distributed"
            )

    if sharded:
        load_format = LOAD_FORMAT_SHARDED
        pattern = options.pattern or default_pattern(1)
        # vLLM rejects every key but `pattern` here (vllm#30100): tuning goes through the environment.
        extra_config: dict[str, object] = {"pattern": pattern} if options.pattern else {}
        env["RUNAI_STREAMER_CONCURRENCY"] = str(concurrency)
        if memory_limit is not None:
            env["RUNAI_STREAMER_MEMORY_LIMIT"] = str(memory_limit)
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
    else:
        load_format = LOAD_FORMAT
        if options.pattern:
            raise UsageError("--pattern applies to sharded checkpoints only")
        extra_config = {"concurrency": concurrency}
        if memory_limit is not None:
            extra_config["memory_limit"] = memory_limit
        if distributed or options.distributed is not None:
            extra_config["distributed"] = bool(distributed)

    experimental = options.engram.enabled
    if experimental:
        assert options.engram.cpu_memory_limit is not None
        env.update(EXPERIMENTAL_ENGRAM_ENV)
        env["VLLM_RUNAI_CPU_WEIGHT_FILES"] = ",".join(options.engram.cpu_weight_files)
        env["VLLM_RUNAI_CPU_MEMORY_LIMIT"] = str(options.engram.cpu_memory_limit)
        warnings.append("EXPERIMENTAL: DeepSeek V4.1 CPU Engram loading needs vLLM's experimental patch")

    argv = [
        executable,
        "serve",
        model,
        "--load-format",
        load_format,
        "--tensor-parallel-size",
        str(tp),
    ]
    if extra_config:
        argv += ["--model-loader-extra-config", json.dumps(extra_config, separators=(",", ":"))]
    argv += list(options.vllm_args)
    return LaunchPlan(tuple(argv), env, load_format, extra_config, tuple(warnings), experimental)


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


def startup_budget_seconds(total_bytes: int, worst_case_bytes_per_second: float = 100e6) -> int:
    """How long a pod may take to load: the checkpoint at a slow-but-sane rate, plus engine start-up."""
    return int(math.ceil(total_bytes / worst_case_bytes_per_second)) + 600


def staging_bytes(facts: CheckpointFacts, memory_limit: int | None) -> int:
    """CPU bytes one streamer stages at most: its limit, bounded by the checkpoint itself."""
    if memory_limit == LARGEST_TENSOR:
        return facts.largest_tensor_bytes
    if memory_limit is None:
        return min(STREAMER_DEFAULT_MEMORY_LIMIT, facts.total_bytes)
    if memory_limit == UNLIMITED:
        return facts.total_bytes
    return min(memory_limit, facts.total_bytes)


def pod_memory_request(facts: CheckpointFacts, plan: LaunchPlan, tensor_parallel_size: int) -> int:
    """Host memory a serving pod needs: staging per streaming worker plus vLLM's own working set."""
    limit = plan.extra_config.get("memory_limit")
    if limit is None and "RUNAI_STREAMER_MEMORY_LIMIT" in plan.env:
        limit = int(plan.env["RUNAI_STREAMER_MEMORY_LIMIT"])
    workers = 1 if plan.extra_config.get("distributed") else tensor_parallel_size
    return workers * staging_bytes(facts, limit if isinstance(limit, int) else None) + 8 * 1024**3
