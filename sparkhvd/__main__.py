"""``python -m sparkhvd ...``: the ``sparkhvd`` command (:mod:`sparkhvd.ops.cli`)."""
from sparkhvd.ops.cli import main

__side__ = "public"

if __name__ == "__main__":
    main()
