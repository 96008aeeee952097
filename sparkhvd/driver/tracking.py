"""MLflow tracking for ``HorovodRunner(mlflow=True | "experiment")`` -- optional, off by default.

One MLflow run per training run, written from the driver only (rank 0's per-epoch records
arrive there as :class:`~sparkhvd.common.protocol.Metrics` events, the same records that make
``metrics.csv``). The run folder stays the single source of truth; MLflow gets:

- params: np, mode, launcher, the function, its scalar keyword arguments, package versions;
- metrics: every epoch record, logged as it arrives (``step`` = epoch); every rank's system
  metrics as ``system/rank_<N>/<name>`` (MLflow's own shape for a node, so its System metrics
  tab shows them; :mod:`sparkhvd.timing`); ``world_size`` per attempt;
- tags: each resize (``sparkhvd.resizeN``) and what the time split found (``sparkhvd.findingN``:
  a straggler, an input- or communication-bound run);
- artifacts: ``run.json``, ``metrics.csv``, ``curves.png``, ``report.html``, ``timing.jsonl``,
  the rank logs, and the model (as
  MLflow's Keras/TensorFlow flavour where it loads, else the file);
- tags linking both ways: ``sparkhvd.run_id`` / ``sparkhvd.run_folder`` on the MLflow run, and
  ``mlflow`` (tracking URI, experiment, run id) in ``run.json``;
- status: FINISHED, FAILED (a rank failed, a storage error) or KILLED (interrupted, timed out).

The tracking store is MLflow's own: ``MLFLOW_TRACKING_URI`` when set, else its local default
(MLflow 3: ``sqlite:///mlflow.db``; MLflow 2: ``./mlruns``) -- works offline, no server needed,
and no extra environment variable (MLflow 3 refuses its file store unless one is set, so
sparkhvd never picks that store itself). Every value passes through the redaction
(:mod:`sparkhvd.common.redaction`): no credential reaches a param, a tag or an artifact.

MLflow 2 and 3 both work (runtimes ship either): on MLflow 3 the model is a *logged model*
(``log_model(name=...)``, its id recorded in ``run.json`` as ``mlflow.model_id``), on MLflow 2
an artifact folder ``model`` of the run.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping, Optional, Union

from sparkhvd.common.errors import EnvironmentMismatchError
from sparkhvd.common.redaction import SECRET_NAME, redact

__side__ = "driver"

log = logging.getLogger(__name__)

INSTALL_HINT = ("MLflow tracking needs the 'mlflow' extra: pip install 'sparkhvd[mlflow]' "
                "(or pip install mlflow), then run again.")


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as exc:
        raise EnvironmentMismatchError(f"{INSTALL_HINT} ({exc})") from None
    return mlflow


def _scalar_params(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """The function's scalar keyword arguments, redacted; credential-looking names dropped."""
    out = {}
    for name, value in kwargs.items():
        if isinstance(value, (bool, int, float, str)) and not SECRET_NAME.search(name):
            out[f"fn.{name}"] = redact(str(value))[:500]
    return out


class MlflowTracker:
    """One MLflow run for one sparkhvd run (see the module docstring)."""

    def __init__(self, experiment: Union[bool, str]) -> None:
        self.mlflow = _import_mlflow()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        self.tracking_uri = self.mlflow.get_tracking_uri()
        name = experiment if isinstance(experiment, str) else "sparkhvd"
        found = self.client.get_experiment_by_name(name)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(name)
        self.experiment = name
        self.major = int(str(getattr(self.mlflow, "__version__", "2")).split(".")[0] or 2)
        self.run_id: Optional[str] = None
        self.model_id: Optional[str] = None  # MLflow 3's logged model, once logged
        self._resizes = 0
        self._lock = threading.Lock()

    def start(self, run_dir: Any, params: Mapping[str, Any], kwargs: Mapping[str, Any]) -> None:
        from sparkhvd.storage import public_url

        run = self.client.create_run(self.experiment_id, run_name=run_dir.run_id, tags={
            "sparkhvd.run_id": run_dir.run_id,
            "sparkhvd.run_folder": public_url(run_dir.url)})
        self.run_id = run.info.run_id
        values = {k: redact(str(v))[:500] for k, v in params.items() if v is not None}
        values.update(_scalar_params(kwargs))
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in values.items()])
        run_dir.record.tracked(tracking_uri=public_url(redact(self.tracking_uri)),
                               experiment=self.experiment, run_id=self.run_id)

    def metrics(self, record: Mapping[str, Any]) -> None:
        """One epoch's record (called from a launcher thread as it arrives)."""
        if self.run_id is None:
            return
        import time

        from mlflow.entities import Metric

        step = int(record.get("epoch", 0))
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in record.items()
                 if k != "epoch" and isinstance(v, (int, float))]
        with self._lock:
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as exc:  # noqa: BLE001 - tracking must never stop training
                log.warning("MLflow: could not log epoch %s: %s", step, redact(str(exc)))

    def system_metrics(self, rank: int, metrics: Mapping[str, float], step: int) -> None:
        """One rank's system metrics in MLflow's own shape (``system/rank_<N>/<name>``, as its
        ``SystemMetricsMonitor`` logs a node's), so the run's System metrics tab shows them."""
        if self.run_id is None:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"system/rank_{rank}/{name}", float(value), now, step)
                 for name, value in metrics.items() if isinstance(value, (int, float))]
        with self._lock:
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as exc:  # noqa: BLE001 - tracking must never stop training
                log.debug("MLflow: could not log rank %d's system metrics: %s", rank,
                          redact(str(exc)))

    def finding(self, number: int, text: str) -> None:
        """What the time split found (a straggler, an input-bound run) as a tag
        ``sparkhvd.findingN``."""
        if self.run_id is None:
            return
        try:
            self.client.set_tag(self.run_id, f"sparkhvd.finding{number}", redact(text)[:500])
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            log.warning("MLflow: could not record a finding: %s", redact(str(exc)))

    def transition(self, entry: Mapping[str, Any]) -> None:
        """A change of the run's state: the world size of every attempt as the metric
        ``world_size`` (step = attempt), and each resize as a tag ``sparkhvd.resizeN``
        ("3 -> 2: why, from checkpoint")."""
        if self.run_id is None:
            return
        try:
            if entry["state"] == "running":
                self.client.log_metric(self.run_id, "world_size", float(entry["size"]),
                                       step=int(entry["attempt"]))
            elif entry["state"] == "resizing":
                self._resizes += 1
                text = f"{entry['from']} -> {entry['to']}: {entry['why']}"
                if entry.get("checkpoint"):
                    text += f", from checkpoint {entry['checkpoint']}"
                self.client.set_tag(self.run_id, f"sparkhvd.resize{self._resizes}",
                                    redact(text)[:500])
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            log.warning("MLflow: could not record the run's %s: %s", entry.get("state"),
                        redact(str(exc)))

    def finish(self, run_dir: Any, status: str) -> None:
        """Artifacts from the run folder, then the run's final status."""
        if self.run_id is None:
            return
        mlflow_status = {"succeeded": "FINISHED", "failed": "FAILED"}.get(status, "KILLED")
        try:
            attempts = run_dir.record.get("attempts") or []
            if attempts:  # retries (max_retries): how many, and why each attempt ended
                self.client.set_tag(self.run_id, "sparkhvd.attempts", str(len(attempts)))
                self.client.log_metric(self.run_id, "retries", len(attempts) - 1)
                for entry in attempts[:-1]:
                    self.client.set_tag(self.run_id, f"sparkhvd.attempt{entry['attempt']}",
                                        str(entry.get("retryable") or entry.get("error"))[:500])
            resume = run_dir.record.get("resume") or {}
            if resume.get("restored"):
                self.client.set_tag(self.run_id, "sparkhvd.resumed_from", resume["restored"])
            if resume.get("skipped"):  # checkpoints passed over: which, and why
                self.client.set_tag(self.run_id, "sparkhvd.resume_skipped",
                                    "; ".join(resume["skipped"])[:5000])
        except Exception as exc:  # noqa: BLE001 - tracking must not hide the run's outcome
            log.warning("MLflow: could not record the attempts: %s", redact(str(exc)))
        try:
            local = run_dir.path if os.path.isdir(run_dir.path) else None
            if local:
                for name in ("run.json", "metrics.csv", "curves.png", "timeline.json",
                             "timing.jsonl", "report.html"):
                    if os.path.exists(os.path.join(local, name)):
                        self.client.log_artifact(self.run_id, os.path.join(local, name))
                if os.path.isdir(os.path.join(local, "logs")):
                    self.client.log_artifacts(self.run_id, os.path.join(local, "logs"), "logs")
                model = run_dir.record.get("model")
                if model and os.path.exists(os.path.join(local, model)):
                    self._log_model(os.path.join(local, model))
                    if self.model_id:
                        run_dir.record.tracked(model_id=self.model_id)
        except Exception as exc:  # noqa: BLE001 - tracking must not hide the run's outcome
            log.warning("MLflow: could not log the run's artifacts: %s", redact(str(exc)))
        finally:
            self.client.set_terminated(self.run_id, mlflow_status)

    def _log_model(self, path: str) -> None:
        """The Keras/TensorFlow flavour when the model loads here, else the file itself."""
        quiet = [logging.getLogger(n) for n in ("mlflow", "tensorflow")]
        levels = [q.level for q in quiet]
        try:
            import tensorflow as tf

            from sparkhvd.keras.modelio import load_keras_model

            for q in quiet:  # their advice is about choices sparkhvd made for the user
                q.setLevel(logging.ERROR)
            model = load_keras_model(path, compile=False)
            # Requirements are what the driver runs (MLflow would otherwise infer them by
            # loading the model again in a subprocess).
            kwargs = {"pip_requirements": [f"tensorflow=={tf.__version__}"]}
            with self.mlflow.start_run(run_id=self.run_id, nested=False):
                if self.major >= 3:  # logged models, named; artifact_path is deprecated there
                    info = self.mlflow.tensorflow.log_model(model, name="model", **kwargs)
                    self.model_id = getattr(info, "model_id", None)
                else:
                    self.mlflow.tensorflow.log_model(model, artifact_path="model", **kwargs)
            # start_run(run_id=...) ends the run as FINISHED on exit; finish() sets the truth.
        except Exception as exc:  # noqa: BLE001 - fall back to the file
            log.info("MLflow: logging %s as a plain artifact (%s)", os.path.basename(path), exc)
            self.client.log_artifact(self.run_id, path, "model")
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
