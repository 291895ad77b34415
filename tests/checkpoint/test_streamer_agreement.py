"""What the Run:ai streamer 0.17 reads, held against verify-index's findings.

The streamer itself is the judge (tests/vllm_oracle/stream_runai.py, in the vLLM venv): for every
safetensors dtype, a file is streamed and its verdict must match whether verify reports a
`streamer-*` finding. Empty part files are streamed at every memory-limit mode and concurrency.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpoints import TensorSpec, write_serving_files, write_tensor_file
from cli_helpers import run_cli
from oracle import requires_vllm_oracle, stream_runai_many
from servers import StorageServers
from streamctl.checkpoint.safetensors import DTYPE_BITS
from streamctl.checkpoint.streamer_compat import STREAMER_CODES, STREAMER_UNREADABLE_DTYPES
from streamctl.storage import open_location
from streamctl.verify.report import VerifyOptions, VerifyReport
from streamctl.verify.run import verify_checkpoint

SHAPES = ((8,), (2, 4), (0,))


def _checkpoint(folder: Path, specs: list[TensorSpec], *, extra_empty: bool = False) -> Path:
    location = open_location(str(folder))
    write_serving_files(location)
    write_tensor_file(location, "model.safetensors", specs)
    if extra_empty:
        write_tensor_file(location, "model-empty.safetensors", [], {"format": "pt"})
    return folder


def _streamer_findings(report: VerifyReport) -> list[tuple[str, str]]:
    return [(finding.severity, finding.code) for finding in report.findings if finding.code in STREAMER_CODES]


def test_the_unreadable_dtypes_are_the_ones_measured() -> None:
    assert {"F8_E4M3FNUZ", "F8_E5M2FNUZ", "F6_E2M3", "F6_E3M2"} == STREAMER_UNREADABLE_DTYPES


@pytest.mark.parametrize("dtype", ["F8_E4M3FNUZ", "F6_E2M3", "F4"])
def test_streamer_refusals_are_warnings_for_verify_and_errors_for_serve(tmp_path: Path, dtype: str) -> None:
    folder = _checkpoint(tmp_path / dtype, [TensorSpec("w", dtype, (8,))])
    code = "streamer-size-mismatch" if dtype == "F4" else "streamer-unsupported-dtype"
    plain = verify_checkpoint(open_location(str(folder)))
    assert plain.ok and _streamer_findings(plain) == [("warning", code)]
    strict = verify_checkpoint(open_location(str(folder)), VerifyOptions(for_streamer=True))
    assert not strict.ok and _streamer_findings(strict) == [("error", code)]

    verify = run_cli("verify-index", str(folder), "--json")
    assert verify.exit_code == 0, verify.stderr
    assert [finding["code"] for finding in verify.json()["findings"] if finding["code"] in STREAMER_CODES] == [code]
    serve = run_cli("serve", str(folder), "--dry-run")
    assert serve.exit_code == 1, serve.stdout + serve.stderr
    assert code in serve.stderr


def test_an_empty_part_is_a_warning_and_serve_accepts_it(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m", [TensorSpec("w", "F32", (4,))], extra_empty=True)
    report = verify_checkpoint(open_location(str(folder)), VerifyOptions(for_streamer=True))
    assert report.ok
    assert [(f.severity, f.code, f.file) for f in report.findings if f.code == "empty-shard"] == [
        ("warning", "empty-shard", "model-empty.safetensors")
    ]
    serve = run_cli("serve", str(folder), "--dry-run", "--memory-limit", "0")
    assert serve.exit_code == 0, serve.stderr


@requires_vllm_oracle
def test_streamer_verdict_per_dtype_matches_the_findings(tmp_path: Path) -> None:
    cases: list[tuple[str, tuple[int, ...], Path]] = []
    for dtype in DTYPE_BITS:
        for shape in SHAPES:
            spec = TensorSpec("w", dtype, shape)
            try:
                spec.nbytes
            except AssertionError:
                continue  # not whole bytes (F4 with an odd count): no valid file to write
            folder = _checkpoint(tmp_path / f"{dtype}-{'x'.join(map(str, shape))}", [spec])
            cases.append((dtype, shape, folder))
    verdicts = stream_runai_many([{"paths": [folder / "model.safetensors"]} for _, _, folder in cases])
    mismatches: list[str] = []
    for (dtype, shape, folder), verdict in zip(cases, verdicts, strict=True):
        report = verify_checkpoint(open_location(str(folder)), VerifyOptions(for_streamer=True))
        flagged = bool(_streamer_findings(report))
        if flagged == verdict["ok"]:
            mismatches.append(
                f"{dtype} {list(shape)}: streamer ok={verdict['ok']} ({verdict['error']}), flagged={flagged}"
            )
    assert not mismatches, "\n".join(mismatches)
    # The table is not vacuous: the streamer refused some, and read others.
    assert any(not verdict["ok"] for verdict in verdicts) and any(verdict["ok"] for verdict in verdicts)


@requires_vllm_oracle
def test_streamer_loads_empty_parts_in_every_memory_mode(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m", [TensorSpec("w", "F32", (4,)), TensorSpec("v", "BF16", (3,))])
    location = open_location(str(folder))
    write_tensor_file(location, "empty.safetensors", [])
    write_tensor_file(location, "metadata-only.safetensors", [], {"format": "pt"})
    orders = (
        ["empty.safetensors"],
        ["metadata-only.safetensors"],
        ["empty.safetensors", "model.safetensors", "metadata-only.safetensors"],
        ["model.safetensors", "empty.safetensors"],
    )
    envs: list[dict[str, str]] = [
        {},
        {"RUNAI_STREAMER_MEMORY_LIMIT": "0"},
        {"RUNAI_STREAMER_MEMORY_LIMIT": "-1"},
        {"RUNAI_STREAMER_MEMORY_LIMIT": "4096", "RUNAI_STREAMER_CONCURRENCY": "1"},
    ]
    jobs: list[dict[str, Any]] = [
        {"paths": [folder / name for name in order], "env": env} for env in envs for order in orders
    ]
    verdicts = stream_runai_many(jobs)
    failed = [
        json.dumps({"job": str(job), "error": verdict["error"]})
        for job, verdict in zip(jobs, verdicts, strict=False)
        if not verdict["ok"]
    ]
    assert not failed, "\n".join(failed)
    full = [verdict for job, verdict in zip(jobs, verdicts, strict=False) if len(job["paths"]) > 1]
    assert all(sorted(name for name, _, _ in verdict["tensors"]) == ["v", "w"] for verdict in full)
    report = verify_checkpoint(location, VerifyOptions(for_streamer=True))
    assert report.ok and {f.file for f in report.findings if f.code == "empty-shard"} == {
        "empty.safetensors",
        "metadata-only.safetensors",
    }


@requires_vllm_oracle
def test_streamer_loads_empty_parts_from_s3(s3_root: str, storage_servers: StorageServers) -> None:
    location = open_location(s3_root)
    write_tensor_file(location, "model.safetensors", [TensorSpec("w", "F32", (4,))])
    write_tensor_file(location, "empty.safetensors", [])
    write_tensor_file(location, "metadata-only.safetensors", [], {"format": "pt"})
    env = {
        "AWS_ENDPOINT_URL": storage_servers.s3().endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    names = ["empty.safetensors", "model.safetensors", "metadata-only.safetensors"]
    jobs: list[dict[str, Any]] = [
        {"paths": [f"{s3_root}/{name}" for name in names], "env": {**env, **limit}}
        for limit in ({}, {"RUNAI_STREAMER_MEMORY_LIMIT": "0"}, {"RUNAI_STREAMER_MEMORY_LIMIT": "-1"})
    ]
    verdicts = stream_runai_many(jobs)
    assert [(verdict["ok"], [name for name, _, _ in verdict["tensors"]]) for verdict in verdicts] == [
        (True, ["w"])
    ] * 3, verdicts
    report = verify_checkpoint(location, VerifyOptions(for_streamer=True))
    assert {(f.severity, f.file) for f in report.findings if f.code == "empty-shard"} == {
        ("warning", "empty.safetensors"),
        ("warning", "metadata-only.safetensors"),
    }
