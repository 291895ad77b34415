"""The vllm-cpu worker's refusals: WorkerError (a protocol ERROR_KINDS kind and one line), vLLM's exceptions
put into one line and a kind, and the "error" frame the parent receives. Standard library only."""

from __future__ import annotations

import re
import traceback
from typing import Any

from streamctl.shard.engines.vllm_cpu import quantized as vllm_quantized
from streamctl.shard.engines.vllm_cpu.compat import VllmMoved
from streamctl.shard.engines.vllm_cpu.protocol import ERROR_KINDS, UNSUPPORTED_VLLM, ProtocolError

MESSAGE_LIMIT = 600


class WorkerError(Exception):
    """A refusal with its protocol kind (ERROR_KINDS)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def one_line(error: BaseException) -> str:
    """vLLM's own words on one line (a pydantic ValidationError: its messages, not its layout)."""
    errors = getattr(error, "errors", None)
    text = ""
    if callable(errors):
        try:
            text = "; ".join(str(item.get("msg", "")) for item in errors())
        except Exception:  # noqa: BLE001 - not pydantic's errors(): str() below
            text = ""
    if not text and not str(error) and isinstance(error, AssertionError):
        text = _failed_assertion(error)
    text = " ".join((text or str(error) or type(error).__name__).split())
    text = _SUPPORTED_LIST.sub(r"\1 listed in vLLM's docs (Supported Models)", text)
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


# vLLM's "not supported" error lists all of its ~300 architectures: the user needs the first sentence.
_SUPPORTED_LIST = re.compile(r"(Supported architectures:) dict_keys\(\[.*?\]\)")
_NAME_IN_ASSERTION = re.compile(r"\b(self\.[A-Za-z_]\w*|[A-Za-z_]\w*)\b")


def _failed_assertion(error: AssertionError) -> str:
    """A bare `assert` of vLLM's (no message): its source line and the values of the names in it, from the
    failing frame (e.g. "assert self.intermediate_size % tp_size == 0 (self.intermediate_size=66,
    tp_size=4; fused_moe/config.py:90)"), so the user sees which size does not divide."""
    import linecache

    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "AssertionError"
    frame, lineno = tb.tb_frame, tb.tb_lineno
    line = linecache.getline(frame.f_code.co_filename, lineno).strip() or "assert"
    values = []
    for name in dict.fromkeys(_NAME_IN_ASSERTION.findall(line.removeprefix("assert"))):
        owner, _, attribute = name.partition(".")
        value = frame.f_locals.get(owner, _MISSING)
        if attribute and value is not _MISSING:
            value = getattr(value, attribute, _MISSING)
        if isinstance(value, int | float | str | bool) and not isinstance(value, type):
            values.append(f"{name}={value!r}")
    where = "/".join(frame.f_code.co_filename.split("/")[-2:])
    return f"vLLM's check failed: {line} ({', '.join(values)}{'; ' if values else ''}{where}:{lineno})"


_MISSING = object()


def classify_build_error(error: Exception, quantization: str | None) -> WorkerError:
    message = one_line(error)
    if isinstance(error, WorkerError):
        return error
    refusal = vllm_quantized.classify(error, message) if quantization else None
    if refusal is not None:
        return WorkerError(*refusal)
    if "divisible" in message or (
        isinstance(error, AssertionError) and any(word in message for word in _PARALLEL_WORDS)
    ):
        return WorkerError("bad-parallel-size", message)
    if quantization and ("kernel" in message.lower() or "quantiz" in message.lower()):
        return WorkerError("unsupported-quantization", message)
    if "meta tensor" in message:  # e.g. BLOOM's ALiBi slopes, computed and copied while it is constructed
        return WorkerError(
            "unsupported-architecture",
            f"vLLM's model class computes tensors while it is constructed, so it cannot be built on the meta "
            f"device, which streamctl's vllm-cpu planning needs (no weights allocated): {message}",
        )
    return WorkerError("internal", f"building the model: {message}")


# What a bare assertion about the parallel layout mentions (vLLM's `assert x % tp_size == 0` style checks).
_PARALLEL_WORDS = ("tp_size", "ep_size", "world_size", "tp_rank", "ep_rank", "parallel", "num_experts")


def error_frame(error: BaseException) -> dict[str, Any]:
    kind = "internal"
    if isinstance(error, WorkerError):
        kind = error.kind
    elif isinstance(error, ProtocolError):
        kind = "protocol"
    elif isinstance(error, VllmMoved):
        kind = UNSUPPORTED_VLLM
    if kind not in ERROR_KINDS:
        kind = "internal"
    message = one_line(error)
    if kind == "internal" and not isinstance(error, WorkerError | VllmMoved):
        message = f"{type(error).__name__}: {message}"
    detail = "".join(traceback.format_exception(error)[-6:])[-4000:]
    return {"type": "error", "kind": kind, "message": message, "detail": detail}
