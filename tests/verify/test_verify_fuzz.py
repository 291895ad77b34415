"""Property tests: whatever a header or an index holds, verification returns findings or raises a
streamctl error, never another exception, and every finding code is one the verify docstring documents."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import INDEX_NAME, LLAMA_CONFIG, put_bytes, write_serving_files
from safetensors_strategies import BASE_FILE, JSON_VALUES, mutated_files
from streamctl.checkpoint.safetensors import parse_safetensors_bytes
from streamctl.checkpoint.sharded_names import DEFAULT_PATTERN, DEFAULT_PP_PATTERN, match_sharded
from streamctl.errors import StreamctlError
from streamctl.storage import open_location
from streamctl.storage.base import Location
from streamctl.verify import report as verify_report
from streamctl.verify.report import VerifyOptions, VerifyReport
from streamctl.verify.run import verify_checkpoint

DOCUMENTED_CODES = frozenset(re.findall(r"^\| `([a-z0-9-]+)` \|", verify_report.__doc__ or "", re.MULTILINE))


class _Invalid(Exception):
    pass


class _Object(dict[str, Any]):
    """A JSON object as serde_json reads one: the last value of a repeated key wins, every pair is kept."""

    pairs: list[tuple[str, Any]]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    result = _Object(pairs)
    result.pairs = pairs
    return result


def _repeats(value: Any, keys: Any) -> bool:
    names = [key for key, _ in value.pairs if key in keys] if isinstance(value, _Object) else []
    return len(set(names)) != len(names)


def _no_constants(name: str) -> Any:
    raise _Invalid(f"{name} is not JSON")


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:  # iterative: the fuzzer nests far deeper than Python's recursion limit
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**64


def oracle_accepts(data: bytes) -> bool:
    """Rules 1-9 written out plainly, independently of streamctl.checkpoint.safetensors (the parser under test).

    Repeated keys as the reference reader (serde) takes them: a repeated tensor or metadata key keeps its
    last value, but every value is checked as it comes; `__metadata__` or a field of the format twice in
    one object is refused ("duplicate field"). Stricter than the reference reader in the same places
    streamctl is on purpose: lone surrogates and JSON nested deeper than 64 levels are invalid.
    """
    try:
        if len(data) < 8:
            raise _Invalid
        length = int.from_bytes(data[:8], "little")
        if length > 100_000_000 or 8 + length > len(data):
            raise _Invalid
        try:
            text = data[8 : 8 + length].decode("utf-8")
            header = json.loads(text, object_pairs_hook=_object, parse_constant=_no_constants)
        except (ValueError, RecursionError) as error:
            raise _Invalid from error
        if not isinstance(header, dict) or _depth(header) > 64:
            raise _Invalid
        spans: dict[str, tuple[int, int]] = {}  # the last entry of a name wins
        if [name for name, _ in header.pairs].count("__metadata__") > 1:
            raise _Invalid
        for name, entry in header.pairs:
            name.encode("utf-8")  # UnicodeEncodeError (a ValueError) on lone surrogates
            if name == "__metadata__":
                if entry is not None and not (
                    isinstance(entry, dict) and all(isinstance(v, str) for _, v in entry.pairs)
                ):
                    raise _Invalid
                for key, item in (entry or {}).items():
                    key.encode("utf-8"), item.encode("utf-8")
                continue
            fields = ("dtype", "shape", "data_offsets")
            if not isinstance(entry, dict) or not set(fields) <= set(entry) or _repeats(entry, fields):
                raise _Invalid
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            bits = (
                {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}.get(dtype)
                or (
                    8
                    if dtype in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
                    else 16
                    if dtype in ("I16", "U16", "F16", "BF16")
                    else 32
                    if dtype in ("I32", "U32", "F32")
                    else 64
                    if dtype in ("I64", "U64", "F64", "C64")
                    else 0
                )
                if isinstance(dtype, str)
                else 0
            )
            # numpy and torch build tensors with int64 dimensions (test_reader_agreement).
            if not bits or not isinstance(shape, list) or not all(_u64(dim) and dim < 2**63 for dim in shape):
                raise _Invalid
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_u64, offsets)):
                raise _Invalid
            elements = 1
            for dim in shape:
                elements *= dim
                if elements >= 2**64:
                    raise _Invalid
            if elements * bits >= 2**64 or elements * bits % 8 or offsets[1] - offsets[0] != elements * bits // 8:
                raise _Invalid
            extent = 1
            for dim in shape:
                extent *= dim or 1
            if elements == 0 and shape and (extent * bits + 7) // 8 >= 2**63:  # numpy: "array is too big"
                raise _Invalid
            spans[name] = (offsets[0], offsets[1])
        position = 0
        for begin, end in sorted(spans.values()):
            if begin != position:
                raise _Invalid
            position = end
        return 8 + length + position == len(data)
    except (_Invalid, UnicodeError):
        return False


def check_report(report: VerifyReport) -> None:
    for finding in report.findings:
        assert finding.severity in ("error", "warning")
        assert finding.code in DOCUMENTED_CODES, f"undocumented finding code {finding.code!r}"
        assert isinstance(finding.message, str) and finding.message
        finding.message.encode("utf-8")  # printable: no lone surrogates leak into messages
        (finding.tensor or "").encode("utf-8")
    json.dumps(report.to_json())


def test_the_docstring_documents_codes() -> None:
    assert {"header-too-large", "missing-shard", "sharded-rank-missing", "expect-violated"} <= DOCUMENTED_CODES


def test_the_unmutated_base_file_is_valid() -> None:
    assert parse_safetensors_bytes(BASE_FILE).problems == ()
    assert oracle_accepts(BASE_FILE) and not oracle_accepts(BASE_FILE + b"\0")


@settings(max_examples=1500, deadline=None)
@given(mutated_files())
def test_parsing_any_file_returns_problems_never_raises(data: bytes) -> None:
    parsed = parse_safetensors_bytes(data)
    for problem in parsed.problems:
        assert problem.severity in ("error", "warning")
        assert problem.code in DOCUMENTED_CODES
    assert parsed.ok == oracle_accepts(data), [problem.code for problem in parsed.problems]
    if parsed.ok:
        assert len(data) == 8 + parsed.header_length + parsed.data_bytes  # rule 9 held


@pytest.fixture(scope="module")
def fuzz_location(tmp_path_factory: pytest.TempPathFactory) -> Location:
    location = open_location(str(tmp_path_factory.mktemp("fuzz")))
    write_serving_files(location)
    return location


def verify_or_streamctl_error(location: Location, options: VerifyOptions | None = None) -> VerifyReport | None:
    try:
        report = verify_checkpoint(location, options or VerifyOptions())
    except StreamctlError:
        return None
    check_report(report)
    return report


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated_files(), speculative=st.sampled_from([8, 64, 100_000]))
def test_verify_returns_findings_for_any_damaged_shard(fuzz_location: Location, data: bytes, speculative: int) -> None:
    put_bytes(fuzz_location, "model.safetensors", data)
    report = verify_or_streamctl_error(fuzz_location, VerifyOptions(speculative_bytes=speculative))
    assert report is not None  # the file is listed, so verification runs to the end
    assert report.stats.requests <= 2 + 1  # the shard (one or two reads) and config.json
    assert report.stats.bytes_read <= len(data) + len(json.dumps(LLAMA_CONFIG, indent=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    index=st.one_of(
        JSON_VALUES.map(lambda value: json.dumps(value).encode()),
        st.dictionaries(
            st.text(max_size=30),
            st.sampled_from(["model.safetensors", "../x.safetensors", "/x", "a\\b", "", "x.bin"])
            | st.text(max_size=10),
            max_size=6,
        ).map(lambda weight_map: json.dumps({"metadata": {"total_size": 34}, "weight_map": weight_map}).encode()),
        st.binary(max_size=200),
    )
)
def test_verify_returns_findings_for_any_index(fuzz_location: Location, index: bytes) -> None:
    put_bytes(fuzz_location, "model.safetensors", BASE_FILE)
    put_bytes(fuzz_location, INDEX_NAME, index)
    try:
        report = verify_or_streamctl_error(fuzz_location)
    finally:
        fuzz_location.store.delete(fuzz_location.key(INDEX_NAME))
    assert report is not None and report.layout == "indexed"


NAME_TEXT = st.text(alphabet="model-rankpt0123456789.safetensors_{}", max_size=45)


@settings(max_examples=300, deadline=None)
@given(
    names=st.lists(
        NAME_TEXT | st.sampled_from(["model-rank-0-part-0.safetensors", "model-pp-1-tp-0-part-00.safetensors"]),
        max_size=8,
    )
)
def test_sharded_name_matching_never_raises(names: list[str]) -> None:
    for pattern in (DEFAULT_PATTERN, DEFAULT_PP_PATTERN):
        for (pp_rank, tp_rank), parts in match_sharded(pattern, names).items():
            assert pp_rank >= 0 and tp_rank >= 0 and parts == sorted(parts)
