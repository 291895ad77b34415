"""Subprocess worker for `serve --tune`: stream files with runai-model-streamer, print bytes and seconds.

Input: JSON on stdin `{"paths": [...]}`. Output: one JSON line `{"bytes": int, "seconds": float}`.
Exit 127 when the streamer is not installed. Settings come from RUNAI_STREAMER_* in the environment.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    request = json.load(sys.stdin)
    try:
        from runai_model_streamer import SafetensorsStreamer
    except ImportError:
        sys.exit(127)
    total = 0
    started = time.perf_counter()
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(list(request["paths"]))
        for _name, tensor in streamer.get_tensors():
            total += tensor.numel() * tensor.element_size()
    print(json.dumps({"bytes": total, "seconds": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
