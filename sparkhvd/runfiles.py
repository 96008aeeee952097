"""Public: a rank's run folder (implementation: :mod:`sparkhvd.rank.runfiles`)."""
from sparkhvd.rank.runfiles import RunFiles, run_files

__all__ = ['RunFiles', 'run_files']
