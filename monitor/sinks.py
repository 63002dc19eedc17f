"""Where the monitor's aggregated metrics go: the console, a JSON-lines file, wandb, the web app's dashboard.

The sinks are chosen once at start-up (``build_sinks``); the loop hands every new global step to all of them.
A sink that fails logs a warning and never stops the monitor.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from arguments import MetricsArguments
from collab.extras import require_extra
from collab.wire import bearer_header, json_safe
from monitor.aggregate import format_line

logger = logging.getLogger(__name__)


class Sink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None:
        """Report one global step: the SwarmMetrics keys, ``contributors`` (monitor.aggregate.top_contributors),
        plus ``eval_*`` keys after an evaluation."""

    def close(self) -> None: ...


class ConsoleSink:
    """``step 12  loss 3.412  peers 3  samples 1024  samples/s 88.1``: one line per global step."""

    def write(self, record: Mapping[str, Any]) -> None:
        extra = "".join(f"  {key} {value:.4g}" for key, value in record.items() if key.startswith("eval_"))
        logger.info(format_line(record) + extra)

    def close(self) -> None:
        pass


class JsonLinesSink:
    """Appends one JSON object per global step to a file (created with its folder); each line is flushed."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            self._file.write("\n")  # a crash cut the last line short: start on a fresh one

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(json_safe(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def last_step_in(path: str | os.PathLike | None) -> int | None:
    """The step of the last complete line of a metrics file (a restarted monitor goes on after it, unless the swarm
    is far behind it: see ``monitor.run.last_step_within_reach``); lines without a whole-number step are skipped."""
    if not path or not Path(path).exists():
        return None
    for line in reversed(Path(path).read_text(encoding="utf-8", errors="replace").splitlines()):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
    return None


class WandbSink:
    """Logs each global step's numbers to Weights & Biases (``WANDB_MODE=offline`` writes the run locally, no
    network); the contributors table stays in the metrics file and the web app."""

    def __init__(self, project: str, run_name: str, config: Mapping[str, Any]):
        require_extra("wandb", "--wandb_project")
        import wandb  # imported only when asked for: it is slow to import and optional

        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, config=dict(config), reinit=True)

    def write(self, record: Mapping[str, Any]) -> None:
        values = {
            key: value
            for key, value in record.items()
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        self._run.log(values, step=record["step"])

    def close(self) -> None:
        self._run.finish()


class HttpReportSink:
    """Posts each global step to the web app (``--report_url``) from a background thread, with retries.

    The monitor's loop never waits on the network: records queue up (at most ``max_queued``; the oldest are
    dropped when the web app is down for long) and are sent in order.
    """

    def __init__(self, url: str, token: str | None, timeout: float = 10.0, max_queued: int = 10_000, retries: int = 5):
        self.url, self.timeout, self.retries = url, timeout, retries
        self.headers = bearer_header(token)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="report-sender", daemon=True)
        self._thread.start()

    def write(self, record: Mapping[str, Any]) -> None:
        while True:
            try:
                self._queue.put_nowait(json_safe(record))
                return
            except queue.Full:
                self._queue.get_nowait()

    def _run(self) -> None:
        import requests

        while not (self._closed.is_set() and self._queue.empty()):
            try:
                record = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            for attempt in range(self.retries):
                try:
                    response = requests.post(self.url, json=record, headers=self.headers, timeout=self.timeout)
                    if response.status_code < 400:
                        break
                    if response.status_code in (401, 403, 404, 422):  # retrying will not help
                        logger.warning("The web app refused step %s: %s", record["step"], response.text[:200])
                        break
                except requests.RequestException as e:
                    logger.debug("Posting step %s failed: %s", record["step"], e)
                self._closed.wait(min(2**attempt, 30))
            else:
                logger.warning("Could not post step %s to %s after %d tries", record["step"], self.url, self.retries)

    def close(self, timeout: float = 10.0) -> None:
        self._closed.set()
        self._thread.join(timeout)


def build_sinks(metrics_args: MetricsArguments, run_name: str, token: str | None, config: Mapping) -> list[Sink]:
    """The sinks these settings ask for; the console always."""
    sinks: list[Sink] = [ConsoleSink()]
    if metrics_args.metrics_path:
        sinks.append(JsonLinesSink(metrics_args.metrics_path))
    if metrics_args.wandb_project:
        sinks.append(WandbSink(metrics_args.wandb_project, metrics_args.wandb_run_name or run_name, config))
    if metrics_args.report_url:
        sinks.append(HttpReportSink(metrics_args.report_url, token))
    return sinks


def write_all(sinks: list[Sink], record: Mapping[str, Any]) -> None:
    for sink in sinks:
        try:
            sink.write(record)
        except Exception as e:
            logger.warning("%s failed to report step %s: %s", type(sink).__name__, record.get("step"), e)
