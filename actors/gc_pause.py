"""Pausing Python's cyclic garbage collector around phases that build or walk millions of
long-lived objects none of which form a reference cycle (a trace's ops, a replay's steps).

Left on, every generation-2 collection rescans the whole heap: on a Llama-70B trace (about a
million tracked objects) each costs 1-3 s and a dry-run probe met a dozen of them, against a
few seconds of actual work. Reference counting still frees everything acyclic at once; cycles
made meanwhile are collected after the pause.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """Disable the cyclic GC inside the block (re-enabled after it if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
