"""The job-relative step-time comparison: a rank's step time against its job's median at the same step.

The one rule both readers of step times compare by: the service's fail-slow judgement over each job's
window (service/steptimes.py, `FailSlowSettings` configures it) and the predictor's step-time signal
over the `step_times` rows (predictor/steptimes.py, with the defaults below, part of the feature
definition). The step times are the migrator's (jobs.proto StepTime; schema v1 `step_times`).

`compare(total, compute, ranks)` takes a job's steps as rows and its ranks as columns (NaN: the rank
did not report that step). A step is *judged* when at least `min_ranks` ranks, and at least half of
the job's `ranks`, reported it. The time compared there is the compute part when every rank reporting
the step measured it (> 0), else the whole step: in a synchronous data-parallel job every rank's whole
step is the same (all wait for the slowest at the all-reduce), so only the compute part tells the
culprit; the whole step still does for jobs whose ranks do not wait for each other. Each rank's time
is taken over the step's median across ranks; it is *slow* when it is at least `ratio` times the
median and at least `mad_k` robust standard deviations (MAD_SIGMA x the median absolute deviation
across ranks) and `min_excess_seconds` above it. The slow ranks must be fewer than half of the job's,
or the median moves: the comparison is job-relative.

Medians are taken by sorting each row (`row_median`), so a step's result depends on its reported
values only, not on the columns of ranks that did not report it nor on their order: the predictor's
offline and online paths, which see different sets of steps at a time, agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RATIO = 1.2                 # a rank's time at a step, over the job's median there
MIN_RANKS = 3               # ranks that reported a step before it is judged (and half the job's)
MAD_K = 3.0                 # and this many robust standard deviations above the median
MIN_EXCESS_SECONDS = 0.002  # and this much above it: sub-millisecond jitter is no fault
MAD_SIGMA = 1.4826          # the median absolute deviation of a normal sample, in standard deviations
# The fail-slow rule's defaults (service/steptimes.py FailSlowSettings, `foreshock serve`): a rank is fail-slow
# when it was slow in at least FAIL_SLOW_MIN_STEPS of its last FAIL_SLOW_WINDOW judged steps.
FAIL_SLOW_MIN_STEPS, FAIL_SLOW_WINDOW = 12, 16


@dataclass(frozen=True)
class Compared:
    """The judged steps of a compare() call, rows in the order of its input's judged rows."""

    judged: np.ndarray       # [S] bool: which input rows were judged
    use_compute: np.ndarray  # [J] the compute part was compared (else the whole step)
    x: np.ndarray            # [J, R] the time compared (NaN: the rank did not report the step)
    ratio: np.ndarray        # [J, R] x over the step's median
    slow: np.ndarray         # [J, R] bool


def row_median(x: np.ndarray) -> np.ndarray:
    """[S, R] -> [S]: each row's median over its known (not NaN) values, NaN for a row with none; the
    mean of the middle two of an even count."""
    s = np.sort(x, axis=1)                   # NaN last
    n = (~np.isnan(x)).sum(axis=1)
    rows = np.arange(len(x))
    lo, hi = np.maximum((n - 1) // 2, 0), np.maximum(n // 2, 0)
    if x.shape[1] == 0:
        return np.full(len(x), np.nan)
    with np.errstate(invalid="ignore"):
        return np.where(n > 0, (s[rows, lo] + s[rows, hi]) / 2.0, np.nan)


def compare(total: np.ndarray, compute: np.ndarray, ranks, *, ratio: float = RATIO, min_ranks: int = MIN_RANKS,
            mad_k: float = MAD_K, min_excess_seconds: float = MIN_EXCESS_SECONDS) -> Compared:
    """Judge a job's steps (module docstring). total, compute: [S, R] float64 seconds, NaN where the
    rank did not report the step; a compute part of 0 or NaN where the whole step is known is one not
    measured. ranks: the job's rank count, one number or one per row."""
    total = np.asarray(total, dtype=np.float64)
    compute = np.asarray(compute, dtype=np.float64)
    valid = ~np.isnan(total)
    n = valid.sum(axis=1)
    need = np.maximum(min_ranks, np.ceil(np.asarray(ranks, dtype=np.float64) / 2.0))
    judged = n >= need
    with np.errstate(invalid="ignore"):
        use_compute = np.all(~valid | (compute > 0), axis=1)[judged]
    x = np.where(use_compute[:, None], compute[judged], total[judged])
    x = np.where(valid[judged], x, np.nan)
    med = row_median(x)
    with np.errstate(all="ignore"):
        mad = row_median(np.abs(x - med[:, None]))
        floor = np.maximum(min_excess_seconds, mad_k * MAD_SIGMA * mad)
        slow = (x >= ratio * med[:, None]) & (x - med[:, None] >= floor[:, None])
        rel = x / med[:, None]
    return Compared(judged, use_compute, x, rel, slow)


__all__ = ["Compared", "compare", "row_median", "RATIO", "MIN_RANKS", "MAD_K", "MIN_EXCESS_SECONDS", "MAD_SIGMA",
           "FAIL_SLOW_MIN_STEPS", "FAIL_SLOW_WINDOW"]
