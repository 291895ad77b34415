"""vLLM 0.33's own `get_pooling_config` on local model folders (oracle venv): the pooling it would serve with.

    pooling_config.py --jobs JOBS.json   # a JSON list of folder paths

Prints ONE JSON document: {"ok": true, "results": [{"pooling": <get_pooling_config's dict, or null>,
"error": null}], "error": null}. Pooling types are printed by name (they are enums).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import _harness as h


def pooling(folder: str) -> dict[str, Any]:
    from vllm.transformers_utils.config import get_pooling_config

    try:
        config = get_pooling_config(folder, revision=None)
    except Exception as error:  # noqa: BLE001 - the verdict: vLLM could not read the sentence-transformers config
        return {"pooling": None, "error": f"{type(error).__name__}: {error}"[:1000]}
    if config is None:
        return {"pooling": None, "error": None}
    return {"pooling": {key: str(value) for key, value in sorted(config.items())}, "error": None}


def main() -> int:
    out = h.redirect_stdout_to_stderr()
    if len(sys.argv) != 3 or sys.argv[1] != "--jobs":
        h.emit(out, {"ok": False, "results": [], "error": "usage: pooling_config.py --jobs JOBS.json"})
        return 2
    with open(sys.argv[2]) as handle:
        folders = json.load(handle)
    h.emit(out, {"ok": True, "results": [pooling(folder) for folder in folders], "error": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
