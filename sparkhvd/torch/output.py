"""What a PyTorch run leaves besides checkpoints: a folder for a library's own files
(:func:`output_dir`), the newest whole checkpoint a library left there (:func:`last_checkpoint`),
and the model as TorchScript bytes (:func:`model_bytes`) -- public in :mod:`sparkhvd.torch`.
"""
from __future__ import annotations

import io
import os
from typing import Any, Optional

from sparkhvd.torch.training import unwrap

__side__ = "rank"


def last_checkpoint(folder: str, complete: str = "trainer_state.json") -> Optional[str]:
    """The newest *complete* ``checkpoint-N`` folder a library left in ``folder``, or None.

    A rank killed while its library wrote a checkpoint leaves a folder that is not whole; a
    Hugging Face ``Trainer`` writes ``trainer_state.json`` last, so a folder without it is
    skipped -- ``transformers``' own ``get_last_checkpoint`` would pick it and ``train`` then
    refuse it. The one line that resumes a ``Trainer`` after any relaunch::

        trainer.train(resume_from_checkpoint=st.last_checkpoint(args.output_dir))
    """
    import re

    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.exists(os.path.join(folder, name, complete)):
            found.append((int(match.group(1)), name))
    return os.path.join(folder, max(found)[1]) if found else None


def output_dir(name: str) -> str:
    """A folder for files a library writes itself -- Lightning's ``default_root_dir``,
    Hugging Face ``TrainingArguments(output_dir=...)`` -- that ends up in the run folder as
    ``<run folder>/<name>/``.

    On the driver's machine it *is* that folder. Elsewhere it is a folder on this rank's host
    whose files are copied into the run folder (through the driver's run-folder service) when
    the training function ends, however it ends -- nothing written there is lost.
    """
    from sparkhvd.runfolder.rank_files import output_folder

    return output_folder(name)


def model_bytes(model: Any, example_input: Any = None) -> bytes:
    """``model`` as TorchScript bytes: the run's model file (``model.pt``), which
    :func:`sparkhvd.load_model` and :func:`sparkhvd.predict` load without your Python class.

    Scripted (``torch.jit.script``); a model scripting cannot handle is traced with
    ``example_input`` (one batch).
    """
    import torch

    module = unwrap(model)
    was_training = module.training
    module.eval()
    try:
        try:
            scripted = torch.jit.script(module)
        except Exception as exc:  # noqa: BLE001 - any scripting failure: trace instead
            if example_input is None:
                why = (" -- a class defined in your script or notebook travels to the ranks "
                       "without its source file, which scripting reads" if
                       "source" in str(exc) else "")
                raise TypeError(
                    f"torch.jit.script cannot compile {type(module).__name__} ({exc}){why}. "
                    "Fix: pass one batch, model_bytes(model, example_input=x), to trace it; "
                    "or return model.state_dict() (saved as model.state_dict.pt).") from None
            scripted = torch.jit.trace(module, example_input)
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        return buffer.getvalue()
    finally:
        module.train(was_training)


__all__ = ["last_checkpoint", "output_dir", "model_bytes"]
