"""The README's tables and lists say what the code does: the exit codes and JSON error codes, the environment
variable rule and its per-command names, and the default file set of `transfer`. Each test reads the README
itself, so a change on either side without the other fails here."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from streamctl import errors
from streamctl.app import EXIT_INTERNAL_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED, app
from streamctl.checkpoint.files import config_references, select_files
from streamctl.commands._environment import DEFERS_TO, PER_COMMAND, variable_name
from streamctl.oserrors import _MEANINGS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def section(title: str) -> str:
    """The README's text from `## title` to the next `## ` heading."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def error_classes() -> list[type[errors.StreamctlError]]:
    found: list[type[errors.StreamctlError]] = []
    pending: list[type[errors.StreamctlError]] = [errors.StreamctlError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def test_the_exit_code_table_is_the_error_trees() -> None:
    """Every row of the README's table is an exit code streamctl can end with, and every such code has a row:
    the error classes' `exit_code` (read from the source, as raised_codes does), 0, and app.main's own."""
    table = {int(code) for code in re.findall(r"^\| (\d+) \|", section("Exit codes"), re.MULTILINE)}
    raised: set[int] = set()
    for path in Path(errors.__file__).parent.rglob("*.py"):
        raised |= {int(code) for code in re.findall(r"^\s+exit_code = (\d+)$", path.read_text(), re.MULTILINE)}
    assert {1, 2, 7, 127} <= raised  # the scan itself works
    assert table == {0} | raised | {EXIT_INTERNAL_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED}


def raised_codes() -> set[str]:
    """Every JSON error code streamctl's code can raise: the error classes' `code` attributes and the
    `code="..."` given to an error where it is raised, read from the source (an error class of a module no
    test imports counts too), and the errno table's own codes."""
    package = Path(errors.__file__).parent
    found: set[str] = set()
    for path in package.rglob("*.py"):
        source = path.read_text()
        found |= set(re.findall(r"^\s+code = \"([a-z-]+)\"$", source, re.MULTILINE))
        found |= set(re.findall(r"\bcode=\"([a-z-]+)\"", source))
    found.discard("no-any-return")  # mypy's, in a `# type: ignore[...]`
    found.discard(errors.StreamctlError.code)  # the base class's, replaced by every error that is raised
    return found | {meaning.code for meaning in _MEANINGS.values() if meaning.code}


def test_the_json_error_codes_are_the_error_trees() -> None:
    text = section("Exit codes")
    listed = set(re.findall(r"`([a-z-]+)`", text[text.index("Codes:") : text.index("Options that would do nothing")]))
    assert "usage-error" in listed and "internal-error" in listed  # the list itself was found
    assert listed == raised_codes() | {"internal-error"}  # app.main's, for a bug


def commands() -> dict[str, object]:
    group = typer.main.get_command(app)
    return dict(group.commands)  # type: ignore[attr-defined]


def environment_paragraph() -> str:
    text = section("Exit codes")
    start = text.index("Every option can also be set by an environment variable")
    return text[start : text.index("\n\n", start)]


def test_the_per_command_variable_names_are_the_codes() -> None:
    """The README names every option that reads STREAMCTL_<COMMAND>_<OPTION> (-tp and -pp by their short
    names), and only those; every variable it gives as an example is one a command reads."""
    paragraph = environment_paragraph()
    per_command_part = paragraph[paragraph.index("An option name that commands use for different things") :]
    per_command_part = per_command_part[: per_command_part.index("Flags take")]
    short = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
    named = {short.get(flag, flag) for flag in re.findall(r"`(--?[a-z][a-z-]*)`", per_command_part)}
    named |= {"--image"}  # named through its two variables, STREAMCTL_SERVE_IMAGE and STREAMCTL_TRANSFER_IMAGE
    assert named == PER_COMMAND
    read = {
        variable_name(param, name)
        for name, command in commands().items()
        for param in command.params  # type: ignore[attr-defined]
        if param.param_type_name == "option"
    }
    examples = set(re.findall(r"\b(STREAMCTL_[A-Z_]+[A-Z])", paragraph))
    assert examples and examples <= read | {"STREAMCTL_DEBUG"}, examples - read


def test_the_variables_that_keep_precedence_are_the_codes() -> None:
    """`RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING over STREAMCTL_PATH_STYLE`, and each option's older variable
    (`AWS_ENDPOINT_URL over STREAMCTL_ENDPOINT_URL`) read before ours: as the options declare them."""
    paragraph = environment_paragraph()
    pairs = re.findall(r"`([A-Z0-9_]+)`\s+over\s+`(STREAMCTL_[A-Z_]+)`", paragraph)
    assert len(pairs) >= 3, pairs
    declared: dict[str, list[str]] = {}
    for command in commands().values():
        for param in command.params:  # type: ignore[attr-defined]
            envvar = param.envvar
            if param.param_type_name == "option" and isinstance(envvar, (list, tuple)):
                declared.setdefault(envvar[-1], list(envvar[:-1]))
    deferred = {
        variable_name(param, None): list(DEFERS_TO[param.name])
        for command in commands().values()
        for param in command.params  # type: ignore[attr-defined]
        if param.name in DEFERS_TO
    }
    for theirs, ours in pairs:
        assert theirs in declared.get(ours, []) + deferred.get(ours, []), (theirs, ours)


# Every name in backticks in README's "By default only what vLLM needs is copied" bullet, as an example path
# (`sub-folder/` names one file in it) and whether the default set takes it. A name added to the README
# fails here until it is given a verdict, which the code must then agree with.
FILE_SET_EXAMPLES: dict[str, tuple[str, bool]] = {
    "config.json": ("config.json", True),
    "generation_config.json": ("generation_config.json", True),
    "modules.json": ("modules.json", True),
    "tokenizer.model.v*": ("tokenizer.model.v3", True),
    "tekken.json": ("tekken.json", True),
    "*.tiktoken": ("qwen.tiktoken", True),
    "additional_chat_templates/": ("additional_chat_templates/tool_use.jinja", True),
    "*.bin": ("pytorch_model.bin", False),
    "original/": ("original/consolidated.00.pth", False),
    ".gitattributes": (".gitattributes", False),
    "consolidated.safetensors": ("consolidated.safetensors", False),
    "training_args.bin": ("training_args.bin", False),
    "adapter_config.json": ("adapter_config.json", True),
    "adapter_model.safetensors": ("adapter_model.safetensors", True),
}
# Names in the bullet that are not files of the default set: rules, folders named by configs, commands.
NOT_A_FILE = {
    "1_Pooling/", "2_Dense/", "auto_map", "*.bin.index.json", "verify-index", "serve", "transfer",
    "--enable-lora --lora-modules NAME=LOCATION", "--include '*.gguf'", "hf://org/repo/SUBFOLDER",
}  # fmt: skip


def test_the_default_file_set_is_the_codes() -> None:
    text = section("transfer")
    start = text.index("- By default only what vLLM needs is copied")
    bullet = text[start : text.index("\n- ", start + 1)]
    names = set(re.findall(r"`([^`]+)`", bullet))
    assert names - NOT_A_FILE == set(FILE_SET_EXAMPLES), names ^ (set(FILE_SET_EXAMPLES) | NOT_A_FILE)
    # As transfer sees a repo: the HF shards its index names (so consolidated* is the duplicate), and the
    # files the configs reference (config_references: additional_chat_templates/, modules.json's folders).
    indexed = frozenset({"model-00001-of-00001.safetensors"})
    verdicts = {}
    for name, (path, _) in FILE_SET_EXAMPLES.items():
        listing = [path, *indexed] if name != "adapter_model.safetensors" else [path, "adapter_config.json"]
        shards = indexed if name != "adapter_model.safetensors" else None
        referenced = config_references({}, listing)
        (selection,) = [s for s in select_files(listing, has_auto_map=False, indexed_shards=shards,
                                                referenced=referenced) if s.path == path]  # fmt: skip
        verdicts[name] = selection.selected
    assert verdicts == {name: selected for name, (_, selected) in FILE_SET_EXAMPLES.items()}
