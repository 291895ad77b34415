"""`streamctl verify-index` as a library, reading headers only: report.py (findings, options, the report: the
stable contract), reading.py (listing and parallel header reads), indexed.py (index vs headers), sharded.py
(vLLM sharded state), folder.py (serving files and config), run.py (verify_checkpoint, detect_layout)."""
