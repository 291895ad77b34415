"""Manifests of custom kinds checked against their CRD's published OpenAPI schema (tests/k8s/schemas/, with
where each came from), with `jsonschema`, strictly: an object whose schema lists `properties` takes no field
besides them (the API server's strict field validation, `kubectl apply --validate=strict`), unless the schema
says `x-kubernetes-preserve-unknown-fields`. Kubernetes' own extensions (`x-kubernetes-int-or-string`, ...)
are keywords jsonschema ignores; the `anyOf` next to them still applies."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

SCHEMAS = Path(__file__).resolve().parent / "k8s" / "schemas"
CRDS = {  # (apiVersion, kind) -> the CRD's file
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    ("serving.kserve.io/v1alpha2", "LLMInferenceService"): "serving.kserve.io_llminferenceservices.yaml",
}


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    """The strict openAPIV3Schema of `kind` at `api_version`, from its CRD kept under tests/k8s/schemas/."""
    crd = yaml.load((SCHEMAS / CRDS[(api_version, kind)]).read_text(), Loader=yaml.CSafeLoader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return _strict(served["schema"]["openAPIV3Schema"])


def schema_errors(document: Mapping[str, Any]) -> list[str]:
    """What the CRD's schema finds wrong in `document` ("path: message"), none when it is valid."""
    import jsonschema

    validator = jsonschema.Draft7Validator(crd_schema(document["apiVersion"], document["kind"]))
    return sorted(
        f"{'.'.join(str(part) for part in error.absolute_path)}: {error.message}"
        for error in validator.iter_errors(dict(document))
    )
