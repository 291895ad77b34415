"""Ask vLLM 0.33 whether it builds each folder's model config without --trust-remote-code (oracle venv).

    model_config.py FOLDER...

For each FOLDER: `vllm.transformers_utils.config.get_config(FOLDER, trust_remote_code=False)`, vLLM's own
config loading (transformers' AutoConfig underneath; nothing of the repo's code runs). Also the model types
vLLM builds a config for itself: transformers' CONFIG_MAPPING_NAMES and vLLM's _CONFIG_REGISTRY.

Prints ONE JSON document: {"ok", "results": [{"folder", "loads", "error"}], "known_model_types", "error"}.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import _harness as h


def load(folder: str) -> dict[str, Any]:
    from vllm.transformers_utils.config import get_config

    try:
        get_config(folder, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 -- the verdict: vLLM refuses, in its own words
        return {"folder": folder, "loads": False, "error": f"{type(error).__name__}: {error}"[:500]}
    return {"folder": folder, "loads": True, "error": None}


def main() -> int:
    out = h.redirect_stdout_to_stderr()
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from vllm.transformers_utils.config import _CONFIG_REGISTRY

        known = sorted(set(CONFIG_MAPPING_NAMES) | set(_CONFIG_REGISTRY.keys()))
        results = [load(folder) for folder in sys.argv[1:]]
    except Exception:  # noqa: BLE001 -- a verdict of "could not decide", with vLLM's own words
        h.emit(out, {"ok": False, "results": [], "known_model_types": [], "error": traceback.format_exc()})
        return 1
    h.emit(out, {"ok": True, "results": results, "known_model_types": known, "error": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
