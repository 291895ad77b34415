"""URL parsing (storage/url.py): every scheme and alias accepted, every malformed or unsafe URL refused."""

from __future__ import annotations

import pytest

from streamctl.errors import UsageError
from streamctl.storage import ParsedURL, parse_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bucket/a/b", ParsedURL("s3", "bucket", "a/b")),
        ("s3://bucket", ParsedURL("s3", "bucket", "")),
        ("S3://bucket/a/", ParsedURL("s3", "bucket", "a")),
        ("gs://bucket/models/llama", ParsedURL("gs", "bucket", "models/llama")),
        ("gcs://bucket/x", ParsedURL("gs", "bucket", "x")),
        ("az://container/p/q", ParsedURL("az", "container", "p/q")),
        ("https://MyAcct.blob.core.windows.net/container/p", ParsedURL("az", "container", "p", "myacct")),
        ("https://acct.blob.core.windows.net/container", ParsedURL("az", "container", "", "acct")),
        ("https://acct.blob.core.windows.net/c1/a%20b", ParsedURL("az", "c1", "a b", "acct")),
        ("file:///tmp/models", ParsedURL("file", "/tmp/models", "")),
        ("file://localhost/tmp/models", ParsedURL("file", "/tmp/models", "")),
        ("/tmp/models", ParsedURL("file", "/tmp/models", "")),
        ("./relative/dir", ParsedURL("file", "./relative/dir", "")),
    ],
)
def test_parse_url_accepts(url: str, expected: ParsedURL) -> None:
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.bucket, parsed.prefix, parsed.account) == (
        expected.scheme,
        expected.bucket,
        expected.prefix,
        expected.account,
    )
    assert parsed.is_remote == (expected.scheme != "file")


@pytest.mark.parametrize(
    "url",
    [
        "",
        "   ",
        "s3://",
        "s3:///key",
        "ftp://host/path",
        "https://example.com/bucket/key",
        "s3://-bad/key",
        "s3://bucket/a/../b",
        "gs://bucket/a//b",
        "az://container/./x",
        "https://acct.blob.core.windows.net/",
        "file://",
        "file://models/x",  # a host, not a path: would silently mean /x
    ],
)
def test_parse_url_rejects(url: str) -> None:
    with pytest.raises(UsageError):
        parse_url(url)


def test_parse_url_refuses_a_sas_url_without_echoing_the_token() -> None:
    with pytest.raises(UsageError) as caught:
        parse_url("https://acct.blob.core.windows.net/container/prefix?sv=2024-01-01&sig=SECRET%2Fx")
    assert "SECRET" not in caught.value.message and "AZURE_STORAGE_SAS_TOKEN" in (caught.value.hint or "")
