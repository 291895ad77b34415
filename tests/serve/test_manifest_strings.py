"""Every string streamctl writes into a manifest reads back as that same string, under YAML 1.1
(PyYAML, kubectl's go-yaml) and through the Kubernetes client's models."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from streamctl.k8s import serve_manifests, to_yaml, to_yaml_documents

# Each is a number, date, bool, null, base-60 integer, merge key or value indicator to some YAML reader.
TRICKY = [
    "1:30",
    "190:20:30",
    "0x10",
    "0o17",
    "0b101",
    "017",
    "08",
    "09",
    "1e3",
    "1E3",
    "+1",
    "-1",
    "1_000",
    ".5",
    "5.",
    ".inf",
    "-.inf",
    "+.INF",
    ".nan",
    ".NaN",
    "2001-12-14",
    "2001-12-14t21:59:43.10-05:00",
    "2001-12-14 21:59:43",
    "yes",
    "Yes",
    "YES",
    "no",
    "NO",
    "on",
    "On",
    "off",
    "OFF",
    "y",
    "Y",
    "n",
    "N",
    "true",
    "True",
    "FALSE",
    "~",
    "null",
    "Null",
    "NULL",
    "",
    " ",
    "=",
    "<<",
    "-",
    "--",
    "?",
    "- x",
    "? x",
    ": x",
    "a: b",
    "a #b",
    "#x",
    "[x]",
    "{x}",
    "*anchor",
    "&anchor",
    "!tag",
    "|",
    ">",
    "%x",
    "@x",
    "`x",
    "'",
    '"',
    "a'b",
    'a"b',
    "\\",
    "a\\nb",
    "\n",
    "\t",
    "line\nbreak",
    "\x1b[2J",
    "\x00",
    "\x7f",
    "\x85",
    "\u2028",
    "\u202e",
    "\ufeff",
    "é",
    "日本",
    "🔥",
    "nvidia.com/gpu",
    "--load-format",
    "-tp",
    "/dev/shm",
    "1Gi",
    "8000",
    "0",
    "-0",
    "0.0",
    "1.0e+3",
    "inf",
    "nan",
]


def _round_trip(value: object) -> object:
    return yaml.safe_load(to_yaml(value))


@pytest.mark.parametrize("text", TRICKY, ids=repr)
def test_tricky_strings_read_back_as_strings(text: str) -> None:
    assert _round_trip({"value": text, text: "key"}) == {"value": text, text: "key"}
    assert _round_trip([text]) == [text]


@settings(max_examples=400, deadline=None)
@given(
    st.recursive(
        st.text(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=8,
    )
)
def test_any_text_reads_back(value: Any) -> None:
    document = {"root": value}
    assert _round_trip(document) == document


def test_non_string_scalars_keep_their_type() -> None:
    document = {"i": 3, "b": True, "n": None, "f": 0.25, "inf": float("inf"), "empty": {}, "list": []}
    assert _round_trip(document) == document


def test_manifest_strings_survive_the_kubernetes_models() -> None:
    from kubernetes import client

    env = {f"V{index}": text for index, text in enumerate(TRICKY)}
    args = ["vllm", "serve", "/m", "--served-model-name", *TRICKY]
    documents = serve_manifests(
        args,
        env,
        name="vllm-m",
        namespace="08",
        image="vllm/vllm-openai:v0.33.0",
        tensor_parallel_size=1,
        service_account="yes",
        accelerator="1:30",
        secret=None,
        startup_budget_s=600,
        memory_request_bytes=None,
        shm_bytes=2 * 1024**3,
    )
    loaded = list(yaml.safe_load_all(to_yaml_documents(documents)))
    assert loaded == documents  # PyYAML reads back exactly what was meant

    api = client.ApiClient()

    class _Response:
        def __init__(self, data: object) -> None:
            self.data = json.dumps(data)

    deployment = api.deserialize(_Response(loaded[0]), "V1Deployment")
    container = deployment.spec.template.spec.containers[0]
    assert container.args == args[1:]
    assert {item.name: item.value for item in container.env} == env
    assert deployment.metadata.namespace == "08"
    assert deployment.spec.template.spec.node_selector == {"cloud.google.com/gke-accelerator": "1:30"}
    assert deployment.spec.template.spec.service_account_name == "yes"


@pytest.mark.parametrize("length", [1000, 1024, 5000])
def test_long_keys_read_back(length: int) -> None:
    """YAML caps implicit keys at 1024 characters: longer ones need the explicit form."""
    document = {"k" * length: "v", "\x1b" * (length // 4): {"nested": ["x"]}, "e" * length: []}
    assert _round_trip(document) == document
