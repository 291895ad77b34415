"""streamctl used as a library leaves its caller's process alone: logging and urllib3 as the caller set them.

The CLI silences the SDK loggers (app.main, streamctl.sdklogging), and the overall request deadline
(storage/deadlines.py) times streamctl's own clients through their own urllib3 pool classes; neither is done to
a program that calls `run_transfer`. Each check runs in a fresh Python, as a program that imports streamctl would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

# The caller: its own handler and DEBUG levels on the SDK loggers, then two transfers (local folder -> local
# folder, local folder -> S3) and one read back (S3 -> local folder) through run_transfer, as streamctl's
# transfer command calls it. It prints what it saw before and after, as JSON.
CALLER = textwrap.dedent(
    """
    import json, logging, sys
    import boto3, s3transfer  # imported before "before": each adds its NullHandler as it is imported
    import botocore.awsrequest
    import urllib3
    import urllib3.connectionpool as connectionpool
    import urllib3.poolmanager as poolmanager

    NAMES = ("botocore", "boto3", "s3transfer", "urllib3", "azure", "google", "httpx", "huggingface_hub")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.name)

    handler = Keep(logging.DEBUG)
    for name in NAMES:
        logging.getLogger(name).setLevel(logging.DEBUG)
        logging.getLogger(name).addHandler(handler)

    POOLS = (connectionpool.HTTPConnectionPool, connectionpool.HTTPSConnectionPool,
             botocore.awsrequest.AWSHTTPConnectionPool, botocore.awsrequest.AWSHTTPSConnectionPool)

    def state():
        loggers = {name: [logging.getLogger(name).level, [id(h) for h in logging.getLogger(name).handlers],
                          logging.getLogger(name).disabled, logging.getLogger(name).propagate] for name in NAMES}
        root = logging.getLogger()
        pools = {cls.__name__: [id(cls.__dict__.get(attr)) for attr in ("_make_request", "_put_conn", "urlopen")]
                 + [id(getattr(cls, "_make_request")), id(getattr(cls, "_put_conn"))] for cls in POOLS}
        return {
            "loggers": loggers,
            "root": [root.level, [id(h) for h in root.handlers]],
            "disable": logging.root.manager.disable,
            "pools": pools,
            "pool_classes_by_scheme": {k: id(v) for k, v in poolmanager.pool_classes_by_scheme.items()},
            "module_pools": [id(urllib3.HTTPConnectionPool), id(urllib3.HTTPSConnectionPool),
                             id(connectionpool.HTTPConnectionPool), id(poolmanager.HTTPConnectionPool)],
        }

    before = state()
    from streamctl.storage import StorageOptions
    from streamctl.transfer import TransferOptions, TransferRun, run_transfer

    source, local_dest, s3_dest, back = sys.argv[1:5]
    runs = [run_transfer(s, d, TransferOptions(), StorageOptions())
            for s, d in ((source, local_dest), (source, s3_dest), (s3_dest, back))]
    after = state()
    own_pool = type(urllib3.PoolManager().connection_from_url("http://127.0.0.1:9/"))
    print(json.dumps({
        "before": before, "after": after, "runs": [isinstance(run, TransferRun) for run in runs],
        "records": sorted(set(records)), "own_pool": own_pool is connectionpool.HTTPConnectionPool,
    }))
    """
)


def _checkpoint(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    save_file(
        {"model.embed_tokens.weight": np.arange(64, dtype=np.float32).reshape(8, 8)}, folder / "model.safetensors"
    )
    return folder


def test_run_transfer_leaves_the_callers_logging_and_urllib3_alone(
    tmp_path: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    source = _checkpoint(tmp_path / "source")
    arguments = [str(source), str(tmp_path / "copy"), f"{s3_root}/model", str(tmp_path / "back")]
    completed = subprocess.run(
        [sys.executable, "-c", CALLER, *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, **storage_env},
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    seen = json.loads(completed.stdout.splitlines()[-1])
    assert seen["runs"] == [True, True, True]
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    for part in ("loggers", "root", "disable", "pools", "pool_classes_by_scheme", "module_pools"):
        assert seen["after"][part] == seen["before"][part], part
    # The caller's loggers kept speaking to the caller's handler through streamctl's S3 requests...
    assert {"botocore.endpoint", "urllib3.connectionpool"} <= set(seen["records"]), seen["records"]
    assert seen["own_pool"]  # ...and its own urllib3 pools are urllib3's, not streamctl's timed ones


def test_streamctls_own_s3_client_has_timed_pools(s3_root: str, storage_env: dict[str, str]) -> None:
    import urllib3.connectionpool

    from streamctl.storage import open_location
    from streamctl.storage.deadlines import _TimedPool

    store: object = open_location(s3_root).store
    session = store._client._endpoint.http_session  # type: ignore[attr-defined]
    classes = session._pool_classes_by_scheme
    assert set(classes) == {"http", "https"}
    assert all(issubclass(cls, _TimedPool) for cls in classes.values()), classes
    assert session._manager.pool_classes_by_scheme is classes  # the pools it makes, and its proxy managers'
    assert not issubclass(urllib3.connectionpool.HTTPConnectionPool, _TimedPool)


def test_a_timed_requests_adapter_times_its_own_pools_only() -> None:
    import requests.adapters
    import urllib3.poolmanager

    from streamctl.storage import deadlines

    default_table = dict(urllib3.poolmanager.pool_classes_by_scheme)
    adapter = deadlines.timed_adapter(requests.adapters.HTTPAdapter)(pool_connections=2, pool_maxsize=4)
    assert isinstance(adapter, requests.adapters.HTTPAdapter)
    assert deadlines.timed_adapter(requests.adapters.HTTPAdapter) is type(adapter)  # one subclass per base
    proxied = adapter.proxy_manager_for("http://127.0.0.1:9")
    for manager in (adapter.poolmanager, proxied):
        assert all(issubclass(cls, deadlines._TimedPool) for cls in manager.pool_classes_by_scheme.values())
        pool = manager.connection_from_url("http://127.0.0.1:9/")
        assert isinstance(pool, urllib3.connectionpool.HTTPConnectionPool)
        assert isinstance(pool, deadlines._TimedPool)
    assert urllib3.poolmanager.pool_classes_by_scheme == default_table  # urllib3's own table is untouched
    plain = requests.adapters.HTTPAdapter()
    assert type(plain.poolmanager.connection_from_url("http://127.0.0.1:9/")) is urllib3.HTTPConnectionPool


@pytest.mark.parametrize("debug", [False, True])
def test_the_cli_still_manages_the_sdk_loggers(tmp_path: Path, debug: bool) -> None:
    """`streamctl` (app.main) silences the SDK loggers, or with --debug opens them; the library did neither."""
    source = _checkpoint(tmp_path / "source")
    script = textwrap.dedent(
        f"""
        import logging, sys
        sys.argv = ["streamctl", *{["--debug"] if debug else []!r}, "transfer", "--quiet", sys.argv[1], sys.argv[2]]
        from streamctl import app
        try:
            app.main()
        except SystemExit as exit_:
            print("exit", exit_.code, logging.getLogger("botocore").level, logging.getLogger("urllib3").level)
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script, str(source), str(tmp_path / "copy")], capture_output=True, text=True, timeout=120
    )
    _, code, *levels = completed.stdout.splitlines()[-1].split()  # after the DEST `--quiet` prints
    assert code == "0", completed.stderr
    assert levels == ([str(10)] * 2 if debug else [str(50 + 1)] * 2)


def test_streamctls_own_gcs_session_and_its_token_refreshes_have_timed_pools(
    gs_root: str, storage_env: dict[str, str]
) -> None:
    from streamctl.storage import open_location
    from streamctl.storage.deadlines import _TimedAdapter

    store: object = open_location(gs_root).store
    session = store._client._http  # type: ignore[attr-defined]
    assert all(isinstance(session.adapters[prefix], _TimedAdapter) for prefix in ("http://", "https://"))
    assert isinstance(session._auth_request_session.adapters["https://"], _TimedAdapter)
