"""The copy engine: move a planned file's bytes from SOURCE to DEST, checked end to end.

How it moves bytes: every file is split into parts; parts are read with ranged reads and uploaded as
multipart parts by one pool of worker threads, so downloads overlap uploads and several files move at
once. A byte budget (`max_buffer`) is taken before a part is read and given back after it is uploaded,
so memory never grows with the model; each part is read into a reused buffer (parts.PartBuffers),
hashed and sent from it without a copy. Each file's sha256 is computed in flight, in part order, and
the upload is completed only when it matches the source's (the hub's LFS sha256, or the git blob sha1
of small files); otherwise it is aborted and the file retried once from scratch. A source that publishes
no sha256 (a local folder) is hashed before its upload starts when DEST is a bucket, which fixes metadata
then; into a local folder it is not: the digest computed in flight is stored at completion, and the source's
size and version are checked again first (a file that changed is refused). From a local folder into one,
a new upload's bytes never pass through this process: the kernel copies each part (copy_file_range, as cp
does; NFS 4.2 on the server) while one task reads the source in order beside it for the digests, so the
copy and the hash run side by side on two cores instead of one after the other.

Why it is resumable: nothing is visible under a final name until its upload completes, each object
stores its sha256 as metadata, and a re-run skips objects whose size and stored sha256 match. Inside a
file too: each upload is started under a resume token naming the plan's upload of it (object, size, part
size, source, commit, the source's version of the file), so the next run of the same plan reopens what a
killed run (kill -9, an evicted pod, a link lost past its retries) left and sends only the parts DEST
lacks. It still reads every byte of the source, to hash the whole file before completing and to check
each held part: a part is reused only when the MD5 of the source's bytes matches what DEST holds (see
storage.base.HeldPart); any other is sent again. Uploads of other plans are discarded, as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

from streamctl.common.sizes import MiB
from streamctl.dest.uploads import (
    SHA256_KEY,
    ByteBudget,
    Cancelled,
    CopiedFile,
    part_size_for,
    part_size_note,
)
from streamctl.errors import IntegrityError, RangeIgnoredError, RemoteError, StreamctlError
from streamctl.interrupts import Shielded
from streamctl.oserrors import from_os_error
from streamctl.progress import Progress
from streamctl.retry import with_retries
from streamctl.storage.base import HeldPart, KernelCopy, Location, MultipartUpload, ObjectInfo
from streamctl.transfer.hashing import GIT_SHA1_KEY, HASH_CHUNK, Digests, hash_object, mismatch
from streamctl.transfer.parts import PartBuffers, resume_token
from streamctl.transfer.plan import FilePlan, TransferOptions

# A kernel copy's step: progress and a stop signal are seen once per step.
KERNEL_COPY_CHUNK = 16 * MiB


class _ChecksumMismatch(Exception):
    pass


@dataclass
class _HashChain:
    """Feeds parts to a file's digests strictly in order, whatever order they arrive in."""

    digests: Digests
    next_index: int = 0
    failed: bool = False
    condition: threading.Condition = field(default_factory=threading.Condition)

    def feed(self, index: int, data: bytes | memoryview, cancelled: threading.Event) -> None:
        with self.condition:
            while self.next_index != index:
                if self.failed or cancelled.is_set():
                    raise Cancelled()
                self.condition.wait(0.2)
            self.digests.update(data)
            self.next_index += 1
            self.condition.notify_all()

    def fail(self) -> None:
        with self.condition:
            self.failed = True
            self.condition.notify_all()


@dataclass
class _OneStream:
    """A file read through one GET from its first byte, handed to its parts strictly in order: for a source
    that ignores Range (a CDN answering 200 with the whole file), where each part's own read would fetch
    the file again. Parts are submitted in order to a FIFO pool, so the part a waiting one needs is ahead."""

    chunks: Iterator[bytes]
    position: int = 0
    failed: bool = False
    pending: memoryview = field(default_factory=lambda: memoryview(b""))
    condition: threading.Condition = field(default_factory=threading.Condition)

    def read_into(self, start: int, view: memoryview, cancelled: threading.Event) -> int:
        with self.condition:
            while self.position != start:
                if self.failed or cancelled.is_set():
                    raise Cancelled()
                self.condition.wait(0.2)
            filled = 0
            try:
                while filled < len(view):
                    if not self.pending:
                        chunk = next(self.chunks, b"")
                        if not chunk:
                            break  # the file ended early: the caller reports it
                        self.pending = memoryview(chunk)
                    taken = min(len(self.pending), len(view) - filled)
                    view[filled : filled + taken] = self.pending[:taken]
                    self.pending, filled = self.pending[taken:], filled + taken
            except BaseException:
                self.failed = True
                raise
            finally:
                self.position += filled
                self.condition.notify_all()
            return filled

    def close(self) -> None:
        with self.condition:
            self.failed = True
            self.condition.notify_all()
        close = getattr(self.chunks, "close", None)
        if close is not None:
            close()


@dataclass
class Engine:
    source: Location
    dest: Location
    options: TransferOptions
    progress: Progress
    overall_task: int
    budget: ByteBudget
    parts: ThreadPoolExecutor
    cancelled: threading.Event = field(default_factory=threading.Event)
    open_uploads: dict[int, MultipartUpload] = field(default_factory=dict)  # by id(): uploads need not be hashable
    lock: threading.Lock = field(default_factory=threading.Lock)
    bytes_sent: int = 0
    buffers: PartBuffers = field(default_factory=PartBuffers)
    bytes_reused: int = 0  # parts an earlier run left at DEST that matched the source: not sent again
    origin: Mapping[str, object] = field(default_factory=dict)  # the plan's source and commit (resume tokens)
    shielded: Shielded | None = None  # runs the uploads' creation (see _copy_once)
    # Kernel copies in flight (local to local), at most one per core: each is CPU-bound in the kernel, and more
    # only contend for the page cache (4.8 GB on 2 cores: 5.0 s with two at a time, 5.9-7.5 s with -j 16).
    kernel_copies: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(os.cpu_count() or 1))

    def part_size(self, file: FilePlan) -> int:
        return part_size_for(file.size, self.options.part_size, self.dest.store)

    def resume_token(self, file: FilePlan) -> str:
        """The token of `file`'s upload (Store.start_multipart's `resume`): the same for every run that
        would upload the same source version of it the same way."""
        identity = {"key": self.dest.key(file.path), "size": file.size, "part_size": self.part_size(file)}
        return resume_token({**identity, **self.origin, "version": file.source_etag or file.sha256})

    def _retry(self, operation: Callable[[], object], what: str) -> object:
        def note(attempt: int, error: RemoteError) -> None:
            self.progress.log(f"retrying {what} (attempt {attempt + 1}): {error.message}")

        return with_retries(operation, self.options.retry, note, self.cancelled)

    def _read(self, path: str, start: int, length: int) -> bytes:
        key = self.source.key(path)
        data = self._retry(lambda: self.source.store.read_range(key, start, length), f"read of {path}")
        assert isinstance(data, bytes)
        if len(data) != length:
            raise IntegrityError(f"{self.source.store.url(key)}: source ended early (changed during the copy?)")
        return data

    def _read_into(self, path: str, start: int, buffer: memoryview) -> None:
        key = self.source.key(path)
        read = self._retry(lambda: self.source.store.read_range_into(key, start, buffer), f"read of {path}")
        if read != len(buffer):
            raise IntegrityError(f"{self.source.store.url(key)}: source ended early (changed during the copy?)")

    def _check_unchanged(self, file: FilePlan) -> None:
        """IntegrityError when the source file's size or version (a local file's mtime) is not the plan's any
        more: it changed while it was read, so the digest computed in flight may mix two versions."""
        key = self.source.key(file.path)
        info = self._retry(lambda: self.source.store.stat(key), f"stat of {file.path}")
        assert isinstance(info, ObjectInfo)
        if info.size != file.size or (None not in (file.source_etag, info.etag) and info.etag != file.source_etag):
            now = f"{info.size:,} bytes now" if info.size != file.size else "modified since"
            raise IntegrityError(
                f"{self.source.store.url(key)} changed during the copy ({file.size:,} bytes planned, {now}); "
                "nothing was committed",
                hint="re-run once nothing writes to the source",
            )

    def _sent(self, task: int, amount: int) -> None:
        with self.lock:
            self.bytes_sent += amount
        self.progress.advance(task, amount)
        self.progress.advance(self.overall_task, amount)

    def copy(self, file: FilePlan) -> CopiedFile:
        """Copy one file; a checksum mismatch is retried once from scratch, then fails with exit 5."""
        note = part_size_note(file.path, file.size, self.options.part_size, self.part_size(file), self.dest.store)
        if note:
            self.progress.log(note)
        for attempt in (1, 2):
            task = self.progress.task(file.path, file.size)
            try:
                sha256 = self._copy_once(file, task)
                return CopiedFile(file.path, file.size, sha256, "copied")
            except _ChecksumMismatch as mismatch:
                if attempt == 2:
                    raise IntegrityError(
                        f"{file.path}: checksum mismatch twice ({mismatch}); nothing was committed",
                        hint="the source served different bytes than it advertises; retry later or report it",
                    ) from None
                self.progress.log(f"{file.path}: checksum mismatch ({mismatch}); retrying once from scratch")
            finally:
                self.progress.done(task)
        raise AssertionError("unreachable")

    def _copy_once(self, file: FilePlan, task: int) -> str:
        store = self.dest.store
        part_size = self.part_size(file)
        if file.size <= part_size:
            return self._copy_small(file, task)
        sha256 = file.sha256
        if sha256 is None and not self.dest.metadata_at_completion():
            # A bucket fixes an object's metadata when its upload starts (S3: a late one costs a server-side
            # copy of the object), so the digest is known first; a local file takes it at completion.
            sha256 = hash_object(self.source, file.path, file.size, self.options.retry)
        metadata = {
            **({SHA256_KEY: sha256} if sha256 else {}),
            **({GIT_SHA1_KEY: file.git_sha1} if file.git_sha1 else {}),
        }
        key = self.dest.key(file.path)
        token = self.resume_token(file)

        def start_and_record() -> MultipartUpload:
            started = self._retry(
                lambda: store.start_multipart(key, part_size, metadata, None, token), f"upload of {file.path}"
            )
            upload = cast(MultipartUpload, started)
            with self.lock:
                self.open_uploads[id(upload)] = upload
            return upload

        # Shielded: a stop signal cuts worker threads' requests, and must not cut an upload's creation off from
        # its record (the upload would stay open, unknown to the clean-up that aborts the others).
        upload = self.shielded(start_and_record) if self.shielded is not None else start_and_record()
        held_parts = {part.index: part for part in upload.held_parts()}
        # Local to local, a fresh upload: the kernel copies, a reader hashes beside it (a resumed upload checks
        # each held part against the source's bytes, so it takes the parts' way).
        copier = upload.kernel_copier() if not held_parts else None
        open_file: Callable[[str], int] | None = getattr(self.source.store, "open_file", None)
        kept = False
        try:
            if copier is not None and open_file is not None:
                chain = self._copy_in_kernel(file, copier, open_file, part_size, task)
            else:
                chain = self._send_in_parts(file, upload, part_size, held_parts, task)
            problem = mismatch(chain.digests, sha256, file.git_sha1)
            if problem:
                raise _ChecksumMismatch(problem)
            if sha256 is None:  # hashed in flight only: the bytes read are the file's only if it held still
                self._check_unchanged(file)
            computed = chain.digests.sha256.hexdigest()
            self._retry(lambda: upload.complete({**metadata, SHA256_KEY: computed}), f"completion of {file.path}")
            return computed
        except BaseException as error:
            # A lost link or a stopped run leaves sound parts: the run decides whether they stay to resume.
            kept = isinstance(error, (Cancelled, RemoteError))
            if not kept:
                self._abort(upload)
            raise
        finally:
            if not kept:
                with self.lock:
                    self.open_uploads.pop(id(upload), None)

    def _send_in_parts(
        self, file: FilePlan, upload: MultipartUpload, part_size: int, held_parts: Mapping[int, HeldPart], task: int
    ) -> _HashChain:
        try:
            return self._send_parts(file, upload, part_size, held_parts, task, None)
        except RangeIgnoredError as ignored:
            stream = self._one_stream(file, ignored)
            try:  # every part again, from the one stream (parts sent already are simply replaced)
                return self._send_parts(file, upload, part_size, held_parts, task, stream)
            finally:
                stream.close()

    def _copy_in_kernel(
        self, file: FilePlan, copy: KernelCopy, open_file: Callable[[str], int], part_size: int, task: int
    ) -> _HashChain:
        """`file` copied inside the kernel by one task, in order (no buffer in between; parts of one file at
        once only contend for its inode's lock: 11% of the CPU spinning on it with -j 16), while another reads
        the source in order and hashes it: the copy does not wait for the hash, so the two run side by side on
        two cores. Returns once both have ended; the first failure is raised."""
        unknown = file.sha256 is None and self.dest.metadata_at_completion()
        chain = _HashChain(Digests(file.size, with_git_sha1=unknown and file.git_sha1 is not None))
        key = self.source.key(file.path)
        source_fd = open_file(key)
        futures: list[Future[None]] = []
        try:
            futures.append(self.parts.submit(self._hash_source, source_fd, key, chain))
            parts = [(start, min(part_size, file.size - start)) for start in range(0, file.size, part_size)]
            futures.append(self.parts.submit(self._copy_parts, copy, source_fd, key, parts, task, chain))
            for future in futures:
                future.result()
            return chain
        except BaseException:
            chain.fail()
            for future in futures:
                future.exception()  # wait: none may use the descriptor once it is closed
            raise
        finally:
            os.close(source_fd)

    def _hash_source(self, source_fd: int, key: str, chain: _HashChain) -> None:
        """The source's bytes, read in order from `source_fd` and fed to the file's digests."""
        buffer = bytearray(HASH_CHUNK)
        view = memoryview(buffer)
        size, offset = chain.digests.size, 0
        while offset < size:
            if self.cancelled.is_set() or chain.failed:
                raise Cancelled()
            try:
                count = os.preadv(source_fd, [view[: min(HASH_CHUNK, size - offset)]], offset)
            except OSError as error:
                raise from_os_error(error, self.source.store.url(key)) from None
            if not count:
                raise IntegrityError(f"{self.source.store.url(key)}: source ended early (changed during the copy?)")
            chain.digests.update(view[:count])
            offset += count

    def _copy_parts(
        self,
        copy: KernelCopy,
        source_fd: int,
        key: str,
        parts: list[tuple[int, int]],
        task: int,
        chain: _HashChain,
    ) -> None:
        """The parts (start, length) copied by the kernel in order, each in chunks, so that progress moves and a
        stop is seen within one, and a stopped copy leaves whole parts for the next run to keep."""
        for offset, length in parts:
            end = offset + length
            while offset < end:
                if self.cancelled.is_set() or chain.failed:
                    raise Cancelled()
                with self.kernel_copies:
                    count = copy(source_fd, offset, min(KERNEL_COPY_CHUNK, end - offset))
                if not count:
                    url = self.source.store.url(key)
                    raise IntegrityError(f"{url}: source ended early (changed during the copy?)")
                offset += count
                self._sent(task, count)

    def _send_parts(
        self,
        file: FilePlan,
        upload: MultipartUpload,
        part_size: int,
        held_parts: Mapping[int, HeldPart],
        task: int,
        stream: _OneStream | None,
    ) -> _HashChain:
        """Every part of `file` read (each on its own, or from `stream`), hashed in order and sent; on any
        failure, returns only once every part has given its budget back."""
        # The git blob sha1 checks a file only when no sha256 is known before the copy (hub files outside LFS).
        unknown = file.sha256 is None and self.dest.metadata_at_completion()
        chain = _HashChain(Digests(file.size, with_git_sha1=unknown and file.git_sha1 is not None))
        futures: list[Future[None]] = []
        try:
            for index, start in enumerate(range(0, file.size, part_size)):
                length = min(part_size, file.size - start)
                if self.cancelled.is_set():
                    raise Cancelled()
                held = self.budget.acquire(length, self.cancelled)
                at_dest = held_parts.get(index)
                future = self.parts.submit(
                    self._part, file, upload, chain, index, start, length, held, task, at_dest, stream
                )
                futures.append(future)
            for future in futures:
                future.result()
            return chain
        except BaseException:
            chain.fail()
            if stream is not None:
                stream.close()
            for future in futures:
                future.exception()  # wait: every part gives its budget back before we abort
            raise

    def _one_stream(self, file: FilePlan, ignored: RangeIgnoredError) -> _OneStream:
        """`file` read once, through one GET, when its source ignores Range and can stream (the Hub's
        iter_range); else the source's error stands."""
        iter_range = getattr(self.source.store, "iter_range", None)
        if iter_range is None:
            raise ignored
        self.progress.log(f"{file.path}: the source ignores byte ranges; reading the file in one stream")
        return _OneStream(iter_range(self.source.key(file.path), 0, file.size, chunk_size=MiB))

    def _part(
        self,
        file: FilePlan,
        upload: MultipartUpload,
        chain: _HashChain,
        index: int,
        start: int,
        length: int,
        held: int,
        task: int,
        at_dest: HeldPart | None = None,
        stream: _OneStream | None = None,
    ) -> None:
        try:
            if self.cancelled.is_set() or chain.failed:
                raise Cancelled()
            # Read, hash and send from one reused buffer: no copy of the part, no fresh pages per part.
            buffer = self.buffers.take(upload.part_size)  # the last part too: one size, reused
            try:
                view = memoryview(buffer)[:length]
                if stream is None:
                    self._read_into(file.path, start, view)
                elif stream.read_into(start, view, self.cancelled) != length:
                    raise IntegrityError(f"{file.path}: source ended early (changed during the copy?)")
                data = view.toreadonly()  # what the SDKs see (some take read-only buffers only)
                chain.feed(index, data, self.cancelled)
                if at_dest is not None and at_dest.matches(data):
                    self._reused(task, length)  # an earlier run sent these very bytes: read and hashed, not sent
                    return
                self._retry(lambda: upload.upload_part(index, data), f"part {index} of {file.path}")
            finally:
                self.buffers.give(buffer)
            self._sent(task, length)
        finally:
            self.budget.release(held)

    def _reused(self, task: int, amount: int) -> None:
        with self.lock:
            self.bytes_reused += amount
        self.progress.advance(task, amount)
        self.progress.advance(self.overall_task, amount)

    def _copy_small(self, file: FilePlan, task: int) -> str:
        held = self.budget.acquire(max(file.size, 1), self.cancelled)
        try:
            data = self._read(file.path, 0, file.size)
            digests = Digests(file.size)
            digests.update(data)
            problem = mismatch(digests, file.sha256, file.git_sha1)
            if problem:
                raise _ChecksumMismatch(problem)
            sha256 = digests.sha256.hexdigest()
            metadata = {SHA256_KEY: sha256, GIT_SHA1_KEY: digests.git_sha1.hexdigest()}
            key = self.dest.key(file.path)
            self._retry(lambda: self.dest.store.put(key, data, metadata), f"upload of {file.path}")
            self._sent(task, file.size)
            return sha256
        finally:
            self.budget.release(held)

    def _abort(self, upload: MultipartUpload) -> None:
        try:
            upload.abort()
        except StreamctlError as error:
            self.progress.log(f"could not abort the upload of {upload.key}: {error.message}")

    def abort_all(self) -> None:
        with self.lock:
            uploads = list(self.open_uploads.values())
            self.open_uploads.clear()
        for upload in uploads:
            self._abort(upload)

    def keep_for_resume(self) -> None:
        """Leave the open uploads' parts at DEST (a lost link, a lost lease): the next run of the same plan
        reopens them and sends only what they lack; any other run into DEST discards them."""
        with self.lock:
            uploads = list(self.open_uploads.values())
            self.open_uploads.clear()
        if uploads:
            shown = ", ".join(sorted(self.dest.relative(upload.key) for upload in uploads)[:5])
            self.progress.log(f"left {len(uploads)} unfinished upload(s) for the next run to resume: {shown}")
