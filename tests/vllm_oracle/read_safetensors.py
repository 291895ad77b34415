"""What three readers load from a checkpoint (oracle venv): the reference safetensors reader, vLLM 0.33's
weight iterator and the Run:ai streamer 0.17, each run to the last byte.

    read_safetensors.py --jobs JOBS.json   # [{"folder": PATH}, ...]: a folder of .safetensors files

The files read are the folder's top-level `*.safetensors`, filtered by `model.safetensors.index.json` when
there is one as vLLM filters them (`filter_duplicate_safetensors_files`: json.load, every file the
weight_map's values name; transformers selects its shards the same way). Then:
  "safetensors": safetensors.safe_open(framework="numpy").get_tensor for every key (numpy builds the array)
  "vllm":        vllm...weight_utils.safetensors_weights_iterator (safetensors' torch back end)
  "streamer":    runai_model_streamer.SafetensorsStreamer, as vLLM's runai_streamer loader streams
Prints ONE JSON document: {"ok": true, "results": [{READER: {"ok", "tensors": {name: [shape, sha256 of the
bytes]}, "error"}}], "error": null}; a reader's "ok" is its verdict.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import _harness as h

Loaded = Iterable[tuple[str, list[int], bytes]]


def _files(folder: str) -> list[str]:
    from vllm.model_executor.model_loader.weight_utils import filter_duplicate_safetensors_files

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    return filter_duplicate_safetensors_files(files, folder, "model.safetensors.index.json")


def _torch_bytes(tensor: Any) -> bytes:
    import torch

    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def reference(files: list[str]) -> Loaded:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="numpy") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                array = handle.get_tensor(name)
                yield name, list(array.shape), array.tobytes()


def vllm_iterator(files: list[str]) -> Loaded:
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    for name, tensor in safetensors_weights_iterator(files, False):
        yield name, list(tensor.shape), _torch_bytes(tensor)


def streamer(files: list[str]) -> Loaded:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as stream:
        stream.stream_files(files)
        for name, tensor in stream.get_tensors():
            yield name, list(tensor.shape), _torch_bytes(tensor)


READERS: dict[str, Callable[[list[str]], Loaded]] = {
    "safetensors": reference,
    "vllm": vllm_iterator,
    "streamer": streamer,
}


def verdict(read: Callable[[list[str]], Loaded], files: list[str]) -> dict[str, Any]:
    try:
        tensors = {name: [shape, hashlib.sha256(data).hexdigest()] for name, shape, data in read(files)}
    except Exception as error:  # noqa: BLE001 - the verdict: any refusal is the reader's answer
        return {"ok": False, "tensors": {}, "error": h.describe(error)[:500]}
    return {"ok": True, "tensors": tensors, "error": None}


def read_folder(job: dict[str, Any]) -> dict[str, Any]:
    try:
        files = _files(job["folder"])
    except Exception as error:  # noqa: BLE001 - vLLM refused the index itself: every reader fails the same
        failed = {"ok": False, "tensors": {}, "error": h.describe(error)[:500]}
        return dict.fromkeys(READERS, failed)
    return {name: verdict(read, files) for name, read in READERS.items()}


def main() -> int:
    out = h.redirect_stdout_to_stderr()
    if len(sys.argv) != 3 or sys.argv[1] != "--jobs":
        h.emit(out, {"ok": False, "results": [], "error": "usage: read_safetensors.py --jobs JOBS.json"})
        return 2
    with open(sys.argv[2]) as handle:
        jobs = json.load(handle)
    h.emit(out, {"ok": True, "results": [read_folder(job) for job in jobs], "error": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
