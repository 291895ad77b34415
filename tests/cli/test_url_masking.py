"""Credentials in URLs (`user:pass@`, signed-URL parameters) are masked wherever streamctl shows a
URL (plans, --dry-run, --json, errors, logs) and refused in manifests; launches keep the real value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.common.redact import has_credentials, mask_credentials
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location

SECRET = "pw-SECRET-9f3a"
ENDPOINT = f"http://minio-user:{SECRET}@127.0.0.1:9"  # port 9: nothing listens, so network errors


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"http://u:{SECRET}@host:9000/b", "http://***@host:9000/b"),
        (f"https://{SECRET}@host", "https://***@host"),
        (f"http://u:p@ss{SECRET}@host/x@y", "http://***@host/x@y"),  # a raw "@" in the password
        (
            f"see 'HTTPS://u:{SECRET}@proxy:3128' and http://u2:{SECRET}@h2/",
            "see 'HTTPS://***@proxy:3128' and http://***@h2/",
        ),
        (
            f'Could not connect to the endpoint URL: "http://a:{SECRET}@127.0.0.1:9/bkt?list-type=2"',
            'Could not connect to the endpoint URL: "http://***@127.0.0.1:9/bkt?list-type=2"',
        ),
        (
            f"https://acct.blob.core.windows.net/c/b?sv=2024&sig={SECRET}&se=1",
            "https://acct.blob.core.windows.net/c/b?sv=2024&sig=***&se=1",
        ),
        (
            f"https://b.s3.amazonaws.com/k?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***",
        ),
    ],
)
def test_mask_credentials(text: str, shown: str) -> None:
    assert mask_credentials(text) == shown
    assert has_credentials(text) and SECRET not in shown
    assert mask_credentials(shown) == shown  # masking twice changes nothing


@pytest.mark.parametrize("text", ["s3://bucket/model", "http://127.0.0.1:9000/b", "user@example.com", "a=b", "/x/y@z"])
def test_urls_without_credentials_are_unchanged(text: str) -> None:
    assert mask_credentials(text) == text and not has_credentials(text)


def _clean(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text, text


@pytest.fixture
def demo_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    build_demo_checkpoint(open_location(str(folder)))
    return folder


def test_serve_dry_run_and_json_mask_the_endpoint() -> None:
    args = ("serve", "s3://bkt/model", "--no-preflight", "--not-sharded", "--endpoint-url", ENDPOINT)
    dry = run_cli(*args, "--dry-run", "--", "--otlp-traces-endpoint", f"http://o:{SECRET}@collector:4317")
    assert dry.exit_code == 0, dry.stderr
    _clean(dry.stdout, dry.stderr)
    assert "AWS_ENDPOINT_URL='http://***@127.0.0.1:9'" in dry.stdout
    assert "http://***@collector:4317" in dry.stdout
    document = run_cli(*args, "--json")
    assert document.exit_code == 0, document.stderr
    _clean(document.stdout, document.stderr)
    assert document.json()["env"]["AWS_ENDPOINT_URL"] == "http://***@127.0.0.1:9"


def test_a_user_variable_with_credentials_is_masked_in_warnings() -> None:
    result = run_cli(
        "serve",
        "s3://bkt/model",
        "--no-preflight",
        "--not-sharded",
        "--dry-run",
        "--endpoint-url",
        "http://127.0.0.1:9",
        env={"AWS_ENDPOINT_URL": ENDPOINT},
    )
    assert result.exit_code == 0, result.stderr
    _clean(result.stdout, result.stderr)


@pytest.mark.parametrize(
    "command",
    [
        ("serve", "s3://bkt/model", "--dry-run"),
        ("serve", "s3://bkt/model", "--json"),
        ("verify-index", "s3://bkt/model"),
        ("verify-index", "s3://bkt/model", "--json"),
        ("transfer", "s3://bkt/model", "s3://bkt/copy", "--dry-run"),
    ],
)
def test_network_errors_mask_the_endpoint(command: tuple[str, ...], storage_env: dict[str, str]) -> None:
    result = run_cli(
        *command, "--endpoint-url", ENDPOINT, env={**storage_env, "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}
    )
    assert result.exit_code == 6, (result.stdout, result.stderr)
    _clean(result.stdout, result.stderr)
    assert "***@127.0.0.1:9" in result.stdout + result.stderr  # the endpoint is still named


def test_launch_gets_the_real_endpoint(tmp_path: Path) -> None:
    """Only display is masked: vLLM itself is started with the real value."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record.json"
    script = bin_dir / "vllm"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv, 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    model = "s3://bkt/model"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamctl",
            "serve",
            model,
            "-q",
            "--no-preflight",
            "--not-sharded",
            "--endpoint-url",
            ENDPOINT,
            "--",
            "--api-key",
            SECRET,
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    launched = json.loads(record.read_text())
    assert launched["env"]["AWS_ENDPOINT_URL"] == ENDPOINT
    assert launched["argv"][-2:] == ["--api-key", SECRET]


@pytest.mark.parametrize(
    ("command", "env"),
    [
        (("serve", "s3://bkt/model", "--no-preflight", "--not-sharded", "--k8s", "--endpoint-url", ENDPOINT), {}),
        (("serve", "s3://bkt/model", "--no-preflight", "--not-sharded", "--k8s"), {"AWS_ENDPOINT_URL": ENDPOINT}),
        (
            (
                "serve",
                "s3://bkt/model",
                "--no-preflight",
                "--not-sharded",
                "--k8s",
                "--",
                "--otlp-traces-endpoint",
                f"http://o:{SECRET}@collector:4317",
            ),
            {},
        ),
        (("transfer", "s3://bkt/model", "s3://bkt/copy", "--k8s-job", "--endpoint-url", ENDPOINT), {}),
        (("transfer", "s3://bkt/model", "s3://bkt/copy", "--k8s-job"), {"AWS_ENDPOINT_URL": ENDPOINT}),
        (("transfer", "org/model", f"https://acct.blob.core.windows.net/c/m?sig={SECRET}", "--k8s-job"), {}),
    ],
)
def test_manifests_refuse_urls_with_credentials(command: tuple[str, ...], env: dict[str, str]) -> None:
    result = run_cli(*command, env={"AWS_ENDPOINT_URL": "", **env})
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    _clean(result.stdout, result.stderr)
    if "?sig=" in " ".join(command):  # a SAS in the URL is refused as soon as the URL is read, for every command
        assert "AZURE_STORAGE_SAS_TOKEN" in result.stderr
    else:
        assert "Secret" in result.stderr and "--secret" in result.stderr


def test_manifests_without_credentials_still_work() -> None:
    serve = run_cli(
        "serve",
        "s3://bkt/model",
        "--no-preflight",
        "--not-sharded",
        "--k8s",
        "--endpoint-url",
        "http://minio.storage:9000",
        "--secret",
        "creds",
    )
    assert serve.exit_code == 0, serve.stderr
    assert "http://minio.storage:9000" in serve.stdout
    job = run_cli(
        "transfer", "s3://bkt/model", "s3://bkt/copy", "--k8s-job", "--endpoint-url", "http://minio.storage:9000",
        "--image", "registry.example/streamctl:0.1.0",
    )  # fmt: skip
    assert job.exit_code == 0, job.stderr


def test_progress_logs_and_task_names_are_masked_and_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.progress import Progress as Bars

    from streamctl import output

    bars = Bars(console=output.stderr())
    progress = output.RichProgress(bars)
    task = progress.task(f"read http://u:{SECRET}@h/\x1b[2Jx [bold]y", total=1)
    progress.log(f"retrying http://u:{SECRET}@h/x (attempt 2): \x1b]0;owned\x07 reset")
    description = bars.tasks[0].description
    assert SECRET not in description and "\x1b" not in description
    bars.console.print(description)
    progress.done(task)
    err = capsys.readouterr().err
    _clean(err)
    assert "\x1b" not in err and "\x07" not in err
    assert "\\x1b]0;owned\\x07" in err and "[bold]y" in err
