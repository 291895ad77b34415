"""`serve --kserve`: KServe's LLMInferenceService (serving.kserve.io/v1alpha2, KServe >= 0.17) for the launch
`serve --k8s` would run as a Deployment, built from that very Deployment's pod (k8s.serve_pod_documents: the
streamer's environment, the credentials' Secret, the identity's ServiceAccount and labels, the startup budget,
/dev/shm and the compile-cache volume), so that both kinds say the same.

What KServe does with it (read in KServe's v0.20 sources; docs/specs/kubernetes-serving.md, section 2a):
- the well-known `config-llm-template` is merged under `spec.template` (strategic merge: containers by name,
  env by name, volumes by name, mounts by path), then the whole spec is rendered as a Go template;
- with the storage initializer on, only pvc://, oci://, hf:// and s3:// model URIs pass, and the model is
  downloaded whole into /mnt/models before vLLM starts: it is turned off here, vLLM streams from the bucket;
- the template's container `main` runs `vllm serve /mnt/models ...` from a bash script: its command is
  replaced by streamctl's `vllm serve` line, with the template's TLS flags kept (added when KServe's TLS is
  on, as the template does);
- the template demands a non-root user (`runAsNonRoot: true`), which vLLM's image is not: KServe's own
  samples with that image set it to false, and so does this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar, cast

from streamctl.errors import UsageError
from streamctl.k8s import (
    ServeManifestOptions,
    StartupBudget,
    serve_pod_documents,
    to_yaml_documents,
)
from streamctl.k8s_identity import IdentityPlan
from streamctl.serve.plan import CheckpointFacts, LaunchPlan, ServeOptions
from streamctl.serve.vllm_args import takes

API_VERSION = "serving.kserve.io/v1alpha2"
KIND = "LLMInferenceService"
MAIN_CONTAINER = "main"  # the config-llm-template's vLLM container, which ours is merged into by name
TLS_DIR = "/var/run/kserve/tls"  # where the template mounts the service's certificate
# The template's own TLS flags, under its own condition: KServe renders the spec as a Go template.
TLS_FLAGS = f"--enable-ssl-refresh --ssl-certfile {TLS_DIR}/tls.crt --ssl-keyfile {TLS_DIR}/tls.key"
TLS_CONDITION = "{{ if .GlobalConfig.EnableTLS }}"
# bash runs vLLM's argv as given ("$@", never re-split), the TLS flags after it when TLS is on; "--" is $0.
LAUNCHER = ["/bin/bash", "-c", f'exec "$@"{TLS_CONDITION} {TLS_FLAGS}{{{{ end }}}}', "--"]
SELECTOR_LABEL = "app.kubernetes.io/name"  # KServe sets it on the pods itself, to the service's name
INITIALIZER_SCHEMES = ("pvc://", "oci://", "hf://", "s3://")
T = TypeVar("T")

COMMENT = (
    f"{KIND} ({API_VERSION}, KServe >= 0.17): vLLM streams the weights from the bucket (Run:ai Model Streamer).",
    "spec.storageInitializer.enabled is false: with KServe's storage initializer on, only "
    + ", ".join(INITIALIZER_SCHEMES)
    + " model URIs pass, and the model is downloaded whole into /mnt/models before vLLM starts.",
    "The main container's command replaces the config-llm-template's `vllm serve /mnt/models`: bash runs "
    f"streamctl's vllm serve line, plus the template's TLS flags ({TLS_FLAGS}) when KServe's TLS is on.",
    "No spec.router: KServe's workload Service serves port 8000; add router: {route: {}, gateway: {}} "
    "(and scheduler: {}) to route through the cluster's Gateway.",
)


def go_template_literal(text: str) -> str:
    """`text` as a Go template that renders to itself: KServe renders the whole spec, so a `{{` of the user's
    (a chat template in vLLM's arguments) is written as the action {{`{{`}}."""
    return text.replace("{{", "{{`{{`}}")


def _literal(value: T) -> T:
    """`value` with every string (keys too) as go_template_literal writes it."""
    if isinstance(value, str):
        return cast(T, go_template_literal(value))
    if isinstance(value, Mapping):
        return cast(T, {go_template_literal(str(key)): _literal(item) for key, item in value.items()})
    if isinstance(value, list):
        return cast(T, [_literal(item) for item in value])
    return value


def option_value(argv: Sequence[str], *options: str) -> str | None:
    """The value of the last of `options` in vLLM's `argv` (`--name V`, `--name=V`, however vLLM spells or
    abbreviates it; with several values, the first), or None."""
    found = None
    for index, arg in enumerate(argv):
        if not any(takes(arg, option) or arg.split("=", 1)[0] == option for option in options):
            continue
        if "=" in arg:
            found = arg.split("=", 1)[1]
        elif index + 1 < len(argv):
            found = argv[index + 1]
    return found


def _parallelism(argv: Sequence[str], tensor_parallel_size: int) -> dict[str, object]:
    parallelism: dict[str, object] = {"tensor": tensor_parallel_size}
    pipeline = option_value(argv, "--pipeline-parallel-size", "-pp")
    if pipeline is not None and pipeline.isdigit() and int(pipeline) > 1:
        parallelism["pipeline"] = int(pipeline)
    return parallelism


def _main_container(container: Mapping[str, object], argv: Sequence[str]) -> dict[str, object]:
    """The Deployment's vLLM container as the template's `main`: its command the launcher and `argv`."""
    main = {key: value for key, value in container.items() if key not in ("name", "command", "args")}
    security = {"runAsNonRoot": False}  # vLLM's image runs as root; the template asks for a non-root user
    return {"name": MAIN_CONTAINER, "command": [*LAUNCHER, *argv], **main, "securityContext": security}


def llm_inference_service(
    plan: LaunchPlan,
    facts: CheckpointFacts | None,
    options: ServeOptions,
    kubernetes: ServeManifestOptions,
    *,
    startup: StartupBudget | None = None,
) -> tuple[list[dict[str, object]], IdentityPlan | None]:
    """`serve --kserve`: the LLMInferenceService (after the identity's ServiceAccount, if any) and the
    identity's plan. Everything the pod gets is the Deployment's (k8s.serve_pod_documents, with its checks:
    a local model refused, no secret in clear text, no static key next to an identity); the served model's
    name is the `--served-model-name` of vLLM's arguments, else the service's name, which is added to them."""
    documents, identity = serve_pod_documents(plan, facts, options, kubernetes, startup=startup)
    deployments = [document for document in documents if document["kind"] == "Deployment"]
    if len(deployments) != 1:  # the pod's GPUs span nodes: KServe's multi-node mode is data/expert parallel only
        raise UsageError(
            "--kserve: this launch needs more than one pod, and KServe's LLMInferenceService spans nodes only for "
            "data and expert parallelism, not TP x PP",
            hint="use --k8s for TP x PP across nodes, or fewer GPUs per replica",
        )
    (deployment,) = deployments
    accounts = [document for document in documents if document["kind"] == "ServiceAccount"]
    metadata = cast(dict[str, object], deployment["metadata"])
    template = cast(dict[str, dict[str, object]], cast(dict[str, object], deployment["spec"])["template"])
    pod = _literal(dict(template["spec"]))
    argv = list(plan.argv)
    served = option_value(argv[2:], "--served-model-name")
    if served is None:
        served = str(metadata["name"])
        argv += ["--served-model-name", served]
    containers = cast(list[dict[str, object]], pod["containers"])
    pod["containers"] = [_main_container(containers[0], _literal(argv)), *containers[1:]]
    pod_labels = dict(cast(dict[str, str], template["metadata"].get("labels", {})))
    pod_labels.pop(SELECTOR_LABEL, None)  # KServe's own, with the same value
    spec: dict[str, object] = {
        "model": _literal({"uri": options.model, "name": served}),
        "storageInitializer": {"enabled": False},
        "replicas": 1,
        "parallelism": _parallelism(argv[2:], options.tensor_parallel_size),
        "labels": _literal(pod_labels),  # on the pods: an identity's webhook label
        "annotations": _literal(dict(cast(dict[str, str], template["metadata"].get("annotations", {})))),
        "template": pod,
    }
    service: dict[str, object] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": _literal(metadata), "spec": spec}
    return [*accounts, service], identity


def kserve_yaml(
    plan: LaunchPlan,
    facts: CheckpointFacts | None,
    options: ServeOptions,
    kubernetes: ServeManifestOptions,
    *,
    startup: StartupBudget | None = None,
) -> str:
    """`llm_inference_service` as YAML, headed with what KServe does with it and the identity's steps."""
    documents, identity = llm_inference_service(plan, facts, options, kubernetes, startup=startup)
    head = "".join(f"# {line}\n" for line in COMMENT)
    return head + (identity.comment() if identity is not None else "") + to_yaml_documents(documents)
