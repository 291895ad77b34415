"""moto and gcp-storage-emulator as tests/servers.py runs them, given two behaviours the real services have.

Run as `python tests/patched_servers.py moto ARGS...` (ARGS as for `python -m moto.server`) or
`python tests/patched_servers.py gcs ARGS...` (as for `python -m gcp_storage_emulator`). Nothing else changes.

1. moto 5.x answers ListMultipartUploads with one fixed `Initiated` time (2010-11-10T20:48:33Z) for every
   upload. Real S3 returns "Initiated: Date and time at which the multipart upload was initiated"
   (ListMultipartUploads API reference). Patched: each upload records the time it was created, and the listing
   reports it. streamctl uses it to leave alone uploads a live writer started.
2. gcp-storage-emulator ignores `ifGenerationMatch`. Real GCS: "Makes the operation conditional on whether the
   object's current generation matches the given value. Setting to 0 makes the operation succeed only if there
   are no live versions of the object", answering 412 Precondition Failed otherwise (JSON API, objects.insert /
   objects.delete / objects.get parameters). Patched for uploads (media, multipart, and the start of a resumable
   upload), media downloads, metadata reads and deletes.
3. gcp-storage-emulator serves one connection at a time and waits for a request forever; a test that stops a
   client (SIGSTOP) halfway through a request would stop the server with it. Real front ends close an idle
   connection: patched, it gives up after IDLE_CONNECTION_SECONDS.

Azurite 3.35 needs no patch: it honours If-None-Match: * (409 BlobAlreadyExists) and If-Match (412
ConditionNotMet) on Put Blob and Delete Blob, and lists uncommitted blobs with their creation time.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

IDLE_CONNECTION_SECONDS = 10
_MOTO_FIXED_INITIATED = '"Initiated": "2010-11-10T20:48:33.000Z"'


def patch_moto() -> None:
    from moto.s3 import models, responses

    original_init = models.FakeMultipart.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        now = datetime.now(UTC)
        self.streamctl_initiated = now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"

    models.FakeMultipart.__init__ = init
    source = textwrap.dedent(inspect.getsource(responses.S3Response.list_multipart_uploads))
    if _MOTO_FIXED_INITIATED not in source:
        raise RuntimeError("moto's list_multipart_uploads changed; update tests/patched_servers.py")
    source = source.replace(_MOTO_FIXED_INITIATED, '"Initiated": upload.streamctl_initiated')
    namespace: dict[str, Any] = {}
    exec(compile(source, responses.__file__, "exec"), vars(responses), namespace)
    responses.S3Response.list_multipart_uploads = namespace["list_multipart_uploads"]


def _precondition_failed(response: Any) -> None:
    response.status = HTTPStatus.PRECONDITION_FAILED
    message = "At least one of the pre-conditions you specified did not hold."
    response.json(
        {"error": {"code": 412, "message": message, "errors": [{"reason": "conditionNotMet", "message": message}]}}
    )


def patch_gcs() -> None:
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def generation_differs(request: Any, storage: Any, bucket: str, name: str | None) -> bool:
        wanted = (request.query.get("ifGenerationMatch") or [None])[0]
        if wanted is None or name is None:
            return False
        try:
            current = str(storage.get_file_obj(bucket, name)["generation"])
        except NotFound:
            current = "0"
        return str(wanted) != current

    def upload_name(request: Any) -> str | None:
        if "name" in request.query:
            return request.query["name"][0]
        data = request.data if isinstance(request.data, dict) else {}
        return (data.get("meta") or {}).get("name") or data.get("name")

    def guarded(handler: Any, name_of: Any) -> Any:
        def wrapper(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            if "upload_id" not in request.query and generation_differs(
                request, storage, request.params["bucket_name"], name_of(request)
            ):
                return _precondition_failed(response)
            return handler(request, response, storage, *args, **kwargs)

        return wrapper

    objects.insert = guarded(objects.insert, upload_name)
    by_path = lambda request: request.params.get("object_id")  # noqa: E731
    objects.download = guarded(objects.download, by_path)
    objects.get = guarded(objects.get, by_path)
    objects.delete = guarded(objects.delete, by_path)

    from gcp_storage_emulator import server  # only now: it builds its handler table from `objects` on import

    server.RequestHandler.timeout = IDLE_CONNECTION_SECONDS


def main() -> None:
    which, arguments = sys.argv[1], sys.argv[2:]
    if which == "moto":
        patch_moto()
        from moto.server import main as moto_main

        moto_main(arguments)
    elif which == "gcs":
        patch_gcs()  # before the server module builds its handler table from these functions
        from gcp_storage_emulator.__main__ import main as gcs_main

        gcs_main(arguments)
    else:
        raise SystemExit(f"unknown server {which!r}")


if __name__ == "__main__":
    main()
