"""``sparkhvd.notebook``, the old name of :mod:`sparkhvd.ops.notebook`:
importing it gives that module itself (the same object, not a copy)."""
import sys

from sparkhvd.ops import notebook as _moved

__side__ = "public"

if __name__ != "__main__":  # ``python -m sparkhvd.notebook`` runs this file and does nothing
    sys.modules[__name__] = _moved
