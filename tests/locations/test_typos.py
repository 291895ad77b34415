"""Typos in a location are refused, never made into a local folder.

`s3:/bkt/model`, `gs:/bkt/model`, `s3:bkt/model` and a DEST with an embedded newline used to make `transfer`
write a folder under the current directory and report done (exit 0); a trailing CR (a file edited on
Windows) became part of an S3 key. Now every location that starts with a scheme of the scheme table (or an
alias, any case) and a colon but not `//`, and every location holding a control character (C0, DEL, C1),
is refused with exit 2 naming the likely meaning, by the one parser every command uses. RFC 8089's short
form `file:/ABSOLUTE/PATH` is a location, the absolute path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.errors import UsageError
from streamctl.storage import open_location, parse_url
from streamctl.storage.schemes import ALIASES, SCHEMES

# Every spelling the table knows, and Azure's https://: each one written without its `//`.
TYPED_SCHEMES = sorted({*SCHEMES, *ALIASES, "https"} - {"file"})


def meant(scheme: str, rest: str) -> str:
    return f"{scheme}://{rest}"


@pytest.mark.parametrize("scheme", TYPED_SCHEMES)
@pytest.mark.parametrize("shape", ["{s}:/bkt/model", "{s}:bkt/model", "{S}:/bkt/model", "{S}:bkt/m"])
def test_a_known_scheme_without_slashes_is_refused_naming_the_likely_meaning(scheme: str, shape: str) -> None:
    url = shape.format(s=scheme, S=scheme.upper())
    with pytest.raises(UsageError) as refused:
        parse_url(url)
    rest = url.split(":", 1)[1].lstrip("/")
    assert f"did you mean {meant(scheme, rest)!r}?" in refused.value.message
    assert refused.value.exit_code == 2


@pytest.mark.parametrize(
    ("url", "likely"),
    [("file:relative/x", "file:///relative/x"), ("FILE:x", "file:///x"), ("az:/acct/c", "az://acct/c")],
)
def test_other_slashless_forms_name_their_meaning(url: str, likely: str) -> None:
    with pytest.raises(UsageError, match=f"did you mean {likely!r}"):
        parse_url(url)


def test_rfc_8089_short_file_form_is_the_absolute_path() -> None:
    for url in ("file:/tmp/models", "FILE:/tmp/models", "file:/tmp/a%20b"):
        parsed = parse_url(url)
        assert parsed.scheme == "file" and parsed.bucket in ("/tmp/models", "/tmp/a b"), url


def test_unknown_schemes_and_drive_letters_stay_paths() -> None:
    """Only the table's schemes are typos: `C:/x` or `notes:v2` may be real folder names."""
    for url in ("C:/models", "notes:v2", "./s3:/bkt"):
        assert parse_url(url).scheme == "file", url


CONTROL_CHARACTERS = ["\x00", "\x01", "\t", "\n", "\r", "\x1b", "\x7f", "\x85", "\x9b"]


@pytest.mark.parametrize("character", CONTROL_CHARACTERS, ids=[f"{ord(c):#04x}" for c in CONTROL_CHARACTERS])
@pytest.mark.parametrize("where", ["trailing", "embedded"])
@pytest.mark.parametrize("base", ["s3://bkt/model", "gs://bkt/model", "az://c/model", "hf://org/repo", "/tmp/out"])
def test_a_control_character_anywhere_is_refused(character: str, where: str, base: str) -> None:
    url = base + character if where == "trailing" else base[:-2] + character + base[-2:]
    with pytest.raises(UsageError) as refused:
        parse_url(url)
    assert f"control character {character!r}" in refused.value.message
    assert f"did you mean {base!r}?" in refused.value.message


def test_a_slashless_scheme_and_a_cr_together_name_the_whole_fix() -> None:
    with pytest.raises(UsageError, match=r"did you mean 's3://bkt/model'\?"):
        parse_url("s3:/bkt/model\r")


# ------------------------------------------------------------------------------------------ the commands


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    """An empty working directory: a typo must not become a folder in it."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


TYPOS = {
    "s3:/bkt/model": "s3://bkt/model",
    "gs:/bkt/model": "gs://bkt/model",
    "S3:bkt/model": "s3://bkt/model",
    "az:/acct/c": "az://acct/c",
    "gcs:bkt/m": "gcs://bkt/m",
    "out\nx": "outx",
    "s3://bkt/model\r": "s3://bkt/model",
    "out\t": "out",
    "out\x1b[2J": "out[2J",
}


def command_lines(model: Path, location: str) -> dict[str, list[str]]:
    """Every command and argument that takes a location, with `location` in it."""
    return {
        "transfer DEST": ["transfer", str(model), location],
        "transfer SOURCE": ["transfer", location, "out"],
        "verify-index": ["verify-index", location],
        "shard DEST": ["shard", str(model), location, "-tp", "2"],
        "shard SOURCE": ["shard", location, "out", "-tp", "2"],
        "serve": ["serve", location, "--dry-run", "--no-preflight"],
        "serve --k8s": ["serve", location, "--k8s"],
        # a Hub SOURCE: a Job refuses a local one before it reads DEST
        "transfer --k8s-job": ["transfer", "hf://org/model", location, "--k8s-job"],
    }


def assert_refused(argv: list[str], cwd: Path, likely: str) -> None:
    result = run_cli(*argv, cwd=cwd)
    assert result.exit_code == 2, (argv, result.stdout, result.stderr)
    assert f"did you mean {likely!r}?" in result.stderr, (argv, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 2 and "Traceback" not in result.stderr  # error + hint
    assert list(cwd.iterdir()) == [], (argv, list(cwd.iterdir()))


@pytest.mark.parametrize("command", list(command_lines(Path("m"), "x")))
def test_every_command_refuses_typos_and_writes_nothing(model: Path, cwd: Path, command: str) -> None:
    for typo in ("s3:/bkt/model", "out\nx", "s3://bkt/model\r"):
        assert_refused(command_lines(model, typo)[command], cwd, TYPOS[typo])


@pytest.mark.parametrize("typo", list(TYPOS), ids=[repr(typo) for typo in TYPOS])
def test_every_typo_is_refused_as_a_dest_and_makes_no_folder(model: Path, cwd: Path, typo: str) -> None:
    assert_refused(command_lines(model, typo)["transfer DEST"], cwd, TYPOS[typo])


def test_the_json_error_document_names_the_meaning(model: Path, cwd: Path) -> None:
    for argv in (
        ["transfer", str(model), "s3:/bkt/model", "--json"],
        ["verify-index", "gs:bkt/model\r", "--json"],
        ["shard", str(model), "S3:/bkt/x", "-tp", "2", "--json"],
        ["serve", "hf:org/repo", "--json", "--no-preflight"],
    ):
        result = run_cli(*argv, cwd=cwd)
        assert result.exit_code == 2, (argv, result.stderr)
        document = json.loads(result.stdout)
        assert document["ok"] is False and document["error"]["code"] == "usage-error", document
        assert "did you mean" in document["error"]["message"] and document["error"]["exit_code"] == 2
    assert list(cwd.iterdir()) == []


def test_a_trailing_cr_never_reaches_a_bucket(
    model: Path, cwd: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    result = run_cli("transfer", str(model), f"{s3_root}/model\r", env=storage_env, cwd=cwd)
    assert result.exit_code == 2, result.stderr
    assert f"did you mean {s3_root + '/model'!r}?" in result.stderr
    assert list(open_location(s3_root).store.list("")) == []  # not one object in the bucket
    assert list(cwd.iterdir()) == []


def test_the_rfc_8089_short_form_copies_into_the_absolute_path(model: Path, cwd: Path, tmp_path: Path) -> None:
    dest = tmp_path / "copied"
    result = run_cli("transfer", str(model), f"file:{dest}", cwd=cwd)
    assert result.exit_code == 0, result.stderr
    assert (dest / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert list(cwd.iterdir()) == []
