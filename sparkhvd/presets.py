"""``sparkhvd.presets``, the old name of :mod:`sparkhvd.spark.presets`:
importing it gives that module itself (the same object, not a copy)."""
import sys

from sparkhvd.spark import presets as _moved

__side__ = "public"

if __name__ != "__main__":  # ``python -m sparkhvd.presets`` runs this file and does nothing
    sys.modules[__name__] = _moved
