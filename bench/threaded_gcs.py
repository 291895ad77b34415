"""gcp-storage-emulator, patched to serve connections in parallel, for throughput benchmarks.

Run it like the emulator: `python bench/threaded_gcs.py start --host 127.0.0.1 --port PORT --in-memory`.

Stock gcp-storage-emulator serves with `http.server.HTTPServer`: ONE request at a time. Behind a simulated
link that caps each connection (bench/netsim.py), that makes the whole store as fast as one connection, so
any parallel uploader looks no faster than a sequential one, unlike real GCS. The patch:

- connections are accepted and served on threads (`ThreadingHTTPServer`);
- each request's body is read in full on its own thread, outside any lock (this is the slow, link-bound part);
- the emulator's handler then runs under one global lock (its storage is not thread-safe), writing its
  response into memory; the response is sent after the lock is released.

So request bodies and response bodies move in parallel while the storage logic stays serialized, as it was.

`compose` is replaced too. Stock, it joins its sources with `dest += source` in a loop, which copies
quadratically (32 parts of 16 MiB: ~8.4 GiB copied), and it computes an MD5 of the result. Real GCS composes
server-side without either, and composite objects carry a CRC32C but no MD5, so on this 2-core machine both
costs would be charged to any client that composes (streamctl's gs:// uploads do). The replacement joins the
sources once and sets the CRC32C only (etag: derived from it), as GCS does. Same routes, storage and answers
otherwise. (Uploads keep the emulator's own costs: an MD5 and a CRC32C of every uploaded object, and a
quadratic append for resumable uploads sent in several chunks, which is what `upload_from_filename` does.)
"""

from __future__ import annotations

import io
import sys
import threading
from http.server import ThreadingHTTPServer
from typing import Any

GLOBAL_LOCK = threading.Lock()


def _read_body(handler: Any) -> None:
    """Replace handler.rfile by the request's body, read in full (Content-Length or chunked)."""
    length = handler.headers.get("Content-Length")
    if length:
        handler.rfile = io.BytesIO(handler.rfile.read(int(length)))
        return
    if (handler.headers.get("Transfer-Encoding") or "").lower() == "chunked":
        pieces: list[bytes] = []
        while True:
            size = int(handler.rfile.readline().strip() or b"0", 16)
            if size == 0:
                handler.rfile.readline()
                break
            pieces.append(handler.rfile.read(size))
            handler.rfile.readline()
        body = b"".join(pieces)
        del handler.headers["Transfer-Encoding"]
        handler.headers["Content-Length"] = str(len(body))
        handler.rfile = io.BytesIO(body)


def linear_compose(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    """gcp_storage_emulator.handlers.objects.compose, with the sources joined once instead of `+=` in a loop,
    and a CRC32C but no MD5 for the result (GCS composite objects have none)."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import Conflict, NotFound
    from gcp_storage_emulator.handlers import objects

    content_type = None
    sources: list[bytes] = []
    try:
        dest_properties = request.data["destination"]
        for src_obj in request.data["sourceObjects"]:
            if content_type is None:
                temp = storage.get_file_obj(request.params["bucket_name"], src_obj["name"])
                content_type = temp["contentType"]
            sources.append(storage.get_file(request.params["bucket_name"], src_obj["name"]))
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    dest_file = b"".join(sources)
    del sources
    dest_obj = objects._make_object_resource(
        request.base_url,
        request.params["bucket_name"],
        request.params["object_id"],
        content_type,
        len(dest_file),
        dest_properties,
    )
    try:
        dest_obj["crc32c"] = objects._crc32c(dest_file)
        dest_obj["etag"] = "c" + dest_obj["crc32c"]
        storage.create_file(request.params["bucket_name"], request.params["object_id"], dest_file, dest_obj)
        response.json(dest_obj)
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
    except Conflict as err:
        objects._handle_conflict(response, err)


def install_patches() -> None:
    from gcp_storage_emulator import server as emulator
    from gcp_storage_emulator.handlers import objects

    for _, methods in emulator.HANDLERS:
        for method, handler in list(methods.items()):
            if handler is objects.compose:
                methods[method] = linear_compose

    def run(self: Any) -> None:
        def handler(*args: Any, **kwargs: Any) -> Any:
            return emulator.RequestHandler(self._storage, *args, **kwargs)

        httpd = ThreadingHTTPServer((self._host, self._port), handler)
        httpd.daemon_threads = True
        self._httpd = httpd
        self.is_running.set()
        httpd.serve_forever()

    emulator.APIThread.run = run  # type: ignore[method-assign]

    for name in ("do_GET", "do_POST", "do_PUT", "do_DELETE", "do_PATCH"):
        original = getattr(emulator.RequestHandler, name)

        def handle(self: Any, _original: Any = original) -> None:
            _read_body(self)
            socket_file, self.wfile = self.wfile, io.BytesIO()
            try:
                with GLOBAL_LOCK:
                    _original(self)
            finally:
                response, self.wfile = self.wfile.getvalue(), socket_file
                self.wfile.write(response)

        setattr(emulator.RequestHandler, name, handle)


def main(argv: list[str]) -> None:
    install_patches()
    from gcp_storage_emulator.__main__ import main as emulator_main

    sys.exit(emulator_main(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
