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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
