"""The real-parallelism judge's own rules, without vLLM: what counts as a difference, which cases run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import real_parallelism
from real_parallelism import Run, differences, generate
from shard.test_real_parallelism import FAMILY_CASES, MATRIX_KINDS, Case, chosen_cases


def _run(tokens: list[int], logprobs: list[dict[str, float]]) -> dict[str, Any]:
    return {"outputs": [{"token_ids": tokens, "logprobs": logprobs}]}


STEPS = [{"5": -0.5, "7": -1.25}, {"9": -0.125, "5": -3.0}]


def test_identical_outputs_have_no_differences() -> None:
    assert differences(_run([5, 9], STEPS), _run([5, 9], [dict(step) for step in STEPS])) == []


def test_another_token_is_a_difference_named_by_prompt() -> None:
    assert differences(_run([5, 9], STEPS), _run([5, 7], STEPS)) == ["prompt 0: tokens [5, 7] != [5, 9]"]


def test_a_logprob_one_ulp_away_is_a_difference() -> None:
    moved = [dict(STEPS[0]), {**STEPS[1], "5": -3.0000000000000004}]
    assert differences(_run([5, 9], STEPS), _run([5, 9], moved)) == [
        "prompt 0 step 1 token 5: -3.0000000000000004 != -3.0"
    ]


def test_another_top_k_set_is_a_difference() -> None:
    other = [STEPS[0], {"9": -0.125, "6": -3.0}]
    assert differences(_run([5, 9], STEPS), _run([5, 9], other)) == [
        "prompt 0 step 1: top tokens ['6', '9'] != ['5', '9']"
    ]


def test_the_cases_ci_runs_are_one_per_family_and_the_matrix_is_every_row() -> None:
    assert chosen_cases("") == FAMILY_CASES
    assert [case.kind for case in chosen_cases("1")] == list(MATRIX_KINDS)
    assert chosen_cases("gemma2, phi3") == (Case("gemma2", 2), Case("phi3", 2))
    with pytest.raises(AssertionError, match="unknown kinds \\['bloomz'\\]"):
        chosen_cases("bloomz")


def test_a_judge_that_times_out_keeps_the_runs_it_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    finished = {"model": "a", "load_format": "auto", "seconds": 1.0, "error": None, "outputs": [{"token_ids": [1]}]}
    judge = tmp_path / "python"  # answers its first run, then hangs in its second
    judge.write_text(f"#!/bin/sh\necho '{json.dumps(finished)}'\nexec sleep 60\n")
    judge.chmod(0o755)
    monkeypatch.setenv(real_parallelism.ENV_VAR, str(judge))
    monkeypatch.setattr(real_parallelism, "START_TIMEOUT_S", 0)
    monkeypatch.setattr(real_parallelism, "LLM_TIMEOUT_S", 1)
    answer = generate([Run(Path("a"), "auto"), Run(Path("b"), "sharded_state")], tp=2)
    assert answer["ok"] is False
    assert answer["runs"][0] == finished
    assert answer["runs"][1] == {
        "model": "b",
        "load_format": "sharded_state",
        "outputs": [],
        "error": "timed out after 2 s",
    }
