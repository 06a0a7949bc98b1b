"""The Ray actor of one capture rank (the driver wraps it with ``ray.remote``)."""
from __future__ import annotations

import shutil
import sys
import tempfile
import traceback

from actors.capture.request import CaptureRequest
from actors.capture.worker import run_capture
from actors.errors import TracefleetError
from actors.rank_base import RankWorkerBase


class CaptureActor(RankWorkerBase):
    """One rank of a capture: trains the workload and records its trace."""

    def capture(self, request: CaptureRequest, out_dir: str, return_bytes: bool = False) -> dict:
        """Run :func:`run_capture` (``request`` as the driver made it: Ray pickles it); the
        driver has exported the rendezvous env via setup().

        With ``return_bytes`` the trace is written to a private temp dir and its bytes come
        back as ``trace_bytes`` (and the profiler trace's as ``kineto_bytes``): no shared
        filesystem between the nodes and the driver.
        """
        work_dir = tempfile.mkdtemp(prefix="tracefleet-capture-") if return_bytes else out_dir
        try:
            result = run_capture(request, work_dir)
            if return_bytes:
                for path_key, bytes_key in (("path", "trace_bytes"), ("kineto_path", "kineto_bytes")):
                    if result[path_key]:
                        with open(result[path_key], "rb") as f:
                            result[bytes_key] = f.read()
            return result
        except TracefleetError:
            raise
        except Exception:
            # Only the exception's type and message reach the driver: keep the traceback
            # in the actor's log (streamed to the driver) for debugging.
            traceback.print_exc(file=sys.stderr)
            raise
        finally:
            if return_bytes:
                shutil.rmtree(work_dir, ignore_errors=True)
