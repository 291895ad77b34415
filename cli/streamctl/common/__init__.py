"""Small helpers every layer may use: words and sizes as printed, limits, memory, libc calls, redaction."""
