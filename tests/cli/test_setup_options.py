"""Options that would do nothing for the given input are refused (exit 2) or warned about, never silently
ignored; a missing optional program or extra is exit 127 in every command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location


@pytest.fixture
def model(tmp_path: Path) -> str:
    folder = tmp_path / "model"
    build_demo_checkpoint(open_location(str(folder)))
    return str(folder)


REFUSED = {
    # Which data or where it is: ignoring them could read or write other data than meant.
    "verify --endpoint-url": (
        ["verify-index", "{model}", "--endpoint-url", "http://127.0.0.1:9"],
        "--endpoint-url applies to s3:// locations",
    ),
    "verify --azure-account": (
        ["verify-index", "{model}", "--azure-account", "acct"],
        "--azure-account applies to az:// locations",
    ),
    "transfer --revision": (
        ["transfer", "{model}", "{out}", "--revision", "v1", "--dry-run"],
        "--revision applies to Hugging Face sources",
    ),
    "transfer --repo-type": (
        ["transfer", "{model}", "{out}", "--repo-type", "dataset", "--dry-run"],
        "--repo-type applies to Hugging Face sources",
    ),
    "shard --endpoint-url": (
        ["shard", "{model}", "{out}", "-tp", "2", "--endpoint-url", "http://127.0.0.1:9"],
        "--endpoint-url applies to s3://",
    ),
    "serve --azure-account": (
        ["serve", "{model}", "--dry-run", "--azure-account", "acct"],
        "--azure-account applies to az://",
    ),
    # Kubernetes options without the mode that uses them (serve would launch vLLM here instead).
    "serve --namespace": (
        ["serve", "{model}", "--dry-run", "--namespace", "ml"],
        "--namespace applies only with --k8s",
    ),
    "serve --image": (["serve", "{model}", "--dry-run", "--image", "vllm:x"], "--image applies only with --k8s"),
    "serve --accelerator": (
        ["serve", "{model}", "--dry-run", "--accelerator", "nvidia-l4"],
        "--accelerator applies only with --k8s",
    ),
    "serve --service-account": (
        ["serve", "{model}", "--dry-run", "--service-account", "sa"],
        "--service-account applies only with --k8s",
    ),
    "transfer --secret": (
        ["transfer", "{model}", "{out}", "--dry-run", "--secret", "hf"],
        "--secret applies only with --k8s-job",
    ),
    "transfer --namespace": (
        ["transfer", "{model}", "{out}", "--namespace", "ml"],
        "--namespace applies only with --k8s-job",
    ),
    # Contradictions: one of the two would silently lose.
    "serve --tune --concurrency": (
        ["serve", "{model}", "--tune", "--concurrency", "4", "--dry-run"],
        "--concurrency and --tune together",
    ),
    # (a manifest's model, SOURCE and DEST are in buckets or the Hub: a local one is refused first)
    "serve --k8s --json": (["serve", "s3://bkt/m", "--k8s", "--json"], "--k8s and --json together"),
    "transfer --k8s-job --dry-run": (
        ["transfer", "org/m", "s3://bkt/m", "--k8s-job", "--dry-run"],
        "--k8s-job and --dry-run together",
    ),
    "transfer --all-files --include": (
        ["transfer", "{model}", "{out}", "--all-files", "--include", "*.md"],
        "--all-files and --include together",
    ),
    "transfer --k8s-job --json": (
        ["transfer", "org/m", "s3://bkt/m", "--k8s-job", "--json"],
        "--k8s-job and --json together",
    ),
    "verify -tp --not-sharded": (
        ["verify-index", "{model}", "-tp", "2", "--not-sharded"],
        "--tensor-parallel-size describes a sharded",
    ),
    "verify -pp --not-sharded": (
        ["verify-index", "{model}", "-pp", "2", "--not-sharded"],
        "--pipeline-parallel-size describes a sharded",
    ),
    "verify --pattern --not-sharded": (
        ["verify-index", "{model}", "--pattern", "m-{{rank}}.safetensors", "--not-sharded"],
        "--pattern describes",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_options_that_would_do_nothing_are_refused(case: str, model: str, tmp_path: Path) -> None:
    template, message = REFUSED[case]
    args = [word.format(model=model, out=str(tmp_path / "out")) for word in template]
    result = run_cli(*args)
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr and result.stderr.startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


WARNED = {
    # How the data is reached: the result is the one asked for, so a warning and the run goes on.
    "verify --path-style": (["verify-index", "{model}", "--path-style"], "--path-style applies to s3:// locations"),
    "verify --virtual-host-style": (
        ["verify-index", "{model}", "--virtual-host-style"],
        "--virtual-host-style applies",
    ),
    "transfer --token": (
        ["transfer", "{model}", "{out}", "--dry-run", "--token", "hf_secret_value"],
        "--token applies to Hugging Face sources",
    ),
    "shard --token": (
        ["shard", "{model}", "{out}", "-tp", "2", "--token", "hf_secret_value"],
        "--token applies to Hugging Face",
    ),
}


@pytest.mark.parametrize("case", sorted(WARNED))
def test_options_that_only_tune_access_are_warned_about(case: str, model: str, tmp_path: Path) -> None:
    template, message = WARNED[case]
    args = [word.format(model=model, out=str(tmp_path / "out")) for word in template]
    result = run_cli(*args)
    assert result.exit_code == 0, result.stderr
    assert f"warning: {message}" in result.stderr
    assert "ignored" in result.stderr
    assert "hf_secret_value" not in result.stderr + result.stdout


def test_ambient_environment_variables_are_not_complaints(model: str, tmp_path: Path) -> None:
    """HF_TOKEN, AWS_ENDPOINT_URL and AZURE_STORAGE_ACCOUNT_NAME are set for every command a shell runs:
    only what the user typed for this command counts."""
    env = {"HF_TOKEN": "hf_x", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AZURE_STORAGE_ACCOUNT_NAME": "acct"}
    result = run_cli("transfer", model, str(tmp_path / "out"), "--dry-run", env=env)
    assert result.exit_code == 0, result.stderr
    assert "warning" not in result.stderr and "error" not in result.stderr


def test_options_for_a_location_in_the_command_are_accepted() -> None:
    # in buckets and the Hub: a manifest refuses local folders (its pods cannot see them)
    result = run_cli(
        "transfer", "org/model", "s3://bucket/m", "--endpoint-url", "http://127.0.0.1:9", "--path-style", "--k8s-job",
        "--image", "registry.example/streamctl:0.1.0",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "--endpoint-url=http://127.0.0.1:9" in result.stdout and "warning" not in result.stderr
    serve = run_cli("serve", "s3://bucket/m", "--no-preflight", "--not-sharded", "--k8s", "--namespace", "ml",
                    "--endpoint-url", "http://127.0.0.1:9", "--path-style")  # fmt: skip
    assert serve.exit_code == 0, serve.stderr


@pytest.mark.parametrize("flag", ["-tp", "-pp"])
def test_a_parallel_size_on_an_hf_checkpoint_checks_for_sharded_files(model: str, flag: str) -> None:
    """-tp/-pp say a sharded checkpoint is expected (as --pattern does): an HF layout fails the check
    (exit 1, rank-missing findings) instead of passing with the size silently ignored."""
    result = run_cli("verify-index", model, flag, "2", "--json")
    assert result.exit_code == 1, result.stderr
    document = result.json()
    assert document["layout"] == "sharded"
    assert "sharded-rank-missing" in {finding["code"] for finding in document["findings"]}
    assert run_cli("verify-index", model).exit_code == 0  # the same checkpoint, unasked, is fine


def test_shard_engine_vllm_without_vllm_is_127(model: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed in this environment")
    result = run_cli("shard", model, str(tmp_path / "out"), "-tp", "2", "--engine", "vllm")
    assert result.exit_code == 127, result.stderr
    assert "streamctl[vllm]" in result.stderr
