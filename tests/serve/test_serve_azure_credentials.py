"""`serve az://...` when the credentials are an AZURE_STORAGE_CONNECTION_STRING.

streamctl's own pre-flight reads connection strings (the Python SDK does), but the Run:ai streamer inside vLLM
reads only AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN (else DefaultAzureCredential): its Azure client
configuration, and the messages of the 0.17 library vLLM loads ("Using AZURE_STORAGE_ACCOUNT_KEY for
authentication", "Using AZURE_STORAGE_SAS_TOKEN ..."). So a launch on this host passes the connection string's
key or token under the streamer's name (masked wherever it is shown), a manifest never holds it (a warning says
what the pod's secret needs), and a key or token the user set is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.demo import build_demo_checkpoint
from streamctl.serve.plan import LaunchPlan, ServeOptions, plan_launch
from streamctl.storage import open_location
from streamctl.storage.azure_auth import connection_string_fields

KEY = "c2VjcmV0LWtleS1ieXRlcw=="  # base64 ends in '=': the parser must keep it whole
SAS = "sv=2024-11-04&ss=b&srt=co&sp=rl&se=2030-01-01T00:00:00Z&sig=c2lnbmF0dXJl%3D"


def plan(model: str, environ: dict[str, str], *, for_kubernetes: bool = False) -> LaunchPlan:
    return plan_launch(
        ServeOptions(model), None, sharded=False, environ=environ, cuda_available=True, host_memory_bytes=None,
        for_kubernetes=for_kubernetes,
    )  # fmt: skip


def connection(**fields: str) -> dict[str, str]:
    return {"AZURE_STORAGE_CONNECTION_STRING": ";".join(f"{name}={value}" for name, value in fields.items()) + ";"}


def assert_nowhere_shown(launch: LaunchPlan, secret: str) -> None:
    shown = json.dumps(launch.to_json()) + launch.shell_line() + repr(launch)
    assert secret not in shown


@pytest.mark.parametrize(
    ("fields", "variable", "secret"),
    [
        (
            {"AccountName": "acct", "AccountKey": KEY, "EndpointSuffix": "core.windows.net"},
            "AZURE_STORAGE_ACCOUNT_KEY",
            KEY,
        ),
        ({"AccountName": "acct", "SharedAccessSignature": SAS}, "AZURE_STORAGE_SAS_TOKEN", SAS),
        # Both: the key, as the streamer itself prefers it
        ({"AccountName": "acct", "AccountKey": KEY, "SharedAccessSignature": SAS}, "AZURE_STORAGE_ACCOUNT_KEY", KEY),
        # streamctl's own name for an account key, which the streamer does not read either
        ({"AZURE_STORAGE_KEY": KEY}, "AZURE_STORAGE_ACCOUNT_KEY", KEY),
    ],
    ids=["account-key", "sas-token", "both", "azure-storage-key"],
)
def test_a_secret_streamctl_reads_reaches_the_streamer_under_its_name_masked(
    fields: dict[str, str], variable: str, secret: str
) -> None:
    environ = (
        {**fields, "AZURE_STORAGE_ACCOUNT_NAME": "acct"} if "AZURE_STORAGE_KEY" in fields else connection(**fields)
    )
    launch = plan("az://models/llama", environ)
    assert launch.credentials == {variable: secret}
    assert launch.launch_env()[variable] == secret
    assert launch.launch_env()["AZURE_STORAGE_ACCOUNT_NAME"] == "acct"
    assert launch.to_json()["env"][variable] == "***"  # type: ignore[index]
    assert any(f"goes to it as {variable}" in warning for warning in launch.warnings), launch.warnings
    assert_nowhere_shown(launch, secret)


@pytest.mark.parametrize(
    "environ",
    [
        {**connection(AccountName="acct", AccountKey=KEY), "AZURE_STORAGE_ACCOUNT_KEY": "theirs"},
        {**connection(AccountName="acct", AccountKey=KEY), "AZURE_STORAGE_SAS_TOKEN": "theirs"},
        connection(AccountName="acct"),  # no secret in it: the streamer's DefaultAzureCredential, as streamctl's
        {"AZURE_STORAGE_ACCOUNT_NAME": "acct"},
        {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_SAS_TOKEN": SAS},  # the streamer reads it itself
        # A connection string for another account is not what streamctl uses for this one (choose_auth)
        {**connection(AccountName="other", AccountKey=KEY), "AZURE_STORAGE_ACCOUNT_NAME": "acct"},
    ],
    ids=["user-key", "user-sas", "no-secret", "no-connection-string", "sas-variable", "other-account"],
)
def test_nothing_is_added_where_the_user_chose_or_there_is_nothing_to_pass(environ: dict[str, str]) -> None:
    launch = plan("az://models/llama", environ)
    assert launch.credentials == {}
    assert not any("does not read" in warning for warning in launch.warnings), launch.warnings


def test_other_schemes_never_get_azure_secrets() -> None:
    for model in ("s3://bucket/llama", "gs://bucket/llama", "/models/llama"):
        launch = plan(model, connection(AccountName="acct", AccountKey=KEY))
        assert launch.credentials == {} and "AZURE_STORAGE_ACCOUNT_KEY" not in launch.launch_env()


def test_a_manifest_never_gets_the_secret_and_says_what_the_pods_secret_needs() -> None:
    launch = plan("az://models/llama", connection(AccountName="acct", AccountKey=KEY), for_kubernetes=True)
    assert launch.credentials == {} and "AZURE_STORAGE_ACCOUNT_KEY" not in launch.launch_env()
    assert any(
        "--secret must hold AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN" in warning
        for warning in launch.warnings
    ), launch.warnings


def test_a_custom_blob_endpoint_is_named_as_one_the_streamer_will_not_use() -> None:
    launch = plan(
        "az://models/llama", connection(AccountName="acct", AccountKey=KEY, BlobEndpoint="http://10.0.0.5:10000/acct")
    )
    assert any("BlobEndpoint=http://10.0.0.5:10000/acct" in warning for warning in launch.warnings), launch.warnings


@pytest.fixture
def az_model(az_root: str, tmp_path: Path) -> str:
    build_demo_checkpoint(open_location(az_root))
    return az_root


def test_the_cli_launch_gets_the_key_and_prints_it_nowhere(
    az_model: str, storage_env: dict[str, str], fake_vllm: dict[str, str]
) -> None:
    """Against Azurite: the pre-flight authenticates with the connection string; the exec'd `vllm` (a stand-in
    that records its environment) receives the key as AZURE_STORAGE_ACCOUNT_KEY; --json and --k8s never show it."""
    key = connection_string_fields(storage_env["AZURE_STORAGE_CONNECTION_STRING"])["AccountKey"]
    env = {**storage_env, **fake_vllm}
    env.pop("AZURE_STORAGE_ACCOUNT_KEY", None)

    dry = run_cli("serve", az_model, "--dry-run", "--json", env=env)
    assert dry.exit_code == 0, dry.stderr
    assert dry.json()["env"]["AZURE_STORAGE_ACCOUNT_KEY"] == "***"
    assert key not in dry.stdout + dry.stderr

    k8s = run_cli("serve", az_model, "--k8s", "--secret", "azure-creds", env=env)
    assert k8s.exit_code == 0, k8s.stderr
    assert key not in k8s.stdout + k8s.stderr and "AZURE_STORAGE_ACCOUNT_KEY" not in k8s.stdout
    assert "the pod's --secret must hold AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN" in k8s.stderr

    launched = subprocess.run(
        [sys.executable, "-m", "streamctl", "serve", az_model, "-q"],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launched.returncode == 0, launched.stderr
    record = json.loads(Path(fake_vllm["FAKE_VLLM_RECORD"]).read_text())
    assert record["env"]["AZURE_STORAGE_ACCOUNT_KEY"] == key
    assert record["env"]["AZURE_STORAGE_ACCOUNT_NAME"] == "devstoreaccount1"
    assert key not in launched.stdout + launched.stderr
