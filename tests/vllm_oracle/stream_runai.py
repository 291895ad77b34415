"""Stream safetensors files with the Run:ai Model Streamer 0.17 itself (oracle venv): does it read them?

    stream_runai.py --jobs JOBS.json   # [{"paths": [file, ...], "env": {NAME: VALUE}, "hash": bool}, ...]

Each job sets its environment variables (RUNAI_STREAMER_MEMORY_LIMIT, RUNAI_STREAMER_CONCURRENCY, ...),
opens a `SafetensorsStreamer`, streams the files to the CPU as vLLM's runai_streamer loader does, and puts
them back. Prints ONE JSON document: {"ok": true, "results": [{"ok", "tensors": [[name, torch dtype,
shape]], "sha256": {name: hex digest of its bytes} (jobs with "hash" only), "error"}], "error": null}; a job's
"ok" is the streamer's verdict, the top "ok" that every job ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import _harness as h


def stream(paths: list[str], env: dict[str, str], digests: bool = False) -> dict[str, Any]:
    import torch
    from runai_model_streamer import SafetensorsStreamer

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        tensors, sha256 = [], {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(paths)
            for name, tensor in streamer.get_tensors():
                tensors.append([name, str(tensor.dtype), list(tensor.shape)])
                if digests:
                    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                    sha256[name] = hashlib.sha256(raw.tobytes()).hexdigest()
        return {"ok": True, "tensors": tensors, **({"sha256": sha256} if digests else {}), "error": None}
    except Exception as error:  # noqa: BLE001 - the verdict: any refusal is the streamer's answer
        return {"ok": False, "tensors": [], "error": f"{type(error).__name__}: {error}"[:1000]}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> int:
    out = h.redirect_stdout_to_stderr()
    if len(sys.argv) != 3 or sys.argv[1] != "--jobs":
        h.emit(out, {"ok": False, "results": [], "error": "usage: stream_runai.py --jobs JOBS.json"})
        return 2
    with open(sys.argv[2]) as handle:
        jobs = json.load(handle)
    results = [stream(job["paths"], job.get("env", {}), bool(job.get("hash"))) for job in jobs]
    h.emit(out, {"ok": True, "results": results, "error": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
