"""vLLM's `serve` options as vLLM 0.33's own parser reads them, for masking and refusing by option, not by spelling.

`vllm serve` parses with `FlexibleArgumentParser` (vllm/utils/argparse_utils.py), an argparse parser with
`allow_abbrev` on that first rewrites every `--name` so that `_` becomes `-` up to the first `.` (names
stay case-sensitive) and turns `--name.key=value` into `--name JSON`. argparse then takes an exact option name, or a unique prefix of one (`--api-k K` is `--api-key K`). So a
secret can be spelled `--api-key K`, `--api_key=K`, `--api-k K`, `--api-key K1 K2`, `--hf_tok=T` or
`--api-key.x K`; `resolve_option` maps each spelling to the option(s) vLLM would take it for.

`VLLM_SERVE_OPTIONS` is every option string of vLLM 0.33's serve parser; `SECRET_OPTIONS` are those whose
value is a credential. Both are checked against the real parser by tests/serve/test_vllm_secret_flags.py
(tests/vllm_oracle/serve_options.py), which also derives the secret list from the parser's options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamctl.common.redact import MASK, mask_credentials

VLLM_SERVE_OPTIONS = frozenset(
    [
        "--additional-config",
        "--aggregate-engine-logging",
        "--all2all-backend",
        "--allow-credentials",
        "--allow-deprecated-quantization",
        "--allowed-headers",
        "--allowed-local-media-path",
        "--allowed-media-domains",
        "--allowed-methods",
        "--allowed-origins",
        "--anthropic-disabled-thinking-effort",
        "--api-key",
        "--api-server-count",
        "--async-scheduling",
        "--attention-backend",
        "--attention-config",
        "--aux-output-config",
        "--block-size",
        "--chat-template",
        "--chat-template-content-format",
        "--code-revision",
        "--cohere-format",
        "--cohere-is-reasoning-model",
        "--collect-detailed-traces",
        "--compilation-config",
        "--config",
        "--config-format",
        "--convert",
        "--cp-kv-cache-interleave-size",
        "--cpu-distributed-timeout-seconds",
        "--cpu-offload-gb",
        "--cpu-offload-params",
        "--cudagraph-capture-sizes",
        "--cudagraph-metrics",
        "--custom-histogram-buckets",
        "--data-parallel-address",
        "--data-parallel-backend",
        "--data-parallel-external-lb",
        "--data-parallel-hybrid-lb",
        "--data-parallel-multi-port-external-lb",
        "--data-parallel-rank",
        "--data-parallel-rpc-port",
        "--data-parallel-size",
        "--data-parallel-size-local",
        "--data-parallel-start-rank",
        "--data-parallel-supervisor-port",
        "--dbo-decode-token-threshold",
        "--dbo-prefill-token-threshold",
        "--dcp-comm-backend",
        "--dcp-kv-cache-interleave-size",
        "--dcp-q-replicate",
        "--decode-context-parallel-size",
        "--default-chat-template-kwargs",
        "--default-mm-loras",
        "--device-ids",
        "--device-memory-utilization",
        "--diffusion-config",
        "--disable-access-log-for-endpoints",
        "--disable-auto-tool-choice",
        "--disable-batch-sharded-sampling",
        "--disable-cascade-attn",
        "--disable-chunked-mm-input",
        "--disable-chunked-prefill",
        "--disable-cumem-allocator",
        "--disable-custom-all-reduce",
        "--disable-dbo",
        "--disable-elastic-ep",
        "--disable-ep-weight-filter",
        "--disable-eplb",
        "--disable-expert-parallel",
        "--disable-fastapi-docs",
        "--disable-fault-tolerance",
        "--disable-flash-late-interaction",
        "--disable-flashinfer-autotune",
        "--disable-force-include-usage",
        "--disable-hc-sp",
        "--disable-hybrid-kv-cache-manager",
        "--disable-layerwise-nvtx-tracing",
        "--disable-log-deltas",
        "--disable-log-outputs",
        "--disable-log-requests",
        "--disable-log-stats",
        "--disable-logging-iteration-details",
        "--disable-lora",
        "--disable-mamba-cache-stochastic-rounding",
        "--disable-mamba-shared-prefix-checkpoint",
        "--disable-mfu-metrics",
        "--disable-mixed-moe-lora-format",
        "--disable-mm-embeds",
        "--disable-moe-shared-loras",
        "--disable-nccl-comm-suspend",
        "--disable-nccl-for-dp-synchronization",
        "--disable-offline-docs",
        "--disable-per-request-metrics",
        "--disable-prefix-caching",
        "--disable-prompt-embeds",
        "--disable-prompt-tokens-details",
        "--disable-request-id-headers",
        "--disable-return-routed-experts",
        "--disable-scale-out",
        "--disable-server-load-tracking",
        "--disable-shm-tensor-arena",
        "--disable-sleep-mode",
        "--disable-sliding-window",
        "--disable-ssl-refresh",
        "--disable-tokenizer-info-endpoint",
        "--disable-tower-connector-lora",
        "--disable-trace-replay",
        "--disable-uvicorn-access-log",
        "--distributed-executor-backend",
        "--distributed-timeout-seconds",
        "--download-dir",
        "--dp-supervisor-probe-failure-threshold",
        "--dp-supervisor-probe-interval-s",
        "--dp-supervisor-probe-timeout-s",
        "--dp-sync-interval",
        "--dtype",
        "--ec-manager-config",
        "--ec-transfer-config",
        "--elastic-ep-max-dp-size",
        "--enable-auto-tool-choice",
        "--enable-batch-sharded-sampling",
        "--enable-cascade-attn",
        "--enable-chunked-mm-input",
        "--enable-chunked-prefill",
        "--enable-cumem-allocator",
        "--enable-custom-all-reduce",
        "--enable-dbo",
        "--enable-elastic-ep",
        "--enable-ep-weight-filter",
        "--enable-eplb",
        "--enable-expert-parallel",
        "--enable-fastapi-docs",
        "--enable-fault-tolerance",
        "--enable-flash-late-interaction",
        "--enable-flashinfer-autotune",
        "--enable-force-include-usage",
        "--enable-hc-sp",
        "--enable-hybrid-kv-cache-manager",
        "--enable-layerwise-nvtx-tracing",
        "--enable-log-deltas",
        "--enable-log-outputs",
        "--enable-log-requests",
        "--enable-logging-iteration-details",
        "--enable-lora",
        "--enable-mamba-cache-stochastic-rounding",
        "--enable-mamba-shared-prefix-checkpoint",
        "--enable-mfu-metrics",
        "--enable-mixed-moe-lora-format",
        "--enable-mm-embeds",
        "--enable-moe-shared-loras",
        "--enable-nccl-comm-suspend",
        "--enable-nccl-for-dp-synchronization",
        "--enable-offline-docs",
        "--enable-per-request-metrics",
        "--enable-prefix-caching",
        "--enable-prompt-embeds",
        "--enable-prompt-tokens-details",
        "--enable-request-id-headers",
        "--enable-return-routed-experts",
        "--enable-scale-out",
        "--enable-server-load-tracking",
        "--enable-shm-tensor-arena",
        "--enable-sleep-mode",
        "--enable-sliding-window",
        "--enable-ssl-refresh",
        "--enable-tokenizer-info-endpoint",
        "--enable-tower-connector-lora",
        "--enable-trace-replay",
        "--enable-uvicorn-access-log",
        "--enforce-eager",
        "--engram-config",
        "--eplb-config",
        "--exclude-tools-when-tool-choice-none",
        "--expert-placement-strategy",
        "--fail-on-environ-validation",
        "--fault-tolerance-config",
        "--fingerprint-mode",
        "--fingerprint-value",
        "--fully-sharded-loras",
        "--gdn-prefill-backend",
        "--generation-config",
        "--gpu-memory-utilization",
        "--grpc",
        "--grpc-port",
        "--h11-max-header-count",
        "--h11-max-incomplete-event-size",
        "--headless",
        "--help",
        "--hf-config-path",
        "--hf-overrides",
        "--hf-token",
        "--host",
        "--ignore-patterns",
        "--interleave-mm-strings",
        "--io-processor-plugin",
        "--ir-op-priority",
        "--jit-monitor-mode",
        "--jit-monitor-verbose",
        "--kda-decode-backend",
        "--kda-prefill-backend",
        "--kernel-config",
        "--kv-cache-dtype",
        "--kv-cache-dtype-skip-layers",
        "--kv-cache-memory-bytes",
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample",
        "--kv-events-config",
        "--kv-offloading-backend",
        "--kv-offloading-size",
        "--kv-sharing-fast-prefill",
        "--kv-transfer-config",
        "--language-model-only",
        "--limit-mm-per-prompt",
        "--linear-backend",
        "--load-format",
        "--log-config-file",
        "--log-error-stack",
        "--log-level",
        "--logging-config",
        "--logits-processors",
        "--logprobs-mode",
        "--long-prefill-token-threshold",
        "--long-prefill-token-threshold-adaptive",
        "--lora-dtype",
        "--lora-modules",
        "--lora-target-modules",
        "--mamba-backend",
        "--mamba-block-size",
        "--mamba-cache-dtype",
        "--mamba-cache-mode",
        "--mamba-cache-philox-rounds",
        "--mamba-ssm-cache-dtype",
        "--mamba-ssu-algorithm",
        "--master-addr",
        "--master-port",
        "--max-cpu-loras",
        "--max-cudagraph-capture-size",
        "--max-log-len",
        "--max-logprobs",
        "--max-lora-cls-labels",
        "--max-lora-rank",
        "--max-loras",
        "--max-model-len",
        "--max-num-active-seqs",
        "--max-num-batched-tokens",
        "--max-num-queued-reqs",
        "--max-num-queued-tokens",
        "--max-num-scheduled-tokens",
        "--max-num-seqs",
        "--max-parallel-loading-workers",
        "--media-io-kwargs",
        "--middleware",
        "--mm-device-do-normalize",
        "--mm-encoder-attn-backend",
        "--mm-encoder-attn-dtype",
        "--mm-encoder-fp8-scale-path",
        "--mm-encoder-fp8-scale-save-margin",
        "--mm-encoder-fp8-scale-save-path",
        "--mm-encoder-only",
        "--mm-encoder-tp-mode",
        "--mm-hasher-algorithm",
        "--mm-ipc-gpu-memory-gb",
        "--mm-processor-cache-gb",
        "--mm-processor-cache-type",
        "--mm-processor-device",
        "--mm-processor-kwargs",
        "--mm-shm-cache-max-object-size-mb",
        "--mm-tensor-ipc",
        "--model",
        "--model-class-overrides",
        "--model-impl",
        "--model-loader-extra-config",
        "--moe-backend",
        "--monokernel",
        "--nnodes",
        "--no-allow-credentials",
        "--no-allow-deprecated-quantization",
        "--no-async-scheduling",
        "--no-cohere-is-reasoning-model",
        "--no-cudagraph-metrics",
        "--no-data-parallel-external-lb",
        "--no-data-parallel-hybrid-lb",
        "--no-dcp-q-replicate",
        "--no-enforce-eager",
        "--no-exclude-tools-when-tool-choice-none",
        "--no-fail-on-environ-validation",
        "--no-fully-sharded-loras",
        "--no-interleave-mm-strings",
        "--no-jit-monitor-verbose",
        "--no-kv-cache-metrics",
        "--no-kv-sharing-fast-prefill",
        "--no-language-model-only",
        "--no-log-error-stack",
        "--no-long-prefill-token-threshold-adaptive",
        "--no-mm-device-do-normalize",
        "--no-mm-encoder-only",
        "--no-monokernel",
        "--no-numa-bind",
        "--no-ray-workers-use-nsight",
        "--no-return-sampling-mask",
        "--no-return-tokens-as-token-ids",
        "--no-scheduler-reserve-full-isl",
        "--no-skip-mm-profiling",
        "--no-skip-tokenizer-init",
        "--no-sleep-mode-offload-cudagraph",
        "--no-specialize-active-lora",
        "--no-swa-bounded-replay",
        "--no-tokens-only",
        "--no-trust-remote-code",
        "--no-trust-request-chat-template",
        "--no-trust-request-mm-kwargs",
        "--no-use-fp64-gumbel",
        "--no-use-replayssm",
        "--no-use-tqdm-on-load",
        "--node-rank",
        "--num-gpu-blocks-override",
        "--numa-bind",
        "--numa-bind-cpus",
        "--numa-bind-nodes",
        "--offload-backend",
        "--offload-group-size",
        "--offload-num-in-group",
        "--offload-params",
        "--offload-prefetch-step",
        "--optimization-level",
        "--otlp-traces-endpoint",
        "--override-generation-config",
        "--per-request-spec-decode-metrics",
        "--performance-mode",
        "--pipeline-parallel-size",
        "--pooler-config",
        "--port",
        "--prefill-context-parallel-size",
        "--prefill-schedule-interval",
        "--prefix-cache-retention-interval",
        "--prefix-caching-hash-algo",
        "--prefix-match-unit",
        "--profiler-config",
        "--pt-load-map-location",
        "--quantization",
        "--quantization-config",
        "--ray-workers-use-nsight",
        "--reasoning-config",
        "--reasoning-effort-map",
        "--reasoning-parser",
        "--reasoning-parser-plugin",
        "--renderer-num-workers",
        "--replayssm-buffer-len",
        "--response-role",
        "--return-sampling-mask",
        "--return-tokens-as-token-ids",
        "--revision",
        "--root-path",
        "--runner",
        "--safetensors-load-strategy",
        "--safetensors-prefetch-block-size",
        "--safetensors-prefetch-num-threads",
        "--scheduler-cls",
        "--scheduler-reserve-full-isl",
        "--scheduling-policy",
        "--seed",
        "--served-model-name",
        "--show-hidden-metrics-for-version",
        "--shutdown-timeout",
        "--skip-mm-profiling",
        "--skip-tokenizer-init",
        "--sleep-mode-backend",
        "--sleep-mode-offload-cudagraph",
        "--sleep-preserve-parameter-names",
        "--sparse-indexer-topk-backend",
        "--spec-method",
        "--spec-model",
        "--spec-tokens",
        "--specialize-active-lora",
        "--speculative-config",
        "--sse-keep-alive-interval",
        "--ssl-ca-certs",
        "--ssl-cert-reqs",
        "--ssl-certfile",
        "--ssl-ciphers",
        "--ssl-keyfile",
        "--stream-interval",
        "--structured-outputs-config",
        "--swa-bounded-replay",
        "--tensor-parallel-size",
        "--tokenizer",
        "--tokenizer-mode",
        "--tokenizer-revision",
        "--tokens-only",
        "--tool-call-parser",
        "--tool-parser-plugin",
        "--tool-server",
        "--tool-strict-level",
        "--trust-remote-code",
        "--trust-request-chat-template",
        "--trust-request-mm-kwargs",
        "--ubatch-size",
        "--uds",
        "--use-fp64-gumbel",
        "--use-replayssm",
        "--use-tqdm-on-load",
        "--uvicorn-log-level",
        "--video-pruning-method",
        "--video-pruning-rate",
        "--watchdog-config",
        "--watermark",
        "--watermark-config",
        "--weight-transfer-config",
        "--worker-cls",
        "--worker-extension-cls",
        "-ac",
        "-asc",
        "-cc",
        "-dc",
        "-dcp",
        "-dp",
        "-dpa",
        "-dpb",
        "-dpe",
        "-dph",
        "-dpl",
        "-dpm",
        "-dpn",
        "-dpp",
        "-dpr",
        "-ep",
        "-h",
        "-n",
        "-pcp",
        "-pp",
        "-q",
        "-r",
        "-sc",
        "-tp",
    ]
)
# Option -> argparse nargs: "+" takes every value up to the next option, "?" at most one.
SECRET_OPTIONS = {"--api-key": "+", "--hf-token": "?"}


def option_name(arg: str) -> str | None:
    """The option name vLLM's parser reads from `arg` before abbreviation (`--hf_token=T` -> `--hf-token`),
    or None for a value."""
    if not arg.startswith("-") or arg in ("-", "--"):
        return None
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return name
    name = name.split(".", 1)[0]  # --name.key=value is a dict option
    return "--" + name[2:].replace("_", "-")


def resolve_option(arg: str) -> frozenset[str]:
    """The vLLM options `arg` stands for: its exact name, or every option it is a prefix of (one: the option
    vLLM takes; several: vLLM refuses the abbreviation as ambiguous). Empty for values and unknown options."""
    name = option_name(arg)
    if name is None:
        return frozenset()
    if name in VLLM_SERVE_OPTIONS:
        return frozenset({name})
    if not name.startswith("--") or len(name) < 3:
        return frozenset()
    return frozenset(option for option in VLLM_SERVE_OPTIONS if option.startswith(name))


def takes(arg: str, option: str) -> bool:
    """Whether vLLM reads `arg` as `option` (exactly, with underscores, or as its unique abbreviation)."""
    return resolve_option(arg) == {option}


def _secret(arg: str) -> str | None:
    """The secret option `arg` may stand for (ambiguous abbreviations included: hide rather than guess)."""
    return next((option for option in sorted(resolve_option(arg)) if option in SECRET_OPTIONS), None)


def _is_value(arg: str) -> bool:
    """Whether argparse would take `arg` as one more value of a secret option. Conservative: anything that
    is not a vLLM option (negative numbers, `-a b`, unknown dashes too) counts, so it is hidden."""
    return arg != "--" and not resolve_option(arg)


@dataclass(frozen=True)
class SecretValue:
    index: int  # of the argument holding the value
    option: str  # the secret option it is the value of, as vLLM names it
    written: str  # that option as the user wrote it (`--api_k`)
    after_equals: bool  # `--option=VALUE` in one argument


def secret_values(argv: Sequence[str]) -> list[SecretValue]:
    """Every argument of `argv` that holds the value of a secret vLLM option, however it is spelled."""
    found: list[SecretValue] = []
    hide = 0  # how many of the following arguments are values; -1: all up to the next option
    force = False  # `--name.key VALUE`: vLLM takes the next argument as the value, whatever it looks like
    option = written = ""
    for index, arg in enumerate(argv):
        if force or (hide and _is_value(arg)):
            found.append(SecretValue(index, option, written, False))
            force = False
            hide = hide - 1 if hide > 0 else hide
            continue
        hide = 0
        secret = _secret(arg)
        if secret is None:
            continue
        option, written = secret, arg.split("=", 1)[0]
        if "=" in arg:
            found.append(SecretValue(index, option, written, True))
        elif "." in arg:
            force = True
        else:
            hide = 1 if SECRET_OPTIONS[option] == "?" else -1
    return found


def masked_arguments(argv: Sequence[str]) -> list[str]:
    """`argv` for display: the values of secret options, and credentials in URLs, replaced by ***."""
    hidden = {value.index: value for value in secret_values(argv)}
    masked: list[str] = []
    for index, arg in enumerate(argv):
        value = hidden.get(index)
        if value is None:
            masked.append(mask_credentials(arg))
        else:
            masked.append(arg.split("=", 1)[0] + "=" + MASK if value.after_equals else MASK)
    return masked
