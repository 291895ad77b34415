"""Options shared by several commands, declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from streamctl import output

JsonOption = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs on stderr.")]
DebugOption = Annotated[
    bool, typer.Option("--debug", envvar="STREAMCTL_DEBUG", help="Show tracebacks on errors.")
]
EndpointOption = Annotated[
    Optional[str],
    typer.Option(
        "--endpoint-url",
        envvar="AWS_ENDPOINT_URL",
        help="S3-compatible endpoint (MinIO, R2, GCS interop ...).",
        rich_help_panel="Storage",
    ),
]
PathStyleOption = Annotated[
    Optional[bool],
    typer.Option(
        "--path-style/--virtual-host-style",
        help="S3 addressing; default from RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING (0 = path style).",
        show_default=False,
        rich_help_panel="Storage",
    ),
]
AzureAccountOption = Annotated[
    Optional[str],
    typer.Option(
        "--azure-account",
        envvar="AZURE_STORAGE_ACCOUNT_NAME",
        help="Azure storage account for az:// URLs.",
        rich_help_panel="Storage",
    ),
]

FollowSymlinksOption = Annotated[
    bool,
    typer.Option(
        "--follow-symlinks",
        help=(
            "Also read symbolic links in a local folder that lead outside it (a Hugging Face cache snapshot's "
            "do); by default they are skipped and reported. Nothing is ever written through a link."
        ),
    ),
]

HfTokenOption = Annotated[
    Optional[str],
    typer.Option("--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token (never printed)."),
]


def apply_output_flags(json_output: bool, quiet: bool, debug: bool) -> None:
    output.configure(json_output=json_output, quiet=quiet, debug=debug)
