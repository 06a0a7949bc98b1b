"""`tracefleet-compare SNAPSHOT.pickle PREDICTION`: a memory snapshot recorded on a GPU beside
the predicted one (orchestrator/reports/snapshot_compare.py): allocated and reserved peaks, the
op at each peak, the first point where the allocation streams part. Snapshots are read without
trusting them (orchestrator/reports/snapshot_file.py)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import orjson

from orchestrator.cli.app import guarded
from orchestrator.errors import ResultsError, SnapshotError
from orchestrator.outputs import RunDir
from orchestrator.studies.prediction import read_prediction

_EPILOG = """SNAPSHOT is a pickle from torch.cuda.memory._dump_snapshot (record with
torch.cuda.memory._record_memory_history() before the steps). PREDICTION is the run dir of
`tracefleet-predict ... predict.snapshot=true` (its snapshot_rank<r>.pickle; --rank picks one,
default the rank prediction.json's figures are of) or one such file. Exit status: 0 compared,
2 user error (a missing or refused file)."""


def predicted_file(prediction: Path, rank: int | None) -> Path:
    """The predicted snapshot a PREDICTION argument names."""
    if prediction.is_file():
        return prediction
    found = {int(m.group(1)): p for p in prediction.glob("snapshot_rank*.pickle")
             if (m := re.fullmatch(r"snapshot_rank(\d+)\.pickle", p.name))}
    if not found:
        raise SnapshotError(prediction, "no snapshot_rank<r>.pickle here (predict with "
                                        "predict.snapshot=true)")
    if rank is None:
        rank = _rank_of(RunDir(prediction).prediction)
        rank = rank if rank in found else min(found)
    if rank not in found:
        raise SnapshotError(prediction, f"no snapshot of rank {rank} (there are ranks "
                                        f"{sorted(found)})")
    return found[rank]


def _rank_of(meta: Path) -> int | None:
    """The rank ``prediction.json``'s figures are of (None when there is no such file)."""
    if not meta.is_file():
        return None
    try:
        return read_prediction(meta).rank
    except ResultsError as e:
        why = str(e).removeprefix(f"{meta}: ")
        raise SnapshotError(meta, f"not a whole prediction.json ({why}): pass --rank, or the "
                                  "snapshot file itself") from None


def main(argv: list[str] | None = None) -> int:
    """Console-script entry; returns the exit status (2 on a user error)."""
    parser = argparse.ArgumentParser(prog="tracefleet-compare", epilog=_EPILOG,
                                     description="Compare a memory snapshot recorded on a GPU "
                                                 "with tracefleet's predicted one.")
    parser.add_argument("snapshot", help="the recorded snapshot (.pickle)")
    parser.add_argument("prediction", help="a tracefleet-predict run dir, or a predicted .pickle")
    parser.add_argument("--rank", type=int, default=None, help="the predicted rank to compare")
    parser.add_argument("--device", type=int, default=None,
                        help="the recorded device (default: the one with the longest history)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    args = parser.parse_args(argv)

    def body() -> int:
        # pandas and the snapshot readers only once the arguments parsed: `--help` stays fast
        from orchestrator.reports.snapshot_compare import compare, compare_lines
        from orchestrator.reports.snapshot_file import read_snapshot

        pred_path = predicted_file(Path(args.prediction), args.rank)
        recorded = read_snapshot(args.snapshot)
        num_devices = len(recorded["device_traces"])
        if args.device is not None and not 0 <= args.device < num_devices:
            raise SnapshotError(args.snapshot, f"--device {args.device}: it holds the "
                                f"histories of {num_devices} device(s), 0..{num_devices - 1}")
        result = compare(recorded, read_snapshot(pred_path), args.device)
        if args.json:
            print(orjson.dumps({"recorded_file": args.snapshot, "predicted_file": str(pred_path),
                                **result}).decode())
        else:
            print("\n".join(compare_lines(result, args.snapshot, str(pred_path))))
        return 0

    return guarded("tracefleet-compare", body, args.debug, also=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
