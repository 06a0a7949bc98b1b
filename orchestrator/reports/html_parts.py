"""HTML pieces both pages (the run report, prediction.html) are built from: self-contained,
so a page is one file that opens anywhere, offline."""
from __future__ import annotations

import base64
import html
from pathlib import Path


def kv_table(pairs) -> str:
    """A two-column table of (label, value) strings, escaped."""
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                               for k, v in pairs) + "</table>"


def grid(header: list[str], rows) -> str:
    """A table with a header row and rows of strings, escaped."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def img(path: Path, alt: str) -> str:
    """The PNG at ``path`` inlined as a data URI (the page carries its plots)."""
    data = base64.b64encode(path.read_bytes()).decode()
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"
