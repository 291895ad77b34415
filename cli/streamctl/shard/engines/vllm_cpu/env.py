"""The CPU-only vLLM environment that `--engine vllm-cpu` runs its worker in: one recipe, for users and CI.

`resolve_vllm_python` answers which Python to run the worker with: `--vllm-python PATH` as given (checked: it
runs and has vllm), else a cached environment `$STREAMCTL_CACHE or ~/.cache/streamctl` / `vllm-{V}-cpu`,
built once by `build_environment` under a lock. `.ci/vllm-env` builds the tests' oracle venv with the same
`ensure_environment`, adding streamctl itself (`-e ROOT`).

The recipe (why each step; the measured facts are in docs/design/shard-vllm-cpu.md):
- torch TORCH_VERSION's CPU build first, alone. vLLM 0.33 asks for torch==2.14.0, and any torch pip picks
  for it by itself is a multi-GB CUDA build; so torch comes from the PyTorch CPU index
  ($STREAMCTL_TORCH_INDEX_URL; empty: pip's own configuration, e.g. a local CPU wheel), a CUDA torch is refused.
- vllm with --no-deps, then vLLM's own Requires-Dist minus EXCLUDED_REQUIREMENTS (GPU-only), with torch held
  at TORCH_VERSION by a constraints file, so a newer vLLM brings its new needs along; the Run:ai streamer,
  safetensors, numpy.
- No torchvision: PyPI's fails to import beside the CPU torch; the worker has a build-only stand-in.
- An import check, then the stamp, written last: a build that stops half-way is resumed next time and never
  taken for a good one.

Standard library only: imported by streamctl's own Python and by `.ci/vllm-env` before any venv exists.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from streamctl import oserrors
from streamctl.checkpoint.vllm_layouts import VLLM_DISTRIBUTIONS, default_vllm_version, parse_version
from streamctl.errors import MissingProgramError, RemoteError, StreamctlError, UsageError
from streamctl.progress import Progress

TORCH_VERSION = "2.13.0"
TORCH_INDEX_ENV = "STREAMCTL_TORCH_INDEX_URL"
DEFAULT_TORCH_INDEX_URL = "https://download.pytorch.org/whl/cpu"
STREAMER_REQUIREMENT = "runai-model-streamer[s3,gcs,azure]==0.17.*"
PLAIN_REQUIREMENTS = ("safetensors", "numpy")
RECIPE_REVISION = 1  # bump when a step changes in a way the stamp's other fields do not show
MIN_PYTHON = (3, 11)  # vLLM 0.33's floor, and the worker runs as `python -P`

# vLLM's Requires-Dist entries that are NOT installed, and why (names compared after PEP 503 normalisation).
# Everything else it requires is installed; a new GPU-only package that wants a CUDA torch then fails loudly
# on the torch constraint instead of downloading gigabytes.
EXCLUDED_REQUIREMENTS: Mapping[str, str] = {
    "torch": f"installed first, pinned to the CPU build {TORCH_VERSION} (vLLM 0.33 asks for 2.14.0)",
    "torchaudio": "built for vLLM's CUDA torch; media only",
    "torchvision": "PyPI's fails to import beside the CPU torch ('operator torchvision::nms does not exist')",
    "torchcodec": "built for vLLM's CUDA torch; media only",
    "pynvvideocodec": "NVIDIA hardware video decoder",
    "flashinfer-python": "CUDA kernels",
    "apache-tvm-ffi": "pinned by vLLM for flashinfer (xgrammar still brings its own version)",
    "tilelang": "CUDA kernels",
    "quack-kernels": "CUDA kernels",
    "tokenspeed-mla": "CUDA kernels",
    "humming-kernels": "CUDA kernels",
    "nvidia-cutlass-dsl": "CUDA tooling",
    "nvidia-cudnn-frontend": "CUDA tooling",
    "nvtx": "CUDA tooling",
    "fastsafetensors": "GPU-direct weight loader for a --load-format streamctl does not use",
    "instanttensor": "GPU-direct weight loader for a --load-format streamctl does not use",
}

# What the final check imports: what the worker and the oracle scripts need of the environment.
CHECK_IMPORTS = (
    "runai_model_streamer",
    "safetensors",
    "transformers",
    "vllm.model_executor.model_loader.sharded_state_loader",
    "vllm.entrypoints.cli.serve",
)

PIP_TAIL_LINES = 30  # how much of pip's output an error keeps in its details
_BUILD_HINT = "pass --vllm-python PATH to use an existing vLLM environment"
_VERSION_TEXT = re.compile(r"^[0-9]+(\.[0-9]+){0,5}((a|b|rc|\.post|\.dev)[0-9]+)*$", re.ASCII)
# pip's words for an index it could not reach, and for one that answered with nothing at all.
_UNREACHABLE = (
    (re.compile(r"Connection refused|NewConnectionError", re.I), "connection refused"),
    (re.compile(r"Name or service not known|Temporary failure in name resolution|getaddrinfo failed"), "unknown host"),
    (re.compile(r"timed out|ConnectTimeout|ReadTimeout", re.I), "timed out"),
    (re.compile(r"Network is unreachable|No route to host|ProxyError|SSLError|Max retries exceeded"), "no route"),
    (re.compile(r"\(from versions: none\)"), "it offered no versions"),
)


@dataclass(frozen=True)
class VllmPython:
    """The Python of a vLLM environment: run the worker as `path -P -m streamctl.shard.engines.vllm_cpu.worker`."""

    path: str
    version: str  # vllm's version as its package metadata says, e.g. "0.33.0"


BuildStep = Callable[..., None]
"""`build_environment`'s signature: (venv, vllm_version, progress, extra_pip_args=(), *, stamp_extra="",
check_imports=()). A parameter of `ensure_environment` so the lock is testable with a quick stand-in."""


def resolve_vllm_python(
    vllm_python: str | None, vllm_version: str | None, progress: Progress, *, build: BuildStep | None = None
) -> VllmPython:
    """The vLLM environment to run the worker in: `vllm_python` checked, else the cached one (built once)."""
    if vllm_python:
        found = probe_vllm_python(vllm_python)
        if vllm_version is not None and _release(found.version) != _release(check_version_text(vllm_version)):
            raise UsageError(
                f"--vllm-python {vllm_python} has vLLM {found.version}, not the --vllm-version {vllm_version} asked for",
                hint="leave out --vllm-version to use that environment's vLLM, or pass another --vllm-python",
                code="vllm-version-mismatch",
            )
        return found
    version = check_version_text(vllm_version) if vllm_version is not None else default_vllm_version()
    venv = cached_environment_path(version)
    python = ensure_environment(venv, version, progress, build=build or build_environment)
    cached = _probe(str(python))
    if cached is None or _release(cached.version) != _release(version):
        raise MissingProgramError(
            f"the cached vLLM environment {venv} is broken: it does not answer with vLLM {version}",
            hint=f"delete {venv} to have it built again, or {_BUILD_HINT}",
            code="vllm-environment-broken",
        )
    return cached


def check_version_text(version: str) -> str:
    """`version` when it is a plain release (0.33.0, 0.34.0rc1): it names a folder and a pip requirement."""
    if not _VERSION_TEXT.match(version):
        shown = version if len(version) <= 40 else version[:40] + "..."
        raise UsageError(f"invalid vLLM version {shown!r}", hint="write it like 0.33.0", code="bad-option-value")
    return version


def cache_root() -> Path:
    return Path(os.environ.get("STREAMCTL_CACHE") or Path.home() / ".cache" / "streamctl")


def cached_environment_path(vllm_version: str) -> Path:
    return cache_root() / f"vllm-{vllm_version}-cpu"


def venv_python(venv: Path) -> Path:
    """The venv's own python, never resolved: the symlink's location is what makes it the venv's."""
    return venv / "bin" / "python"


def stamp_path(venv: Path) -> Path:
    """Beside the venv, not in it: a venv reached through a symlink can be stamped without writing into it."""
    return venv.with_name(venv.name + ".stamp")


def recipe_stamp(vllm_version: str, extra_pip_args: Sequence[str] = (), stamp_extra: str = "") -> str:
    """What a finished build of this recipe records (with its venv's Python: `write_stamp`); an environment
    whose stamp differs is built (again)."""
    lines = [
        f"recipe={RECIPE_REVISION}",
        f"vllm={vllm_version}",
        f"torch={TORCH_VERSION}",
        f"streamer={STREAMER_REQUIREMENT}",
        f"packages={' '.join(PLAIN_REQUIREMENTS)}",
        f"excluded={' '.join(sorted(EXCLUDED_REQUIREMENTS))}",
        f"extra={json.dumps(list(extra_pip_args))}",
    ]
    if stamp_extra:
        lines.append(stamp_extra.strip())
    return "\n".join(lines) + "\n"


def write_stamp(venv: Path, recipe: str) -> None:
    """The last step of a build: `recipe` and the version of the venv's own Python, which must still run
    the same for the stamp to hold (whichever Python runs streamctl)."""
    stamp_path(venv).write_text(f"{recipe}python={_python_version(str(venv_python(venv)))}\n", encoding="utf-8")


def is_built(venv: Path, recipe: str) -> bool:
    try:
        recorded = stamp_path(venv).read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return False
    if not recorded.startswith(recipe) or not os.access(venv_python(venv), os.X_OK):
        return False
    return recorded == f"{recipe}python={_python_version(str(venv_python(venv)))}\n"


def ensure_environment(
    venv: Path,
    vllm_version: str,
    progress: Progress,
    extra_pip_args: Sequence[str] = (),
    *,
    stamp_extra: str = "",
    check_imports: Sequence[str] = (),
    rebuild: bool = False,
    build: BuildStep | None = None,
) -> Path:
    """The venv's python, building the environment first unless its stamp matches. One builder at a time
    (an exclusive lock beside the venv): a second one waits, then finds it built."""
    # An unwritable, full or read-only cache folder is the user's to fix, or to point elsewhere.
    with oserrors.mapped(venv, f"set STREAMCTL_CACHE to another folder, or {_BUILD_HINT}"):
        return _ensure_environment(
            venv, vllm_version, progress, extra_pip_args, stamp_extra, check_imports, rebuild, build
        )


def _ensure_environment(
    venv: Path,
    vllm_version: str,
    progress: Progress,
    extra_pip_args: Sequence[str],
    stamp_extra: str,
    check_imports: Sequence[str],
    rebuild: bool,
    build: BuildStep | None,
) -> Path:
    stamp = recipe_stamp(vllm_version, extra_pip_args, stamp_extra)
    if not rebuild and is_built(venv, stamp):
        return venv_python(venv)
    with _exclusive_lock(venv, progress):
        if rebuild:
            _remove_environment(venv, progress)
        elif is_built(venv, stamp):  # another builder finished it while this one waited
            return venv_python(venv)
        (build or build_environment)(
            venv, vllm_version, progress, extra_pip_args, stamp_extra=stamp_extra, check_imports=check_imports
        )
    if not is_built(venv, stamp):
        raise MissingProgramError(
            f"the vLLM environment {venv} was not stamped after its build",
            hint=_BUILD_HINT,
            code="vllm-environment-unstamped",
        )
    return venv_python(venv)


@contextmanager
def _exclusive_lock(venv: Path, progress: Progress) -> Iterator[None]:
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress.log(f"waiting for another streamctl that is building {venv}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_environment(venv: Path, progress: Progress) -> None:
    stamp_path(venv).unlink(missing_ok=True)
    if venv.is_symlink():
        venv.unlink()
    elif venv.exists():
        progress.log(f"removing {venv} to build it again")
        shutil.rmtree(venv)


def build_environment(
    venv: Path,
    vllm_version: str,
    progress: Progress,
    extra_pip_args: Sequence[str] = (),
    *,
    stamp_extra: str = "",
    check_imports: Sequence[str] = (),
) -> None:
    """Build (or finish) the CPU-only vLLM environment in `venv` with the recipe above; stamp it last.

    Call it under `ensure_environment`'s lock. Raises RemoteError when the package index is unreachable,
    MissingProgramError when a step fails otherwise; pip's last lines are in the error's details."""
    if sys.version_info < MIN_PYTHON:
        raise MissingProgramError(
            f"could not build a CPU-only vLLM {vllm_version} environment: vLLM needs Python "
            f"{'.'.join(map(str, MIN_PYTHON))} or newer, streamctl runs on {sys.version.split()[0]}",
            hint=_BUILD_HINT,
            code="vllm-environment-build-failed",
        )
    stamp_path(venv).unlink(missing_ok=True)  # from here until the end, the environment is not a good one
    if (venv / "pyvenv.cfg").exists():  # an earlier build stopped, or the recipe changed: pip skips what is there
        progress.log(f"completing the CPU-only vLLM {vllm_version} environment in {venv}")
    else:
        progress.log(f"creating a CPU-only vLLM {vllm_version} environment in {venv} (once; a few minutes)")
    _make_venv(venv, progress)
    python = str(venv_python(venv))
    constraints = venv / "streamctl-torch-constraint.txt"
    constraints.write_text(f"torch=={TORCH_VERSION}\n", encoding="utf-8")
    index = os.environ.get(TORCH_INDEX_ENV, DEFAULT_TORCH_INDEX_URL)
    source = index or "pip's configured index"
    progress.log(f"torch {TORCH_VERSION}, CPU build, from {source}")
    index_args = ["--index-url", index] if index else []
    # No constraints file here: the requirement pins torch, and pip 23 reports a pin that is also a constraint
    # and finds nothing as a "conflict" instead of "from versions: none".
    _pip(python, [f"torch=={TORCH_VERSION}", *index_args], vllm_version, f"torch from {source}")
    _refuse_cuda_torch(python, vllm_version)
    progress.log(f"vllm {vllm_version} without its dependencies")
    _pip(python, ["--no-deps", f"vllm=={vllm_version}"], vllm_version, f"vllm=={vllm_version}")
    requirements = venv / "streamctl-vllm-requirements.txt"
    required = _vllm_requirements(python, vllm_version)
    requirements.write_text("".join(line + "\n" for line in required), encoding="utf-8")
    progress.log(f"vLLM's {len(required)} requirements (GPU-only ones left out), the Run:ai streamer")
    _pip(
        python,
        ["-c", str(constraints), "-r", str(requirements), STREAMER_REQUIREMENT, *PLAIN_REQUIREMENTS, *extra_pip_args],
        vllm_version,
        "vLLM's requirements",
    )
    progress.log("checking that vLLM imports on the CPU")
    _import_check(python, vllm_version, (*CHECK_IMPORTS, *check_imports))
    write_stamp(venv, recipe_stamp(vllm_version, extra_pip_args, stamp_extra))
    progress.log(f"the vLLM {vllm_version} environment is ready: {venv}")


def _make_venv(venv: Path, progress: Progress) -> None:
    """A venv left by an earlier build is finished (pip skips what it has) while its Python still runs."""
    python = venv_python(venv)
    made = (venv / "pyvenv.cfg").exists() and not venv.is_symlink()
    if made and _python_version(str(python)) is None:
        progress.log(f"{venv}'s Python no longer runs: building it again")
        shutil.rmtree(venv)
    if not python.exists():
        _run_step([sys.executable, "-m", "venv", str(venv)], "python -m venv", "")


def _python_version(python: str) -> str | None:
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print('.'.join(map(str, sys.version_info[:3])))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _pip(python: str, args: Sequence[str], vllm_version: str, what: str) -> None:
    # Not -q: pip's quiet mode hides the lines that say why nothing was found ("from versions: none").
    command = [python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", *args]
    _run_step(command, what, vllm_version)


def _run_step(command: Sequence[str], what: str, vllm_version: str) -> str:
    """Run one step, its output captured (pip's noise stays out of the way); a failure becomes an error."""
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
    except OSError as error:
        raise _build_failed(vllm_version, f"{what}: {error.strerror or error}", []) from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise _step_error(vllm_version, what, output)
    return done.stdout


def _step_error(vllm_version: str, what: str, output: str) -> StreamctlError:
    lines = [line for line in output.splitlines() if line.strip()]
    tail = lines[-PIP_TAIL_LINES:]
    for pattern, cause in _UNREACHABLE:
        if pattern.search(output):
            return RemoteError(
                f"could not build a CPU-only vLLM {vllm_version} environment: "
                f"the package index is unreachable ({what}: {cause})",
                hint=_BUILD_HINT,
                code="package-index-unreachable",
                details={"pip_output_tail": tail},
            )
    errors = [line for line in lines if line.startswith("ERROR:")]
    last = (errors or lines or ["no output"])[-1].removeprefix("ERROR:").strip()
    return _build_failed(vllm_version, f"{what}: {last[:200]}", tail)


def _build_failed(vllm_version: str, reason: str, tail: list[str]) -> MissingProgramError:
    return MissingProgramError(
        f"could not build a CPU-only vLLM {vllm_version} environment: {reason}",
        hint=_BUILD_HINT,
        code="vllm-environment-build-failed",
        details={"pip_output_tail": tail},
    )


def _refuse_cuda_torch(python: str, vllm_version: str) -> None:
    script = "import torch; print(torch.__version__, torch.version.cuda or '')"
    version, _, cuda = _run_step([python, "-c", script], "importing torch", vllm_version).strip().partition(" ")
    if cuda or version.split("+")[0] != TORCH_VERSION:
        raise _build_failed(
            vllm_version,
            f"torch {TORCH_VERSION} came as {version} (CUDA {cuda or 'none'}), not the CPU build; "
            f"point {TORCH_INDEX_ENV} at an index with the CPU build",
            [],
        )


# Run by the venv's python: vLLM's requirements as written (markers kept, pip evaluates them), less the
# extras-only entries and the excluded names.
_REQUIREMENTS_SCRIPT = """
import json, re, sys
from importlib.metadata import requires
excluded = set(json.loads(sys.argv[1]))
for requirement in requires("vllm") or []:
    name = re.match(r"\\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    if re.search(r"\\bextra\\s*==", requirement):
        continue
    if re.sub(r"[-_.]+", "-", name).lower() not in excluded:
        print(requirement)
"""


def _vllm_requirements(python: str, vllm_version: str) -> list[str]:
    excluded = json.dumps(sorted(EXCLUDED_REQUIREMENTS))
    output = _run_step([python, "-c", _REQUIREMENTS_SCRIPT, excluded], "reading vLLM's requirements", vllm_version)
    return [line for line in output.splitlines() if line.strip()]


_IMPORT_CHECK_SCRIPT = """
import importlib, json, sys
torch_version, vllm_version, modules = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import torch
assert torch.__version__.split("+")[0] == torch_version, f"torch was changed to {torch.__version__}"
assert not torch.version.cuda, f"a CUDA torch got in: {torch.__version__}"
import vllm
assert vllm.__version__.split("+")[0] == vllm_version, f"vllm is {vllm.__version__}"
for module in modules:
    importlib.import_module(module)
"""


def _import_check(python: str, vllm_version: str, modules: Sequence[str]) -> None:
    command = [python, "-c", _IMPORT_CHECK_SCRIPT, TORCH_VERSION, vllm_version, json.dumps(list(modules))]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", env=env)
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        raise _build_failed(
            vllm_version, f"the import check failed: {(lines or ['?'])[-1][:200]}", lines[-PIP_TAIL_LINES:]
        )


# Asks the Python which vLLM it has without importing vllm (seconds) or torch: package metadata only.
_PROBE_SCRIPT = """
import importlib.metadata as m, json, sys
version = None
for distribution in json.loads(sys.argv[1]):
    try:
        version = m.version(distribution)
        break
    except m.PackageNotFoundError:
        pass
print(json.dumps({"python": list(sys.version_info[:3]), "vllm": version}))
"""


def probe_vllm_python(vllm_python: str) -> VllmPython:
    """`--vllm-python PATH` checked: a file that runs as a Python 3.11+ and has vllm installed."""
    path = Path(vllm_python)
    option = f"--vllm-python {vllm_python}"
    if not path.exists():
        raise UsageError(f"{option}: no such file", hint=_python_hint(path), code="bad-option-value")
    if path.is_dir():
        raise UsageError(f"{option} is a folder, not a Python", hint=_python_hint(path), code="bad-option-value")
    if not os.access(path, os.X_OK):
        raise UsageError(
            f"{option} is not executable", hint="pass the python of a vLLM environment", code="bad-option-value"
        )
    answer = _probe_answer(vllm_python)
    if answer is None:
        raise UsageError(
            f"{option} does not run as a Python {'.'.join(map(str, MIN_PYTHON))} or newer",
            hint="pass the python of a vLLM environment, e.g. VENV/bin/python",
            code="bad-option-value",
        )
    if answer.get("vllm") is None:
        raise MissingProgramError(
            f"{option} has no vllm installed",
            hint="pass the python of an environment with vLLM, or leave out --vllm-python to have streamctl "
            f"build a CPU-only vLLM {default_vllm_version()} environment",
            code="vllm-not-installed",
        )
    return VllmPython(path=vllm_python, version=str(answer["vllm"]))


def _probe(python: str) -> VllmPython | None:
    answer = _probe_answer(python)
    if answer is None or answer.get("vllm") is None:
        return None
    return VllmPython(path=python, version=str(answer["vllm"]))


def _probe_answer(python: str) -> dict[str, object] | None:
    try:
        done = subprocess.run(
            [python, "-P", "-c", _PROBE_SCRIPT, json.dumps(VLLM_DISTRIBUTIONS)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return answer if isinstance(answer, dict) else None


def _python_hint(path: Path) -> str:
    inside = venv_python(path)
    if path.is_dir() and os.access(inside, os.X_OK):
        return f"did you mean --vllm-python {inside}?"
    return "pass the python of a vLLM environment, e.g. VENV/bin/python"


def _release(version: str) -> tuple[int, ...]:
    """0.33 and 0.33.0+cpu both name release (0, 33)."""
    parts = list(parse_version(version))
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


__all__ = [
    "DEFAULT_TORCH_INDEX_URL",
    "EXCLUDED_REQUIREMENTS",
    "TORCH_INDEX_ENV",
    "TORCH_VERSION",
    "VllmPython",
    "build_environment",
    "cached_environment_path",
    "ensure_environment",
    "is_built",
    "probe_vllm_python",
    "recipe_stamp",
    "resolve_vllm_python",
    "stamp_path",
    "venv_python",
    "write_stamp",
]
