"""`transfer --k8s-job`: the Job runs an image built from the repository's Dockerfile (no package index
serves streamctl), and `--parallelism N` makes it an Indexed Job whose pod K runs `--worker K/N`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from cli_helpers import run_cli
from kube_models import check_with_models

REPO = Path(__file__).resolve().parents[2]
IMAGE = "registry.example/streamctl:0.1.0"


def test_parallelism_prints_an_indexed_job_whose_pods_take_their_own_share() -> None:
    import yaml

    result = run_cli(
        "transfer", "org/model", "s3://bucket/m", "--k8s-job", "--parallelism", "3", "--image", IMAGE,
        "--secret", "creds", "-j", "8",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    job = check_with_models(document)  # every field is one the schema knows
    assert job.spec.completion_mode == "Indexed"
    assert (job.spec.completions, job.spec.parallelism) == (3, 3)
    assert job.spec.backoff_limit_per_index >= 3  # each pod retries on its own: a re-run skips what is done
    assert job.spec.pod_replacement_policy == "Failed"
    assert job.spec.template.spec.restart_policy == "Never"
    container = job.spec.template.spec.containers[0]
    assert container.image == IMAGE
    assert container.command[:4] == ["streamctl", "transfer", "hf://org/model", "s3://bucket/m"]
    assert container.command[-1] == "--worker=$(JOB_COMPLETION_INDEX)/3"  # Kubernetes fills the pod's index in
    index = container.env[0]
    assert index.name == "JOB_COMPLETION_INDEX"
    assert index.value_from.field_ref.field_path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert "pip install" not in result.stdout


def test_the_job_commands_parse_as_a_transfer_of_each_share(s3_root: str, storage_env: dict[str, str]) -> None:
    """What each pod runs, with the index filled in, is a valid `--worker K/3` run (its plan, dry), from a
    bucket into a bucket (a Job refuses local folders: its pods cannot see them)."""
    import yaml

    from streamctl.storage import open_location

    source = open_location(s3_root)
    for name in ("config.json", "tokenizer.json"):
        source.store.put(source.key(name), b"{}")
    printed = run_cli("transfer", s3_root, f"{s3_root}-out", "--k8s-job", "--parallelism", "3", "--image", IMAGE,
                      env=storage_env)  # fmt: skip
    assert printed.exit_code == 0, printed.stderr
    command = yaml.safe_load(printed.stdout)["spec"]["template"]["spec"]["containers"][0]["command"]
    planned = []
    for index in range(3):
        argv = [part.replace("$(JOB_COMPLETION_INDEX)", str(index)) for part in command[1:]]
        result = run_cli(*argv, "--dry-run", "--json", env=storage_env)
        assert result.exit_code == 0, (shlex.join(argv), result.stderr)
        planned += [item["path"] for item in json.loads(result.stdout)["files"]]
    assert sorted(planned) == ["config.json", "tokenizer.json"]


def test_a_job_without_image_is_refused_saying_how_to_build_one() -> None:
    result = run_cli("transfer", "org/model", "s3://bucket/m", "--k8s-job", "--parallelism", "3")
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    line = " ".join(result.stderr.split())
    assert "--k8s-job needs --image" in line
    assert "docker build -t REGISTRY/streamctl:0.1.0 . && docker push REGISTRY/streamctl:0.1.0" in line
    plain = run_cli("transfer", "org/model", "s3://bucket/m", "--k8s-job")
    assert plain.exit_code == 2 and "--image" in plain.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--k8s-job", "--image", IMAGE, "--worker", "0/3"], "--k8s-job and --worker together"),
        (["--parallelism", "3"], "--parallelism applies only with --k8s-job"),
        (["--k8s-job", "--image", IMAGE, "--parallelism", "0"], "--parallelism"),
    ],
)
def test_job_options_that_contradict_are_refused(args: list[str], message: str) -> None:
    result = run_cli("transfer", "org/model", "s3://bucket/m", *args)
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    joined = text.replace("\\\n", " ")
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_the_dockerfile_installs_this_repository_and_runs_streamctl_unprivileged() -> None:
    """Docker is not on the test machines: the Dockerfile's steps are checked as text."""
    steps = _instructions((REPO / "Dockerfile").read_text())
    kinds = [kind for kind, _ in steps]
    base = steps[0]
    assert base[0] == "FROM" and base[1].startswith("python:") and "slim" in base[1]
    version = tuple(int(part) for part in base[1].split(":", 1)[1].split("-")[0].split("."))
    assert version >= (3, 11)  # pyproject's requires-python
    copy = next(arguments for kind, arguments in steps if kind == "COPY")
    assert copy.split() == [".", "."]  # the whole checkout into the working folder
    workdir = [index for index, kind in enumerate(kinds) if kind == "WORKDIR"]
    assert workdir and workdir[0] < kinds.index("COPY")
    install = next(arguments for kind, arguments in steps if kind == "RUN" and "pip install" in arguments)
    assert install.startswith("pip install . ") or install == "pip install ."  # the copied repository itself
    assert kinds.index("COPY") < kinds.index("RUN")
    user = [arguments for kind, arguments in steps if kind == "USER"]
    assert user and user[-1] not in ("root", "0")
    last_run = max(index for index, kind in enumerate(kinds) if kind == "RUN")
    assert kinds.index("USER") > last_run  # the user is set once everything is installed
    entrypoint = next(arguments for kind, arguments in steps if kind == "ENTRYPOINT")
    assert json.loads(entrypoint) == ["streamctl"]
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    for needed in ("pyproject.toml", "README.md", "cli"):
        assert needed not in ignored  # what `pip install .` builds from
    assert ".git" in ignored and "tests" in ignored
