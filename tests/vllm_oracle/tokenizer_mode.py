"""Ask vLLM 0.33 which tokenizer it would load from each folder (oracle venv): its own selection code.

    tokenizer_mode.py FOLDER[=MODE]...

For each FOLDER, with vLLM's and mistral_common's own functions, nothing loaded:
  - "auto_mode": the mode `resolve_tokenizer_args(FOLDER, tokenizer_mode="auto")` picks ("mistral" when
    the folder has `consolidated*.safetensors` and `tekken.json` or `tokenizer.model.v*`, else "hf");
  - "mode": the mode vLLM takes with `--tokenizer-mode MODE` (the same call; MODE defaults to auto);
  - "mistral_file": the file `--tokenizer-mode mistral` loads (`get_one_valid_tokenizer_file` over the
    folder's names, as transformers' MistralCommonBackend.from_pretrained does), or null when there is none.

Prints ONE JSON document: {"ok", "results": [{"folder", "auto_mode", "mode", "mistral_file"}], "error"}.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import _harness as h


def choose(argument: str) -> dict[str, Any]:
    from mistral_common.tokens.tokenizers.utils import get_one_valid_tokenizer_file
    from vllm.tokenizers.registry import resolve_tokenizer_args

    folder, _, asked = argument.partition("=")
    mode = resolve_tokenizer_args(folder, tokenizer_mode="auto")[0]
    given = resolve_tokenizer_args(folder, tokenizer_mode=asked or "auto")[0]
    try:
        mistral_file: str | None = get_one_valid_tokenizer_file(sorted(os.listdir(folder)))
    except ValueError:  # "No tokenizer file found."
        mistral_file = None
    return {"folder": folder, "auto_mode": mode, "mode": given, "mistral_file": mistral_file}


def main() -> int:
    out = h.redirect_stdout_to_stderr()
    try:
        results = [choose(folder) for folder in sys.argv[1:]]
    except Exception:  # noqa: BLE001 -- a verdict of "could not decide", with vLLM's own words
        h.emit(out, {"ok": False, "results": [], "error": traceback.format_exc()})
        return 1
    h.emit(out, {"ok": True, "results": results, "error": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
