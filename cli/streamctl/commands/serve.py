"""`streamctl serve`: check the checkpoint, then replace this process with a tuned `vllm serve`."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from streamctl import output
from streamctl.commands._options import (
    AzureAccountOption,
    DebugOption,
    EndpointOption,
    JsonOption,
    PathStyleOption,
    QuietOption,
    apply_output_flags,
    check_mode_options,
    check_option_scope,
    refuse_together,
    storage_options,
)

if TYPE_CHECKING:
    from streamctl.k8s import ServeManifestOptions
    from streamctl.serve.run import ServeResult

EXPERIMENTAL = "Experimental: DeepSeek V4.1 CPU Engram loading"


class IdentityOption(str, Enum):
    gke = "gke"
    eks_irsa = "eks-irsa"
    eks_pod_identity = "eks-pod-identity"
    aks = "aks"


def command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Bucket prefix (s3://, gs://, az://) or local folder.")],
    vllm_args: Annotated[
        list[str] | None, typer.Argument(help="Arguments for vLLM, after --.", show_default=False)
    ] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="GPUs per replica.")
    ] = 1,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", min=1, help="Streamer readers (default: 16 local, 8 object store)."),
    ] = None,
    memory_limit: Annotated[
        str | None,
        typer.Option(
            "--memory-limit", metavar="SIZE", help="CPU staging: 5GiB, bytes, -1 unlimited, 0 largest tensor."
        ),
    ] = None,
    distributed: Annotated[
        bool | None,
        typer.Option(
            "--distributed/--no-distributed",
            help="Distributed streaming (default: on when TP > 1 with CUDA).",
            show_default=False,
        ),
    ] = None,
    sharded: Annotated[
        bool | None,
        typer.Option(
            "--sharded/--not-sharded", help="Pre-sharded model-rank-* files (default: detected).", show_default=False
        ),
    ] = None,
    pattern: Annotated[str | None, typer.Option("--pattern", help="Sharded file name pattern.")] = None,
    tune: Annotated[
        bool, typer.Option("--tune", help="Measure streamer concurrency on this checkpoint; use the best.")
    ] = False,
    preflight: Annotated[
        bool, typer.Option("--preflight/--no-preflight", help="Check credentials, headers and vllm first.")
    ] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command and environment; run nothing.")] = False,
    k8s: Annotated[
        bool,
        typer.Option("--k8s", help="Print a Kubernetes Deployment (LeaderWorkerSet across nodes) and Service instead."),
    ] = False,
    kserve: Annotated[
        bool, typer.Option("--kserve", help="Print a KServe LLMInferenceService instead (storage initializer off).")
    ] = False,
    namespace: Annotated[
        str,
        typer.Option(
            "--namespace", metavar="NAME", help="Namespace of the Deployment and Service.", rich_help_panel="Kubernetes"
        ),
    ] = "default",
    name: Annotated[
        str | None, typer.Option("--name", metavar="NAME", help="Deployment name.", rich_help_panel="Kubernetes")
    ] = None,
    image: Annotated[
        str | None,
        typer.Option("--image", help="vLLM image (default: vllm/vllm-openai:v0.33.0).", rich_help_panel="Kubernetes"),
    ] = None,
    service_account: Annotated[
        str | None,
        typer.Option(
            "--service-account", metavar="NAME", help="Workload-identity service account.", rich_help_panel="Kubernetes"
        ),
    ] = None,
    accelerator: Annotated[
        str | None,
        typer.Option(
            "--accelerator", metavar="TYPE", help="GKE accelerator, e.g. nvidia-l4.", rich_help_panel="Kubernetes"
        ),
    ] = None,
    secret: Annotated[
        str | None,
        typer.Option(
            "--secret", metavar="NAME", help="Secret with credentials as env vars.", rich_help_panel="Kubernetes"
        ),
    ] = None,
    identity: Annotated[
        IdentityOption | None,
        typer.Option(
            "--identity",
            help="Cloud identity of the pod: ServiceAccount + cloud-side steps; no static key.",
            rich_help_panel="Kubernetes",
            show_default=False,
        ),
    ] = None,
    gcp_project: Annotated[
        str | None,
        typer.Option("--gcp-project", metavar="ID", help="gke: the project ID.", rich_help_panel="Kubernetes"),
    ] = None,
    gcp_project_number: Annotated[
        str | None,
        typer.Option(
            "--gcp-project-number",
            metavar="NUMBER",
            help="gke: the project number (default: looked up).",
            rich_help_panel="Kubernetes",
        ),
    ] = None,
    aws_role_arn: Annotated[
        str | None,
        typer.Option("--aws-role-arn", metavar="ARN", help="eks-*: the IAM role.", rich_help_panel="Kubernetes"),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option("--cluster", metavar="NAME", help="eks-*, aks: the cluster.", rich_help_panel="Kubernetes"),
    ] = None,
    azure_client_id: Annotated[
        str | None,
        typer.Option(
            "--azure-client-id", metavar="UUID", help="aks: the identity's client ID.", rich_help_panel="Kubernetes"
        ),
    ] = None,
    azure_identity: Annotated[
        str | None,
        typer.Option(
            "--azure-identity", metavar="NAME", help="aks: the managed identity.", rich_help_panel="Kubernetes"
        ),
    ] = None,
    resource_group: Annotated[
        str | None,
        typer.Option("--resource-group", metavar="NAME", help="aks: its resource group.", rich_help_panel="Kubernetes"),
    ] = None,
    compile_cache_pvc: Annotated[
        str | None,
        typer.Option(
            "--compile-cache-pvc",
            metavar="CLAIM",
            help="PVC for vLLM's compile caches (default: an emptyDir).",
            rich_help_panel="Kubernetes",
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            "--gpus-per-node",
            min=1,
            max=64,
            metavar="N",
            help="GPUs per node; TP x PP beyond it: a LeaderWorkerSet (default: by --accelerator, else 8).",
            rich_help_panel="Kubernetes",
            show_default=False,
        ),
    ] = None,
    cpu_weight_files: Annotated[
        str | None,
        typer.Option(
            "--cpu-weight-files",
            metavar="F1,F2",
            help="EXPERIMENTAL: shards read on CPU.",
            rich_help_panel=EXPERIMENTAL,
        ),
    ] = None,
    cpu_memory_limit: Annotated[
        str | None,
        typer.Option(
            "--cpu-memory-limit", metavar="SIZE", help="EXPERIMENTAL: CPU phase budget.", rich_help_panel=EXPERIMENTAL
        ),
    ] = None,
    engram: Annotated[
        list[str] | None,
        typer.Option(
            "--engram",
            metavar="GLOB",
            help="EXPERIMENTAL: Engram tensors that must be in those files.",
            rich_help_panel=EXPERIMENTAL,
        ),
    ] = None,
    endpoint_url: EndpointOption = None,
    path_style: PathStyleOption = None,
    azure_account: AzureAccountOption = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    debug: DebugOption = False,
) -> None:
    """Launch vLLM with the Run:ai Model Streamer: validated, tuned, checked before the GPUs spin.

    Everything after -- goes to vLLM unchanged. Unless --dry-run, --json, --k8s or --kserve is given, this process
    becomes vLLM.
    """
    apply_output_flags(json_output, quiet, debug)
    from streamctl.errors import PreflightFailed
    from streamctl.serve.plan import EngramOptions, ServeOptions, normalize_model, parse_memory_limit
    from streamctl.serve.run import prepare_launch

    engram_options = EngramOptions.parse(cpu_weight_files, cpu_memory_limit, engram or ())
    options = ServeOptions(
        model=normalize_model(model),
        tensor_parallel_size=tensor_parallel_size,
        concurrency=concurrency,
        memory_limit=parse_memory_limit(memory_limit) if memory_limit is not None else None,
        distributed=distributed,
        sharded=sharded,
        pattern=pattern,
        storage=storage_options(endpoint_url=endpoint_url, path_style=path_style, azure_account=azure_account),
        engram=engram_options,
        vllm_args=tuple(vllm_args or ()),
        preflight=preflight,
        tune=tune,
    )
    options.validate()
    check_mode_options(ctx, k8s or kserve, "--k8s or --kserve", "Kubernetes")
    kubernetes = _kubernetes_options(ctx.params)
    if kubernetes is not None:
        kubernetes.validate(options.model)
    refuse_together(ctx, "concurrency", "tune", "--tune measures the concurrency and uses the fastest")
    refuse_together(ctx, "k8s", "json_output", "--k8s prints the manifests as YAML")
    check_option_scope(ctx, [options.model])
    try:
        with output.progress() as progress:
            result = prepare_launch(options, for_kubernetes=kubernetes is not None, progress=progress)
    except PreflightFailed as failure:  # the findings on stderr, also with --json (stdout: the error document)
        output.render_verify_report(failure.report, to_stderr=True)
        raise
    _show(result, kubernetes, dry_run)


IDENTITY_VALUES = (
    "gcp_project",
    "gcp_project_number",
    "aws_role_arn",
    "cluster",
    "azure_client_id",
    "azure_identity",
    "resource_group",
)


def _kubernetes_options(params: dict[str, Any]) -> ServeManifestOptions | None:
    """`serve --k8s`'s (or `--kserve`'s) section of options, from the command's parameters, None without either;
    UsageError for both, for --kserve with --json, or for an identity's value without --identity."""
    from streamctl.errors import UsageError
    from streamctl.k8s import ServeManifestOptions
    from streamctl.k8s_identity import IdentityOptions
    from streamctl.k8s_multinode import NodeLayout

    if params["k8s"] and params["kserve"]:
        raise UsageError(
            "--k8s and --kserve together: one prints a Deployment, the other a KServe LLMInferenceService",
            hint="drop one of them",
        )
    if params["kserve"] and params["json_output"]:
        raise UsageError("--kserve and --json together: --kserve prints the manifests as YAML", hint="drop one of them")
    if not (params["k8s"] or params["kserve"]):
        return None

    # before the pre-flight reads anything: a TP x PP group that does not split into whole nodes
    argv = ("vllm", "serve", params["model"], *(params["vllm_args"] or ()))
    NodeLayout.for_launch(params["tensor_parallel_size"], argv, params["gpus_per_node"], params["accelerator"])
    identity: IdentityOption | None = params["identity"]
    values = {key: params[key] for key in IDENTITY_VALUES}
    if identity is None:
        for key, value in values.items():
            if value is not None:
                flag = "--" + key.replace("_", "-")
                raise UsageError(f"{flag} applies only with --identity", hint="add --identity, or drop it")
    return ServeManifestOptions(
        params["namespace"],
        params["name"],
        params["image"],
        params["service_account"],
        params["accelerator"],
        params["secret"],
        identity=IdentityOptions(identity.value, **values) if identity is not None else None,
        compile_cache_claim=params["compile_cache_pvc"],
        gpus_per_node=params["gpus_per_node"],
        kserve=params["kserve"],
    )


def _show(result: ServeResult, kubernetes: ServeManifestOptions | None, dry_run: bool) -> None:
    """Print the checked launch (tune table, warnings, then YAML, JSON or the command line), or become vLLM."""
    from streamctl.serve.run import exec_vllm

    if result.tune is not None and not output.settings.json:
        output.render_tune_result(result.tune)
    manifests = result.kubernetes_yaml(kubernetes) if kubernetes is not None else None
    for warning in result.warnings_for(kubernetes):
        output.warn(warning)  # silent with --json: the document lists them
    for note in result.plan.notes:
        output.log_always(f"note: {note}")
    if manifests is not None:
        typer.echo(manifests, nl=False)
    elif dry_run or output.settings.json:
        output.emit(result)
    else:
        exec_vllm(result)


# The last section of `streamctl serve --help` (each command line fits 80 columns).
EXAMPLES = (
    (
        "Print the checked vLLM command line; run nothing:",
        "streamctl serve gs://models/qwen3-8b --dry-run -- --max-model-len 4096",
    ),
    (
        "Launch a model sharded for 8 GPUs, concurrency measured first:",
        "streamctl serve s3://models/llama-70b-tp8 -tp 8 --tune",
    ),
    (
        "Write a GKE Deployment and Service for it (--kserve: a KServe LLMInferenceService):",
        "streamctl serve gs://m/q3 --k8s --accelerator nvidia-l4 > vllm.yaml",
    ),
)
