"""`serve --k8s --identity gke|eks-irsa|eks-pod-identity|aks`: the ServiceAccount with its cloud's annotation
(and AKS's pod label), the cloud-side steps as exact commands at the head of the YAML, the streamer's
environment said, never a static key; each option's value checked, with a one-line error and exit 2.
The facts are docs/specs/kubernetes-serving.md's, section 2d."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from cli_helpers import run_cli
from kube_models import check_with_models
from streamctl.errors import UsageError
from streamctl.k8s import ServeManifestOptions, serve_pod_yaml
from streamctl.k8s_identity import STATIC_KEY_VARIABLES, IdentityOptions
from streamctl.serve.plan import CheckpointFacts, ServeOptions, plan_launch

GiB = 1024**3
FACTS = CheckpointFacts(total_bytes=16 * GiB, largest_tensor_bytes=GiB // 2, files=4)
ARN = "arn:aws:iam::123456789012:role/vllm-read"
CLIENT_ID = "00000000-1111-2222-3333-444444444444"
IDENTITIES: dict[str, tuple[str, dict[str, str]]] = {  # kind -> (model, its options)
    "gke": ("gs://models/qwen3-8b", {"gcp_project": "ml-prod", "gcp_project_number": "123456789"}),
    "eks-irsa": ("s3://models/llama/70b", {"aws_role_arn": ARN, "cluster": "prod"}),
    "eks-pod-identity": ("s3://models/llama/70b", {"aws_role_arn": ARN, "cluster": "prod"}),
    "aks": (
        "az://models/llama",
        {"azure_client_id": CLIENT_ID, "azure_identity": "vllm-id", "resource_group": "ml-rg", "cluster": "aks1"},
    ),
}
# every variable a host may hold a key in: none of it reaches a manifest
HOST_KEYS = {
    "AWS_ACCESS_KEY_ID": "AKIAHOSTKEY000000000",
    "AWS_SECRET_ACCESS_KEY": "host-secret-key-material",
    "AWS_SESSION_TOKEN": "host-session-token",
    "AZURE_STORAGE_ACCOUNT_NAME": "acct",
    "AZURE_STORAGE_KEY": "aG9zdC1henVyZS1rZXk=",
    "AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct;AccountKey=aG9zdC1henVyZS1rZXk=",
    "AWS_ENDPOINT_URL": "",
}


def _yaml(kind: str, *, namespace: str = "ml", service_account: str | None = "vllm-ksa") -> str:
    model, values = IDENTITIES[kind]
    options = ServeOptions(model=model)
    plan = plan_launch(
        options,
        FACTS,
        sharded=False,
        environ=HOST_KEYS,
        cuda_available=True,
        host_memory_bytes=None,
        for_kubernetes=True,
    )
    kubernetes = ServeManifestOptions(
        namespace=namespace, service_account=service_account, identity=IdentityOptions(kind, **values)
    )
    return serve_pod_yaml(plan, FACTS, options, kubernetes)


def _head(text: str) -> list[str]:
    """The comment lines that head the YAML, without their '# '."""
    return [line[2:] if line.startswith("# ") else line[1:] for line in text.splitlines() if line.startswith("#")]


def _script(text: str) -> list[str]:
    head = _head(text)
    return head[head.index("manifest, without their '# '):") + 1 :]


@pytest.mark.parametrize("kind", sorted(IDENTITIES))
def test_every_identity_is_valid_kubernetes_without_a_key(kind: str) -> None:
    text = _yaml(kind)
    documents: list[dict[str, Any]] = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in documents] == ["ServiceAccount", "Deployment", "Service"]
    for document in documents:
        check_with_models(document)
    account, deployment, _service = documents
    assert account["metadata"]["name"] == "vllm-ksa" and account["metadata"]["namespace"] == "ml"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "vllm-ksa"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "envFrom" not in container
    assert not {item["name"] for item in container["env"]} & STATIC_KEY_VARIABLES
    for value in HOST_KEYS.values():  # no key material, by value, anywhere in the output
        if len(value) > 8:
            assert value not in text, value
    assert "aG9zdC1" not in text and "AKIA" not in text


def test_gke_binds_the_ksas_principal_on_the_bucket() -> None:
    text = _yaml("gke")
    account = next(yaml.safe_load_all(text))
    assert "annotations" not in account["metadata"]  # Workload Identity Federation: no iam.gke.io annotation
    principal = (
        "principal://iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/"
        "ml-prod.svc.id.goog/subject/ns/ml/sa/vllm-ksa"
    )
    assert _script(text) == [
        f"gcloud storage buckets add-iam-policy-binding gs://models --role={role} --member={principal}"
        for role in ("roles/storage.bucketViewer", "roles/storage.objectUser")
    ]
    assert "metadata server" in text
    # without the number, it is looked up into a variable first
    model, _values = IDENTITIES["gke"]
    options = ServeOptions(model=model)
    plan = plan_launch(options, FACTS, sharded=False, environ={}, cuda_available=True, host_memory_bytes=None)
    identity = IdentityOptions("gke", gcp_project="ml-prod")
    looked_up = _script(serve_pod_yaml(plan, FACTS, options, ServeManifestOptions(identity=identity)))
    assert looked_up[0] == "PROJECT_NUMBER=$(gcloud projects describe ml-prod --format='value(projectNumber)')"
    # no --service-account: the KSA is the Deployment's own name
    assert re.search(
        r"/projects/\$\{PROJECT_NUMBER\}/.*/subject/ns/default/sa/vllm-qwen3-8b-[0-9a-f]{8}$", looked_up[1]
    )


def test_eks_irsa_annotates_the_role_and_prints_its_trust_policy() -> None:
    text = _yaml("eks-irsa")
    account = next(yaml.safe_load_all(text))
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": ARN}
    script = "\n".join(_script(text))
    assert '"sts:AssumeRoleWithWebIdentity"' in script
    assert '"${OIDC_PROVIDER}:sub": "system:serviceaccount:ml:vllm-ksa"' in script
    assert '"${OIDC_PROVIDER}:aud": "sts.amazonaws.com"' in script
    assert "aws iam update-assume-role-policy --role-name vllm-read" in script
    assert '"Resource":"arn:aws:s3:::models/llama/70b/*"' in script  # s3:GetObject under the prefix only
    assert "AWS_ROLE_ARN" in text and "AWS_WEB_IDENTITY_TOKEN_FILE" in text


def test_eks_pod_identity_prints_the_association() -> None:
    text = _yaml("eks-pod-identity")
    account = next(yaml.safe_load_all(text))
    assert "annotations" not in account["metadata"]
    script = _script(text)
    assert script[-1] == (
        f"aws eks create-pod-identity-association --cluster-name prod --namespace ml --service-account vllm-ksa "
        f"--role-arn {ARN}"
    )
    assert any(line.strip() == '"Service": "pods.eks.amazonaws.com"' for line in script)
    assert "AWS_CONTAINER_CREDENTIALS_FULL_URI" in text


def test_aks_labels_the_pod_and_federates_the_ksa() -> None:
    text = _yaml("aks")
    account, deployment, _service = yaml.safe_load_all(text)
    assert account["metadata"]["annotations"] == {"azure.workload.identity/client-id": CLIENT_ID}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["azure.workload.identity/use"] == "true"  # a string: the webhook compares text
    assert "azure.workload.identity/use" not in deployment["spec"]["selector"]["matchLabels"]
    script = _script(text)
    assert script[1] == (
        "az identity federated-credential create --name streamctl-ml-vllm-ksa --identity-name vllm-id "
        '--resource-group ml-rg --issuer "${AKS_OIDC_ISSUER}" --subject system:serviceaccount:ml:vllm-ksa '
        "--audience api://AzureADTokenExchange"
    )
    assert "--role 'Storage Blob Data Reader'" in script[2] and "/containers/models" in script[2]
    assert "AZURE_FEDERATED_TOKEN_FILE" in text
    env = {item["name"]: item.get("value") for item in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AZURE_STORAGE_ACCOUNT_NAME"] == "acct"


SERVE = ("serve", "--no-preflight", "--not-sharded", "--k8s")
NO_ENDPOINT = {"AWS_ENDPOINT_URL": ""}


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        ("gs://models/q", ["--identity", "gke"], "--identity gke needs --gcp-project"),
        ("gs://models/q", ["--identity", "gke", "--gcp-project", "My_Project"], "--gcp-project 'My_Project' is not a project ID"),
        ("gs://models/q", ["--identity", "gke", "--gcp-project", "ml-prod", "--gcp-project-number", "12a"], "is not a project number"),
        ("s3://models/q", ["--identity", "eks-irsa", "--aws-role-arn", "arn:aws:iam::1234:role/x", "--cluster", "c"], "is not an IAM role ARN"),
        ("s3://models/q", ["--identity", "eks-irsa", "--aws-role-arn", "arn:aws:s3:::bucket", "--cluster", "c"], "is not an IAM role ARN"),
        ("s3://models/q", ["--identity", "eks-pod-identity", "--aws-role-arn", ARN], "needs --cluster"),
        ("az://models/q", ["--identity", "aks", "--azure-client-id", "not-a-uuid"], "is not a client ID"),
        ("s3://models/q", ["--identity", "gke", "--gcp-project", "ml-prod"], "grants access to gs:// buckets, but the model is on s3://"),
        ("gs://models/q", ["--identity", "gke", "--gcp-project", "ml-prod", "--cluster", "c"], "--cluster does not apply to --identity gke"),
        ("gs://models/q", ["--identity", "gke", "--gcp-project", "ml-prod", "--secret", "keys"], "--secret keys and --identity gke together"),
        ("gs://models/q", ["--gcp-project", "ml-prod"], "--gcp-project applies only with --identity"),
        ("gs://models/q", ["--identity", "gcp"], "'gcp' is not one of"),
    ],
)  # fmt: skip
def test_identity_options_are_checked(model: str, options: list[str], message: str) -> None:
    result = run_cli(SERVE[0], model, *SERVE[1:], *options, env={**NO_ENDPOINT, "AZURE_STORAGE_ACCOUNT_NAME": "acct"})
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:") or "Invalid value" in line]
    assert len(errors) == 1 and message in " ".join(result.stderr.split()), result.stderr


def test_a_secret_with_an_identity_is_refused_in_the_library_too() -> None:
    with pytest.raises(UsageError, match="would win over the identity"):
        ServeManifestOptions(secret="keys", identity=IdentityOptions("gke", gcp_project="ml-prod")).validate(
            "gs://models/q"
        )


def test_the_cli_prints_the_steps_then_the_manifests() -> None:
    _model, values = IDENTITIES["aks"]
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in values.items()]
    result = run_cli(
        SERVE[0], "az://models/llama", *SERVE[1:], "--identity", "aks", *flags, "--namespace", "ml", env=HOST_KEYS
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("# The streamer's credentials in the pod: ")
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout)] == ["ServiceAccount", "Deployment", "Service"]
    assert "aG9zdC1" not in result.stdout
    # the host's key is not for the pod: no warning asks for it in a --secret
    assert "--secret" not in result.stderr, result.stderr


@pytest.mark.parametrize("kind", sorted(IDENTITIES))
def test_the_readmes_extraction_gives_a_shell_script(kind: str, tmp_path: Any) -> None:
    """README: `sed -n '4,/^[^#]/s/^# \\{0,1\\}//p' vllm.yaml | bash` runs the steps; bash -n parses them."""
    import subprocess

    manifest = tmp_path / "vllm.yaml"
    manifest.write_text(_yaml(kind))
    script = subprocess.run(
        ["sed", "-n", r"4,/^[^#]/s/^# \{0,1\}//p", str(manifest)], capture_output=True, text=True, check=True
    ).stdout
    assert script.splitlines() == _script(manifest.read_text())
    parsed = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
