"""Writing a file whole or not at all, and never through a link someone planted: every file
tracefleet writes into a folder that may already hold files (a run dir given again to
``tracefleet-report``, a prediction's ``out_dir``, a capture's ``out_dir``) goes through here.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

from actors.errors import writing


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: ``.<name>.<pid>.tmp`` beside it, then a rename. The
    rename replaces whatever ``path`` is, a planted symlink included (never written through),
    and the temp file is opened without following a link."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        with writing(path, path.name), os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:  # a full disk: no half-written temp file left beside
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_with(path: Path, write) -> None:
    """``write(buffer)`` into memory, then ``atomic_write`` it to ``path`` (for writers that
    take a file: matplotlib's ``savefig``, pandas' ``to_csv`` / ``to_parquet``)."""
    buffer = io.BytesIO()
    write(buffer)
    atomic_write(path, buffer.getvalue())
