"""`streamctl transfer`: a Hugging Face repo, local folder or bucket prefix into a bucket or folder."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

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
    pod_arguments,
    refuse_together,
    storage_options,
)


class RepoType(str, Enum):
    model = "model"
    dataset = "dataset"


def command(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="hf://ORG/NAME, ORG/NAME, a local folder, or a bucket prefix.")],
    dest: Annotated[str, typer.Argument(help="gs://, s3://, az:// prefix or a local folder.")],
    revision: Annotated[
        str | None, typer.Option("--revision", metavar="REV", help="Branch, tag or commit (resolved to one commit).")
    ] = None,
    repo_type: Annotated[
        RepoType | None, typer.Option("--repo-type", help="Hugging Face repo type (default: model).")
    ] = None,
    include: Annotated[
        list[str] | None, typer.Option("--include", metavar="GLOB", help="Also copy matching files (repeatable).")
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option("--exclude", metavar="GLOB", help="Leave out matching files (repeatable).")
    ] = None,
    all_files: Annotated[bool, typer.Option("--all-files", help="Copy every file, not just what vLLM needs.")] = False,
    follow_symlinks: FollowSymlinksOption = False,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-j", min=1, max=256, help="Parallel parts in flight.")
    ] = 16,
    part_size: Annotated[str, typer.Option("--part-size", metavar="SIZE", help="Multipart part size.")] = "16MiB",
    max_buffer: Annotated[
        str, typer.Option("--max-buffer", metavar="SIZE", help="Most bytes held in memory at once.")
    ] = "256MiB",
    token: HfTokenOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; touch nothing.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Copy every file again; replace what an earlier streamctl run wrote there.")
    ] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Run verify-index on DEST afterwards.")] = True,
    worker: WorkerOption = None,
    k8s_job: K8sJobOption = False,
    namespace: NamespaceOption = "default",
    service_account: ServiceAccountOption = None,
    secret: SecretOption = None,
    image: ImageOption = None,
    parallelism: ParallelismOption = None,
    endpoint_url: EndpointOption = None,
    path_style: PathStyleOption = None,
    azure_account: AzureAccountOption = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    debug: DebugOption = False,
) -> None:
    """Copy a model into a bucket: parallel, bounded memory, resumable, sha256-verified end to end.

    Only what vLLM needs to serve is copied by default (safetensors, index, configs, tokenizer); the plan
    lists what is left out and why. Re-runs skip objects whose size and sha256 already match.
    """
    apply_output_flags(json_output, quiet, debug)
    from streamctl.common.limits import MAX_BUFFER, MAX_PART_SIZE
    from streamctl.common.sizes import parse_size
    from streamctl.dest.shares import parse_worker
    from streamctl.storage.url import resolve_source_url
    from streamctl.transfer import TransferOptions, run_transfer

    options = TransferOptions(
        include=tuple(include or ()),
        exclude=tuple(exclude or ()),
        all_files=all_files,
        concurrency=concurrency,
        part_size=parse_size(part_size, "--part-size", MAX_PART_SIZE),
        max_buffer=parse_size(max_buffer, "--max-buffer", MAX_BUFFER),
        force=force,
        worker=parse_worker(worker) if worker is not None else None,
    )
    options.validate()
    source_url = resolve_source_url(source, repo_type.value if repo_type else None)
    check_mode_options(ctx, k8s_job, "--k8s-job", "Kubernetes")
    if k8s_job:
        _check_job(source_url, ctx.params)
    refuse_together(ctx, "k8s_job", "dry_run", "the Job runs the whole transfer (preview it without --k8s-job)")
    refuse_together(ctx, "k8s_job", "json_output", "--k8s-job prints the Job as YAML")
    refuse_together(ctx, "k8s_job", "worker", "the Job gives each pod its share (use --parallelism N)")
    refuse_together(ctx, "all_files", "include", "--all-files copies every file, --include adds to what vLLM needs")
    check_option_scope(ctx, [source_url, dest])
    if k8s_job:
        _print_job(ctx, _job_source(source_url, repo_type))
        return
    storage = storage_options(
        endpoint_url=endpoint_url, path_style=path_style, azure_account=azure_account, token=token,
        revision=revision, repo_type=repo_type.value if repo_type else None, follow_symlinks=follow_symlinks,
    )  # fmt: skip
    with output.progress(byte_counts=True) as progress:
        plan_shown = output.log_transfer_plan
        result = run_transfer(
            source_url, dest, options, storage, progress, dry_run=dry_run, verify=verify, on_plan=plan_shown
        )
    output.emit(result)


def _check_job(source_url: str, given: dict[str, Any]) -> None:
    """What --k8s-job refuses before any other check: a local SOURCE or DEST, a name Kubernetes would refuse."""
    from streamctl.k8s import check_transfer_job

    names = {key: given[key] for key in ("namespace", "service_account", "secret", "image")}
    check_transfer_job(source_url, given["dest"], **names)


# Options the Job's pods are not given, and why: the Job is how this command runs (--k8s-job and its own
# section, Kubernetes, which it is built from); the pod gets each share from its index (--worker); the token
# is a secret, read in the pod from --secret's HF_TOKEN; --dry-run and --json are refused with --k8s-job.
NOT_FOR_THE_POD = frozenset({"k8s_job", "worker", "token", "dry_run", "json_output"})


def _job_source(source_url: str, repo_type: RepoType | None) -> str:
    """A Hub SOURCE as the URL of the repo --repo-type names (hf://datasets/ORG/NAME, as the pod reads it):
    the Job's name and annotation are derived from SOURCE, so a dataset's Job is not its namesake model's."""
    from streamctl.storage.url import format_hf_url, parse_url

    parsed = parse_url(source_url)
    if parsed.scheme != "hf" or repo_type is None:
        return source_url
    return format_hf_url(repo_type.value, parsed.bucket, parsed.revision, parsed.prefix)


def _print_job(ctx: typer.Context, source_url: str) -> None:
    """The Kubernetes Job that runs this transfer in the cluster (every option given here, written back by
    the command line serializer), as YAML on stdout."""
    from streamctl import __version__
    from streamctl.k8s import to_yaml, transfer_job

    given = ctx.params
    arguments = pod_arguments(ctx, NOT_FOR_THE_POD)
    if given["token"] and not given["secret"]:
        output.log("note: the token is not written into the Job; put HF_TOKEN in a secret and pass --secret")
    if given["parallelism"] and source_url.startswith("hf://") and not given["revision"]:
        output.warn("each pod resolves the branch itself; pass --revision COMMIT so that all pods copy the same one")
    job = transfer_job(
        source_url,
        given["dest"],
        arguments,
        namespace=given["namespace"],
        image=given["image"],
        version=__version__,
        service_account=given["service_account"],
        secret=given["secret"],
        env={},
        parallelism=given["parallelism"],
        revision=given["revision"],
        endpoint=given["endpoint_url"],
        azure_account=given["azure_account"],
    )
    typer.echo(to_yaml(job), nl=False)


# The last section of `streamctl transfer --help` (each command line fits 80 columns).
EXAMPLES = (
    (
        "Copy what vLLM needs from a Hub repo into a GCS bucket:",
        "streamctl transfer Qwen/Qwen3-8B gs://models/qwen3-8b",
    ),
    (
        "Show the plan for one revision; copy nothing:",
        "streamctl transfer Qwen/Qwen3-8B s3://models/q3 --revision v1 --dry-run",
    ),
    (
        "A Kubernetes Indexed Job of 4 pods (IMG: built from the repo's Dockerfile):",
        "streamctl transfer org/m gs://m/q3 --k8s-job --parallelism 4 --image IMG",
    ),
)
