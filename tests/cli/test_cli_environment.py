"""Every option is an environment variable STREAMCTL_<LONG_NAME>: used, beaten by the command line, behind the
variables options read before, shown in --help, and named when its value is bad."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main

from headers_helpers import run_main
from streamctl.app import app
from streamctl.commands._environment import PER_COMMAND, variable_name

REPO = Path(__file__).resolve().parents[2]
SERVE_DRY = ["serve", "s3://bucket/model", "--no-preflight", "--not-sharded", "--dry-run", "--json"]


def commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    return {"": group, **group.commands}  # type: ignore[attr-defined]


def options(command: Any) -> list[Any]:
    return [param for param in command.params if param.param_type_name == "option" and param.name != "version"]


def serve_plan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *extra: str, **env: str
) -> dict[str, Any]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, stdout, stderr = run_main(monkeypatch, capsys, *SERVE_DRY, *extra)
    assert code == 0, stdout + stderr
    return json.loads(stdout)


@pytest.fixture(autouse=True)
def no_streamctl_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable of the machine running the tests must not change what they see."""
    import os

    for name in list(os.environ):
        if name.startswith("STREAMCTL_") and name not in ("STREAMCTL_AZURITE", "STREAMCTL_VLLM_PYTHON"):
            monkeypatch.delenv(name)
    for name in (
        "AWS_ENDPOINT_URL",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",
        "AZURE_STORAGE_ACCOUNT_NAME",
        "HF_TOKEN",
    ):
        monkeypatch.delenv(name, raising=False)


def long_name(option: Any) -> str:
    return str(max(option.opts, key=len))


def variable_of(command: str, option: Any) -> str:
    return variable_name(option, command or None)


def test_every_option_of_every_command_reads_its_variable() -> None:
    for name, command in commands().items():
        for option in options(command):
            names = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar)
            assert names[-1] == variable_of(name, option), (name, option.name, names)
            words = long_name(option)[2:] if long_name(option) not in PER_COMMAND else f"{name}-{long_name(option)[2:]}"
            assert variable_of(name, option) == "STREAMCTL_" + words.upper().replace("-", "_")
        arguments = [param for param in command.params if param.param_type_name == "argument"]
        assert all(argument.envvar is None for argument in arguments), name  # SOURCE, DEST, vLLM's args: none


def test_no_flat_variable_is_read_for_options_of_different_meanings() -> None:
    """Every option of every command: a variable read by two commands belongs to options of one meaning
    (one declaration, so one help text and one kind of value); names used for different things are all in
    PER_COMMAND, and each entry there is such a name (none is kept without need)."""
    readers: dict[str, list[tuple[str, Any]]] = {}
    by_name: dict[str, list[Any]] = {}
    for name, command in commands().items():
        for option in options(command):
            readers.setdefault(variable_of(name, option), []).append((name, option))
            by_name.setdefault(long_name(option), []).append(option)
    for variable, users in readers.items():
        meanings = {
            (
                option.help,
                option.is_flag,
                option.multiple,
                str(getattr(getattr(option, "type_descriptor", None), "annotation", None)),
            )
            for _, option in users
        }
        assert len(meanings) == 1, (variable, [command for command, _ in users], meanings)
    differing = {name for name, found in by_name.items() if len({option.help for option in found}) > 1}
    assert differing == PER_COMMAND
    # the clashes named in issue 22: each command reads its own name, and none reads the flat one
    for clash in ("IMAGE", "CONCURRENCY", "PATTERN", "FORCE", "SECRET"):
        assert f"STREAMCTL_{clash}" not in readers
        assert len([variable for variable in readers if variable.endswith(f"_{clash}")]) >= 2, clash
    assert [command for command, _ in readers["STREAMCTL_JSON"]] == ["transfer", "verify-index", "shard", "serve"]


def test_a_variable_set_for_one_command_leaves_the_other_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """STREAMCTL_TRANSFER_IMAGE (the Job's streamctl image) is not serve's vLLM image, nor the transfer
    concurrency serve's streamer readers; each command's own variable still works, and the flat name of
    before is read by neither, with a warning naming the one that is."""
    manifest = ["serve", "s3://bucket/model", "--no-preflight", "--not-sharded", "--k8s"]
    monkeypatch.setenv("STREAMCTL_TRANSFER_IMAGE", "registry.example/streamctl:1")
    monkeypatch.setenv("STREAMCTL_TRANSFER_SECRET", "transfer-keys")
    code, stdout, stderr = run_main(monkeypatch, capsys, *manifest)
    assert code == 0, stderr
    assert 'image: "vllm/vllm-openai:v0.33.0"' in stdout and "registry.example" not in stdout
    assert "transfer-keys" not in stdout
    monkeypatch.setenv("STREAMCTL_SERVE_IMAGE", "registry.example/vllm:2")
    monkeypatch.setenv("STREAMCTL_SERVE_SECRET", "serve-keys")
    code, stdout, stderr = run_main(monkeypatch, capsys, *manifest)
    assert code == 0 and 'image: "registry.example/vllm:2"' in stdout and "name: serve-keys" in stdout, stderr
    assert serve_plan(monkeypatch, capsys, STREAMCTL_TRANSFER_CONCURRENCY="3")["extra_config"]["concurrency"] == 8
    assert serve_plan(monkeypatch, capsys, STREAMCTL_SERVE_CONCURRENCY="3")["extra_config"]["concurrency"] == 3
    monkeypatch.delenv("STREAMCTL_SERVE_CONCURRENCY")
    monkeypatch.setenv("STREAMCTL_CONCURRENCY", "5")
    monkeypatch.setenv("STREAMCTL_PATTERN", "x-{rank}.safetensors")
    code, stdout, stderr = run_main(monkeypatch, capsys, *SERVE_DRY[:-1])
    assert code == 0, stderr
    assert "STREAMCTL_CONCURRENCY is not read" in stderr and "STREAMCTL_SERVE_CONCURRENCY" in stderr
    assert "STREAMCTL_PATTERN is not read" in stderr and "x-{rank}" not in stdout
    code, stdout, stderr = run_main(monkeypatch, capsys, *SERVE_DRY)  # --json: the document alone
    assert code == 0 and "is not read" not in stderr, stderr


def test_an_option_from_the_environment_is_used(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve_plan(monkeypatch, capsys)["extra_config"]["concurrency"] == 8  # the default for a bucket
    assert serve_plan(monkeypatch, capsys, STREAMCTL_SERVE_CONCURRENCY="5")["extra_config"]["concurrency"] == 5


def test_a_flag_and_a_repeatable_option_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("config.json", "notes.txt", "extra.md"):
        (source / name).write_text("{}")
    monkeypatch.setenv("STREAMCTL_TRANSFER_DRY_RUN", "true")
    monkeypatch.setenv("STREAMCTL_ALL_FILES", "1")
    monkeypatch.setenv("STREAMCTL_EXCLUDE", "*.txt *.md")
    code, stdout, stderr = run_main(monkeypatch, capsys, "transfer", str(source), str(tmp_path / "dest"), "--json")
    assert code == 0, stderr
    assert [file["path"] for file in json.loads(stdout)["files"]] == ["config.json"]
    assert not (tmp_path / "dest").exists()  # a dry run: nothing written


def test_the_command_line_beats_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = serve_plan(monkeypatch, capsys, "--concurrency", "3", STREAMCTL_SERVE_CONCURRENCY="5")
    assert plan["extra_config"]["concurrency"] == 3
    # A bad value in the environment is not even read when the command line sets the option.
    assert serve_plan(monkeypatch, capsys, "-tp", "1", STREAMCTL_SERVE_TENSOR_PARALLEL_SIZE="many")["argv"]
    monkeypatch.delenv("STREAMCTL_SERVE_TENSOR_PARALLEL_SIZE")
    # A flag pair: --not-sharded (on the command line) beats STREAMCTL_SERVE_SHARDED=1.
    assert serve_plan(monkeypatch, capsys, STREAMCTL_SERVE_SHARDED="1")["load_format"] == "runai_streamer"


def test_existing_variables_still_win(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    endpoints = {"AWS_ENDPOINT_URL": "http://127.0.0.1:1", "STREAMCTL_ENDPOINT_URL": "http://127.0.0.1:2"}
    assert serve_plan(monkeypatch, capsys, **endpoints)["env"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:1"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    only_ours = serve_plan(monkeypatch, capsys)["env"]
    assert only_ours["AWS_ENDPOINT_URL"] == "http://127.0.0.1:2"
    # STREAMCTL_PATH_STYLE=0 asks for virtual-host addressing ...
    assert (
        serve_plan(monkeypatch, capsys, STREAMCTL_PATH_STYLE="0")["env"]["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"]
        == "1"
    )
    # ... unless the streamer's own variable says otherwise: that one is kept, with no "as asked" override.
    plan = serve_plan(monkeypatch, capsys, RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")
    assert plan["env"]["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] == "0" and plan["warnings"] == []
    # The command line still beats the streamer's variable, as before.
    plan = serve_plan(monkeypatch, capsys, "--virtual-host-style")
    assert plan["env"]["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] == "1" and "as asked" in plan["warnings"][0]
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "theirs")
    monkeypatch.setenv("STREAMCTL_AZURE_ACCOUNT", "ours")
    code, stdout, stderr = run_main(monkeypatch, capsys, "serve", "az://container/model", *SERVE_DRY[2:])
    assert code == 0, stderr
    assert json.loads(stdout)["env"]["AZURE_STORAGE_ACCOUNT_NAME"] == "theirs"
    token = next(option for option in options(commands()["transfer"]) if option.name == "token")
    assert token.envvar == ["HF_TOKEN", "STREAMCTL_TOKEN"]  # huggingface_hub's variable first


@pytest.mark.parametrize("name", ["", "transfer", "verify-index", "shard", "serve"], ids=lambda name: name or "top")
def test_help_shows_each_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    code, stdout, _ = run_main(monkeypatch, capsys, *([name] if name else []), "--help")
    assert code == 0
    for option in options(commands()[name]):
        assert variable_of(name, option) in stdout, (name, option.name)
    assert "STREAMCTL_VERSION" not in stdout and "STREAMCTL_HELP" not in stdout  # requests, not settings


@pytest.mark.parametrize(
    ("arguments", "variable", "value"),
    [
        (["verify-index", "{tmp}"], "STREAMCTL_VERIFY_INDEX_CONCURRENCY", "lots"),  # Click's own conversion
        (["verify-index", "{tmp}"], "STREAMCTL_VERIFY_INDEX_TENSOR_PARALLEL_SIZE", "0"),  # Click's range check
        (["verify-index", "{tmp}"], "STREAMCTL_STRICT", "perhaps"),  # a flag
        (["transfer", "{tmp}", "{tmp}/dest"], "STREAMCTL_PART_SIZE", "big"),  # streamctl's own size parser
        (["shard", "{tmp}", "{tmp}/dest", "-tp", "2"], "STREAMCTL_MAX_PART_SIZE", "0"),
    ],
)
@pytest.mark.parametrize("json_output", [False, True], ids=["human", "json"])
def test_a_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    arguments: list[str],
    variable: str,
    value: str,
    json_output: bool,
) -> None:
    monkeypatch.setenv(variable, value)
    args = [part.format(tmp=tmp_path) for part in arguments] + ["--json"] * json_output
    code, stdout, stderr = run_main(monkeypatch, capsys, *args)
    assert code == 2, stdout + stderr
    if json_output:
        assert variable in json.loads(stdout)["error"]["message"]
    else:
        assert variable in stderr and stdout == ""
    monkeypatch.delenv(variable)
    # Typed on the command line, the same value is refused without naming any variable.
    flag = "--" + variable.removeprefix("STREAMCTL_").removeprefix("VERIFY_INDEX_").lower().replace("_", "-")
    typed = args if flag == "--strict" else [*args, f"{flag}={value}"]
    code, stdout, stderr = run_main(monkeypatch, capsys, *typed)
    if flag != "--strict":
        assert code == 2 and "STREAMCTL_" not in stdout + stderr, stdout + stderr


def test_streamctl_json_makes_errors_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STREAMCTL_JSON", "1")
    code, stdout, _ = run_main(monkeypatch, capsys, "verify-index", "--bogus")
    assert code == 2 and json.loads(stdout)["error"]["code"] == "unknown-option"


# A variable read or set: a string that is just its name (Python), `$NAME`/`${NAME` or `NAME=` (shell).
USE = r"[\"'](STREAMCTL_\w+)[\"']|\$\{?(STREAMCTL_\w+)|\b(STREAMCTL_\w+)="


def test_option_variables_are_not_the_projects_other_variables() -> None:
    """STREAMCTL_AZURITE, STREAMCTL_LEASE_TTL, ... configure the tests and the library; no option may share a name
    with one (only --debug's STREAMCTL_DEBUG and shard's --vllm-python STREAMCTL_VLLM_PYTHON, the tests' vLLM
    oracle python, are both, on purpose: each is the same setting)."""
    used: set[str] = set()
    about_options = (Path(__file__).parent, REPO / "cli" / "streamctl" / "commands" / "_environment.py")
    for place in (REPO / ".ci", REPO / "bench", REPO / "tests", REPO / "cli" / "streamctl"):
        for path in place.rglob("*"):
            if (
                path.is_file()
                and path.suffix in ("", ".py", ".sh", ".toml")
                and not path.is_relative_to(about_options[0])
            ) and path != about_options[1]:
                used |= {"".join(names) for names in re.findall(USE, path.read_text(errors="replace"))}
    assert "STREAMCTL_AZURITE" in used and "STREAMCTL_LEASE_TTL" in used  # the scan itself works
    ours = {variable_of(name, option) for name, command in commands().items() for option in options(command)}
    assert ours & used == {"STREAMCTL_DEBUG", "STREAMCTL_VLLM_PYTHON"}
