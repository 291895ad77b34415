"""vLLM secret options are masked and refused in manifests however they are spelled, because they
are matched the way vLLM 0.33's own parser reads them (underscores, abbreviations, dotted dict options);
with the oracle, the option table and the secret list are held against the real parser."""

from __future__ import annotations

import json
import re
import tempfile

import pytest

from cli_helpers import run_cli
from oracle import _run, installed_vllm_version, requires_vllm_oracle
from streamctl.checkpoint.vllm_layouts import default_vllm_version, parse_version
from streamctl.errors import UsageError
from streamctl.serve.plan import CheckpointFacts, ServeOptions, plan_launch
from streamctl.serve.vllm_args import SECRET_OPTIONS, VLLM_SERVE_OPTIONS, masked_arguments, secret_values

K, K2, T = "sk-KEYsecret-1", "sk-KEYsecret-2", "hf_TOKENsecret"
SPELLINGS: list[list[str]] = [
    ["--api-key", K],
    ["--api_key", K],
    ["--api-key=" + K],
    ["--api_key=" + K],
    ["--api-k", K],
    ["--api_k=" + K],
    ["--api-key", K, K2],
    ["--api-key", K, K2, "--port", "8001"],
    ["--api-key", "-123"],  # argparse takes a negative number as a value
    ["--api-key.x", K],
    ["--api-key.x=" + K],
    ["--hf-token", T],
    ["--hf_token=" + T],
    ["--hf-t", T],
    ["--hf_tok=" + T],
    ["--enforce-eager", "--hf_token", T, "--max-model-len", "2048"],
]
SECRETS = (K, K2, T, "-123")


def _plain(argv: list[str]) -> list[str]:
    return list(
        plan_launch(
            ServeOptions(model="/m", vllm_args=tuple(argv)),
            CheckpointFacts(1, 1, 1),
            sharded=False,
            environ={},
            cuda_available=True,
            host_memory_bytes=None,
        ).argv
    )


@pytest.mark.parametrize("spelling", SPELLINGS, ids=" ".join)
def test_every_spelling_is_masked(spelling: list[str]) -> None:
    masked = masked_arguments(spelling)
    assert len(masked) == len(spelling)
    for secret in SECRETS:
        assert not any(secret in arg for arg in masked), masked
    assert secret_values(spelling), spelling
    assert [arg for arg in masked if not arg.endswith("***")] == [
        arg for arg in spelling if not any(secret in arg for secret in SECRETS)
    ]  # everything else is shown as written


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-model-len", "2048"],
        ["--hf-overrides", "{}"],
        ["--hf-token"],
        ["--host", "0.0.0.0", "--port", "8000"],
        ["--served-model-name", "api-key"],
    ],
)
def test_other_options_are_shown_as_written(argv: list[str]) -> None:
    assert masked_arguments(argv) == argv
    assert secret_values(argv) == []


@pytest.mark.parametrize("spelling", [SPELLINGS[1], SPELLINGS[4], SPELLINGS[9], SPELLINGS[14]], ids=" ".join)
def test_serve_dry_run_json_and_k8s(spelling: list[str]) -> None:
    base = ("serve", "s3://bkt/model", "--no-preflight", "--not-sharded")
    for mode in ("--dry-run", "--json"):
        result = run_cli(*base, mode, "--", *spelling)
        assert result.exit_code == 0, result.stderr
        for secret in SECRETS:
            assert secret not in result.stdout + result.stderr
        assert "***" in result.stdout
    k8s = run_cli(*base, "--k8s", "--secret", "creds", "--", *spelling)
    assert k8s.exit_code == 2, k8s.stdout
    assert k8s.stdout == ""
    assert "Secret" in k8s.stderr and ("VLLM_API_KEY" in k8s.stderr or "HF_TOKEN" in k8s.stderr)
    for secret in SECRETS:
        assert secret not in k8s.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--load_format", "auto"],
        ["--load-f=auto"],
        ["--tensor_parallel_size", "2"],
        ["--tensor-p=2"],
        ["--model-loader-extra-config", "{}"],
        ["--model_loader_extra_config={}"],
        ["--model-l", "{}"],
        ["-tp=2"],
    ],
    ids=" ".join,
)
def test_flags_streamctl_sets_are_refused_however_spelled(argv: list[str]) -> None:
    with pytest.raises(UsageError, match="pass .* to streamctl"):
        _plain(argv)


def test_model_is_not_mistaken_for_an_abbreviation() -> None:
    # `--model` is an option of its own, though a prefix of --model-loader-extra-config
    assert _plain(["--max-model-len", "64"])[-2:] == ["--max-model-len", "64"]
    assert not secret_values(["--model", "x"])


# ------------------------------------------------------------------------------------------ vLLM as the judge

_SECRET_WORDS = re.compile(
    r"(^|_)(api_key|key|keys|token|tokens|secret|secrets|password|passwd|credential|credentials|auth)($|_)"
)
_NUMERIC_TYPES = {"int", "float", "human_readable_int", "human_readable_int_or_auto"}


def _oracle(argvs: list[list[str]]) -> dict[str, object]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as jobs:
        json.dump({"argvs": argvs}, jobs)
        jobs.flush()
        document = _run("serve_options.py", ["--jobs", jobs.name])
    assert document["ok"], document
    return document


def _leaves(value: object) -> list[str]:
    """Every string a parsed value holds (vLLM turns `--api-key.x K` into the JSON text '{"x": "K"}')."""
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, str) and value.startswith("{"):
        return _leaves(json.loads(value))
    return [str(value)]


PROBES = [
    *SPELLINGS,
    ["--api", K],  # ambiguous in vLLM (--api-key, --api-server-count): refused there; masked here anyway
    ["--a", K],
    ["-api-key", K],
    ["--API-KEY", K],
    ["--max-model-len", "2048"],
    ["--hf-token"],
    ["--served-model-name", K],
]


@requires_vllm_oracle
def test_against_vllms_own_parser() -> None:
    document = _oracle(PROBES)
    assert document["allow_abbrev"] is True  # why prefixes matter at all
    options = document["options"]
    real = {string for option in options for string in option["option_strings"]}
    # The table is the union of the supported releases' options: the newest (the default) has them all; an
    # older one none the table lacks.
    assert real <= set(VLLM_SERVE_OPTIONS), sorted(real - VLLM_SERVE_OPTIONS)
    if parse_version(installed_vllm_version())[:2] == parse_version(default_vllm_version())[:2]:
        assert real == set(VLLM_SERVE_OPTIONS), sorted(VLLM_SERVE_OPTIONS - real)

    # The secret options, derived from the parser: options that take a non-numeric value and whose name says
    # it is a key, token, secret, password or credential.
    derived = {
        max(option["option_strings"], key=len): option["nargs"]
        for option in options
        if _SECRET_WORDS.search(option["dest"]) and option["nargs"] != 0 and option["type"] not in _NUMERIC_TYPES
    }
    assert derived == SECRET_OPTIONS

    secret_dests = {option["dest"] for option in options if set(option["option_strings"]) & set(SECRET_OPTIONS)}
    for argv, parsed in zip(PROBES, document["parsed"], strict=False):
        given = {  # `--hf-token` alone is True (use the cached login): no secret in the command line
            dest: value for dest, value in parsed["values"].items() if dest in secret_dests and value is not True
        }
        values = secret_values(argv)
        if given:  # vLLM would receive a secret: streamctl masks every byte of it and refuses it in manifests
            assert values, (argv, given)
            shown = " ".join(masked_arguments(argv))
            for value in _leaves(given):
                assert value not in shown, (argv, given, shown)
        elif parsed["ok"]:  # vLLM reads no secret: streamctl shows it as written, refuses nothing
            assert not values, (argv, parsed)
