"""Identical files as hard links: 1,024 copies of one trace (or memory timeline) cost no disk,
and a reader can tell them identical by inode without reading them."""
from __future__ import annotations

import os
import shutil


def link_or_copy(src: str, dst: str) -> None:
    """``dst`` as a hard link of ``src`` (replacing an older ``dst``), or a copy where the
    filesystem refuses links (another device, no link support)."""
    if os.path.lexists(dst):
        os.unlink(dst)  # e.g. a previous capture's file: os.link refuses to replace it
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
