"""Scoring a DataFrame with a trained model on the executors (:func:`predict`), and loading a
run's model on the driver (:func:`load_model`). Driver side: the executors run what
:mod:`~sparkhvd.scoring.scorer` ships to them as a pandas UDF."""
from sparkhvd.common.faces import lazy_face

__side__ = "public"

__all__ = ["predict", "load_model"]
__getattr__, __dir__ = lazy_face(__name__, {"predict": "scorer", "load_model": "models"})
