"""The fleet's score level: a model's thresholds raised on a fleet whose healthy nodes score higher than
the world the thresholds were chosen on, read from the scores alone (no label, no incident).

Why: a manifest's threshold holds its false-evacuation budget on fleets like its validation slice. On
a fleet noisier than the catalogue the same threshold gave 30 to 400 times the budget
(benchmarks/results/predictor-score-level-2026-12-06.md), and a fleet's own false evacuations are too
few and too slow to re-fit it (calibration.py). What moves on such a fleet is the level of its healthy
nodes' scores, seen within the hour.

The level at time t, L(t): over the steps that ended in [t - WINDOW_HOURS, t), each node's highest score
(nodes with at least MIN_NODE_STEPS scored steps there), and the LEVEL_QUANTILE quantile of those maxima
over the nodes (numpy's linear quantile; fewer than MIN_NODES nodes: no level). A quantile of nodes, not
of steps, so that a few failing or flapping nodes do not set it. Time is cut into hour bins
[t0 + h REFIT_HOURS, t0 + (h + 1) REFIT_HOURS) from the first scored step's end t0; the threshold in
force for the steps of bin i reads bins i - WINDOW_BINS .. i - 1 only, never a step's own score:

    threshold(i) = min(1, max(θ, θ * L(t0 + i REFIT_HOURS) / reference))     (governed())

θ the manifest's threshold for the budget, `reference` the manifest's `score_level.reference`: the
LEVEL_QUANTILE quantile of L over the refit times of the world the thresholds were chosen on, so that
on such a world the threshold is the manifest's nine hours in ten. It never goes below θ.

`FleetLevel` is the online side (the control plane feeds it every round's scores); `levels` the offline
side over evaluate.NodeScores (`foreshock evaluate`, `foreshock train`'s reference); both reduce hour
bins with `_level_of`, and a test feeds one's steps to the other.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

WINDOW_HOURS = 24        # a day: the diurnal load and the daily jobs are inside every window
REFIT_HOURS = 1          # a shifted fleet is caught within the hour
BIN_NS = REFIT_HOURS * 3600 * 10**9
WINDOW_BINS = WINDOW_HOURS // REFIT_HOURS
LEVEL_QUANTILE = 0.9     # the fleet's healthy tail; a tenth of the nodes may fail or flap without moving it
MIN_NODES = 16           # fewer nodes make a quantile of a handful: no level, the manifest's threshold
MIN_NODE_STEPS = 60      # an hour of steps before a node's maximum counts

RULE = ("the threshold in force each hour is max(manifest threshold, manifest threshold x L / reference), at most 1: "
        f"L the {LEVEL_QUANTILE:g} quantile over nodes (at least {MIN_NODES}, each with {MIN_NODE_STEPS}+ scored "
        f"steps) of each node's highest score in the last {WINDOW_HOURS} h before the hour; reference: the same "
        f"level's {LEVEL_QUANTILE:g} quantile over the hours of the world the threshold was chosen on")


def governed(threshold: float, level: float, reference: float | None) -> float:
    """The threshold in force for a level (module docstring): the manifest's `threshold` when there is no
    level (NaN) or no reference."""
    if reference is None or not reference > 0 or level is None or math.isnan(level):
        return float(threshold)
    return float(min(1.0, max(threshold, threshold * level / reference)))


def check_reference(value, where: str) -> float:
    """A manifest's `score_level.reference`: a probability in (0, 1]. Raises ValueError naming `where`."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: score_level.reference {value!r} is not a number") from None
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{where}: score_level.reference {v} must be in (0, 1]")
    return v


def reference_of(manifest: dict) -> float | None:
    """The manifest's score-level reference (None: the model has none; its thresholds are fixed)."""
    block = (manifest or {}).get("score_level")
    if not block:
        return None
    return check_reference(block.get("reference"), "model manifest")


def _level_of(maxima: np.ndarray, counts: np.ndarray) -> float:
    """L from a window's per-node maxima [N] (NaN: no score) and scored-step counts [N]."""
    keep = (counts >= MIN_NODE_STEPS) & ~np.isnan(maxima)
    if int(keep.sum()) < MIN_NODES:
        return float("nan")
    return float(np.quantile(maxima[keep], LEVEL_QUANTILE))


def hour_bins(nodes, name: str) -> tuple[int, np.ndarray, np.ndarray]:
    """(t0, maxima [N, H], counts [N, H]) of `name`'s usable scores of evaluate.NodeScores per hour bin
    (NaN maximum: no usable step of the node in the bin)."""
    ends = [ns.step_end_ns[ns.usable].astype(np.int64) for ns in nodes]
    seen = [e for e in ends if len(e)]
    if not seen:
        return 0, np.zeros((len(nodes), 0)), np.zeros((len(nodes), 0), np.int64)
    t0 = min(int(e[0]) for e in seen)
    n_bins = (max(int(e[-1]) for e in seen) - t0) // BIN_NS + 1
    maxima = np.full((len(nodes), n_bins), np.nan)
    counts = np.zeros((len(nodes), n_bins), np.int64)
    for i, (ns, e) in enumerate(zip(nodes, ends)):
        b = (e - t0) // BIN_NS
        np.fmax.at(maxima[i], b, ns.scores[name][ns.usable].astype(np.float64))
        np.add.at(counts[i], b, 1)
    return t0, maxima, counts


def levels(nodes, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(refit times [H + 1] in ns, L at each: NaN where there is none) of scored data."""
    t0, maxima, counts = hour_bins(nodes, name)
    n_bins = maxima.shape[1]
    times = t0 + np.arange(n_bins + 1, dtype=np.int64) * BIN_NS
    out = np.full(n_bins + 1, np.nan)
    with np.errstate(all="ignore"):
        for i in range(1, n_bins + 1):
            lo = max(0, i - WINDOW_BINS)
            window = maxima[:, lo:i]
            seen = ~np.isnan(window).all(axis=1)
            peak = np.full(len(window), np.nan)
            peak[seen] = np.nanmax(window[seen], axis=1)
            out[i] = _level_of(peak, counts[:, lo:i].sum(axis=1))
    return times, out


def reference_level(nodes, name: str = "model") -> float | None:
    """The reference a manifest records: the LEVEL_QUANTILE quantile of L over the refit times of scored
    data (train: its validation slice); None when the data give no level (fewer than MIN_NODES nodes or
    less than an hour)."""
    _, lv = levels(nodes, name)
    lv = lv[~np.isnan(lv)]
    if not len(lv) or not lv.max() > 0:
        return None
    return float(np.quantile(lv, LEVEL_QUANTILE))


def schedule(hourly: tuple[np.ndarray, np.ndarray], threshold: float, reference: float | None):
    """(threshold_at, times [R], thresholds [R]): the governed threshold in force over scored data whose
    levels() are `hourly`; threshold_at maps step end times (ns) to it (evaluate.at_threshold takes it as
    its threshold)."""
    times, lv = hourly
    ths = np.array([governed(threshold, v, reference) for v in lv]) if len(lv) else np.array([float(threshold)])
    if not len(times):
        times = np.zeros(1, np.int64)

    def threshold_at(step_end_ns: np.ndarray) -> np.ndarray:
        i = np.searchsorted(times, step_end_ns, side="right") - 1
        return ths[np.clip(i, 0, len(ths) - 1)]
    return threshold_at, times, ths


class FleetLevel:
    """The level online: fed every scoring round's scores, it gives the threshold in force (governed())
    for the hour bin of the latest round.

    observe() once per round with the round's step end and every scored node's probability, in time
    order; a round older than the current hour bin is ignored (it changes no level). save() and
    restore() carry the hours seen across a restart of the control plane."""

    STATE_FORMAT = "foreshock-score-level/1"

    def __init__(self, reference: float | None):
        self.reference = None if reference is None else check_reference(reference, "FleetLevel")
        self._index: dict[str, int] = {}
        self._t0: int | None = None
        self._bin = -1
        self._bins: list[tuple[int, np.ndarray, np.ndarray]] = []   # closed bins within the window, oldest first
        self._max = np.zeros(0)
        self._cnt = np.zeros(0, np.int64)
        self.level = float("nan")

    def _grow(self, n: int) -> None:
        if n > len(self._max):
            add = n - len(self._max)
            self._max = np.concatenate([self._max, np.full(add, np.nan)])
            self._cnt = np.concatenate([self._cnt, np.zeros(add, np.int64)])

    def observe(self, step_end_ns: int, nodes: Sequence[str], scores: np.ndarray) -> bool:
        """Take a round's scores; True when it opened a new hour (the level was computed again)."""
        step_end_ns = int(step_end_ns)
        if self._t0 is None:
            self._t0 = step_end_ns
        b = (step_end_ns - self._t0) // BIN_NS
        if b < self._bin:
            return False
        opened = b > self._bin
        if opened:
            if self._bin >= 0:
                self._bins.append((self._bin, self._max, self._cnt))
            self._bin = b
            self._bins = [e for e in self._bins if e[0] >= b - WINDOW_BINS]
            self._max = np.full(len(self._index), np.nan)
            self._cnt = np.zeros(len(self._index), np.int64)
            self.level = self._window_level()
        idx = np.fromiter((self._index.setdefault(n, len(self._index)) for n in nodes), np.int64, len(nodes))
        self._grow(len(self._index))
        s = np.asarray(scores, dtype=np.float64)
        np.fmax.at(self._max, idx, s)
        np.add.at(self._cnt, idx, 1)
        return opened

    def _window_level(self) -> float:
        n = len(self._index)
        peak = np.full(n, np.nan)
        count = np.zeros(n, np.int64)
        for _, mx, cnt in self._bins:
            peak[:len(mx)] = np.fmax(peak[:len(mx)], mx)
            count[:len(cnt)] += cnt
        return _level_of(peak, count)

    def threshold(self, base: float) -> float:
        """The threshold in force now for the manifest's threshold `base`."""
        return governed(base, self.level, self.reference)

    def save(self, path, model_version: str) -> None:
        """Write the hours seen to `path` atomically (a temporary file beside it, fsync, rename): an .npz
        of plain arrays and a JSON header, no pickle. The scores are `model_version`'s: restore() takes
        them back for that model only. Nothing is written before a round was observed."""
        import json
        import os
        from pathlib import Path

        path = Path(path)
        if self._t0 is None:
            return
        bins = self._bins + ([(self._bin, self._max, self._cnt)] if self._bin >= 0 else [])
        n = len(self._index)
        maxima = np.full((len(bins), n), np.nan)
        counts = np.zeros((len(bins), n), np.int64)
        for k, (_, mx, cnt) in enumerate(bins):
            maxima[k, :len(mx)] = mx
            counts[k, :len(cnt)] = cnt
        meta = {"format": self.STATE_FORMAT, "model_version": str(model_version), "t0": self._t0,
                "bins": [int(b) for b, _, _ in bins], "nodes": list(self._index)}
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, maxima=maxima, counts=counts, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def restore(self, path, model_version: str) -> str | None:
        """Carry on from save()'s file, on a FleetLevel that has observed nothing: the hours seen, the
        level of the last one. None when there is no file. Raises ValueError naming the file and the
        reason (not such a file, another model's scores, parts that do not fit) and changes nothing."""
        import json
        from pathlib import Path

        path = Path(path)
        if not path.exists():
            return None
        if self._t0 is not None:
            raise ValueError(f"{path}: a score level restores only before it observes a round")
        try:
            with np.load(path, allow_pickle=False) as z:
                maxima, counts = z["maxima"], z["counts"]
                meta = json.loads(z["meta"].tobytes().decode())
            bins, nodes, t0 = [int(b) for b in meta["bins"]], [str(n) for n in meta["nodes"]], int(meta["t0"])
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a score-level state file ({exc})") from None
        if meta.get("format") != self.STATE_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {self.STATE_FORMAT!r}")
        if meta.get("model_version") != str(model_version):
            raise ValueError(f"{path}: the scores of model {meta.get('model_version')!r}, not of {model_version!r}")
        if maxima.shape != (len(bins), len(nodes)) or counts.shape != maxima.shape or bins != sorted(set(bins)):
            raise ValueError(f"{path}: {len(bins)} hours of {len(nodes)} nodes do not fit arrays of {maxima.shape}")
        self._index = {n: i for i, n in enumerate(nodes)}
        self._t0 = t0
        self._bins = [(b, maxima[k].copy(), counts[k].astype(np.int64)) for k, b in enumerate(bins[:-1])]
        if bins:
            self._bin, self._max, self._cnt = bins[-1], maxima[-1].copy(), counts[-1].astype(np.int64)
            self.level = self._window_level()
        return f"{len(bins)} hours of {len(nodes)} nodes' scores, level {self.level:.3g}"
