"""`tracefleet-report DIR`: PNG plots and one self-contained HTML page for a run or sweep dir."""
from __future__ import annotations

import argparse
import sys

from orchestrator.cli.app import guarded
from orchestrator.outputs import REPORT_PLOTS_DIR

_EPILOG = """DIR is a run dir (with summary.json), a sweep root (multirun/sweep-<id>, with
results.csv) or a min_memory run dir. Writes DIR/report.html (images embedded) and the PNGs
under DIR/report/. Exit status: 0 written, 2 user error (not such a dir)."""


def main(argv: list[str] | None = None) -> int:
    """Console-script entry; returns the exit status (2 on a user error)."""
    parser = argparse.ArgumentParser(prog="tracefleet-report", epilog=_EPILOG,
                                     description="Write the plots and the HTML report of a "
                                                 "tracefleet run, sweep or search.")
    parser.add_argument("dir", help="a run dir, a sweep root or a min_memory run dir")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    args = parser.parse_args(argv)
    from orchestrator.reports.html_report import write_report  # matplotlib: after --help

    def body() -> int:
        page = write_report(args.dir)
        images = sorted((page.parent / REPORT_PLOTS_DIR).glob("*.png"))
        print(f"{page} ({len(images)} plots in {page.parent / REPORT_PLOTS_DIR})")
        return 0

    # OSError: an unreadable or read-only dir
    return guarded("tracefleet-report", body, args.debug, also=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
