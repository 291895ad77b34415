"""`streamctl serve`: check the checkpoint, then replace this process with a tuned `vllm serve`."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Annotated, Optional

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
)

if TYPE_CHECKING:
    from streamctl.storage.base import Location

EXPERIMENTAL = "Experimental: DeepSeek V4.1 CPU Engram loading"


def command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Bucket prefix (s3://, gs://, az://) or local folder.")],
    vllm_args: Annotated[
        Optional[list[str]], typer.Argument(help="Arguments for vLLM, after --.", show_default=False)
    ] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="GPUs per replica.")
    ] = 1,
    concurrency: Annotated[
        Optional[int],
        typer.Option("--concurrency", min=1, help="Streamer readers (default: 16 local, 8 object store)."),
    ] = None,
    memory_limit: Annotated[
        Optional[str],
        typer.Option("--memory-limit", metavar="SIZE", help="CPU staging: 5GiB, bytes, -1 unlimited, 0 largest tensor."),
    ] = None,
    distributed: Annotated[
        Optional[bool],
        typer.Option("--distributed/--no-distributed", help="Distributed streaming (default: on when TP > 1 with CUDA).", show_default=False),
    ] = None,
    sharded: Annotated[
        Optional[bool],
        typer.Option("--sharded/--not-sharded", help="Pre-sharded model-rank-* files (default: detected).", show_default=False),
    ] = None,
    pattern: Annotated[Optional[str], typer.Option("--pattern", help="Sharded file name pattern.")] = None,
    tune: Annotated[bool, typer.Option("--tune", help="Measure streamer concurrency on this checkpoint; use the best.")] = False,
    preflight: Annotated[
        bool, typer.Option("--preflight/--no-preflight", help="Check credentials, headers and vllm first.")
    ] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command and environment; run nothing.")] = False,
    k8s: Annotated[bool, typer.Option("--k8s", help="Print a Kubernetes Deployment and Service instead.")] = False,
    namespace: Annotated[
        str, typer.Option("--namespace", metavar="NAME", help="Namespace of the Deployment and Service.", rich_help_panel="Kubernetes")
    ] = "default",
    name: Annotated[Optional[str], typer.Option("--name", metavar="NAME", help="Deployment name.", rich_help_panel="Kubernetes")] = None,
    image: Annotated[
        Optional[str], typer.Option("--image", help="vLLM image (default: vllm/vllm-openai:v0.33.0).", rich_help_panel="Kubernetes")
    ] = None,
    service_account: Annotated[
        Optional[str],
        typer.Option("--service-account", metavar="NAME", help="Workload-identity service account.", rich_help_panel="Kubernetes"),
    ] = None,
    accelerator: Annotated[
        Optional[str], typer.Option("--accelerator", metavar="TYPE", help="GKE accelerator, e.g. nvidia-l4.", rich_help_panel="Kubernetes")
    ] = None,
    secret: Annotated[
        Optional[str], typer.Option("--secret", metavar="NAME", help="Secret with credentials as env vars.", rich_help_panel="Kubernetes")
    ] = None,
    cpu_weight_files: Annotated[
        Optional[str],
        typer.Option("--cpu-weight-files", metavar="F1,F2", help="EXPERIMENTAL: shards read on CPU.", rich_help_panel=EXPERIMENTAL),
    ] = None,
    cpu_memory_limit: Annotated[
        Optional[str],
        typer.Option("--cpu-memory-limit", metavar="SIZE", help="EXPERIMENTAL: CPU phase budget.", rich_help_panel=EXPERIMENTAL),
    ] = None,
    engram: Annotated[
        Optional[list[str]],
        typer.Option("--engram", metavar="GLOB", help="EXPERIMENTAL: Engram tensors that must be in those files.", rich_help_panel=EXPERIMENTAL),
    ] = None,
    endpoint_url: EndpointOption = None,
    path_style: PathStyleOption = None,
    azure_account: AzureAccountOption = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    debug: DebugOption = False,
) -> None:
    """Launch vLLM with the Run:ai Model Streamer: validated, tuned, checked before the GPUs spin.

    Everything after -- goes to vLLM unchanged. Without --dry-run/--json/--k8s this process becomes vLLM.
    """
    apply_output_flags(json_output, quiet, debug)
    from streamctl.errors import MissingProgramError, UsageError, VerificationFailed
    from streamctl.k8s import DEFAULT_VLLM_IMAGE, k8s_name, serve_manifests, to_yaml_documents
    from streamctl.serve.plan import (
        CheckpointFacts,
        EngramOptions,
        ServeOptions,
        cuda_available,
        find_vllm,
        host_memory_bytes,
        normalize_model,
        parse_memory_limit,
        plan_launch,
        pod_memory_request,
        startup_budget_seconds,
    )
    from streamctl.storage import StorageOptions, open_location
    from streamctl.verify.report import Expectation, VerifyOptions
    from streamctl.verify.run import verify_checkpoint
    from streamctl.words import plural

    engram_options = EngramOptions(
        cpu_weight_files=tuple(name.strip() for name in (cpu_weight_files or "").split(",") if name.strip()),
        cpu_memory_limit=parse_memory_limit(cpu_memory_limit) if cpu_memory_limit else None,
        engram_globs=tuple(engram or ()),
    )
    options = ServeOptions(
        model=normalize_model(model),
        tensor_parallel_size=tensor_parallel_size,
        concurrency=concurrency,
        memory_limit=parse_memory_limit(memory_limit) if memory_limit is not None else None,
        distributed=distributed,
        sharded=sharded,
        pattern=pattern,
        endpoint_url=endpoint_url,
        path_style=path_style,
        azure_account=azure_account,
        engram=engram_options,
        vllm_args=tuple(vllm_args or ()),
    )
    options.validate()
    check_mode_options(ctx, k8s, "--k8s", "Kubernetes")
    refuse_together(ctx, "concurrency", "tune", "--tune measures the concurrency and uses the fastest")
    refuse_together(ctx, "k8s", "json_output", "--k8s prints the manifests as YAML")
    check_option_scope(ctx, [options.model])
    if engram_options.enabled and not preflight:
        raise UsageError(
            "--cpu-weight-files needs the pre-flight: it checks that the index places the Engram tensors in those files",
            hint="drop --no-preflight",
        )
    environ = dict(os.environ)
    # The pre-flight reads what vLLM will: vLLM opens a local folder's links wherever they lead (a Hugging
    # Face cache snapshot is all links), so they are followed here too; FIFOs and devices are still refused.
    location = open_location(
        options.model,
        StorageOptions(
            endpoint_url=endpoint_url, path_style=path_style, azure_account=azure_account, follow_symlinks=True
        ),
    )
    facts = None
    report = None
    is_sharded = _layout_without_preflight(location, sharded, pattern) if not preflight else False
    if preflight:
        expectations = tuple(Expectation(glob, engram_options.cpu_weight_files) for glob in engram_options.engram_globs)
        with output.progress() as progress:
            report = verify_checkpoint(
                location,
                VerifyOptions(
                    sharded=sharded,
                    pattern=pattern,
                    expectations=expectations,
                    tensor_parallel_size=tensor_parallel_size if sharded or pattern else None,
                    for_streamer=True,
                ),
                progress,
            )
        if not report.ok:
            output.render_verify_report(report, to_stderr=True)
            raise VerificationFailed(
                f"pre-flight found {plural(len(report.errors), 'error')} in {report.checkpoint}",
                hint="fix them (see the table above), or pass --no-preflight to launch anyway",
                code="preflight-failed",
                details=report.to_json(),  # the findings, as verify-index --json shows them
            )
        is_sharded = report.layout == "sharded"
        facts = CheckpointFacts(
            total_bytes=report.stats.total_bytes,
            largest_tensor_bytes=report.stats.largest_tensor_bytes,
            files=report.stats.files,
            sharded_ranks=report.tensor_parallel_size if is_sharded else None,
        )
    # A manifest is about the pod, never this host: it requests one GPU per TP rank and its own memory.
    target_cuda, target_memory = (True, None) if k8s else (cuda_available(environ), host_memory_bytes())
    plan = plan_launch(
        options,
        facts,
        sharded=is_sharded,
        environ=environ,
        cuda_available=target_cuda,
        host_memory_bytes=target_memory,
    )
    tune_result = None
    if tune:
        from dataclasses import replace

        from streamctl.serve.tune import tune_concurrency

        shards = [info for info in location.list() if info.key.endswith(".safetensors") and "/" not in location.relative(info.key)]
        if not shards:
            raise UsageError(f"--tune found no .safetensors under {location.url}")
        with output.progress() as progress:
            tune_result = tune_concurrency(location, shards, plan.env, progress=progress)
        plan = plan_launch(
            replace(options, concurrency=tune_result.best.concurrency),
            facts,
            sharded=is_sharded,
            environ=environ,
            cuda_available=target_cuda,
            host_memory_bytes=target_memory,
        )
        if not output.settings.json:
            output.render_tune_result(tune_result)

    if k8s:
        manifests = serve_manifests(
            plan.argv,
            plan.env,
            name=name or k8s_name(f"vllm-{options.model.rstrip('/').rsplit('/', 1)[-1]}"),
            namespace=namespace,
            image=image or DEFAULT_VLLM_IMAGE,
            tensor_parallel_size=tensor_parallel_size,
            service_account=service_account,
            accelerator=accelerator,
            secret=secret,
            startup_budget_s=startup_budget_seconds(facts.total_bytes if facts else 0),
            memory_request_bytes=pod_memory_request(facts, plan, tensor_parallel_size) if facts else None,
            shm_bytes=16 * 1024**3 if tensor_parallel_size > 1 else 2 * 1024**3,
        )
        for warning in plan.warnings:
            output.warn(warning)
        typer.echo(to_yaml_documents(manifests), nl=False)
        return
    if output.settings.json:
        document = plan.to_json()
        if tune_result is not None:
            document["tune"] = tune_result.to_json()
        output.print_json(document)
        return
    for warning in plan.warnings:
        output.warn(warning)
    if dry_run:
        typer.echo(plan.shell_line())
        return
    executable = find_vllm(environ)
    if executable is None:
        raise MissingProgramError("vllm is not installed (no `vllm` on PATH)", hint="pip install 'streamctl[vllm]'")
    sys.stdout.flush()
    sys.stderr.flush()
    # exec: vLLM takes over this process, so signals and the exit code are vLLM's own.
    os.execve(executable, [executable, *plan.argv[1:]], {**environ, **plan.env})


def _layout_without_preflight(location: Location, sharded: Optional[bool], pattern: Optional[str]) -> bool:
    """Whether to launch the sharded loader when the pre-flight is off: as forced (--sharded/--not-sharded,
    --pattern implies sharded), else detected from one listing, the pre-flight's own layout rule."""
    from streamctl.errors import StreamctlError
    from streamctl.verify.report import VerifyOptions
    from streamctl.verify.run import detect_layout

    if sharded is not None:
        return sharded
    if pattern is not None:
        return True
    try:
        return detect_layout(location, VerifyOptions()) == "sharded"
    except StreamctlError as error:
        error.hint = "pass --sharded or --not-sharded to launch without listing the checkpoint" + (
            f" ({error.hint})" if error.hint else ""
        )
        raise


# The last section of `streamctl serve --help` (each command line fits 80 columns).
EXAMPLES = (
    ("Print the checked vLLM command line; run nothing:", "streamctl serve gs://models/qwen3-8b --dry-run -- --max-model-len 4096"),
    ("Launch a model sharded for 8 GPUs, concurrency measured first:", "streamctl serve s3://models/llama-70b-tp8 -tp 8 --tune"),
    ("Write a GKE Deployment and Service for it:", "streamctl serve gs://m/q3 --k8s --accelerator nvidia-l4 > vllm.yaml"),
)
