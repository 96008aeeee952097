"""``sparkhvd.kerasio``, the old name of :mod:`sparkhvd.keras.modelio`:
importing it gives that module itself (the same object, not a copy)."""
import sys

from sparkhvd.keras import modelio as _moved

__side__ = "public"

if __name__ != "__main__":  # ``python -m sparkhvd.kerasio`` runs this file and does nothing
    sys.modules[__name__] = _moved
