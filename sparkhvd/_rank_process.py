"""``python -m sparkhvd._rank_process PAYLOAD RESULT_DIR OPTIONS_JSON``: one driver-local rank.

Kept apart from :mod:`sparkhvd.rank` so that ``-m`` does not re-execute a module the package
already imported.
"""
from __future__ import annotations

import json
import os
import sys

import cloudpickle

from sparkhvd.rank import current_rank, rank_main


def main(argv: list[str]) -> int:
    """Run one rank and store its return value as ``RESULT_DIR/rank-N.pkl`` (atomically)."""
    payload_path, result_dir, options_json = argv
    options = json.loads(options_json)
    with open(payload_path, "rb") as f:
        payload = f.read()
    result = rank_main(payload, options)
    rank = current_rank()[0]
    if rank == 0 or options.get("return_all"):
        final = os.path.join(result_dir, f"rank-{rank}.pkl")
        with open(final + ".tmp", "wb") as f:
            cloudpickle.dump(result, f)
        os.replace(final + ".tmp", final)
    return 0


def _exit(code: int) -> None:
    """Run Python's exit handlers and flush, then leave without C++ static destructors.

    Third-party native libraries (pyarrow's and TensorFlow's thread pools, Gloo) can abort
    with "terminate called without an active exception" while the interpreter tears down,
    turning a finished rank into a SIGABRT.
    """
    import atexit
    import logging
    import traceback

    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    except BaseException:  # noqa: BLE001 - exit handlers must not change the outcome
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported by rank_main; the traceback goes to stderr
        import traceback

        traceback.print_exc()
        status = 1
    _exit(status)
