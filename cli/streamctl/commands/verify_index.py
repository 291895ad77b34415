"""`streamctl verify-index`: check a checkpoint's index against its shard headers, reading headers only."""

from __future__ import annotations

from typing import Annotated

import typer

from streamctl import output
from streamctl.commands._options import (
    AzureAccountOption,
    DebugOption,
    EndpointOption,
    FollowSymlinksOption,
    JsonOption,
    PathStyleOption,
    QuietOption,
    apply_output_flags,
    check_option_scope,
    storage_options,
)


def command(
    ctx: typer.Context,
    checkpoint: Annotated[
        str,
        typer.Argument(help="Local folder, s3://, gs://, az:// or https://ACCOUNT.blob.core.windows.net/ prefix."),
    ],
    index: Annotated[
        str | None,
        typer.Option(
            "--index", metavar="NAME", help="Index file name (default: model.safetensors.index.json if present)."
        ),
    ] = None,
    expect: Annotated[
        list[str] | None,
        typer.Option(
            "--expect",
            metavar="GLOB=FILE[,FILE...]",
            help="Every tensor matching GLOB must live in one of the FILEs (repeatable).",
        ),
    ] = None,
    sharded: Annotated[
        bool | None,
        typer.Option(
            "--sharded/--not-sharded",
            help="Treat as vLLM sharded state (model-rank-*); default: detect from file names.",
            show_default=False,
        ),
    ] = None,
    tensor_parallel_size: Annotated[
        int | None,
        typer.Option("--tensor-parallel-size", "-tp", min=1, help="Expected TP ranks (sharded; default: inferred)."),
    ] = None,
    pipeline_parallel_size: Annotated[
        int | None,
        typer.Option("--pipeline-parallel-size", "-pp", min=1, help="Expected PP stages (sharded; default: inferred)."),
    ] = None,
    pattern: Annotated[
        str | None,
        typer.Option("--pattern", help="Sharded file name pattern with {rank} or {tp_rank}, {pp_rank}, {part}."),
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on warnings too.")] = False,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-j", min=1, max=256, help="Parallel header reads.")
    ] = 16,
    follow_symlinks: FollowSymlinksOption = False,
    endpoint_url: EndpointOption = None,
    path_style: PathStyleOption = None,
    azure_account: AzureAccountOption = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    debug: DebugOption = False,
) -> None:
    """Check a checkpoint index against the safetensors shard headers, locally or in a bucket.

    Reads only object sizes and headers (about 100 kB per shard); tensor data is never downloaded.

    Exit 0 when clean, 1 when any error is found (or any warning with --strict).
    """
    apply_output_flags(json_output, quiet, debug)
    from streamctl.errors import ChecksFailed
    from streamctl.storage import open_location
    from streamctl.verify.report import VerifyOptions, parse_expectation
    from streamctl.verify.run import verify_checkpoint

    check_option_scope(ctx, [checkpoint])
    expectations = tuple(parse_expectation(text) for text in expect or ())
    storage = storage_options(
        endpoint_url=endpoint_url, path_style=path_style, azure_account=azure_account, follow_symlinks=follow_symlinks
    )
    location = open_location(checkpoint, storage)
    options = VerifyOptions(
        index_name=index,
        expectations=expectations,
        sharded=sharded,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        pattern=pattern,
        concurrency=concurrency,
    )
    with output.progress() as progress:
        report = verify_checkpoint(location, options, progress)
    if not report.ok or (strict and report.warnings):
        raise ChecksFailed(report, report)
    output.emit(report)


# The last section of `streamctl verify-index --help` (each command line fits 80 columns).
EXAMPLES = (
    ("Check a checkpoint in a bucket, reading headers only:", "streamctl verify-index gs://models/qwen3-8b"),
    (
        "Require every Engram tensor to live in one file; print JSON:",
        "streamctl verify-index s3://m/ds --expect '*engram*=e.safetensors' --json",
    ),
    ("Check a sharded-state folder written for 4 GPUs:", "streamctl verify-index ./llama-tp4 --sharded -tp 4"),
)
