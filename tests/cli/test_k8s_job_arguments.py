"""`transfer --k8s-job` writes every option of the run into the pod's command line, by one
serializer driven by the command's own option definitions (the hand-built list once dropped --repo-type,
so a dataset was copied as the model repo of the same name). The test parses the printed Job's container
arguments back with the CLI's own parser and compares them with what was given, for every option."""

from __future__ import annotations

import os
from typing import Any

import pytest
import typer.main
import yaml

from cli_helpers import run_cli
from streamctl.app import app
from streamctl.commands.transfer import NOT_FOR_THE_POD

IMAGE = "registry.example/streamctl:0.1.0"
# Two runs between them give every option of transfer outside the Kubernetes section a value other than
# its default (--all-files and --include contradict each other; --azure-account needs an az:// DEST).
TO_S3 = [
    "hf://org/data", "s3://bkt/copy", "--revision", "v2", "--repo-type", "dataset", "--include", "*.py",
    "--include", "extra dir/*.md", "--exclude", "*.bin", "--follow-symlinks", "-j", "7", "--part-size", "8MiB",
    "--max-buffer", "64MiB", "--force", "--no-verify", "--endpoint-url", "http://minio.storage:9000",
    "--virtual-host-style", "--quiet", "--debug",
]  # fmt: skip
TO_AZURE = [
    "org/model", "az://container/copy", "--all-files", "--path-style", "--azure-account", "acct", "--verify",
]  # fmt: skip
CASES = {"to-s3": TO_S3, "to-azure": TO_AZURE}


@pytest.fixture(autouse=True)
def no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing here and in the subprocess must see only the command line."""
    for name in list(os.environ):
        if name.startswith(("STREAMCTL_", "AWS_", "AZURE_", "HF_", "RUNAI_")) and name != "STREAMCTL_AZURITE":
            monkeypatch.delenv(name)


def transfer_command() -> Any:
    return typer.main.get_command(app).commands["transfer"]  # type: ignore[attr-defined]


def parsed(arguments: list[str]) -> dict[str, Any]:
    """`arguments` as `streamctl transfer` parses them: option name -> value (SOURCE and DEST included)."""
    with transfer_command().make_context("transfer", list(arguments)) as ctx:
        return dict(ctx.params)


def kubernetes_options() -> set[str]:
    return {
        param.name for param in transfer_command().params if getattr(param, "rich_help_panel", None) == "Kubernetes"
    }


def pod_command(arguments: list[str], *extra: str, env: dict[str, str] | None = None) -> list[str]:
    result = run_cli("transfer", *arguments, "--k8s-job", "--image", IMAGE, *extra, env=env)
    assert result.exit_code == 0, result.stderr
    command: list[str] = yaml.safe_load(result.stdout)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["streamctl", "transfer"]
    return command[2:]


def test_the_cases_give_every_option_of_transfer_a_value_of_its_own() -> None:
    """A new option of transfer fails here until the round trip covers it (or NOT_FOR_THE_POD says why not)."""
    defaults = parsed(["org/m", "s3://b/m"])
    changed = {name for case in CASES.values() for name, value in parsed(case).items() if value != defaults[name]}
    changed |= {"path_style"} if {True, False} <= {parsed(case)["path_style"] for case in CASES.values()} else set()
    options = {param.name for param in transfer_command().params if param.param_type_name == "option"}
    assert options - kubernetes_options() - NOT_FOR_THE_POD - {"help"} <= changed
    assert {True, False} <= {parsed(case)["verify"] for case in CASES.values()}  # both of a pair


@pytest.mark.parametrize("case", CASES)
def test_every_option_reaches_the_pod(case: str) -> None:
    given = parsed(CASES[case])
    in_pod = parsed(pod_command(CASES[case]))
    for name in NOT_FOR_THE_POD | kubernetes_options():
        given.pop(name, None), in_pod.pop(name, None)
    # ORG/NAME is written as the Hub URL it means, a dataset's with its kind (both name the same repo)
    given["source"] = {"to-azure": "hf://org/model", "to-s3": "hf://datasets/org/data"}[case]
    assert in_pod == given


def test_a_datasets_job_is_not_its_namesake_models() -> None:
    """The Job's name and annotation are derived from the repo the pods copy, --repo-type included."""
    jobs = []
    for kind in ("model", "dataset"):
        result = run_cli(
            "transfer", "hf://org/same", "s3://bkt/copy", "--repo-type", kind, "--k8s-job", "--image", IMAGE
        )
        assert result.exit_code == 0, result.stderr
        jobs.append(yaml.safe_load(result.stdout)["metadata"])
    assert jobs[0]["name"] != jobs[1]["name"]
    assert "datasets/org/same" in " ".join(jobs[1]["annotations"].values())


def test_an_indexed_job_adds_only_the_share_and_the_token_stays_out() -> None:
    token = "hf_podSECRET1234"
    command = pod_command(TO_S3, "--parallelism", "3", "--secret", "hf", "--token", token)
    assert command[-1] == "--worker=$(JOB_COMPLETION_INDEX)/3"
    assert token not in " ".join(command)
    in_pod = parsed([part.replace("$(JOB_COMPLETION_INDEX)", "1") for part in command])
    assert in_pod.pop("worker") == "1/3"
    given = {**parsed(TO_S3), "source": "hf://datasets/org/data"}
    given.pop("worker")
    assert {name: value for name, value in in_pod.items() if name != "token"} == {
        name: value for name, value in given.items() if name != "token"
    }


def test_values_from_the_environment_and_before_the_command_reach_the_pod() -> None:
    """The pod has neither this machine's variables nor the options typed before `transfer`."""
    env = {"STREAMCTL_TRANSFER_CONCURRENCY": "5", "STREAMCTL_REPO_TYPE": "dataset", "STREAMCTL_EXCLUDE": "*.h5 *.bin"}
    result = run_cli("--debug", "transfer", "hf://org/data", "s3://bkt/copy", "--k8s-job", "--image", IMAGE, env=env)
    assert result.exit_code == 0, result.stderr
    command = yaml.safe_load(result.stdout)["spec"]["template"]["spec"]["containers"][0]["command"][2:]
    in_pod = parsed(command)
    assert (in_pod["concurrency"], in_pod["repo_type"].value, in_pod["exclude"]) == (5, "dataset", ["*.h5", "*.bin"])
    assert in_pod["debug"] is True
