"""Headless Chromium for the page tests (the run report's, prediction.html, memory_viz's):
Debian's chromium-headless-shell, which .ci/run installs. Wherever a browser is, the check
runs; under CI=true a missing one fails the test instead of skipping it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium-headless-shell") or shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# scripts/test.sh looks for this reason to say the browser check was skipped.
NO_BROWSER = "chromium-headless-shell is not installed"


def require_browser() -> str:
    """The browser's path; skips the test without one (fails it under CI=true)."""
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {NO_BROWSER}: the page's browser check cannot run "
                        "(.ci/run installs it with apt-get; did that fail?)")
        pytest.skip(NO_BROWSER)
    return CHROMIUM


def chromium(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    """One bounded headless Chromium run with its own profile under ``tmp_path``."""
    return subprocess.run([require_browser(), *FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                           *args], capture_output=True, text=True, timeout=120)


def dom_after_scripts(page: Path, tmp_path: Path, budget_ms: int = 5000) -> str:
    """The page's DOM once its scripts ran (virtual time, so no wall-clock wait)."""
    proc = chromium(tmp_path, f"--virtual-time-budget={budget_ms}", "--dump-dom", page.as_uri())
    return proc.stdout


def probe_text(dom: str, probe_id: str) -> str | None:
    m = re.search(rf'<pre id="{probe_id}">(.*?)</pre>', dom, re.S)
    return m.group(1) if m else None
