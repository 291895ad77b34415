"""Reading a checkpoint for verification: one listing, whole small objects (index, config, manifest), and
every `.safetensors` header, `concurrency` at a time; tensor data is never read."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from streamctl.checkpoint.files import weights_elsewhere
from streamctl.checkpoint.safetensors import HeaderProblem, ParsedHeader, parse_header, read_header
from streamctl.errors import NotFoundError
from streamctl.progress import Progress
from streamctl.storage import deadlines
from streamctl.storage.base import Location, SmallObjectError, read_small_object
from streamctl.verify.report import Findings, VerifyOptions

# Headers this large are parsed one at a time, so parallel reads don't multiply the parser's memory.
_LARGE_HEADER_BYTES = 8_000_000


@dataclass(frozen=True)
class Listing:
    """One listing of the location, kept three ways."""

    sizes: Mapping[str, int]  # every object, by name relative to the location
    top_level: Mapping[str, int]  # objects directly in the location
    subfolders: Mapping[str, tuple[int, int]]  # first path segment -> (objects, bytes)


@dataclass(frozen=True)
class ShardHeader:
    """One `.safetensors` file after its header read."""

    name: str
    size: int
    header: ParsedHeader | None  # None when the read or the length checks failed
    read_problem: HeaderProblem | None
    requests: int
    bytes_read: int

    @property
    def complete(self) -> bool:
        """Whether `header.tensors` is every tensor in the file, so absences mean something."""
        return self.header is not None and self.header.complete

    @property
    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self.header.tensors] if self.header else []


@dataclass
class Reads:
    """Ranged reads and bytes read, summed across the threads that read (the listing is not counted)."""

    requests: int = 0
    bytes_read: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, requests: int, bytes_read: int) -> None:
        with self.lock:
            self.requests += requests
            self.bytes_read += bytes_read


def list_location(location: Location) -> Listing:
    """Every object under `location`; NotFoundError when there are none."""
    sizes: dict[str, int] = {}
    top_level: dict[str, int] = {}
    subfolders: dict[str, tuple[int, int]] = {}
    for info in location.list():
        name = location.relative(info.key)
        if not name:
            continue  # an object named as the prefix itself (`PREFIX/`, markers are not listed): no file of it
        sizes[name] = info.size
        folder, separator, _ = name.partition("/")
        if separator:
            objects, total = subfolders.get(folder, (0, 0))
            subfolders[folder] = (objects + 1, total + info.size)
        else:
            top_level[name] = info.size
    if not sizes:
        raise NotFoundError(
            f"nothing found under {location.url}",
            hint="check the URL (prefixes are case-sensitive) and that the checkpoint was uploaded there",
        )
    return Listing(sizes, top_level, subfolders)


def no_safetensors(location: Location, listing: Listing) -> NotFoundError:
    """The error for a location without top-level `.safetensors`, with a hint at sub-folders that hold some."""
    elsewhere = weights_elsewhere(listing.sizes)
    if elsewhere is not None:
        # vLLM's streamer loaders read safetensors alone: a sub-folder is a checkpoint of its own, a GGUF is not one.
        where = f"; verify {location.url.rstrip('/')}/{elsewhere.folders[0]}" if elsewhere.folders else ""
        hint = f"here: {elsewhere.describe()}{where} (vLLM's streamer loaders read top-level *.safetensors only)"
    else:
        hint = "vLLM needs model.safetensors or model-00001-of-0000N.safetensors files at the top of the prefix"
    return NotFoundError(f"no .safetensors files directly under {location.url}", hint=hint)


def read_small(
    location: Location, listing: Listing, name: str, limit: int, findings: Findings, reads: Reads, code: str
) -> bytes | None:
    """Read a whole small object (index, config) in one request; None (with a finding, `code` when it is
    over `limit`) when impossible."""
    try:
        data = read_small_object(location, name, listing.sizes[name], limit)
    except NotFoundError:
        reads.add(1, 0)
        findings.error("object-vanished", name, "listed, but gone when read")
        return None
    except SmallObjectError as error:
        if error.read is None:
            findings.error(code, name, f"{error.listed:,} bytes; refusing to read more than {limit:,}")
        else:
            reads.add(1, error.read)
            findings.error("object-changed", name, f"listed as {error.listed:,} bytes, but {error.read:,} were read")
        return None
    reads.add(1, len(data))
    return data


def _read_one_header(
    location: Location, name: str, size: int, speculative_bytes: int, large_header_lock: threading.Lock
) -> ShardHeader:
    read = read_header(location.store, location.key(name), size, speculative_bytes)
    if read.header_json is None:
        return ShardHeader(name, size, None, read.problem, read.requests, read.bytes_read)
    if len(read.header_json) > _LARGE_HEADER_BYTES:
        with large_header_lock:
            header = parse_header(read.header_json, size)
    else:
        header = parse_header(read.header_json, size)
    return ShardHeader(name, size, header, None, read.requests, read.bytes_read)


def read_headers(
    location: Location, listing: Listing, names: Sequence[str], options: VerifyOptions, progress: Progress
) -> list[ShardHeader]:
    """One header read per file, `options.concurrency` at a time; store errors propagate."""
    task = progress.task("Reading safetensors headers", len(names))
    large_header_lock = threading.Lock()
    executor = ThreadPoolExecutor(max_workers=min(options.concurrency, len(names)), thread_name_prefix="verify")
    try:
        futures: list[Future[ShardHeader]] = [
            executor.submit(
                _read_one_header, location, name, listing.top_level[name], options.speculative_bytes, large_header_lock
            )
            for name in names
        ]
        for future in futures:
            future.add_done_callback(lambda _: progress.advance(task, 1))
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            error = future.exception()
            if error is not None:
                raise error
        return [future.result() for future in futures]
    except BaseException:
        deadlines.cut_all()  # reads in flight end now, not at their deadlines (a silent server, Ctrl-C)
        raise
    finally:
        # On an error (or Ctrl-C) drop the reads that have not started instead of waiting for them.
        executor.shutdown(wait=True, cancel_futures=True)
        progress.done(task)
