"""Where a run resumes from, decided on the driver: ``HorovodRunner(resume_from=...)`` resolved
into a checkpoints folder, once, before the ranks start (they read it through the run-folder
service: :func:`sparkhvd.checkpoint.read.resume_store`).

A folder is one to resume from when it holds a complete checkpoint -- ``latest.json`` or any
checkpoint's record (:func:`sparkhvd.checkpoint.lineage.complete_in`): the rule every path
that looks for one keeps.
"""
from __future__ import annotations

from typing import Any, Optional

from sparkhvd.checkpoint.lineage import complete_in

__side__ = "driver"


def _holds(folder: str, storage_options: Optional[dict]) -> bool:
    """Whether ``folder`` (a URL) holds a complete checkpoint."""
    from sparkhvd import storage

    try:
        return complete_in(storage.listdir(folder, storage_options))
    except (FileNotFoundError, OSError):
        return False


def latest_checkpointed_run(root: str, storage_options: Optional[dict] = None,
                            exclude: Optional[str] = None) -> Optional[str]:
    """URL of the newest run folder under ``root`` whose ``checkpoints/`` holds a complete
    checkpoint."""
    from sparkhvd import storage

    root = root.rstrip("/")
    loc = storage.resolve(root, storage_options)
    if not storage.exists(loc):
        return None
    base = loc.path if loc.is_local else root
    for run_id in sorted(storage.listdir(loc), reverse=True):
        if run_id == exclude or run_id.startswith("."):
            continue
        if _holds(f"{base}/{run_id}/checkpoints", storage_options):
            return f"{base}/{run_id}"
    return None


def resolve_resume_source(resume_from: Any, output_dir: str,
                          storage_options: Optional[dict] = None,
                          exclude: Optional[str] = None) -> str:
    """The checkpoints folder ``resume_from`` points to (never run ``exclude``'s).

    ``True``: the newest run under ``output_dir`` with checkpoints. A URL: a run folder or a
    checkpoints folder. Raises FileNotFoundError naming what was looked for and the fix.
    """
    from sparkhvd import storage

    if resume_from is True:
        source = latest_checkpointed_run(output_dir, storage_options, exclude=exclude)
        if source is None:
            raise FileNotFoundError(
                f"resume_from=True, but no earlier run under {storage.public_url(output_dir)} has "
                "checkpoints (checkpoints/latest.json, or a checkpoint's record). Train with "
                "a checkpoint helper first (sparkhvd.keras.KerasDistributed checkpoints every "
                "epoch; sparkhvd.torch.Checkpoints when you save), or pass "
                "resume_from=<run folder URL>.")
        return f"{source}/checkpoints"
    url = str(resume_from).rstrip("/")
    for candidate in (f"{url}/checkpoints", url):
        if _holds(candidate, storage_options):
            return candidate
    raise FileNotFoundError(
        f"resume_from={storage.public_url(url)!r} has no checkpoints: looked for "
        f"{storage.public_url(url)}/checkpoints/ and {storage.public_url(url)}/ (latest.json, "
        "or a checkpoint's record). Pass a run folder trained with a checkpoint helper "
        "(sparkhvd.keras.KerasDistributed, sparkhvd.torch.Checkpoints), its checkpoints/ "
        "folder, or resume_from=True for the newest run under output_dir.")
