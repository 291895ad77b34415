"""Manifests checked against the Kubernetes Python client's models: a document read into its kind's model
and written back must be itself (an unknown or misplaced field is dropped by the models, a missing required
field or a value of the wrong type refused), and the kinds streamctl prints are all known here."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MODELS = {
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("batch/v1", "Job"): "V1Job",
}


class _Response:
    def __init__(self, data: object) -> None:
        self.data = json.dumps(data)


def check_with_models(document: Mapping[str, Any]) -> Any:
    """The client's model of `document`; AssertionError when the round trip loses or changes anything."""
    from kubernetes import client

    model = MODELS[(document["apiVersion"], document["kind"])]
    api = client.ApiClient()
    parsed = api.deserialize(_Response(document), model)
    assert api.sanitize_for_serialization(parsed) == document, model
    return parsed
