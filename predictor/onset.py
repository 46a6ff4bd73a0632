"""Per-GPU corrected-ECC onset: a GPU that starts counting corrected ECC and does not stop.

A failing HBM stack corrects errors in every ten minutes for hours, at whatever rate; a healthy GPU with
chronic corrected errors has counted like that for days, so it is its own usual; a benign burst stops.
A node's sum (or its worst GPU's count) hides a new GPU's onset behind its healthy GPUs' chronic errors,
so the state is per GPU (benchmarks/results/predictor-ecc-onset-2026-12-07.md; a node-level share of
GPUs counting raised 5-190 false episodes per 1,000 node-days past the scenario catalogue where this
raised none: predictor-onset-design-2026-12-07.md).

Per GPU, in BIN_SECONDS bins of absolute time: whether its corrected-ECC delta was above 0 in the bin
("counted") and whether it had a known delta in it ("seen"). Its value at a sample is judged from the
whole bins before the sample's bin: the number of the last RECENT_BINS bins that counted, where its usual
share of counted bins (an EWMA, USUAL_HALF_LIFE_BINS, of counted over seen for its bins older than those
RECENT_BINS) is at most USUAL_SHARE_MAX; 0 where the usual share is higher (a chronic GPU); NaN until the
EWMA's seen weight reaches MIN_SEEN (about MIN_SEEN_HOURS of bins), so a GPU new to the scorer is not
judged on a usual it does not have.

`OnsetTracker.update` takes a block of a table's sample rows (sorted by entity key, then step: what
SampleStage.samples produces) and returns each row's value, carrying every GPU's state across blocks: a
GPU's bins are processed in order whatever the batching, so a node's whole history at once (offline) and
a few rows a round (online) give identical values (tests/test_predictor_onset.py). The state is seven
numbers a GPU (its open bin, that bin's counted and seen, the last RECENT_BINS bins' counted and seen as
bit masks, the two EWMAs), saved in the scorer's checkpoint with the sample stage's (`state`).
"""

from __future__ import annotations

import numpy as np

BIN_SECONDS = 600
RECENT_BINS = 30                 # five hours of ten-minute bins
USUAL_HALF_LIFE_BINS = 3 * 24 * 6   # the baselines' 3-day half-life (features.BASELINE_HALF_LIFE_STEPS)
USUAL_SHARE_MAX = 0.2
MIN_SEEN_HOURS = 12
ALPHA = 1.0 - 2.0 ** (-1.0 / USUAL_HALF_LIFE_BINS)
KEEP = 1.0 - ALPHA
MIN_SEEN = 1.0 - KEEP ** (MIN_SEEN_HOURS * 3600 // BIN_SECONDS)
_FULL = (1 << RECENT_BINS) - 1
_OLDEST = RECENT_BINS - 1
NO_BIN = np.iinfo(np.int64).min   # the open bin of a GPU not seen yet

# the carried arrays, in state() order: [n] each, sorted by entity key
STATE_FIELDS = ("keys", "bin", "open_counted", "open_seen", "recent_counted", "recent_seen", "usual_counted",
                "usual_seen")


class OnsetTracker:
    """Every GPU's onset state, keyed by the sample stage's entity key (node code * NODE_SHIFT + code)."""

    def __init__(self):
        self.keys = np.zeros(0, dtype=np.int64)
        self.bin = np.zeros(0, dtype=np.int64)
        self.open_counted = np.zeros(0, dtype=np.int64)
        self.open_seen = np.zeros(0, dtype=np.int64)
        self.recent_counted = np.zeros(0, dtype=np.int64)   # bit j: the bin j + 1 bins before the open one
        self.recent_seen = np.zeros(0, dtype=np.int64)
        self.usual_counted = np.zeros(0)
        self.usual_seen = np.zeros(0)

    def __len__(self) -> int:
        return len(self.keys)

    def state(self) -> dict[str, np.ndarray]:
        return {f"onset.{name}": getattr(self, name) for name in STATE_FIELDS}

    @classmethod
    def from_state(cls, arrays: dict[str, np.ndarray]) -> "OnsetTracker":
        """The inverse of state(); an empty tracker where a checkpoint has none (one written before the
        tracker existed: every GPU then starts over and is judged again after MIN_SEEN_HOURS). Raises
        ValueError when the arrays do not fit together."""
        out = cls()
        if "onset.keys" not in arrays:
            return out
        parts = {}
        for name in STATE_FIELDS:
            if f"onset.{name}" not in arrays:
                raise ValueError(f"onset state: onset.{name} missing")
            kind = np.float64 if name.startswith("usual") else np.int64
            parts[name] = np.asarray(arrays[f"onset.{name}"], dtype=kind).copy()
        n = len(parts["keys"])
        if any(len(v) != n for v in parts.values()) or np.any(np.diff(parts["keys"]) <= 0):
            raise ValueError("onset state: inconsistent arrays")
        for name, v in parts.items():
            setattr(out, name, v)
        return out

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        """The state positions of distinct sorted `keys`, adding the ones not seen yet."""
        pos = np.searchsorted(self.keys, keys)
        hit = pos < len(self.keys)
        hit[hit] = self.keys[pos[hit]] == keys[hit]
        if not hit.all():
            new = keys[~hit]
            merged = np.concatenate([self.keys, new])
            order = np.argsort(merged, kind="stable")
            m = len(new)
            self.keys = merged[order]
            self.bin = np.concatenate([self.bin, np.full(m, NO_BIN)])[order]
            for name in ("open_counted", "open_seen", "recent_counted", "recent_seen"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(m, dtype=np.int64)])[order])
            for name in ("usual_counted", "usual_seen"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(m)])[order])
            pos = np.searchsorted(self.keys, keys)
        return pos

    def update(self, key: np.ndarray, step: np.ndarray, delta: np.ndarray, step_seconds: int) -> np.ndarray:
        """Each row's value (module docstring) for rows sorted by (key, step); `delta` the rows' corrected-ECC
        deltas (NaN: not known). Carries the state: the rows' bins count from here on."""
        n = len(key)
        if n == 0:
            return np.full(0, np.nan)
        bins = (np.asarray(step, dtype=np.int64) * int(step_seconds)) // BIN_SECONDS
        known = ~np.isnan(delta)
        counted = known & (np.nan_to_num(delta) > 0)
        # segments: the rows of one GPU in one bin
        new_seg = np.ones(n, dtype=bool)
        new_seg[1:] = (key[1:] != key[:-1]) | (bins[1:] != bins[:-1])
        starts = np.flatnonzero(new_seg)
        seg_key, seg_bin = key[starts], bins[starts]
        seg_counted = np.logical_or.reduceat(counted, starts).astype(np.int64)
        seg_seen = np.logical_or.reduceat(known, starts).astype(np.int64)
        first_of_key = np.ones(len(starts), dtype=bool)
        first_of_key[1:] = seg_key[1:] != seg_key[:-1]
        key_starts = np.flatnonzero(first_of_key)
        segs_of_key = np.diff(np.append(key_starts, len(starts)))
        rank = np.arange(len(starts)) - np.repeat(key_starts, segs_of_key)
        seg_pos = np.repeat(self._positions(seg_key[key_starts]), segs_of_key)
        seg_value = np.full(len(starts), np.nan)
        # the GPUs' r-th bins together, r = 0, 1, ...: each GPU's bins in order, every GPU at once
        by_rank = np.argsort(rank, kind="stable")
        bounds = np.searchsorted(rank[by_rank], np.arange(int(rank.max()) + 2))
        for r in range(len(bounds) - 1):
            at = by_rank[bounds[r]:bounds[r + 1]]
            p, b = seg_pos[at], seg_bin[at]
            fresh = self.bin[p] == NO_BIN
            self.bin[p[fresh]] = b[fresh]
            self._advance(p, b)
            seg_value[at] = self._value(p)
            self.open_counted[p] |= seg_counted[at]
            self.open_seen[p] |= seg_seen[at]
        return np.repeat(seg_value, np.diff(np.append(starts, n)))

    def _advance(self, p: np.ndarray, b: np.ndarray) -> None:
        """Close the open bins of the GPUs at positions p that are older than their rows' bins b, and the
        empty bins between; the bits shifted out of the recent masks join the usual EWMAs, oldest first."""
        gap = b - self.bin[p]
        moving = gap > 0
        if not moving.any():
            return
        p, gap = p[moving], gap[moving]
        rc, rs = self.recent_counted[p], self.recent_seen[p]
        uc, us = self.usual_counted[p], self.usual_seen[p]
        # the open bin closes: its bits enter the masks; then gap - 1 empty bins
        rc, rs, uc, us = _shift(rc, rs, uc, us, self.open_counted[p], self.open_seen[p])
        for j in range(1, min(int(gap.max()), RECENT_BINS + 1)):
            more = gap > j
            zero = np.zeros(int(more.sum()), dtype=np.int64)
            rc[more], rs[more], uc[more], us[more] = _shift(rc[more], rs[more], uc[more], us[more], zero, zero)
        long = gap > RECENT_BINS + 1
        if long.any():
            # the masks are empty by now: each further empty bin only decays the EWMAs
            decay = KEEP ** (gap[long] - (RECENT_BINS + 1)).astype(np.float64)
            uc[long] = uc[long] * decay
            us[long] = us[long] * decay
        self.recent_counted[p], self.recent_seen[p] = rc, rs
        self.usual_counted[p], self.usual_seen[p] = uc, us
        self.open_counted[p] = 0
        self.open_seen[p] = 0
        self.bin[p] = b[moving]

    def _value(self, p: np.ndarray) -> np.ndarray:
        us, uc = self.usual_seen[p], self.usual_counted[p]
        recent = np.bitwise_count(self.recent_counted[p]).astype(np.float64)
        quiet = uc <= USUAL_SHARE_MAX * us
        return np.where(us >= MIN_SEEN, np.where(quiet, recent, 0.0), np.nan)


def _shift(rc, rs, uc, us, counted, seen):
    """One bin pushed into the recent masks (bit 0: the newest); the oldest bit leaves them for the EWMAs."""
    out_c = (rc >> _OLDEST) & 1
    out_s = (rs >> _OLDEST) & 1
    uc = KEEP * uc + ALPHA * out_c
    us = KEEP * us + ALPHA * out_s
    return ((rc << 1) | counted) & _FULL, ((rs << 1) | seen) & _FULL, uc, us
