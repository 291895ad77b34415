"""Options shared by several commands, declared once, and the checks and builders the commands share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from streamctl import output

if TYPE_CHECKING:
    from streamctl.storage.base import StorageOptions

# `--worker` and `--k8s-job` mean the same in transfer and shard (this run is worker K of N; a Job runs it): one
# declaration each, so one variable each (STREAMCTL_WORKER, STREAMCTL_K8S_JOB) serves both.
WorkerOption = Annotated[
    str | None,
    typer.Option(
        "--worker",
        metavar="K/N",
        help="Do share K of N (K from 0 to N-1), balanced by bytes (transfer: files; shard: whole parts of every TP "
        "rank); N runs anywhere, together or not, do it all, and the last completes the manifest.",
    ),
]
K8sJobOption = Annotated[
    bool,
    typer.Option(
        "--k8s-job",
        help="Print a Kubernetes Job that runs this command in-cluster (with --parallelism, an Indexed Job).",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
# --debug and --quiet are accepted before the command (`streamctl --debug transfer ...`) and after it; both
# places use these declarations.
QuietOption = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="Print the result alone (the DEST written; nothing for a check that passed); errors on stderr.",
    ),
]
DebugOption = Annotated[bool, typer.Option("--debug", envvar="STREAMCTL_DEBUG", help="Show tracebacks and debug logs.")]
EndpointOption = Annotated[
    str | None,
    typer.Option(
        "--endpoint-url",
        metavar="URL",
        envvar="AWS_ENDPOINT_URL",
        help="S3-compatible endpoint (MinIO, R2, GCS interop ...).",
        rich_help_panel="Storage",
    ),
]
PathStyleOption = Annotated[
    bool | None,
    typer.Option(
        "--path-style/--virtual-host-style",
        help="S3 addressing; default from RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING (0 = path style).",
        show_default=False,
        rich_help_panel="Storage",
    ),
]
AzureAccountOption = Annotated[
    str | None,
    typer.Option(
        "--azure-account",
        metavar="NAME",
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
    str | None,
    typer.Option(
        "--token", metavar="TOKEN", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token (never printed)."
    ),
]


# `--k8s-job`'s own section (transfer, shard): the Job these build is how the command runs, not a setting of it.
NamespaceOption = Annotated[
    str, typer.Option("--namespace", metavar="NAME", help="Job namespace.", rich_help_panel="Kubernetes")
]
ServiceAccountOption = Annotated[
    str | None,
    typer.Option(
        "--service-account",
        metavar="NAME",
        help="Pod service account (workload identity).",
        rich_help_panel="Kubernetes",
    ),
]
SecretOption = Annotated[
    str | None,
    typer.Option(
        "--secret",
        metavar="NAME",
        help="Secret whose keys become env vars (HF_TOKEN, ...).",
        rich_help_panel="Kubernetes",
    ),
]
ImageOption = Annotated[
    str | None,
    typer.Option(
        "--image",
        help="Image with streamctl installed (required: build it from the repository's Dockerfile).",
        rich_help_panel="Kubernetes",
    ),
]
ParallelismOption = Annotated[
    int | None,
    typer.Option(
        "--parallelism",
        metavar="N",
        min=1,
        max=10_000,
        help="An Indexed Job of N pods, pod K doing share K of N (--worker K/N).",
        rich_help_panel="Kubernetes",
    ),
]


def apply_output_flags(json_output: bool, quiet: bool, debug: bool) -> None:
    output.configure(json_output=json_output, quiet=quiet, debug=debug)


def storage_options(
    *,
    endpoint_url: str | None = None,
    path_style: bool | None = None,
    azure_account: str | None = None,
    token: str | None = None,
    revision: str | None = None,
    repo_type: str | None = None,
    follow_symlinks: bool = False,
) -> StorageOptions:
    """The storage and Hub options of a command line as the library takes them (each command passes those it
    has; the rest keep their defaults)."""
    from streamctl.storage.base import StorageOptions

    return StorageOptions(
        endpoint_url=endpoint_url,
        path_style=path_style,
        azure_account=azure_account,
        hf_token=token,
        hf_revision=revision,
        hf_repo_type=repo_type,
        follow_symlinks=follow_symlinks,
    )


# ---------------------------------------------------------------------------------------- option scope
# The kind of location each storage or Hub option configures. Given on the command line for a command
# whose locations include none of that kind, the option would do nothing; see check_option_scope.
OPTION_SCHEMES: dict[str, str] = {
    "endpoint_url": "s3",
    "path_style": "s3",
    "azure_account": "az",
    "token": "hf",
    "revision": "hf",
    "repo_type": "hf",
}
# Refused when unused: these choose WHICH data (--revision, --repo-type) or WHERE it is (--endpoint-url,
# --azure-account), and ignoring them could read or write other data than the user meant (a gs:// DEST with
# --endpoint-url is real GCS, not the MinIO the user had in mind). Only warned about: these tune HOW the
# data is reached, and the result is the one asked for (scripts pass --token to every command alike).
WARN_WHEN_UNUSED = frozenset({"path_style", "token"})
SCHEME_NAMES = {"s3": "s3:// locations", "az": "az:// locations", "hf": "Hugging Face sources"}


def given_options(ctx: typer.Context) -> dict[str, str]:
    """Options typed on the command line (not defaults, not environment variables): name -> the flag."""
    flags = {}
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if param.param_type_name != "option" or source is None or source.name != "COMMANDLINE":
            continue
        negative = bool(param.secondary_opts) and ctx.params.get(param.name) is False
        flags[param.name] = (param.secondary_opts if negative else [max(param.opts, key=len)])[0]
    return flags


def check_option_scope(ctx: typer.Context, locations: list[str]) -> None:
    """Refuse (exit 2) or warn about storage and Hub options for kinds of location none of `locations` is."""
    from streamctl.errors import UsageError
    from streamctl.storage.url import parse_url

    schemes = {parse_url(location).scheme for location in locations}
    for name, flag in given_options(ctx).items():
        scheme = OPTION_SCHEMES.get(name)
        if scheme is None or scheme in schemes:
            continue
        these = " and ".join(locations) + (" is not one" if len(locations) == 1 else " are not")
        message = f"{flag} applies to {SCHEME_NAMES[scheme]}, and {these}"
        if name in WARN_WHEN_UNUSED:
            output.warn(f"{message}; ignored")
        else:
            raise UsageError(message, hint=f"drop {flag}, or check the location")


def check_mode_options(ctx: typer.Context, enabled: bool, mode_flag: str, panel: str) -> None:
    """Options of one help section (e.g. Kubernetes) only do something with their mode's flag (--k8s):
    without it the command does something else entirely (serve launches vLLM here), so they are refused."""
    from streamctl.errors import UsageError

    if enabled:
        return
    given = given_options(ctx)
    for param in ctx.command.params:
        if getattr(param, "rich_help_panel", None) == panel and param.name in given:
            raise UsageError(
                f"{given[param.name]} applies only with {mode_flag}",
                hint=f"add {mode_flag}, or drop {given[param.name]}",
            )


def refuse_together(ctx: typer.Context, first: str, second: str, why: str) -> None:
    """Two given options that contradict each other: exit 2 naming both, not one silently winning."""
    from streamctl.errors import UsageError

    given = given_options(ctx)
    if first in given and second in given:
        raise UsageError(f"{given[first]} and {given[second]} together: {why}", hint="drop one of them")


# ---------------------------------------------------------------------------------------- command lines
def command_line(ctx: typer.Context, values: dict[str, object], leave_out: frozenset[str]) -> list[str]:
    """`values` (option name -> parsed value, as ctx.params holds them) written back as this command's own
    options, one argument each (`--include=*.py`, `--no-verify`), in the order of its definitions: the one
    serializer for a command line another process runs (transfer --k8s-job's pods). Every option is written
    whatever set it (typed, a variable, a default: the pod has neither this environment nor, perhaps, this
    version's defaults) except those in `leave_out` and those with no value (None, an empty list, a flag off)."""
    from enum import Enum

    arguments: list[str] = []
    for param in ctx.command.params:
        if param.param_type_name != "option" or not param.name or param.name in leave_out:
            continue
        value = values.get(param.name)
        flag = max(param.opts, key=len)
        if value is None or value == [] or value == () or (value is False and not param.secondary_opts):
            continue
        if param.is_flag:  # type: ignore[attr-defined]
            arguments.append(flag if value else param.secondary_opts[0])
            continue
        items = value if param.multiple and isinstance(value, (list, tuple)) else [value]
        arguments.extend(f"{flag}={item.value if isinstance(item, Enum) else item}" for item in items)
    return arguments


def pod_arguments(ctx: typer.Context, not_for_the_pod: frozenset[str]) -> list[str]:
    """Every other option of this run, as parsed, for a Job pod's `streamctl COMMAND SOURCE DEST ...`: all but
    `not_for_the_pod` and the Kubernetes section's (the Job is built from those)."""
    kubernetes = {param.name for param in ctx.command.params if getattr(param, "rich_help_panel", None) == "Kubernetes"}
    # --debug and --quiet count before the command too (`streamctl --debug transfer`): the run's own settings
    values = {**ctx.params, "debug": output.settings.debug, "quiet": output.settings.quiet}
    return command_line(ctx, values, not_for_the_pod | {name for name in kubernetes if name})
