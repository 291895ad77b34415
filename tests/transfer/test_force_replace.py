"""`transfer --force` into a prefix holding another model replaces it, on every backend.

It used to copy the new model's files over the old ones and leave the old model's other shards behind, so
verify-index found `tensor-in-two-shards` (exit 1). Now the files the previous streamctl manifest names and
the new plan does not are removed, after the new files are complete (never before); the plan shows them
(text and --json) and the result lists them. Files no streamctl manifest names are never removed: the plan
lists them as left alone.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.errors import UsageError
from streamctl.retry import RetryPolicy
from streamctl.storage import open_location
from streamctl.storage.base import Location
from streamctl.transfer import TransferOptions, execute_transfer, plan_transfer
from streamctl.verify.run import verify_checkpoint

MiB = 1024 * 1024
FAST_RETRY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)
OPTIONS = TransferOptions(part_size=5 * MiB, max_buffer=20 * MiB, concurrency=4, retry=FAST_RETRY)
FORCE = TransferOptions(part_size=5 * MiB, max_buffer=20 * MiB, concurrency=4, retry=FAST_RETRY, force=True)
TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def write_checkpoint(
    folder: Path, shards: int, seed: int, big: int = 64, extra: dict[str, bytes] | None = None
) -> set[str]:
    """An indexed checkpoint whose TENSORS are spread over `shards` files; returns its shard names."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    names = [f"model-{index + 1:05d}-of-{shards:05d}.safetensors" for index in range(shards)]
    weight_map = {tensor: names[index % shards] for index, tensor in enumerate(TENSORS)}
    for name in names:
        tensors = [(tensor, "U8", [big], rng.randbytes(big)) for tensor, file in weight_map.items() if file == name]
        (folder / name).write_bytes(safetensors_bytes(tensors))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "seed": seed}))
    (folder / "tokenizer.json").write_text("{}")
    for name, data in (extra or {}).items():
        (folder / name).write_bytes(data)
    return set(names)


def names_in(location: Location) -> set[str]:
    return {location.relative(info.key) for info in location.list()}


def transfer(source: Path, dest: str, options: TransferOptions) -> tuple[Any, Any]:
    source_location, dest_location = open_location(str(source)), open_location(dest)
    plan = plan_transfer(source_location, dest_location, str(source), options)
    return plan, execute_transfer(plan, source_location, dest_location, options)


def test_force_replaces_another_model_on_every_backend(tmp_path: Path, any_root: str) -> None:
    old = write_checkpoint(tmp_path / "one", shards=2, seed=1)
    new = write_checkpoint(tmp_path / "two", shards=3, seed=2)
    dest = f"{any_root}/model"
    transfer(tmp_path / "one", dest, OPTIONS)
    with pytest.raises(UsageError, match="already holds"):
        transfer(tmp_path / "two", dest, OPTIONS)
    plan, result = transfer(tmp_path / "two", dest, FORCE)
    assert set(plan.cleanup.to_remove) == old - new
    assert set(result.removed) == old - new and result.to_json()["removed"] == list(result.removed)
    location = open_location(dest)
    assert names_in(location) == new | {"model.safetensors.index.json", "config.json", "tokenizer.json", MANIFEST_NAME}
    report = verify_checkpoint(location)
    assert report.ok, report.errors
    assert json.loads(location.store.read_range(location.key(MANIFEST_NAME), 0, 1 << 20))["source"] == str(
        tmp_path / "two"
    )


class FailingParts:
    """Wraps a store: every multipart part fails (not retried), as a dropped link would."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start_multipart(
        self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None
    ) -> Any:
        upload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                raise UsageError("injected failure")

            def kernel_copier(self) -> Any:  # a local DEST's copy inside the kernel fails the same way
                def failing(source_fd: int, offset: int, length: int) -> int:
                    raise UsageError("injected failure")

                return failing

        return Upload()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_nothing_is_removed_before_the_new_files_are_complete(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    old = write_checkpoint(tmp_path / "one", shards=2, seed=1)
    write_checkpoint(tmp_path / "two", shards=3, seed=2, big=6 * MiB)  # multipart: its parts fail
    dest = f"{request.getfixturevalue(f'{backend}_root')}/model"
    transfer(tmp_path / "one", dest, OPTIONS)
    before = names_in(open_location(dest))
    location = open_location(dest)
    failing = Location(FailingParts(location.store), location.prefix)  # type: ignore[arg-type]
    plan = plan_transfer(open_location(str(tmp_path / "two")), failing, str(tmp_path / "two"), FORCE)
    assert set(plan.cleanup.to_remove) == old - {"model-00001-of-00003.safetensors"}
    with pytest.raises(UsageError, match="injected failure"):
        execute_transfer(plan, open_location(str(tmp_path / "two")), failing, FORCE)
    assert old <= names_in(location) and MANIFEST_NAME in names_in(location)
    assert names_in(location) >= before - {"model.safetensors.index.json", "config.json", "tokenizer.json"}


def test_without_a_manifest_force_removes_nothing_it_did_not_write(
    tmp_path: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    old = write_checkpoint(tmp_path / "one", shards=2, seed=1)
    write_checkpoint(tmp_path / "two", shards=3, seed=2)
    dest = f"{s3_root}/model"
    location = open_location(dest)
    for name in [*sorted(old), "notes.txt"]:  # copied there by hand: no streamctl manifest names them
        data = (tmp_path / "one" / name).read_bytes() if name in old else b"mine"
        location.store.put(location.key(name), data)
    planned = run_cli("transfer", str(tmp_path / "two"), dest, "--force", "--dry-run", "--json", env=storage_env)
    assert planned.exit_code == 0, planned.stderr
    document = planned.json()
    assert document["to_remove"] == []
    left = {item["path"]: item["reason"] for item in document["left_alone"]}
    assert left == dict.fromkeys([*sorted(old), "notes.txt"], "not written by streamctl")
    text = run_cli("transfer", str(tmp_path / "two"), dest, "--force", "--dry-run", env=storage_env)
    assert text.exit_code == 0 and "leave alone" in text.stdout and "not written by streamctl" in text.stdout
    done = run_cli("transfer", str(tmp_path / "two"), dest, "--force", "--no-verify", "--json", env=storage_env)
    assert done.exit_code == 0, done.stderr
    assert done.json()["removed"] == []
    assert old | {"notes.txt"} <= names_in(location)


def test_the_plan_and_the_result_show_what_force_removes(
    tmp_path: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    old = write_checkpoint(tmp_path / "one", shards=2, seed=1)
    new = write_checkpoint(tmp_path / "two", shards=3, seed=2)
    dest = f"{s3_root}/model"
    assert run_cli("transfer", str(tmp_path / "one"), dest, env=storage_env).exit_code == 0
    planned = run_cli("transfer", str(tmp_path / "two"), dest, "--force", "--dry-run", "--json", env=storage_env)
    assert planned.exit_code == 0 and set(planned.json()["to_remove"]) == old - new
    text = run_cli("transfer", str(tmp_path / "two"), dest, "--force", "--dry-run", env=storage_env)
    assert "remove" in text.stdout and "model-00002-of-00002.safetensors" in text.stdout
    assert "in DEST to remove after copying" in text.stdout
    done = run_cli("transfer", str(tmp_path / "two"), dest, "--force", "--json", env=storage_env)
    assert done.exit_code == 0, done.stdout + done.stderr
    document = done.json()
    assert set(document["removed"]) == old - new and document["verify"]["ok"]
    human = run_cli("transfer", str(tmp_path / "one"), dest, "--force", env=storage_env)
    assert human.exit_code == 0 and "removed 3 files an earlier streamctl run wrote" in human.stdout, human.stdout


def test_files_an_earlier_run_left_stay_known_to_a_later_force(tmp_path: Path, local_root: str) -> None:
    """Same source, fewer files, no --force: the old extra files stay (listed), and the new manifest keeps
    naming them, so a later --force still removes them."""
    write_checkpoint(tmp_path / "one", shards=2, seed=1, extra={"README.md": b"# readme\n"})
    everything = TransferOptions(all_files=True, retry=FAST_RETRY)
    transfer(tmp_path / "one", local_root, everything)
    plan, _ = transfer(tmp_path / "one", local_root, OPTIONS)
    assert [(item.path, item.streamctl) for item in plan.cleanup.left_alone] == [("README.md", True)]
    manifest = json.loads((Path(local_root) / MANIFEST_NAME).read_text())
    assert manifest["older_files"] == ["README.md"]
    plan, result = transfer(tmp_path / "one", local_root, FORCE)
    assert result.removed == ("README.md",) and not (Path(local_root) / "README.md").exists()


def test_a_sharded_checkpoint_is_not_overwritten_without_force(tmp_path: Path) -> None:
    from shard_models import write_model

    write_model(tmp_path / "hf", "llama-gqa")
    assert run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "tp2"), "-tp", "2").exit_code == 0
    write_checkpoint(tmp_path / "two", shards=3, seed=2)
    result = run_cli("transfer", str(tmp_path / "two"), str(tmp_path / "tp2"))
    assert result.exit_code == 2 and "streamctl shard" in result.stderr, result.stderr
    # With --force the sharded files go (the shard manifest names them), and the new model verifies.
    result = run_cli("transfer", str(tmp_path / "two"), str(tmp_path / "tp2"), "--force", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not list((tmp_path / "tp2").glob("model-rank-*")) and result.json()["verify"]["ok"]
    # A sharded checkpoint transferred elsewhere carries its own shard manifest: a re-run is not refused.
    assert run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "tp2b"), "-tp", "2").exit_code == 0
    for _ in range(2):
        copied = run_cli("transfer", str(tmp_path / "tp2b"), str(tmp_path / "copy"))
        assert copied.exit_code == 0, copied.stderr


def test_a_crowded_dest_is_summed_up_in_the_text_plan_and_listed_in_json(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "two", shards=3, seed=2)
    dest = tmp_path / "bucket-like"
    dest.mkdir()
    for index in range(25):
        (dest / f"someone-{index:02d}.txt").write_text("theirs")
    text = run_cli("transfer", str(tmp_path / "two"), str(dest), "--force", "--dry-run")
    assert text.exit_code == 0 and "... and 5 more" in text.stdout and "25 in DEST left alone" in text.stdout
    assert "someone-19.txt" in text.stdout and "someone-20.txt" not in text.stdout
    document = run_cli("transfer", str(tmp_path / "two"), str(dest), "--force", "--dry-run", "--json").json()
    assert len(document["left_alone"]) == 25
