"""`serve --k8s --identity`: the pod reads the bucket as a cloud identity, never with a static key.

Per cloud (docs/specs/kubernetes-serving.md, 2d), what the manifest holds and what is done once on the cloud:

- gke: Workload Identity Federation. The ServiceAccount needs no annotation: the bucket grants the KSA's own
  principal (`principal://iam.googleapis.com/projects/NUMBER/locations/global/workloadIdentityPools/
  PROJECT.svc.id.goog/subject/ns/NS/sa/KSA`) the seed document's two roles, roles/storage.bucketViewer and
  roles/storage.objectUser. The streamer's GCS client finds the token itself (vLLM >= 0.11.1).
- eks-irsa: the ServiceAccount's `eks.amazonaws.com/role-arn` annotation; the role trusts the cluster's OIDC
  provider for this KSA; EKS's webhook injects AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE, which the
  streamer's S3 SDK (its web-identity provider) reads.
- eks-pod-identity: no annotation; a Pod Identity association ties the KSA to the role, which trusts
  pods.eks.amazonaws.com; the agent injects AWS_CONTAINER_CREDENTIALS_FULL_URI and
  AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE (the streamer's SDK carries that provider; not yet run by us).
- aks: the ServiceAccount's `azure.workload.identity/client-id` annotation and the pod label
  `azure.workload.identity/use: "true"`; a federated credential on the managed identity for this KSA; the
  webhook injects AZURE_CLIENT_ID, AZURE_TENANT_ID, AZURE_FEDERATED_TOKEN_FILE, AZURE_AUTHORITY_HOST, which
  the streamer's Azure backend reads (WorkloadIdentityCredential).

The cloud-side steps are exact shell commands (a value only the cloud knows is looked up by a command into a
variable), written as the comment that heads the manifests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from streamctl.errors import UsageError
from streamctl.serve.plan import shell_word
from streamctl.storage.url import ParsedURL, parse_url

IDENTITIES = ("gke", "eks-irsa", "eks-pod-identity", "aks")
EKS_ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"
AZURE_CLIENT_ID_ANNOTATION = "azure.workload.identity/client-id"
AZURE_USE_LABEL = "azure.workload.identity/use"
GKE_ROLES = ("roles/storage.bucketViewer", "roles/storage.objectUser")  # the GKE seed document's two bindings
AZURE_READER_ROLE = "Storage Blob Data Reader"
# Variables that would hold a static key: an identity's manifest never carries one, by value or by Secret.
STATIC_KEY_VARIABLES = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_CLIENT_SECRET",
        "GOOGLE_APPLICATION_CREDENTIALS",
    }
)

_SCHEME_OF = {"gke": "gs", "eks-irsa": "s3", "eks-pod-identity": "s3", "aks": "az"}
# Google's rule for a project ID: 6 to 30 lower-case letters, digits and hyphens, a letter first, no hyphen last.
_GCP_PROJECT = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
_GCP_PROJECT_NUMBER = re.compile(r"[1-9][0-9]{0,19}")
# arn:PARTITION:iam::ACCOUNT:role/[PATH/]NAME, a role name of up to 64 of IAM's characters
_ROLE_ARN = re.compile(r"arn:(aws|aws-cn|aws-us-gov):iam::([0-9]{12}):role/((?:[\w+=,.@-]+/)*)([\w+=,.@-]{1,64})")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# EKS: 1-100 letters, digits, '-' and '_', a letter or digit first; AKS clusters and resource groups alike
_CLUSTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
_RESOURCE_GROUP = re.compile(r"[-\w.()]{0,89}[-\w()]")
_AZURE_IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{2,127}")

# The options each identity needs, by the attribute of IdentityOptions: (flag, what it is).
_NEEDS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "gke": (("gcp_project", "--gcp-project", "the GCP project ID of the cluster"),),
    "eks-irsa": (
        ("aws_role_arn", "--aws-role-arn", "the IAM role the pod assumes"),
        ("cluster", "--cluster", "the EKS cluster's name (its OIDC provider)"),
    ),
    "eks-pod-identity": (
        ("aws_role_arn", "--aws-role-arn", "the IAM role the pod assumes"),
        ("cluster", "--cluster", "the EKS cluster's name"),
    ),
    "aks": (
        ("azure_client_id", "--azure-client-id", "the managed identity's client ID"),
        ("azure_identity", "--azure-identity", "the managed identity's name"),
        ("resource_group", "--resource-group", "the resource group of the identity and the cluster"),
        ("cluster", "--cluster", "the AKS cluster's name (its OIDC issuer)"),
    ),
}
_FLAGS = {
    "gcp_project": "--gcp-project",
    "gcp_project_number": "--gcp-project-number",
    "aws_role_arn": "--aws-role-arn",
    "cluster": "--cluster",
    "azure_client_id": "--azure-client-id",
    "azure_identity": "--azure-identity",
    "resource_group": "--resource-group",
}
_RULES: dict[str, tuple[re.Pattern[str], str]] = {
    "gcp_project": (_GCP_PROJECT, "a project ID: 6-30 of a-z, 0-9 and '-', a letter first, no '-' last"),
    "gcp_project_number": (_GCP_PROJECT_NUMBER, "a project number: digits"),
    "aws_role_arn": (_ROLE_ARN, "an IAM role ARN: arn:aws:iam::123456789012:role/NAME"),
    "cluster": (_CLUSTER, "a cluster name: letters, digits, '-' and '_', a letter or digit first"),
    "azure_client_id": (_UUID, "a client ID: a UUID, 8-4-4-4-12 hex digits"),
    "azure_identity": (_AZURE_IDENTITY, "a managed identity name: 3-128 letters, digits, '-' and '_'"),
    "resource_group": (_RESOURCE_GROUP, "a resource group: letters, digits, '-', '_', '.', '(' and ')'"),
}


@dataclass(frozen=True)
class IdentityOptions:
    """`--identity` and the values its cloud needs (None: not given)."""

    kind: str
    gcp_project: str | None = None
    gcp_project_number: str | None = None
    aws_role_arn: str | None = None
    cluster: str | None = None
    azure_client_id: str | None = None
    azure_identity: str | None = None
    resource_group: str | None = None

    def given(self) -> dict[str, str]:
        return {name: value for name, value in vars(self).items() if name != "kind" and value is not None}

    def validate(self, model: str, secret: str | None) -> None:
        """UsageError (exit 2, one line) for a kind not known, a model on another cloud's store, a value of
        the wrong shape, a value this identity needs left out or one it does not use, and any --secret."""
        if self.kind not in IDENTITIES:
            raise UsageError(f"--identity {self.kind!r} is not one of {', '.join(IDENTITIES)}", code="bad-option-value")
        scheme = parse_url(model).scheme
        wanted = _SCHEME_OF[self.kind]
        if scheme != wanted:
            raise UsageError(
                f"--identity {self.kind} grants access to {wanted}:// buckets, but the model is on {scheme}://",
                hint=f"use the identity of the model's cloud ({', '.join(k for k, s in _SCHEME_OF.items() if s == scheme) or 'none'})",
            )
        if secret is not None:
            raise UsageError(
                f"--secret {secret} and --identity {self.kind} together: a Secret's static keys (AWS_ACCESS_KEY_ID, "
                "AZURE_STORAGE_ACCOUNT_KEY, ...) would win over the identity's short-lived credentials",
                hint="drop --secret; put HF_TOKEN or VLLM_API_KEY into the Deployment yourself, from a Secret without keys",
            )
        for name, value in self.given().items():
            pattern, shape = _RULES[name]
            if pattern.fullmatch(value) is None:
                raise UsageError(
                    f"{_FLAGS[name]} {value!r} is not {shape}".replace("\n", "\\n"), code="bad-option-value"
                )
        needed = {name for name, _flag, _what in _NEEDS[self.kind]}
        for name, flag, what in _NEEDS[self.kind]:
            if getattr(self, name) is None:
                raise UsageError(f"--identity {self.kind} needs {flag}: {what}")
        allowed = needed | ({"gcp_project_number"} if self.kind == "gke" else set())
        for name in sorted(set(self.given()) - allowed):
            raise UsageError(f"{_FLAGS[name]} does not apply to --identity {self.kind}", hint=f"drop {_FLAGS[name]}")


@dataclass(frozen=True)
class IdentityPlan:
    """What an identity adds to the manifests: the ServiceAccount, pod labels, the cloud-side steps (shell
    lines) and how the streamer in the pod gets its credentials."""

    service_account: dict[str, object]
    pod_labels: Mapping[str, str]
    steps: tuple[str, ...]
    streamer_env: str

    def comment(self) -> str:
        """The head of the YAML: the streamer's environment, then the steps as a script (each line after '# ')."""
        lines = [
            f"The streamer's credentials in the pod: {self.streamer_env}.",
            "Cloud-side steps, once, before kubectl apply (a shell script: the lines below, up to the first",
            "manifest, without their '# '):",
            *self.steps,
        ]
        return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def _principal(project: str, number: str, namespace: str, service_account: str) -> str:
    pool = f"{project}.svc.id.goog"
    return (
        f"principal://iam.googleapis.com/projects/{number}/locations/global/workloadIdentityPools/{pool}"
        f"/subject/ns/{namespace}/sa/{service_account}"
    )


def _gke_steps(options: IdentityOptions, parsed: ParsedURL, namespace: str, service_account: str) -> list[str]:
    project = options.gcp_project or ""
    steps = []
    number = options.gcp_project_number
    if number is None:
        steps.append(f"PROJECT_NUMBER=$(gcloud projects describe {project} --format='value(projectNumber)')")
        number = "${PROJECT_NUMBER}"
    member = _principal(project, number, namespace, service_account)
    steps += [
        f"gcloud storage buckets add-iam-policy-binding gs://{parsed.bucket} --role={role} --member={member}"
        for role in GKE_ROLES
    ]
    return steps


def _read_policy(partition: str, parsed: ParsedURL) -> str:
    """s3:GetObject under the prefix and s3:ListBucket of it, as one line of JSON."""
    objects = f"arn:{partition}:s3:::{parsed.bucket}/{parsed.prefix + '/' if parsed.prefix else ''}*"
    listing: dict[str, object] = {
        "Effect": "Allow",
        "Action": "s3:ListBucket",
        "Resource": f"arn:{partition}:s3:::{parsed.bucket}",
    }
    if parsed.prefix:
        listing["Condition"] = {"StringLike": {"s3:prefix": [f"{parsed.prefix}/*", parsed.prefix]}}
    statement = [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": objects}, listing]
    return json.dumps({"Version": "2012-10-17", "Statement": statement}, separators=(",", ":"))


def _eks_steps(options: IdentityOptions, parsed: ParsedURL, namespace: str, service_account: str) -> list[str]:
    arn = options.aws_role_arn or ""
    match = _ROLE_ARN.fullmatch(arn)
    assert match is not None  # IdentityOptions.validate
    partition, account, role = match.group(1), match.group(2), match.group(4)
    cluster = options.cluster or ""
    steps = []
    if options.kind == "eks-irsa":
        steps.append(
            f"OIDC_PROVIDER=$(aws eks describe-cluster --name {cluster} --query cluster.identity.oidc.issuer "
            "--output text | sed 's|^https://||')"
        )
        trust = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Federated": f"arn:{partition}:iam::{account}:oidc-provider/${{OIDC_PROVIDER}}"},
                    "Action": "sts:AssumeRoleWithWebIdentity",
                    "Condition": {
                        "StringEquals": {
                            "${OIDC_PROVIDER}:sub": f"system:serviceaccount:{namespace}:{service_account}",
                            "${OIDC_PROVIDER}:aud": "sts.amazonaws.com",
                        }
                    },
                }
            ],
        }
        quote = "EOF"  # the shell fills in ${OIDC_PROVIDER}
    else:
        trust = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Service": "pods.eks.amazonaws.com"},
                    "Action": ["sts:AssumeRole", "sts:TagSession"],
                }
            ],
        }
        quote = "'EOF'"
    steps += [
        f"cat > streamctl-trust-policy.json <<{quote}",
        *json.dumps(trust, indent=2).splitlines(),
        "EOF",
        f"aws iam update-assume-role-policy --role-name {role} --policy-document file://streamctl-trust-policy.json",
        f"aws iam put-role-policy --role-name {role} --policy-name streamctl-read-{parsed.bucket} "
        f"--policy-document {shell_word(_read_policy(partition, parsed))}",
    ]
    if options.kind == "eks-pod-identity":
        steps += [
            f"aws eks create-addon --cluster-name {cluster} --addon-name eks-pod-identity-agent  # if not yet installed",
            f"aws eks create-pod-identity-association --cluster-name {cluster} --namespace {namespace} "
            f"--service-account {service_account} --role-arn {arn}",
        ]
    return steps


def _aks_steps(
    options: IdentityOptions, parsed: ParsedURL, account: str, namespace: str, service_account: str
) -> list[str]:
    group, cluster = shell_word(options.resource_group or ""), options.cluster
    # the account comes from the environment or the URL: quoted, whatever it holds
    scope = (
        f"$(az storage account show --name {shell_word(account)} --query id --output tsv)"
        f"/blobServices/default/containers/{parsed.bucket}"
    )
    return [
        f"AKS_OIDC_ISSUER=$(az aks show --name {cluster} --resource-group {group} "
        "--query oidcIssuerProfile.issuerUrl --output tsv)",
        f"az identity federated-credential create --name streamctl-{namespace}-{service_account} "
        f'--identity-name {options.azure_identity} --resource-group {group} --issuer "${{AKS_OIDC_ISSUER}}" '
        f"--subject system:serviceaccount:{namespace}:{service_account} --audience api://AzureADTokenExchange",
        f"az role assignment create --assignee {options.azure_client_id} --role {shell_word(AZURE_READER_ROLE)} "
        f'--scope "{scope}"',
    ]


STREAMER_ENV = {
    "gke": "none to set: the streamer's GCS client takes the ServiceAccount's token from GKE's metadata server "
    "(vLLM >= 0.11.1); roles/storage.objectViewer alone would do for reading",
    "eks-irsa": "EKS's webhook injects AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE (from the role-arn annotation); "
    "the streamer's S3 SDK reads them (web identity)",
    "eks-pod-identity": "the Pod Identity agent injects AWS_CONTAINER_CREDENTIALS_FULL_URI and "
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE; the streamer's S3 SDK carries that provider, not yet run against "
    "it by streamctl: check one load",
    "aks": "the workload-identity webhook injects AZURE_CLIENT_ID, AZURE_TENANT_ID, AZURE_FEDERATED_TOKEN_FILE and "
    "AZURE_AUTHORITY_HOST into pods labelled azure.workload.identity/use; the streamer's Azure backend reads "
    "AZURE_FEDERATED_TOKEN_FILE (WorkloadIdentityCredential), the account from AZURE_STORAGE_ACCOUNT_NAME",
}


def identity_plan(
    options: IdentityOptions,
    model: str,
    *,
    namespace: str,
    service_account: str,
    labels: Mapping[str, str],
    azure_account: str | None,
) -> IdentityPlan:
    """The ServiceAccount `service_account` in `namespace` and the rest of `options.kind`'s wiring for `model`."""
    parsed = parse_url(model)
    annotations: dict[str, str] = {}
    pod_labels: dict[str, str] = {}
    if options.kind == "gke":
        steps = _gke_steps(options, parsed, namespace, service_account)
    elif options.kind in ("eks-irsa", "eks-pod-identity"):
        if options.kind == "eks-irsa":
            annotations[EKS_ROLE_ANNOTATION] = options.aws_role_arn or ""
        steps = _eks_steps(options, parsed, namespace, service_account)
    else:
        annotations[AZURE_CLIENT_ID_ANNOTATION] = options.azure_client_id or ""
        pod_labels[AZURE_USE_LABEL] = "true"
        steps = _aks_steps(options, parsed, azure_account or "ACCOUNT", namespace, service_account)
    metadata: dict[str, object] = {"name": service_account, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        metadata["annotations"] = annotations
    account: dict[str, object] = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata}
    return IdentityPlan(account, pod_labels, tuple(steps), STREAMER_ENV[options.kind])


def static_keys(env: Sequence[Mapping[str, object]]) -> list[str]:
    """The names among a container's env entries that would hold a static key."""
    return [str(item.get("name")) for item in env if item.get("name") in STATIC_KEY_VARIABLES]
