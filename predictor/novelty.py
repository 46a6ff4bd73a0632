"""The novelty alarm beside the supervised model: an error signal counting far more steadily than usual.

The supervised trees rank the precursor shapes they were shown; a precursor of another shape, or on a
signal no training failure used, stays below their threshold (leave-one-family-out caught none of a
held-out family at budgets 1-5). This alarm needs no failure seen before. It reads the STEADINESS
columns of features.py: per error signal, the share of the last 2 hours' steps in which it counted
minus the node's own share over its days. A benign burst is one strong quarter of an hour and a
chronic device is its own baseline; a failing device counts step after step for hours, at any
magnitude.

Each signal is put on its own scale: its steadiness over the 99.999th percentile of the training
history's healthy rows (`scales_`, floored at SCALE_FLOOR), so 1.0 is "as steady as the steadiest
healthy minute in a hundred thousand". The novelty level is the largest of those over the signals.
It joins the model's probability by the maximum (`fuse`): the level is turned into the probability
at which the model itself would evacuate at the training budget (`reference_probability_`), times
e^(SLOPE (level - ALARM_LEVEL)), capped at CAP_LEVELS above ALARM_LEVEL (5x the reference), and 0 below level 1 (no
signal steadier than its healthy extreme: the model's probability alone). The thresholds for every
budget are then chosen on the fused score, on the validation slice, as for the model alone, so the
novelty alarm spends the same false-evacuation budget as the model and never adds to it unseen.

Stored in the manifest as plain numbers (`novelty`: signals, scales, reference probability); a model
without the section (feature version 6, the shipped model until it is retrained) has no novelty alarm.
Measured and chosen on development worlds only: benchmarks/results/predictor-novelty-2026-12-05.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from foreshock.predictor import features as ft

QUANTILE = 0.99999      # the healthy steadiness a signal's scale is set at
SCALE_FLOOR = 0.05      # a signal that never counts on a healthy node: 5 % more of 2 h's minutes is unusual
# Where the novelty reaches the model's evacuation probability, in units of each signal's healthy
# extreme: 1.5 kept 4 of the 9 precursor failures of a development world's second week at 1.15 false
# evacuations per 1,000 node-days on its own, 2.0 none and 1.25 four at 4.6
# (benchmarks/results/predictor-persistence-2026-12-05.md; a world read before, so a choice, not a result).
ALARM_LEVEL = 1.5
# The alarm's operating point is a level, nearly the same at every budget: the budgets' thresholds
# (about 0.5-1.5x the reference) map to levels 1.41-1.55, so a stricter budget moves the model's
# threshold, not the novelty's. With a slope of 2 they mapped to 1.15-1.7, and at budget 5 the alarm
# fired close to the healthy extreme (level 1): extra false evacuations at budget 5 on every
# development world (benchmarks/results/predictor-novelty-2026-12-05.md).
SLOPE = 8.0
CAP_LEVELS = 0.2        # the fused probability stops at 5x the reference: a novelty is not a certainty
BINS = 4096             # histogram of healthy steadiness over [0, 1] (bounded memory, any history size)
MIN_HEALTHY_ROWS = 100_000   # fewer healthy training rows than this cannot place a 1e-5 quantile: no alarm


class HealthySteadiness:
    """Accumulates the histogram of the STEADINESS columns over healthy training rows (bounded: BINS
    counts per signal), streamed node by node."""

    def __init__(self):
        self.counts = np.zeros((len(ft.STEADY), BINS), dtype=np.int64)
        self.rows = 0

    def add(self, steadiness: np.ndarray) -> None:
        """steadiness: [M, len(STEADY)] rows of healthy steps (NaN and negatives count as 0)."""
        v = np.clip(np.nan_to_num(np.asarray(steadiness, dtype=np.float64), nan=0.0), 0.0, 1.0)
        b = np.minimum((v * BINS).astype(np.int64), BINS - 1)
        for j in range(v.shape[1]):
            self.counts[j] += np.bincount(b[:, j], minlength=BINS)
        self.rows += len(v)

    def quantile(self, q: float) -> np.ndarray:
        """[len(STEADY)]: the upper edge of the bin holding each signal's q-quantile."""
        cum = np.cumsum(self.counts, axis=1)
        k = np.argmax(cum >= q * np.maximum(cum[:, -1:], 1), axis=1)
        return (k + 1) / BINS


class NoveltyAlarm:
    """Per-signal steadiness scales from healthy rows, and the fusion of the level with the model's
    probability. scikit-learn style: `__init__` stores parameters, `fit` returns self, learned
    attributes end in `_`."""

    def __init__(self, quantile: float = QUANTILE, floor: float = SCALE_FLOOR, alarm_level: float = ALARM_LEVEL,
                 slope: float = SLOPE, cap_levels: float = CAP_LEVELS):
        self.quantile = quantile
        self.floor = floor
        self.alarm_level = alarm_level
        self.slope = slope
        self.cap_levels = cap_levels

    def fit(self, healthy: HealthySteadiness) -> "NoveltyAlarm":
        """Each signal's scale from the healthy histogram. Raises ValueError for too few healthy rows."""
        if healthy.rows < MIN_HEALTHY_ROWS:
            raise ValueError(f"{healthy.rows:,} healthy training rows: the novelty alarm needs "
                             f"{MIN_HEALTHY_ROWS:,} to place its scales")
        self.scales_ = np.maximum(healthy.quantile(self.quantile), self.floor)
        self.healthy_rows_ = int(healthy.rows)
        return self

    def calibrate(self, reference_probability: float) -> "NoveltyAlarm":
        """Set the probability ALARM_LEVEL maps to: the model's own threshold at the training budget,
        chosen on the validation slice. Raises ValueError outside (0, 1)."""
        if not 0.0 < reference_probability < 1.0:
            raise ValueError(f"novelty reference probability {reference_probability!r}: must be in (0, 1)")
        self.reference_probability_ = float(reference_probability)
        return self

    def level(self, X: np.ndarray) -> np.ndarray:
        """[n]: the largest steadiness over its scale, from full-width feature rows X [n, N_FEATURES]."""
        s = np.nan_to_num(np.asarray(X[:, ft.STEADY_COLS], dtype=np.float64), nan=0.0)
        return np.max(s / self.scales_, axis=1) if len(s) else np.zeros(0)

    def probability(self, level: np.ndarray) -> np.ndarray:
        """The model-equivalent probability of a novelty level (monotone, capped; 0 below level 1)."""
        level = np.asarray(level, dtype=np.float64)
        over = np.minimum(level - self.alarm_level, self.cap_levels)
        return np.where(level >= 1.0, np.minimum(self.reference_probability_ * np.exp(self.slope * over), 1.0), 0.0)

    def fuse(self, probability: np.ndarray, X: np.ndarray) -> np.ndarray:
        """The model's probability [n] raised to the novelty's where that is higher."""
        return self.fuse_level(probability, self.level(X))

    def fuse_level(self, probability: np.ndarray, level: np.ndarray) -> np.ndarray:
        return np.maximum(np.asarray(probability, dtype=np.float64), self.probability(level))

    def to_manifest(self) -> dict[str, Any]:
        return {"signals": list(ft.STEADY), "scales": [float(v) for v in self.scales_],
                "reference_probability": self.reference_probability_, "healthy_rows": self.healthy_rows_,
                "quantile": self.quantile, "alarm_level": self.alarm_level, "slope": self.slope,
                "cap_levels": self.cap_levels}

    @classmethod
    def from_manifest(cls, section: dict, where: str) -> "NoveltyAlarm":
        """The alarm a manifest's `novelty` section describes. Raises ValueError naming `where` when the
        section does not fit this code (other signals, a scale that is not positive, ...)."""
        try:
            alarm = cls(quantile=float(section["quantile"]), alarm_level=float(section["alarm_level"]),
                        slope=float(section["slope"]), cap_levels=float(section["cap_levels"]))
            signals = list(section["signals"])
            scales = np.asarray(section["scales"], dtype=np.float64)
            ref = float(section["reference_probability"])
            rows = int(section.get("healthy_rows", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: novelty section unreadable: {exc}") from None
        if signals != list(ft.STEADY):
            raise ValueError(f"{where}: novelty signals {signals} are not this code's {list(ft.STEADY)}")
        if scales.shape != (len(ft.STEADY),) or not np.all(np.isfinite(scales)) or not np.all(scales > 0):
            raise ValueError(f"{where}: novelty scales must be {len(ft.STEADY)} positive numbers")
        if not 0.0 < ref < 1.0 or not np.isfinite(alarm.slope) or alarm.slope <= 0 or alarm.cap_levels < 0:
            raise ValueError(f"{where}: novelty reference probability, slope or cap out of range")
        alarm.scales_, alarm.reference_probability_, alarm.healthy_rows_ = scales, ref, rows
        return alarm
