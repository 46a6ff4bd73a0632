"""Scoring: the scorer protocol, and the adapter over the predictor's online scorer.

The adapter (`PredictorScorer`) is the only place that knows foreshock.predictor's API
(registry.load_model(path) -> LoadedModel with .manifest; online.OnlineScorer(model) with
ingest(table, arrow_table) and score(now_ns) -> ScoreBatch(nodes, probability, signals)); everything
else talks to the small `Scorer` protocol below. Who runs the scorer, and when, is service/rounds.py
(the round scheduler and its pipelines: this process, or the scoring worker, service/worker.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from foreshock.predictor.errors import ModelError
from foreshock.service.domain import SignalRecord

log = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    nodes: list[str]
    probability: np.ndarray
    signals: list[list[SignalRecord]] = field(default_factory=list)
    fresh: bool = True          # False: no step closed since the last round, the same scores again
    # a shard's: its nodes' job and site peer totals of the steps closed this round, for the coordinator
    # [(step, {group: {label: row}})] (predictor/online.py take_local_totals); empty elsewhere
    totals: list = field(default_factory=list)
    # node -> what its hard evidence shows, for the nodes that alarm whatever their probability
    # (predictor/model.py HardEvidence, named by the model's manifest); empty for a model without it
    evidence: dict[str, str] = field(default_factory=dict)


class Scorer(Protocol):
    """What the rounds (service/rounds.py) need of a scorer.

    `step_ns`: the feature step it scores at; a round then scores only when a step closes
    (steps.StepSchedule says when), and score() is given the end of the last step to close
    (`close_ns`). None: a scorer without steps, which scores every round (close_ns None). `grace_ns`:
    how long after a step's end its rows may still come."""

    model_version: str
    horizon_seconds: int
    manifest: dict
    step_ns: int | None
    grace_ns: int

    def ingest(self, table: str, data: pa.Table) -> None: ...

    def score(self, now_ns: int, close_ns: int | None = None) -> ScoreResult: ...

    def threshold(self, budget: float | None) -> float | None:
        """The evacuation threshold for `budget` false evacuations per 1,000 node-days (None: the
        model's recommended one); None when the model names none."""

    def close(self) -> None:
        """End what the scorer runs beside its caller (the online scorer's judging thread); called once
        by its owner, after the last round and checkpoint."""


class NullScorer:
    """No model: telemetry is validated and counted, nothing is scored (the service says so at start)."""

    model_version = "none"
    horizon_seconds = 0
    manifest: dict = {}
    step_ns = None
    grace_ns = 0

    def ingest(self, table: str, data: pa.Table) -> None:
        pass

    def score(self, now_ns: int, close_ns: int | None = None) -> ScoreResult:
        return ScoreResult([], np.zeros(0))

    def threshold(self, budget: float | None) -> float | None:
        return None

    def close(self) -> None:
        pass


class PredictorScorer:
    """foreshock.predictor's OnlineScorer behind the Scorer protocol."""

    def __init__(self, model_path: str | Path, *, grace_seconds: float = 2.0, share_totals: bool = False):
        """share_totals: a shard's scorer, which sends its job and site peer totals and takes the other
        shards' (docs/scaling.md, "Peer features across shards")."""
        try:
            from foreshock.predictor import online, registry
        except ImportError as exc:
            raise ModelError(f"the predictor is not available in this build: {exc}") from exc
        try:
            self.model = registry.load_model(model_path)
        except Exception as exc:
            raise ModelError(f"model {model_path}: {exc}") from exc
        self.model_path = str(model_path)
        self.manifest = dict(getattr(self.model, "manifest", {}) or {})
        self.model_version = str(self.manifest.get("version", "unknown"))
        self.horizon_seconds = int(self.manifest.get("horizon_seconds", 0) or 0)
        # Collectors sweep every second and the service answers within a round, so a step's rows are
        # all in a second or two after it ends; a shorter grace than the scorer's default means an
        # earlier verdict on the step that crosses the threshold.
        self._online = online.OnlineScorer(self.model, grace_seconds=grace_seconds, share_totals=share_totals)
        self._last: ScoreResult | None = None
        self._checkpoint_at: float | None = None   # restore_state starts the checkpoint period

    def threshold(self, budget: float | None) -> float | None:
        """The registry decides (registry.LoadedModel.threshold)."""
        try:
            return self.model.threshold(budget)
        except ModelError:
            return None   # the manifest names none: the service's owner picks its default

    def ingest(self, table: str, data: pa.Table) -> None:
        self._online.ingest(table, data)

    @property
    def step_ns(self) -> int:
        return self._online.step_ns

    @property
    def grace_ns(self) -> int:
        return self._online.grace_ns

    def score(self, now_ns: int, close_ns: int | None = None) -> ScoreResult:
        """close_ns: also close the steps that end by then (their telemetry is all in: the
        watermarks), before their grace period is over."""
        # Features change only when a step closes; between closes a round re-scores nothing.
        if self._last is not None and self._online.advance(now_ns, close_ns) == 0:
            return dataclasses.replace(self._last, fresh=False)
        batch = self._online.score(now_ns, close_ns)
        signals = [[SignalRecord(str(s.name), float(s.value), float(s.contribution), str(s.description))
                    for s in node_signals] for node_signals in batch.signals]
        self._last = ScoreResult(list(batch.nodes), np.asarray(batch.probability, dtype=np.float64), signals,
                                 evidence=dict(batch.evidence))
        totals = self._online.take_local_totals()
        return dataclasses.replace(self._last, totals=totals) if totals else self._last

    def set_peer_totals(self, peer_totals: list) -> None:
        """The other shards' sums [(step, {group: {label: row}})], as the coordinator sent them. Sums that
        came too late for any step still to close are counted (late) and dropped; totals the scorer
        refuses (predictor/online.py set_remote_totals) are logged and counted, and change nothing."""
        for step, groups in peer_totals:
            oldest = self._online.oldest_remote_step()
            if oldest is not None and isinstance(step, int) and step < oldest:
                self._online.stats["remote_totals_late"] += 1
                continue
            try:
                self._online.set_remote_totals(step, groups)
            except ValueError as exc:
                self._online.stats["remote_totals_refused"] += 1
                log.warning("peer totals from the coordinator refused: %s", exc)

    def peer_stats(self) -> dict[str, int]:
        """How each closed step's job and site peers were computed: with the other shards' totals of the
        step (used, less lagged), of an earlier step (lagged), without (missing); sums that came too
        late to be used, and totals refused."""
        return {k: int(self._online.stats[f"remote_totals_{k}"])
                for k in ("used", "lagged", "missing", "late", "refused")}

    def left_out(self) -> dict[str, int]:
        """Rows the scorer took in and left out of the features, by reason (online.OnlineScorer.left_out)."""
        return self._online.left_out()

    def close(self) -> None:
        """The online scorer's judging thread ends (online.OnlineScorer.close)."""
        self._online.close()

    # -- checkpoint (the owner calls these: the scoring worker, or the service when it scores itself) --
    def restore_state(self, path: str | Path) -> str | None:
        """Carry on from the checkpoint at `path` when there is one (online.OnlineScorer.restore_state).
        Returns what was restored, or None when there is no file; a file that cannot be used is
        logged, kept aside as `<path>.refused` for a person to read, and the scorer starts cold."""
        path = Path(path)
        self._checkpoint_at = time.monotonic()
        if not path.exists():
            return None
        try:
            return self._online.restore_state(path)
        except ValueError as exc:
            log.warning("scorer checkpoint not used, the 3-day baselines start over: %s", exc)
            try:
                path.replace(path.with_name(path.name + ".refused"))
            except OSError:
                pass
            return None

    def checkpoint(self, path: str | Path, every_seconds: float, force: bool = False) -> int | None:
        """Write the scorer's checkpoint when `every_seconds` have passed since the last one (or
        `force`: at shutdown). Returns the bytes written, None when not due; never raises: a failed
        write is logged and retried at the next call."""
        now = time.monotonic()
        since = now - (self._checkpoint_at if self._checkpoint_at is not None else now)
        if not force and since < every_seconds:
            return None
        self._checkpoint_at = now
        try:
            return self._online.save_state(path)
        except Exception:   # noqa: BLE001 - a full disk must not stop scoring
            log.exception("writing the scorer checkpoint %s", path)
            return None


def default_model_path() -> Path | None:
    try:
        from foreshock.predictor import registry
    except ImportError:
        return None
    try:
        return Path(registry.default_model_path())
    except Exception:
        return None
