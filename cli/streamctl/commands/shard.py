"""`streamctl shard`: write vLLM sharded-state files on a CPU, locally or straight into a bucket."""

from __future__ import annotations

import os
from dataclasses import replace
from enum import Enum
from typing import Annotated

import typer

from streamctl import output
from streamctl.commands._options import (
    AzureAccountOption,
    DebugOption,
    EndpointOption,
    FollowSymlinksOption,
    HfTokenOption,
    ImageOption,
    JsonOption,
    K8sJobOption,
    NamespaceOption,
    ParallelismOption,
    PathStyleOption,
    QuietOption,
    SecretOption,
    ServiceAccountOption,
    WorkerOption,
    apply_output_flags,
    check_mode_options,
    check_option_scope,
    refuse_together,
    storage_options,
)


class DtypeOption(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class EngineOption(str, Enum):
    auto = "auto"
    offline = "offline"
    vllm_cpu = "vllm-cpu"
    vllm_gpu = "vllm-gpu"
    vllm = "vllm"  # the old name of vllm-gpu


ENGINE_HELP = (
    "auto: offline for the layout table's unquantized architectures, else vllm-cpu; offline: streamctl's "
    "table-driven CPU writer; vllm-cpu: vLLM's own model code builds each rank on the CPU; vllm-gpu (or vllm): "
    "vLLM's own save (needs GPUs)."
)


def command(
    ctx: typer.Context,
    source: Annotated[
        str,
        typer.Argument(
            help="Hugging Face safetensors checkpoint: a local folder, a bucket prefix, or a Hub repo "
            "(hf://ORG/NAME or ORG/NAME, @REV for a revision; read in ranges, never downloaded whole).",
        ),
    ],
    dest: Annotated[str, typer.Argument(help="Local folder or s3://, gs://, az:// prefix for the sharded files.")],
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="TP ranks to shard for.")
    ],
    pipeline_parallel_size: Annotated[
        int, typer.Option("--pipeline-parallel-size", "-pp", min=1, help="Pipeline stages (vLLM's layer split).")
    ] = 1,
    pattern: Annotated[
        str | None,
        typer.Option(
            "--pattern",
            help="File name pattern with {rank} or {tp_rank}, {pp_rank}, {part} "
            "(default: vLLM's, model-rank-{rank}-part-{part}.safetensors, "
            "or model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors with PP > 1).",
            show_default=False,
        ),
    ] = None,
    max_part_size: Annotated[
        str, typer.Option("--max-part-size", metavar="SIZE", help="Start a new part file beyond this size.")
    ] = "5GiB",
    dtype: Annotated[
        DtypeOption, typer.Option("--dtype", help="Cast the weights; auto keeps the checkpoint's dtype.")
    ] = DtypeOption.auto,
    vllm_version: Annotated[
        str | None,
        typer.Option(
            "--vllm-version",
            metavar="V",
            help="offline: the vLLM version whose layout to write (default: the installed vllm's, else the newest "
            "known); vllm-cpu: the vLLM environment's version (built once and cached, default the newest known).",
            show_default=False,
        ),
    ] = None,
    engine: Annotated[EngineOption, typer.Option("--engine", help=ENGINE_HELP)] = EngineOption.auto,
    vllm_python: Annotated[
        str | None,
        typer.Option(
            "--vllm-python",
            metavar="PATH",
            help="vllm-cpu: the python of an existing CPU vLLM environment (instead of a cached one).",
            show_default=False,
        ),
    ] = None,
    enable_expert_parallel: Annotated[
        bool,
        typer.Option(
            "--enable-expert-parallel", help="Lay out the experts as vLLM does with expert parallelism (EP = TP)."
        ),
    ] = False,
    data_parallel_size: Annotated[
        int,
        typer.Option("--data-parallel-size", "-dp", min=1, help="vLLM's DP size; only 1 (the files carry no DP rank)."),
    ] = 1,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Write into a DEST that holds files; remove what earlier streamctl runs wrote there."
        ),
    ] = False,
    worker: WorkerOption = None,
    k8s_job: K8sJobOption = False,
    namespace: NamespaceOption = "default",
    service_account: ServiceAccountOption = None,
    secret: SecretOption = None,
    image: ImageOption = None,
    parallelism: ParallelismOption = None,
    follow_symlinks: FollowSymlinksOption = False,
    token: HfTokenOption = None,
    endpoint_url: EndpointOption = None,
    path_style: PathStyleOption = None,
    azure_account: AzureAccountOption = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    debug: DebugOption = False,
) -> None:
    """Write vLLM sharded-state files for a tensor/pipeline-parallel size without GPUs.

    Any architecture vLLM serves (MoE, MLA, Gemma, multimodal, compressed-tensors FP8): with --engine auto,
    Llama, Mistral, Qwen2 and Qwen3 checkpoints are re-partitioned by streamctl's layout table in blocks of a
    few MiB, and every other one by vLLM's own model code on the CPU (vllm-cpu: one decoder layer at a time,
    in a CPU-only vLLM environment made once and cached, or --vllm-python). Either way memory stays bounded
    whatever the model's size, the files stream to DEST, and config, tokenizer and custom code are copied
    next to them. Afterwards verify-index --sharded and a bit-for-bit check of every tensor must pass
    (offline: against the source; vllm-cpu: against vLLM's rank model, re-read from DEST, and vLLM's own
    loader on a local DEST). VLLM_PP_LAYER_PARTITION overrides the layer split as in vLLM.

    Exit 0 when written and checked, 1 when a check failed, 2 on bad input.
    """
    apply_output_flags(json_output, quiet, debug)
    from streamctl.common.limits import MAX_OBJECT_SIZE
    from streamctl.common.memory import keep_freed_buffers_in_the_heap
    from streamctl.common.sizes import parse_size
    from streamctl.dest.shares import parse_worker
    from streamctl.shard.plan import ENGINE_ALIASES
    from streamctl.shard.run import ShardOptions, shard_checkpoint
    from streamctl.storage import open_destination, open_location
    from streamctl.storage.url import pinned_source, resolve_source_url

    options = ShardOptions(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        pattern=pattern,
        max_part_size=parse_size(max_part_size, "--max-part-size", MAX_OBJECT_SIZE),
        dtype=dtype.value,
        vllm_version=vllm_version,
        engine=ENGINE_ALIASES.get(engine.value, engine.value),  # type: ignore[arg-type]
        vllm_python=vllm_python,
        enable_expert_parallel=enable_expert_parallel,
        data_parallel_size=data_parallel_size,
        engine_logs=debug,
        force=force,
        worker=parse_worker(worker) if worker is not None else None,
        layer_partition=os.environ.get("VLLM_PP_LAYER_PARTITION") or None,
    )
    options.validate()
    source_url = resolve_source_url(source)
    _check_modes(ctx, source_url, k8s_job)
    if k8s_job:
        _print_job(ctx, source_url, options.layer_partition)
        return
    keep_freed_buffers_in_the_heap()
    storage = storage_options(endpoint_url=endpoint_url, path_style=path_style, azure_account=azure_account,
                              token=token)  # fmt: skip
    source_location = open_location(source_url, replace(storage, follow_symlinks=follow_symlinks))
    dest_location = open_destination(dest, storage)
    with output.progress(byte_counts=True) as progress:
        result = shard_checkpoint(source_location, dest_location, options, progress, pinned_source(source_location))
    output.emit(result)


def _check_modes(ctx: typer.Context, source_url: str, k8s_job: bool) -> None:
    """The Kubernetes options only with --k8s-job, which refuses a local SOURCE or DEST and names Kubernetes
    would refuse (before any other check), --json and --worker; then the storage options' scope."""
    from streamctl.k8s import check_transfer_job

    given = ctx.params
    check_mode_options(ctx, k8s_job, "--k8s-job", "Kubernetes")
    if k8s_job:
        names = {key: given[key] for key in ("namespace", "service_account", "secret", "image")}
        check_transfer_job(source_url, given["dest"], **names)
    refuse_together(ctx, "k8s_job", "json_output", "--k8s-job prints the Job as YAML")
    refuse_together(ctx, "k8s_job", "worker", "the Job gives each pod its share (use --parallelism N)")
    check_option_scope(ctx, [source_url, given["dest"]])


# Options the Job's pods are not given, and why: the Job is how this command runs (--k8s-job and its own
# section, Kubernetes, which it is built from); the pod gets its share from its index (--worker); the token is
# a secret, read in the pod from --secret's HF_TOKEN; --json is refused with --k8s-job.
NOT_FOR_THE_POD = frozenset({"k8s_job", "worker", "token", "json_output"})


def _print_job(ctx: typer.Context, source_url: str, layer_partition: str | None) -> None:
    """The Kubernetes Job that runs this shard in the cluster (every option given here, written back by the
    command line serializer; VLLM_PP_LAYER_PARTITION as the pod's variable), as YAML on stdout."""
    from streamctl import __version__
    from streamctl.commands._options import pod_arguments
    from streamctl.k8s import shard_job, to_yaml
    from streamctl.storage.url import parse_url

    given = ctx.params
    if given["token"] and not given["secret"]:
        output.log("note: the token is not written into the Job; put HF_TOKEN in a secret and pass --secret")
    parsed = parse_url(source_url)
    if given["parallelism"] and parsed.scheme == "hf" and not parsed.revision:
        output.warn("each pod resolves the branch itself; pin it (ORG/NAME@COMMIT) so that all pods shard the same one")
    job = shard_job(
        source_url,
        given["dest"],
        pod_arguments(ctx, NOT_FOR_THE_POD),
        namespace=given["namespace"],
        image=given["image"],
        version=__version__,
        service_account=given["service_account"],
        secret=given["secret"],
        env={"VLLM_PP_LAYER_PARTITION": layer_partition} if layer_partition else {},
        parallelism=given["parallelism"],
        revision=parsed.revision,
        endpoint=given["endpoint_url"],
        azure_account=given["azure_account"],
    )
    typer.echo(to_yaml(job), nl=False)


# The last section of `streamctl shard --help` (each command line fits 80 columns).
EXAMPLES = (
    (
        "Shard a bucket copy for 8 GPUs into another bucket:",
        "streamctl shard gs://models/llama-70b s3://models/llama-70b-tp8 -tp 8",
    ),
    (
        "Shard a Hub repo for TP 2 x PP 2, cast to bfloat16:",
        "streamctl shard Qwen/Qwen3-8B ./qwen3-tp2-pp2 -tp 2 -pp 2 --dtype bfloat16",
    ),
    (
        "Shard a MoE model with vLLM's own code on this CPU, experts over 4 ranks:",
        "streamctl shard Qwen/Qwen3-30B-A3B ./moe -tp 4 --enable-expert-parallel",
    ),
)
