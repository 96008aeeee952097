"""``sparkhvd.cli``, the old name of :mod:`sparkhvd.ops.cli`: importing it gives that module
itself (the same object, not a copy), and ``python -m sparkhvd.cli`` is ``python -m
sparkhvd``."""
import sys

from sparkhvd.ops import cli as _moved

__side__ = "public"

if __name__ == "__main__":
    _moved.main()
else:
    sys.modules[__name__] = _moved
