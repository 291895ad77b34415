"""`serve --kserve`: KServe's LLMInferenceService (serving.kserve.io/v1alpha2) with the storage initializer off,
the main container running streamctl's `vllm serve` line (the template's TLS flags kept under its own
condition), parallelism mapped, and the pod the Deployment's: the same streamer environment, identity,
startup budget and compile-cache volume. Checked against KServe's published CRD schema (tests/k8s/schemas/)
and vLLM's own serve parser (the oracle). Facts: docs/specs/kubernetes-serving.md, section 2a."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from cli_helpers import run_cli
from crd_schema import schema_errors
from kube_models import check_with_models
from oracle import check_serve_args_many, requires_vllm_oracle
from streamctl.errors import UsageError
from streamctl.k8s import ServeManifestOptions, serve_pod_manifests
from streamctl.k8s_identity import IdentityOptions
from streamctl.k8s_kserve import LAUNCHER, TLS_CONDITION, TLS_FLAGS, go_template_literal, kserve_yaml
from streamctl.serve.plan import CheckpointFacts, LaunchPlan, ServeOptions, plan_launch

GiB = 1024**3
FACTS = CheckpointFacts(total_bytes=16 * GiB, largest_tensor_bytes=GiB // 2, files=4)
HOST_KEYS = {  # keys on this host: none of them reaches a manifest
    "AWS_ACCESS_KEY_ID": "AKIAHOSTKEY000000000",
    "AWS_SECRET_ACCESS_KEY": "host-secret-key-material",
    "AWS_SESSION_TOKEN": "host-session-token",
    "GOOGLE_APPLICATION_CREDENTIALS": "/home/me/key.json",
    "AWS_ENDPOINT_URL": "",
}
NO_ENDPOINT = {"AWS_ENDPOINT_URL": ""}


def _plan(options: ServeOptions, environ: dict[str, str] | None = None) -> LaunchPlan:
    environ = {**HOST_KEYS, **(environ or {})}
    return plan_launch(
        options, FACTS, sharded=False, environ=environ, cuda_available=True, host_memory_bytes=None, for_kubernetes=True
    )


def _documents(
    model: str,
    *,
    tp: int = 1,
    vllm_args: tuple[str, ...] = (),
    environ: dict[str, str] | None = None,
    **kubernetes: Any,
) -> tuple[str, list[dict[str, Any]]]:
    options = ServeOptions(model=model, tensor_parallel_size=tp, vllm_args=vllm_args)
    text = kserve_yaml(_plan(options, environ), FACTS, options, ServeManifestOptions(kserve=True, **kubernetes))
    return text, list(yaml.safe_load_all(text))


def _service(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = [d for d in documents if d["kind"] == "LLMInferenceService"]
    assert service["apiVersion"] == "serving.kserve.io/v1alpha2"
    assert schema_errors(service) == []
    for document in documents:
        if document is not service:
            check_with_models(document)  # the core kinds (the ServiceAccount) with the Kubernetes models
    return service


def _main(service: dict[str, Any]) -> dict[str, Any]:
    (container,) = service["spec"]["template"]["containers"]
    assert container["name"] == "main"  # merged into the config-llm-template's container of that name
    return container


def _vllm_argv(container: dict[str, Any]) -> list[str]:
    """The `vllm serve ...` line the container's bash execs (what follows the launcher)."""
    command: list[str] = container["command"]
    assert command[: len(LAUNCHER)] == LAUNCHER and "args" not in container
    return command[len(LAUNCHER) :]


@pytest.mark.parametrize("model", ["s3://models/llama/70b", "gs://models/qwen3-8b"])
def test_a_bucket_model_is_streamed_with_the_initializer_off(model: str) -> None:
    text, documents = _documents(model)
    service = _service(documents)
    spec = service["spec"]
    assert spec["model"]["uri"] == model  # the bucket itself: vLLM streams it, nothing lands in /mnt/models
    assert spec["storageInitializer"] == {"enabled": False}
    assert spec["replicas"] == 1 and spec["parallelism"] == {"tensor": 1}
    argv = _vllm_argv(_main(service))
    head, manifest = text.split("apiVersion", 1)
    assert argv[:3] == ["vllm", "serve", model] and "/mnt/models" not in manifest
    assert argv[argv.index("--load-format") + 1] == "runai_streamer"
    # the served name is the service's, as the template's --served-model-name would make it
    assert argv[argv.index("--served-model-name") + 1] == spec["model"]["name"] == service["metadata"]["name"]
    # the comment says why it is off
    assert "storage initializer on, only pvc://, oci://, hf://, s3:// model URIs pass" in head
    assert "downloaded whole" in head


def test_the_pod_is_the_deployments() -> None:
    """Environment, probes, resources, volumes and names: one builder for both kinds."""
    model = "s3://models/llama/70b"
    options = ServeOptions(model=model, tensor_parallel_size=2)
    plan = _plan(options)
    deployment, _service_doc = serve_pod_manifests(plan, FACTS, options, ServeManifestOptions(namespace="ml"))
    _text, documents = _documents(model, tp=2, namespace="ml")
    service = _service(documents)
    pod = deployment["spec"]["template"]  # type: ignore[index]
    vllm = pod["spec"]["containers"][0]
    main = _main(service)
    for key in ("image", "env", "resources", "startupProbe", "readinessProbe", "livenessProbe", "volumeMounts"):
        assert main[key] == vllm[key], key
    assert service["spec"]["template"]["volumes"] == pod["spec"]["volumes"]  # /dev/shm and the compile cache
    assert service["metadata"] == deployment["metadata"]  # type: ignore[index]
    assert service["spec"]["annotations"] == pod["metadata"]["annotations"]  # how the startup budget was reached
    # 16 GiB at the default 100 MB/s is 172 s, plus 600 s engine start: 78 probes of 10 s, not the template's 60
    assert main["startupProbe"]["failureThreshold"] == 78
    assert _vllm_argv(main)[:-2] == [*vllm["command"], *vllm["args"]]  # the Deployment's line, named
    # KServe's template asks for a non-root user, which vLLM's image is not
    assert main["securityContext"] == {"runAsNonRoot": False}


def test_tp2_maps_the_parallelism() -> None:
    _text, documents = _documents("gs://models/qwen3-32b", tp=2)
    service = _service(documents)
    main = _main(service)
    argv = _vllm_argv(main)
    assert service["spec"]["parallelism"] == {"tensor": 2}
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
    (shm,) = [v for v in service["spec"]["template"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "16Gi"


def test_pipeline_parallelism_and_a_served_name_come_from_vllms_arguments() -> None:
    args = ("-pp", "2", "--served-model-name", "llama-70b")
    _text, documents = _documents("s3://models/llama/70b", tp=4, vllm_args=args)
    service = _service(documents)
    argv = _vllm_argv(_main(service))
    assert service["spec"]["parallelism"] == {"tensor": 4, "pipeline": 2}
    assert service["spec"]["model"]["name"] == "llama-70b"
    assert argv.count("--served-model-name") == 1  # the user's, not one more


def test_tls_flags_are_the_templates_under_its_condition() -> None:
    _text, documents = _documents("s3://models/llama/70b")
    script = _main(_service(documents))["command"][2]
    # config-llm-template: {{ if .GlobalConfig.EnableTLS }}--enable-ssl-refresh / --ssl-certfile / --ssl-keyfile
    assert TLS_CONDITION == "{{ if .GlobalConfig.EnableTLS }}"
    assert script == f'exec "$@"{TLS_CONDITION} {TLS_FLAGS}{{{{ end }}}}'
    for flag in (
        "--enable-ssl-refresh",
        "--ssl-certfile /var/run/kserve/tls/tls.crt",
        "--ssl-keyfile /var/run/kserve/tls/tls.key",
    ):
        assert flag in script


def test_a_users_braces_are_not_a_go_template() -> None:
    """KServe renders the whole spec as a Go template: a `{{` of the user's is written as a literal action."""
    assert go_template_literal("{{ .Values }} and {x}") == "{{`{{`}} .Values }} and {x}"
    _text, documents = _documents("s3://models/m", vllm_args=("--chat-template", "{{ messages }}"))
    argv = _vllm_argv(_main(_service(documents)))
    assert argv[argv.index("--chat-template") + 1] == "{{`{{`}} messages }}"


@pytest.mark.parametrize(
    ("kind", "model", "values"),
    [
        ("gke", "gs://models/qwen3-8b", {"gcp_project": "ml-prod", "gcp_project_number": "123456789"}),
        (
            "aks",
            "az://models/llama",
            {
                "azure_client_id": "00000000-1111-2222-3333-444444444444",
                "azure_identity": "vllm-id",
                "resource_group": "ml-rg",
                "cluster": "aks1",
            },
        ),
    ],
)
def test_identity_gives_the_pod_its_service_account(kind: str, model: str, values: dict[str, str]) -> None:
    identity = IdentityOptions(kind, **values)
    environ = {"AZURE_STORAGE_ACCOUNT_NAME": "acct"}
    text, documents = _documents(model, environ=environ, service_account="vllm-ksa", identity=identity, namespace="ml")
    assert [d["kind"] for d in documents] == ["ServiceAccount", "LLMInferenceService"]
    service = _service(documents)
    account = documents[0]
    assert account["metadata"]["name"] == service["spec"]["template"]["serviceAccountName"] == "vllm-ksa"
    assert "Cloud-side steps" in text.split("apiVersion")[0]
    if kind == "aks":  # the workload-identity webhook's label, on the pods through spec.labels
        assert service["spec"]["labels"]["azure.workload.identity/use"] == "true"
    env = {item["name"] for item in _main(service)["env"]}
    assert not env & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AZURE_STORAGE_KEY"}
    assert "envFrom" not in _main(service)


def test_no_secret_reaches_the_output() -> None:
    text, documents = _documents("s3://models/llama/70b", secret="s3-creds")
    for value in HOST_KEYS.values():
        assert not value or value not in text
    assert _main(_service(documents))["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]  # by name, from a Secret
    with pytest.raises(UsageError, match="--api-key: a secret would be written"):
        _documents("s3://models/llama/70b", vllm_args=("--api-key", "sk-live-123"))


def test_a_launch_beyond_one_pod_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the pod builder gives no single Deployment (TP x PP across nodes), --kserve says why."""
    import streamctl.k8s_kserve as k8s_kserve

    monkeypatch.setattr(
        k8s_kserve, "serve_pod_documents", lambda *args, **kwargs: ([{"kind": "LeaderWorkerSet"}], None)
    )
    with pytest.raises(UsageError, match="spans nodes only for data and expert parallelism"):
        _documents("s3://models/m", tp=8, vllm_args=("-pp", "2"))


def test_the_schema_catches_a_wrong_field() -> None:
    """The CRD check can fail: an unknown field and a wrong type are both found."""
    _text, documents = _documents("s3://models/m")
    service = _service(documents)
    service["spec"]["storageInitialiser"] = {"enabled": False}
    service["spec"]["parallelism"]["tensor"] = "2"
    errors = schema_errors(service)
    assert any("storageInitialiser" in error for error in errors), errors
    assert any(error.startswith("spec.parallelism.tensor:") for error in errors), errors


@requires_vllm_oracle
def test_vllm_parses_the_command_line_with_and_without_tls() -> None:
    lines = []
    for model, tp in (("s3://models/llama/70b", 1), ("gs://models/qwen3-8b", 2)):
        _text, documents = _documents(model, tp=tp)
        argv = _vllm_argv(_main(_service(documents)))
        lines += [argv[2:], [*argv[2:], *TLS_FLAGS.split()]]
    verdicts = check_serve_args_many(lines)
    for line, verdict in zip(lines, verdicts, strict=True):
        assert verdict["ok"], (line, verdict["error"])
        assert verdict["load_format"] == "runai_streamer"
        assert verdict["model"] == line[0]


# -- the command line ------------------------------------------------------------------------------------


def test_the_cli_prints_the_service() -> None:
    result = run_cli(
        "serve", "s3://models/llama", "--no-preflight", "--not-sharded", "--kserve", "-tp", "2", env=NO_ENDPOINT
    )
    assert result.exit_code == 0, result.stderr
    service = _service(list(yaml.safe_load_all(result.stdout)))
    assert service["spec"]["parallelism"] == {"tensor": 2}


def test_a_local_model_is_refused(tmp_path: Any) -> None:
    result = run_cli("serve", str(tmp_path), "--kserve")
    assert result.exit_code == 2 and result.stdout == ""
    assert f"--kserve: MODEL '{tmp_path}' is a local path: the pod cannot read this machine's files" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--k8s", "--kserve"), "--k8s and --kserve together"),
        (("--kserve", "--json"), "--kserve and --json together"),
    ],
)
def test_kserve_is_alone(flags: tuple[str, ...], message: str) -> None:
    result = run_cli("serve", "s3://models/llama", "--no-preflight", "--not-sharded", *flags, env=NO_ENDPOINT)
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_kubernetes_options_apply_with_kserve() -> None:
    result = run_cli("serve", "s3://models/llama", "--no-preflight", "--dry-run", "--namespace", "ml")
    assert result.exit_code == 2
    assert "--namespace applies only with --k8s or --kserve" in result.stderr
