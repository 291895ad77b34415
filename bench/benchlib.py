"""Shared helpers for the benchmark scripts in bench/ (not a test module, not part of the package).

- Servers: the test servers from tests/servers.py (moto S3, GCS emulator), reused as they are by putting
  tests/ on sys.path, plus `start_sparse_s3` (moto with the bench/sparse_moto.py patches); `start_server`
  starts one on 127.0.0.1 or inside a netsim.KernelLink's network namespace.
- Environment: `isolated_env()`, the variables tests/conftest.py sets for its servers and fake hub, so
  SDKs never read a developer's real cloud or Hugging Face settings and never leave 127.0.0.1.
- Measuring a child process: `run_measured()` runs a command, polls a scratch folder's disk usage, and
  reads the child's own peak RSS from `os.wait4` (so the benchmark process's memory is never counted);
  `tree_rss=True` also samples the peak RSS of each process under it (a worker subprocess's own peak).
- Output: `Table` prints aligned tables; `Targets.check()` a PASS/FAIL line, and `Targets.exit_status()`
  the exit status of the run (1 when any target was missed).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TESTS_DIR = REPO_ROOT / "tests"
for _folder in (BENCH_DIR, TESTS_DIR):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import servers  # noqa: E402  (tests/servers.py)

MB = 1_000_000
MiB = 1024 * 1024
GiB = 1024 * MiB
STREAMCTL = [sys.executable, "-m", "streamctl"]

# The same values tests/conftest.py sets for a test session (kept in step by hand: conftest.py cannot be
# imported outside pytest, it starts a fake hub at import).
STATIC_STORAGE_ENV: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    "AWS_EC2_METADATA_DISABLED": "true",
    "GOOGLE_CLOUD_PROJECT": servers.GCS_PROJECT,
    "NO_GCE_CHECK": "true",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_XET": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
CLEARED_ENV: tuple[str, ...] = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE",
    "HF_HUB_ENABLE_HF_TRANSFER", "HF_ENDPOINT", "HF_HOME", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
    "http_proxy", "https_proxy", "all_proxy",
)  # fmt: skip


def isolated_env(scratch: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Set (in os.environ, for this process and its children) the isolated settings; returns them.

    `scratch` gets empty AWS config files. Call before importing boto3 / huggingface_hub.
    """
    for name in CLEARED_ENV:
        os.environ.pop(name, None)
    aws = scratch / "aws-config"
    aws.mkdir(parents=True, exist_ok=True)
    values = {
        **STATIC_STORAGE_ENV,
        "AWS_CONFIG_FILE": str(aws / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(aws / "credentials"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        **(extra or {}),
    }
    os.environ.update(values)
    return values


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder removed afterwards, whatever happens (Ctrl-C included)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------- servers


def start_sparse_s3(workdir: Path) -> servers.S3Server:
    """moto's S3 server with bench/sparse_moto.py's patches (sparse objects, ranged GETs that read a range)."""
    sparse = workdir / "sparse"
    sparse.mkdir(parents=True, exist_ok=True)
    server = servers.start_process(
        "moto-s3-sparse",
        lambda port: [sys.executable, str(BENCH_DIR / "sparse_moto.py"), "-H", "127.0.0.1", "-p", str(port)],
        "/moto-api/",
        workdir,
        env={"INITIAL_NO_AUTH_ACTION_COUNT": "inf", "BENCH_SPARSE_DIR": str(sparse), "TMPDIR": str(sparse)},
    )
    return servers.S3Server(server)


@dataclass
class NetnsServerProcess(servers.ServerProcess):
    """A server inside a KernelLink's network namespace, reached at `host` (the link's unshaped address)."""

    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def start_server(name: str, argv_for: Callable[[str, int], list[str]], ready_path: str, workdir: Path,
                 env: dict[str, str] | None = None, link: Any = None) -> servers.ServerProcess:  # fmt: skip
    """tests/servers.py's start_process on 127.0.0.1, or, given a netsim.KernelLink, inside its namespace.

    `argv_for(host, port)` is the server's command line. In the namespace the server listens on 0.0.0.0 at the
    link's fixed port (a fresh namespace has nothing else listening) and is polled through the direct veth.
    """
    if link is None:
        return servers.start_process(name, lambda port: argv_for("127.0.0.1", port), ready_path, workdir, env)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}-netns.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            link.wrap(argv_for("0.0.0.0", link.server_port)), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=workdir, env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
    server = NetnsServerProcess(name, link.server_port, process, log_path, host=link.direct_address)
    deadline = time.monotonic() + servers.STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if servers._answers_http(server.base_url + ready_path):
            return server
        time.sleep(0.1)
    server.stop()
    raise servers.ServerUnavailable(f"{name} did not start in {link.netns}; log tail:\n{server.log_tail()}")


def start_threaded_gcs(workdir: Path, link: Any = None) -> servers.GCSServer:
    """gcp-storage-emulator with bench/threaded_gcs.py's patch (parallel connections; storage still serialized)."""
    server = start_server(
        "gcs-emulator-threaded",
        lambda host, port: [
            sys.executable,
            str(BENCH_DIR / "threaded_gcs.py"),
            "start",
            "--host",
            host,
            "--port",
            str(port),
            "--in-memory",
        ],
        "/",
        workdir,
        link=link,
    )
    return servers.GCSServer(server)


def start_s3(workdir: Path, link: Any = None) -> servers.S3Server:
    """moto's S3 server as tests/servers.py starts it (its patches included), on 127.0.0.1 or behind `link`."""
    server = start_server(
        "moto-s3",
        lambda host, port: [sys.executable, str(servers.PATCHED_SERVERS), "moto", "-H", host, "-p", str(port)],
        "/moto-api/",
        workdir,
        env={"INITIAL_NO_AUTH_ACTION_COUNT": "inf"},
        link=link,
    )
    return servers.S3Server(server)


def count_log_requests(server: servers.ServerProcess) -> int:
    """Requests the server has logged so far (werkzeug writes one access-log line per request)."""
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if '" ' in line and "HTTP/1." in line)


# --------------------------------------------------------------------------------------------- measuring


def disk_usage(path: Path) -> int:
    """Bytes of disk the files under `path` occupy (allocated blocks, so sparse files count what they use)."""
    total = 0
    stack = [path]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue
    return total


# A minimal Python process that forks, execs the command, and writes the command's rusage as JSON. Needed
# because ru_maxrss survives exec: a child forked straight from this benchmark (which may hold gigabytes,
# e.g. the fake hub's files) would report this benchmark's RSS as its own peak. The launcher is ~10 MB.
_RUSAGE_LAUNCHER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    json.dump({"maxrss_kib": usage.ru_maxrss, "user_s": usage.ru_utime, "sys_s": usage.ru_stime}, out)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@dataclass(frozen=True)
class ProcessPeak:
    pid: int
    argv: tuple[str, ...]
    peak_rss: int  # bytes: the process's VmHWM at the last sample before it ended


@dataclass(frozen=True)
class ChildRun:
    returncode: int
    seconds: float
    peak_rss: int  # bytes, the child's own high-water mark (from wait4)
    peak_disk: int  # bytes, largest growth of the watched folder while it ran
    cpu_s: float  # user + system CPU seconds of the child
    stdout: str
    stderr: str
    descendants: tuple[ProcessPeak, ...] = ()  # with tree_rss=True: the command and every process under it


def descendant_pids(root: int) -> list[int]:
    """`root`'s descendants now (children, their children, ...), from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, pending = [], list(children.get(root, []))
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def process_peak(pid: int) -> ProcessPeak | None:
    """A process's VmHWM and command line now; None once it is gone."""
    try:
        argv = tuple(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return ProcessPeak(pid, argv, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return None


def run_measured(
    argv: Sequence[str], *, env: dict[str, str], watch: Path, poll_s: float = 0.1, tree_rss: bool = False
) -> ChildRun:
    """Run `argv`; measure wall time, peak RSS of the child and peak disk growth of `watch`.

    Peak RSS comes from `os.wait4` on the child itself (Linux reports ru_maxrss in KiB), taken by a small
    launcher process (see _RUSAGE_LAUNCHER) so that neither this process's memory nor any server's is
    counted; it covers the child's own children only if the child waited for them. Disk is the size of
    `watch` (allocated blocks), polled every `poll_s`: point the child's HOME, caches and TMPDIR inside it.
    (The file system's free space is no measure on a shared machine: other processes write to it too.)
    `tree_rss`: also sample, every `poll_s`, the VmHWM of each process under the launcher (a worker the child
    starts has its own peak, which wait4 folds into the child's); a process's last sample stands for its peak.
    """
    watch.mkdir(parents=True, exist_ok=True)
    disk_before = disk_usage(watch)
    peaks = {"disk": 0}
    tree: dict[int, ProcessPeak] = {}
    launcher: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.wait(poll_s):
            peaks["disk"] = max(peaks["disk"], disk_usage(watch) - disk_before)
            for pid in descendant_pids(launcher[0]) if tree_rss and launcher else ():
                sample = process_peak(pid)
                if sample is not None and sample.argv:
                    tree[pid] = sample

    side = watch.parent / f".{watch.name}"
    out_path, err_path, usage_path = (side.with_suffix(suffix) for suffix in (".stdout", ".stderr", ".rusage"))
    poller = threading.Thread(target=poll, daemon=True)
    started = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-c", _RUSAGE_LAUNCHER, str(usage_path), *argv],
            env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        launcher.append(process.pid)
        poller.start()
        try:
            returncode = process.wait()
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher and the command under it
            process.wait()
            raise
        finally:
            done.set()
            poller.join()
    seconds = time.monotonic() - started
    peaks["disk"] = max(peaks["disk"], disk_usage(watch) - disk_before)
    usage = json.loads(usage_path.read_text()) if usage_path.exists() else {"maxrss_kib": 0, "user_s": 0, "sys_s": 0}
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    for path in (out_path, err_path, usage_path):
        path.unlink(missing_ok=True)
    return ChildRun(
        returncode,
        seconds,
        usage["maxrss_kib"] * 1024,
        peaks["disk"],
        usage["user_s"] + usage["sys_s"],
        stdout,
        stderr,
        tuple(tree.values()),
    )


# --------------------------------------------------------------------------------------------- output


class Table:
    """A plain-text table: the first column left-aligned, the others right-aligned."""

    def __init__(self, headers: Sequence[str]) -> None:
        self.headers = list(headers)
        self.rows: list[list[str]] = []

    def add(self, *cells: object) -> None:
        self.rows.append([str(cell) for cell in cells])

    def render(self) -> str:
        widths = [max(len(row[i]) for row in [self.headers, *self.rows]) for i in range(len(self.headers))]

        def line(row: Sequence[str]) -> str:
            return "  ".join(
                cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
            ).rstrip()

        rule = "  ".join("-" * width for width in widths)
        return "\n".join([line(self.headers), rule, *(line(row) for row in self.rows)])

    def print(self) -> None:
        print(self.render(), flush=True)


def verdict(passed: bool, name: str, detail: str) -> str:
    return f"{'PASS' if passed else 'FAIL'}  {name}: {detail}"


EXIT_TARGET_MISSED = 1  # a benchmark ran and missed at least one target
EXIT_NOTHING_CHECKED = 2  # a benchmark ended without evaluating a single target: a bug in the script


@dataclass
class Targets:
    """The targets one benchmark run evaluated. `check` returns the PASS/FAIL line to print; `exit_status`
    is what `main()` returns, so a missed target fails the run (CI, `&&` chains) instead of only saying FAIL."""

    passed: int = 0
    missed: int = 0

    def check(self, passed: bool, name: str, detail: str) -> str:
        if passed:
            self.passed += 1
        else:
            self.missed += 1
        return verdict(passed, name, detail)

    def exit_status(self) -> int:
        if self.missed:
            return EXIT_TARGET_MISSED
        return 0 if self.passed else EXIT_NOTHING_CHECKED


def human_bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.{1 if abs(count) < 100 * size else 0}f} {unit}"
    return f"{count:.0f} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of another process so far (from /proc; 0.0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
