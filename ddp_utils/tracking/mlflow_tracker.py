"""``logger=mlflow``: the run's parameters, metrics by step and files in MLflow.

Talks to the tracking server through ``MlflowClient`` (no global active run, so the trials of
an in-process sweep never share one). The default backend is a SQLite database beside the
run's folder (``<run_dir>/../mlruns.db``, artifacts in ``../mlartifacts``): a sweep's trials
land in one database; ``mlflow ui --backend-store-uri sqlite:///PATH/mlruns.db`` shows them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ddp_utils.config import ConfigError
from ddp_utils.tracking.base import TrackedRun, Tracker, flat_config

BATCH = 100  # MLflow's log_batch takes at most 100 params (and 1000 metrics) per call


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "ddp-recipes",
                 run_name: str | None = None, timeout_s: int = 8,
                 retries: int = 1) -> None:  # fmt: skip
        self.uri, self.experiment, self.run_name = tracking_uri, experiment_name, run_name
        self.timeout_s, self.retries = timeout_s, retries
        self.client, self.run_id = None, None

    def connect(self, run_dir: Path) -> Path:
        """The client of ``tracking_uri`` (default: the database beside ``run_dir``)."""
        from mlflow.tracking import MlflowClient

        # MLflow reads these at each request; set in this process, whose only client this is.
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(self.timeout_s)
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(self.retries)
        os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "1"
        os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"] = "0"
        beside = run_dir.resolve().parent
        self.client = MlflowClient(tracking_uri=self.uri or f"sqlite:///{beside / 'mlruns.db'}")
        return beside

    def start(self, run: TrackedRun) -> int | None:
        try:
            return self._start(run)
        except Exception as e:
            if not (self.uri or "").startswith(("http://", "https://")):
                raise  # a database or folder: the generic message says what it raised
            reason = " ".join(str(e).split())[:200]
            raise ConfigError(
                f"logger=mlflow: the tracking server logger_cfg.mlflow.tracking_uri={self.uri} "
                f"did not answer ({type(e).__name__}: {reason}; {self.retries + 1} tries of "
                f"logger_cfg.mlflow.timeout_s={self.timeout_s} s each). Start the server "
                "(mlflow server --host HOST --port PORT), correct the URI, or leave mlflow out "
                "of logger."
            ) from None

    def _start(self, run: TrackedRun) -> int | None:
        beside = self.connect(run.run_dir)
        resumed = (run.resumed_state(self.name) or {}).get("run_id")
        if resumed:
            self.run_id = self.client.get_run(resumed).info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return self.logged_through()
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            self.experiment, artifact_location=(beside / "mlartifacts").as_uri())  # fmt: skip
        created = self.client.create_run(experiment_id, run_name=self.run_name or run.name,
                                         tags={"run_dir": str(run.run_dir)})  # fmt: skip
        self.run_id = created.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in flat_config(run.config).items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + BATCH])
        return 0

    def logged_through(self) -> int:
        """The newest step this run has in the server (a killed process may have logged past
        its checkpoint, or not reached what metrics.jsonl holds)."""
        keys = ("train/loss", "train/loss_running")
        steps = [m.step for k in keys for m in self.client.get_metric_history(self.run_id, k)]
        return max(steps, default=0)

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def finish(self, files: list[Path]) -> None:
        for f in files:
            self.client.log_artifact(self.run_id, str(f))
        self.client.set_terminated(self.run_id, "FINISHED")


def log_evaluation(options: dict[str, Any], run_id: str, run_dir: Path, files: list[Path],
                   numbers: dict[str, float]) -> None:  # fmt: skip
    """eval.py: the training run's MLflow run gains ``eval/<name>`` and eval.json (and its
    pictures) as artifacts."""
    from mlflow.entities import Metric

    tracker = MlflowTracker(**{k: v for k, v in options.items() if k != "_target_"})
    tracker.connect(run_dir)
    now = int(time.time() * 1000)
    metrics = [Metric(f"eval/{k}", v, now, 0) for k, v in numbers.items()]
    tracker.client.log_batch(run_id, metrics=metrics)
    for f in files:
        tracker.client.log_artifact(run_id, str(f))
