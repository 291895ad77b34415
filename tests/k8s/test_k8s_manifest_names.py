"""The names in `serve --k8s` and `transfer --k8s-job` manifests.

- Every name option a user gives is checked against the API server's own rule for what it becomes (restated
  here from k8s.io/apimachinery/pkg/util/validation, independently of streamctl's table) and refused with exit 2.
- A derived name differs whenever the location does (a bucket apart, or a difference past the 63rd character),
  is the same on every run, and the manifest's annotation holds the whole location.
- A local MODEL, SOURCE or DEST is refused: the pod has a file system of its own.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from cli_helpers import CliResult, run_cli
from streamctl.errors import UsageError
from streamctl.k8s import ServeManifestOptions, serve_pod_manifests, transfer_job
from streamctl.k8s_names import NAME_OPTIONS, check_manifest_names
from streamctl.serve.plan import CheckpointFacts, ServeOptions, plan_launch
from streamctl.storage import StorageOptions

IMAGE = "registry.example/streamctl:0.1.0"
NO_ENDPOINT = {"AWS_ENDPOINT_URL": ""}  # no session endpoint in the manifests: none is reached either
SERVE = ("serve", "--no-preflight", "--not-sharded", "--k8s")  # MODEL goes after "serve"; no request is made
FACTS = CheckpointFacts(total_bytes=2**30, largest_tensor_bytes=2**20, files=1)

# apimachinery's formats and lengths (validation.go), as it writes them.
DNS1123_LABEL = (re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"), 63)
DNS1123_SUBDOMAIN = (re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"), 253)
DNS1035_LABEL = (re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?"), 63)
LABEL_VALUE = (re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"), 63)
RULE_OF_OPTION = {
    "--name": DNS1035_LABEL,  # a Service's name (the Deployment shares it)
    "--namespace": DNS1123_LABEL,
    "--service-account": DNS1123_SUBDOMAIN,
    "--secret": DNS1123_SUBDOMAIN,
    "--accelerator": LABEL_VALUE,  # a nodeSelector value
    "--compile-cache-pvc": DNS1123_SUBDOMAIN,  # a PersistentVolumeClaim's name
}


def keeps(rule: tuple[re.Pattern[str], int], value: str) -> bool:
    pattern, longest = rule
    return len(value) <= longest and pattern.fullmatch(value) is not None


# Values of each class: upper case, '_', ' ', '/', '.', a leading digit or '-', a trailing '-', 64 and 254
# characters, empty, a control character, non-ASCII; and the longest valid ones.
CANDIDATES = [
    "MyModel", "Prod_NS", "SA Name", "../etc", "nvidia l4", "a/b", "a.b", "a..b", ".a", "a.", "1model", "-a",
    "a-", "a_b", "A", "\u00e9t\u00e9", "tab\there", "line\n", "x" * 63, "x" * 64, "a." * 126 + "a", "a" * 254,
    "", "nvidia-l4", "nvidia-tesla-a100", "gcs-access", "hf-token", "ml", "v1.2", "l4_x", "L4.x",
]  # fmt: skip


@pytest.mark.parametrize("option", sorted(RULE_OF_OPTION))
def test_every_name_option_keeps_the_api_servers_rule(option: str) -> None:
    """The check refuses exactly what the API server would, and refuses '' besides (it means nothing)."""
    key = next(key for key, (flag, _, _) in NAME_OPTIONS.items() if flag == option)
    for value in CANDIDATES:
        valid = keeps(RULE_OF_OPTION[option], value) and value != ""
        try:
            check_manifest_names(**{key: value})
        except UsageError as error:
            assert not valid, (option, value, error.message)
            assert error.exit_code == 2 and error.code == "bad-option-value"
            assert error.message.startswith(f"{option} ") and "Kubernetes wants a " in error.message
            assert "\n" not in error.message and "\t" not in error.message  # one line, controls escaped
        else:
            assert valid, (option, value)


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("--name", "MyModel", "it holds 'M'"),
        ("--name", "1model", "it starts with '1'"),
        ("--name", "x" * 64, "64 characters, more than 63"),
        ("--namespace", "Prod_NS", "'_'"),
        ("--service-account", "SA Name", "' '"),
        ("--secret", "../etc", "'/'"),
        ("--secret", "a" * 254, "254 characters, more than 253"),
        ("--accelerator", "nvidia l4", "' '"),
        ("--accelerator", "", "it is empty"),
    ],
)
def test_a_refusal_names_the_option_the_value_and_the_rule(option: str, value: str, reason: str) -> None:
    key = next(key for key, (flag, _, _) in NAME_OPTIONS.items() if flag == option)
    with pytest.raises(UsageError) as refused:
        check_manifest_names(**{key: value})
    message = refused.value.message
    assert f"{option} {value!r}" in message and reason in message
    assert re.search(r"Kubernetes wants an? (DNS-1123 label|DNS-1123 subdomain|DNS-1035 label|label value)", message)


GOOD_IMAGES = [
    "vllm/vllm-openai:v0.33.0", "registry.example/streamctl:0.1.0", "localhost:5000/team/streamctl:dev",
    "REGISTRY/streamctl:0.1.0", "ghcr.io/org/img@sha256:" + "a" * 64, "[::1]:5000/x", "busybox", "a__b-c.d",
]  # fmt: skip
BAD_IMAGES = [
    "", "IMG", "vllm/vllm-openai:v0.33.0 ", "my image", "registry.example/Streamctl:1", "repo:tag:tag",
    "repo@sha256:abc", "-repo", "a/" + "b" * 260, "x:" + "t" * 129, "repo\n", "repo/", "/repo",
]  # fmt: skip


def test_an_image_the_kubelet_cannot_parse_is_refused() -> None:
    """distribution/reference's grammar: the API server takes any text; the pod would fail InvalidImageName."""
    for image in GOOD_IMAGES:
        check_manifest_names(image=image)
    for image in BAD_IMAGES:
        with pytest.raises(UsageError) as refused:
            check_manifest_names(image=image)
        assert refused.value.message.startswith(f"--image {image!r} is not a valid image reference"), image
        assert refused.value.code == "bad-option-value" and "\n" not in refused.value.message


def _error_document(result: CliResult) -> dict[str, Any]:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    document = json.loads(result.stdout)
    assert document["ok"] is False and document["error"]["exit_code"] == 2
    assert "Traceback" not in result.stderr
    return dict(document["error"])


SERVE_BAD = [
    ("--name", "MyModel"), ("--name", "my_model"), ("--name", "1model"), ("--name", "a.b"), ("--name", "x" * 64),
    ("--name", ""), ("--namespace", "Prod_NS"), ("--namespace", "a/b"), ("--service-account", "SA Name"),
    ("--service-account", "a" * 254), ("--secret", "../etc"), ("--secret", "Creds"), ("--accelerator", "nvidia l4"),
    ("--accelerator", "-l4"), ("--accelerator", "x" * 64), ("--image", ""), ("--image", "Vllm/Vllm:1"),
]  # fmt: skip
JOB_BAD = [
    ("--namespace", "Prod_NS"), ("--namespace", "x" * 64), ("--namespace", ""), ("--service-account", "SA Name"),
    ("--service-account", "sa/x"), ("--secret", "../etc"), ("--secret", "a_b"), ("--secret", "a" * 254),
    ("--image", "my image"),
]  # fmt: skip


@pytest.mark.parametrize(("option", "value"), SERVE_BAD)
def test_serve_k8s_refuses_an_invalid_name_with_a_json_error(option: str, value: str) -> None:
    error = _error_document(run_cli(SERVE[0], "s3://bkt/m", *SERVE[1:], option, value, "--json", env=NO_ENDPOINT))
    assert error["code"] == "bad-option-value"
    assert error["message"].startswith(f"{option} {value!r} is not a valid ")


@pytest.mark.parametrize(("option", "value"), JOB_BAD)
def test_transfer_k8s_job_refuses_an_invalid_name_with_a_json_error(option: str, value: str) -> None:
    result = run_cli(
        "transfer", "org/m", "s3://bkt/m", "--k8s-job", "--image", IMAGE, option, value, "--json", env=NO_ENDPOINT
    )
    error = _error_document(result)
    assert error["code"] == "bad-option-value"
    assert error["message"].startswith(f"{option} {value!r} is not a valid ")


def test_without_json_the_refusal_is_one_line_and_prints_no_manifest() -> None:
    result = run_cli(SERVE[0], "s3://bkt/m", *SERVE[1:], "--name", "MyModel", env=NO_ENDPOINT)
    assert result.exit_code == 2 and result.stdout == ""
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "--name 'MyModel'" in error_lines[0] and "DNS-1035" in error_lines[0]
    assert "e.g. --name mymodel" in result.stderr  # a spelling that passes, when there is one


# -- derived names ---------------------------------------------------------------------------------------


def _serve_documents(model: str, storage: StorageOptions | None = None, **kubernetes: Any) -> list[dict[str, Any]]:
    options = ServeOptions(model=model, storage=storage or StorageOptions())
    plan = plan_launch(options, FACTS, sharded=False, environ={}, cuda_available=True, host_memory_bytes=None)
    return serve_pod_manifests(plan, FACTS, options, ServeManifestOptions(**kubernetes))  # type: ignore[return-value]


def _job(source: str, dest: str, revision: str | None = None, **places: str) -> dict[str, Any]:
    job = transfer_job(
        source, dest, [], namespace="default", image=IMAGE, version="0", service_account=None, secret=None,
        env={}, revision=revision, **places,
    )  # fmt: skip
    return job


LONG = "org/" + "checkpoints-of-the-long-running-experiment/" * 2  # past 63 characters before the model's own name
LONG_NAME = "llama-3.1-8b-instruct-" + "finetuned-on-the-support-tickets-of-" * 2  # a last segment past 63 characters
SERVE_PAIRS = [
    ("s3://team-a/llama-8b", "s3://team-b/llama-8b"),  # only the bucket differs
    ("s3://team-a/llama-8b", "gs://team-a/llama-8b"),  # only the scheme
    ("s3://team-a/v1/llama-8b", "s3://team-a/v2/llama-8b"),  # a folder above the model
    (f"s3://bkt/{LONG}llama-3.1-8b-instruct-a", f"s3://bkt/{LONG}llama-3.1-8b-instruct-b"),  # a long prefix
    (f"s3://bkt/{LONG_NAME}2024", f"s3://bkt/{LONG_NAME}2025"),  # past the 63 characters of a name
    ("s3://bkt/Llama-8B", "s3://bkt/llama-8b"),  # keys are case-sensitive
    ("https://acct.blob.core.windows.net/models/m", "https://other.blob.core.windows.net/models/m"),  # the account
]


@pytest.mark.parametrize(("first", "second"), SERVE_PAIRS)
def test_serve_names_differ_whenever_the_locations_do(first: str, second: str) -> None:
    names = []
    for model in (first, second):
        deployment, service = _serve_documents(model)
        name = deployment["metadata"]["name"]
        assert service["metadata"]["name"] == name and keeps(DNS1035_LABEL, name), name
        assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == name
        assert keeps(LABEL_VALUE, name)
        names.append(name)
    assert names[0] != names[1]


def test_a_derived_name_stays_readable_and_the_annotation_holds_the_location() -> None:
    deployment, service = _serve_documents("s3://team-a/llama-8b/")
    name = deployment["metadata"]["name"]
    assert re.fullmatch(r"vllm-llama-8b-[0-9a-f]{8}", name), name
    for document in (deployment, service):
        assert document["metadata"]["annotations"] == {"streamctl.io/source": "s3://team-a/llama-8b"}
    long_model = f"s3://bkt/{LONG}{LONG_NAME}2024"
    (cut, _service) = _serve_documents(long_model)
    assert len(cut["metadata"]["name"]) == 63 and cut["metadata"]["name"].startswith("vllm-llama-3-1-8b-instruct-fine")
    assert cut["metadata"]["annotations"]["streamctl.io/source"] == long_model  # whole, though the name is cut
    (named, _service) = _serve_documents("s3://team-a/llama-8b", name="chat")
    assert named["metadata"]["name"] == "chat"  # --name is used as given ...
    assert named["metadata"]["annotations"] == {"streamctl.io/source": "s3://team-a/llama-8b"}  # ... still annotated


@pytest.mark.parametrize(
    "spellings",
    [
        ("s3://bkt/m", "s3://bkt/m/", "S3://bkt/m", "s3://bkt/m//"),
        ("gs://bkt/m", "gcs://bkt/m", "GS://bkt/m/"),
        ("https://acct.blob.core.windows.net/models/m", "https://ACCT.blob.core.windows.net/models/m/"),
        ("hf://org/m", "hf://models/org/m"),
    ],
)
def test_one_place_spelled_several_ways_gets_one_name(spellings: tuple[str, ...]) -> None:
    names = {_serve_documents(spelling)[0]["metadata"]["name"] for spelling in spellings}
    assert len(names) == 1, names


JOB_PAIRS = [
    (("hf://team-a/m", "s3://bkt/m"), ("hf://team-b/m", "s3://bkt/m")),  # the source's org
    (("hf://org/m", "s3://team-a/m"), ("hf://org/m", "s3://team-b/m")),  # only DEST's bucket
    (("s3://src/m", f"s3://bkt/{LONG}x"), ("s3://src/m", f"s3://bkt/{LONG}y")),  # DEST, a long prefix
    ((f"s3://src/{LONG_NAME}1", "s3://bkt/m"), (f"s3://src/{LONG_NAME}2", "s3://bkt/m")),  # past 63 characters
    (("hf://org/m@v1", "s3://bkt/m"), ("hf://org/m@v2", "s3://bkt/m")),  # the revision
]


@pytest.mark.parametrize(("first", "second"), JOB_PAIRS)
def test_job_names_differ_whenever_source_or_dest_does(first: tuple[str, str], second: tuple[str, str]) -> None:
    jobs = [_job(*pair) for pair in (first, second)]
    for job, (source, dest) in zip(jobs, (first, second), strict=True):
        name = job["metadata"]["name"]
        assert keeps(DNS1123_LABEL, name) and name.startswith("streamctl-transfer-"), name
        # An Indexed Job's pods are NAME-INDEX: the API server wants the last one a DNS-1123 label (and,
        # before 1.27, an Indexed Job's name within 52 characters)
        assert keeps(DNS1123_LABEL, f"{name}-9999") and len(name) <= 52, name
        assert job["metadata"]["annotations"] == {"streamctl.io/source": source, "streamctl.io/dest": dest}
        assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == name
    assert jobs[0]["metadata"]["name"] != jobs[1]["metadata"]["name"]


def test_the_same_bucket_path_on_another_endpoint_or_account_is_another_name() -> None:
    """One bucket name is another bucket on another S3-compatible endpoint, one container name another
    container in another Azure account: the name tells them apart and the annotations say which."""
    names = set()
    for endpoint in (None, "http://minio-a:9000", "http://minio-b:9000"):
        (deployment, _service) = _serve_documents("s3://bkt/m", StorageOptions(endpoint_url=endpoint))
        annotations = deployment["metadata"]["annotations"]
        assert (
            annotations.get("streamctl.io/s3-endpoint") == endpoint
            and annotations["streamctl.io/source"] == "s3://bkt/m"
        )
        names.add(deployment["metadata"]["name"])
        job = _job("s3://src/m", "s3://bkt/m", **({"endpoint": endpoint} if endpoint else {}))
        assert job["metadata"]["annotations"].get("streamctl.io/s3-endpoint") == endpoint
        names.add(job["metadata"]["name"])
    for account in ("acct", "other"):
        (deployment, _service) = _serve_documents("az://models/m", StorageOptions(azure_account=account))
        source = f"https://{account}.blob.core.windows.net/models/m"
        assert deployment["metadata"]["annotations"] == {"streamctl.io/source": source}
        names.add(deployment["metadata"]["name"])
        job = _job("hf://org/m", "az://models/m", azure_account=account)
        assert job["metadata"]["annotations"]["streamctl.io/dest"] == source
        names.add(job["metadata"]["name"])
    assert len(names) == 10, names
    # The endpoint concerns s3:// only: a Hub-to-GCS Job is the same Job with or without it.
    assert _job("hf://org/m", "gs://bkt/m", endpoint="http://minio-a:9000") == _job("hf://org/m", "gs://bkt/m")


def test_a_revision_given_apart_is_part_of_the_jobs_name() -> None:
    pinned = _job("hf://org/m", "s3://bkt/m", revision="v1")
    assert pinned["metadata"]["annotations"]["streamctl.io/source"] == "hf://org/m@v1"
    assert pinned["metadata"]["name"] == _job("hf://org/m@v1", "s3://bkt/m")["metadata"]["name"]
    assert pinned["metadata"]["name"] != _job("hf://org/m", "s3://bkt/m")["metadata"]["name"]


def _as_kubernetes(document: dict[str, Any], model: str) -> Any:
    from kubernetes import client

    class _Response:
        def __init__(self, data: object) -> None:
            self.data = json.dumps(data)

    api = client.ApiClient()
    parsed = api.deserialize(_Response(document), model)
    assert api.sanitize_for_serialization(parsed) == document  # every field is one the schema knows
    return parsed


def test_the_printed_manifests_name_the_same_location_alike_on_every_run() -> None:
    """Two processes, the same name (kubectl apply is idempotent); parsed back, valid for the schema, and
    the annotation read back whole, quoted as YAML must."""
    model = "s3://team-a/llama 8b: v1 #2"  # ': ' and ' #' would end a plain YAML scalar
    runs = [run_cli(SERVE[0], model, *SERVE[1:], env=NO_ENDPOINT) for _ in range(2)]
    assert runs[0].exit_code == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout
    deployment, service = yaml.safe_load_all(runs[0].stdout)
    _as_kubernetes(deployment, "V1Deployment")
    _as_kubernetes(service, "V1Service")
    assert deployment["metadata"]["annotations"]["streamctl.io/source"] == model
    other = run_cli(SERVE[0], "s3://team-b/llama 8b: v1 #2", *SERVE[1:], env=NO_ENDPOINT)
    assert yaml.safe_load_all(other.stdout).__next__()["metadata"]["name"] != deployment["metadata"]["name"]
    jobs = [
        run_cli("transfer", "org/m", "s3://bkt/m", "--k8s-job", "--image", IMAGE, env=NO_ENDPOINT) for _ in range(2)
    ]
    assert jobs[0].exit_code == 0, jobs[0].stderr
    assert jobs[0].stdout == jobs[1].stdout
    job = _as_kubernetes(yaml.safe_load(jobs[0].stdout), "V1Job")
    assert job.metadata.annotations == {"streamctl.io/source": "hf://org/m", "streamctl.io/dest": "s3://bkt/m"}


# -- local locations -------------------------------------------------------------------------------------

LOCAL = ["model", "./x", "/abs/model", "file:///abs/model", "~/model"]


@pytest.mark.parametrize("local", LOCAL)
def test_serve_k8s_refuses_a_local_model(local: str) -> None:
    error = _error_document(run_cli(SERVE[0], local, *SERVE[1:], "--json", env=NO_ENDPOINT))
    assert error["code"] == "local-location"
    assert "MODEL" in error["message"] and "is a local path" in error["message"] and "bucket" in error["message"]
    plain = run_cli(SERVE[0], local, *SERVE[1:], env=NO_ENDPOINT)
    assert plain.exit_code == 2 and plain.stdout == ""
    assert len([line for line in plain.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.parametrize("local", LOCAL)
@pytest.mark.parametrize("role", ["SOURCE", "DEST"])
def test_transfer_k8s_job_refuses_a_local_source_or_dest(local: str, role: str) -> None:
    source, dest = (local, "s3://bkt/m") if role == "SOURCE" else ("hf://org/m", local)
    error = _error_document(run_cli("transfer", source, dest, "--k8s-job", "--image", IMAGE, "--json", env=NO_ENDPOINT))
    assert error["code"] == "local-location"
    assert f"{role} " in error["message"] and "is a local path" in error["message"]
    assert ("bucket" in error["message"]) and (role == "DEST" or "hf://" in error["message"])


def test_a_hub_source_and_buckets_are_not_local() -> None:
    for source in (
        "hf://org/m",
        "org/m",
        "s3://src/m",
        "gs://src/m",
        "az://models/m",
        "https://acct.blob.core.windows.net/models/m",
    ):
        result = run_cli("transfer", source, "gs://bkt/m", "--k8s-job", "--image", IMAGE, env=NO_ENDPOINT)
        assert result.exit_code == 0, (source, result.stderr)
