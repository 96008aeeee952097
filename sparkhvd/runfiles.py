"""``sparkhvd.runfiles``, the old name of :mod:`sparkhvd.runfolder.rank_files`:
importing it gives that module itself (the same object, not a copy)."""
import sys

from sparkhvd.runfolder import rank_files as _moved

__side__ = "public"

if __name__ != "__main__":  # ``python -m sparkhvd.runfiles`` runs this file and does nothing
    sys.modules[__name__] = _moved
