"""Explanations: which signals drove a node's risk, in words a person understands.

Contributions are measured by occlusion: for each signal (the group of features computed from one
base or peer signal of features.py), the signal's features are set to their healthy reference
values (the medians over healthy training steps, stored in the manifest) and the node is scored
again; the contribution is how much the probability drops. One batched predict call covers every
(node, signal) pair, so explaining the riskiest nodes of a round costs milliseconds. The description
is built from the node's own feature values: "HBM corrected ECC errors: 120 in the last 30 min,
40x its 3-day baseline, worst on GPU 3". The step times against the job's (features.STEP_TIMES) are one
signal: "Step time against its job's other ranks (its slowest rank): 1.52x its job's median at most in
30 min (1.49x in 5 min), slow in 48% of its judged steps", named only from a ratio at which the service's
fail-slow rule calls a step slow (foreshock/stepcompare.py). A flag (the NVLink fabric's too) is named
only while set, never from 0 or NaN. A signal no model reads contributes nothing and is never named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from foreshock import stepcompare
from foreshock.predictor import features as ft
from foreshock.predictor import onset
from foreshock.predictor import signals as sg


@dataclass(frozen=True)
class Signal:
    name: str            # the base/peer signal (features.ALL_NAMES)
    value: float         # its headline value (30-min count, current gauge, peer ratio)
    contribution: float  # probability points it adds (probability minus probability with it healthy)
    description: str


SIGNAL_BY_NAME = {s.name: s for s in ft.ALL_SIGNALS}
GROUPS: dict[str, np.ndarray] = {}
for _i, _spec in enumerate(ft.FEATURES):
    GROUPS.setdefault(_spec.signal, [])
    GROUPS[_spec.signal].append(_i)
GROUPS = {k: np.asarray(v) for k, v in GROUPS.items()}
GROUP_NAMES = tuple(GROUPS)
FIDX = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
# A steadiness (features.STEADINESS) worth saying: a tenth more of the last 2 hours' minutes counting
# than usual is above the healthy extreme of every signal but corrected ECC and the IB receive errors
# in the development worlds (novelty.py's scales).
STEADY_WORTH_SAYING = 0.1


def _fmt(v: float) -> str:
    if v is None or not np.isfinite(v):
        return "unknown"
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:.2f}"


# The ratio to the baseline is (rate + eps) / (baseline + eps) per step (features.py), so a single
# error after days of none reads as 2x: below this many per 30 minutes the baseline is said as quiet.
QUIET_BASELINE_PER_30M = 0.05


def _against_baseline(v30: float, ratio: float) -> str:
    eps = 1.0 / ft.HISTORY
    per30 = ((v30 / ft.HISTORY + eps) / ratio - eps) * ft.HISTORY
    if per30 < QUIET_BASELINE_PER_30M:
        return "after a quiet 3 days"
    return f"{ratio:.1f}x its 3-day baseline" if ratio < 10 else f"{ratio:.0f}x its 3-day baseline"


def _unit(unit: str, v: float) -> str:
    """" links" for 2 and for 0, " link" for 1: the signals' units are plural nouns or symbols."""
    if not unit:
        return ""
    return f" {unit[:-1]}" if v == 1 and unit in ("links", "lanes", "rows", "gens") else f" {unit}"


def _ratio(v: float) -> str:
    return f"{v:.2f}x" if v is not None and np.isfinite(v) else "none judged"


def _share(v: float) -> str:
    """A share (0..1) as a percentage."""
    return f"{v:.0%}" if v is not None and np.isfinite(v) else "unknown"


def _count(v: float) -> str:
    """A window's error count in words. Counts across a sampling gap are spread over the gap's steps
    (signals.py), so a window can hold part of one: said as about the whole number, never "0.50"."""
    if float(v).is_integer():
        return _fmt(v)
    return f"about {_fmt(max(1.0, float(round(v))))}"


def headline(signal: str, row: np.ndarray) -> float:
    if signal == "anomaly":
        return float(row[FIDX["anomaly_vs_own_history"]])
    for suffix in ("_30m", "_now", "_30m_vs_baseline"):
        j = FIDX.get(signal + suffix)
        if j is not None:
            return float(row[j])
    j = FIDX.get(f"minutes_since_{signal}")
    return float(row[j]) if j is not None else float("nan")


def describe(signal: str, row: np.ndarray, entity: str | None = None) -> str:
    spec = SIGNAL_BY_NAME.get(signal)
    text = spec.text if spec else signal
    text = text[0].upper() + text[1:]
    get = lambda name: float(row[FIDX[name]]) if name in FIDX else float("nan")  # noqa: E731
    parts = []
    if spec is not None and spec.kind == "count":
        v30 = get(f"{signal}_30m")
        ratio = get(f"{signal}_30m_vs_baseline")
        counted = np.isfinite(v30) and v30 > 0
        if counted:
            parts.append(f"{_count(v30)} in the last 30 min")
            if np.isfinite(ratio) and ratio >= 2:
                parts.append(_against_baseline(v30, ratio))
        day = get(f"{signal}_decayed_12h")
        if np.isfinite(day) and day >= 1 and not (counted and day < v30 + 1):
            parts.append(f"about {_fmt(round(day))} over the last day")
        steady = get(f"{signal}_steadiness_2h")
        if np.isfinite(steady) and steady >= STEADY_WORTH_SAYING:
            parts.append(f"counting in {steady:.0%} more of the last 2 hours' minutes than over its days")
        # a quiet half hour is said after what was counted, never as the reason itself
        if np.isfinite(v30) and not counted and parts:
            parts.append("none in the last 30 min")
        since = get(f"minutes_since_{signal}")
        if np.isfinite(since) and since < ft.SINCE_CAP_MINUTES:
            parts.append(f"the last {since:.0f} min ago")
    elif spec is not None and signal + "_vs_usual" in FIDX:
        rise, day = get(signal + "_vs_usual"), get("remap_correctable_decayed_12h")
        if np.isfinite(rise):
            parts.append(f"{rise:+.1f}{_unit(spec.unit, 2.0)} against its usual")
        if np.isfinite(day) and day >= ft.WARMING_REMAPPED:
            parts.append(f"about {_fmt(max(round(day), 1))} HBM rows remapped over the last day")
    elif signal in sg.ONSET_NAMES:
        bins = get(f"{signal}_now")
        if np.isfinite(bins) and bins > 0:
            parts.append(f"{bins:.0f} of the last {onset.RECENT_BINS}, where it had counted in at most "
                         f"{onset.USUAL_SHARE_MAX:.0%} of its bins before")
    elif spec is not None and spec.kind in ("gauge", "flag"):
        now, mx = get(f"{signal}_now"), get(f"{signal}_max30m")
        if spec.kind == "flag":
            parts.append("now" if now > 0 else "in the last 30 min" if mx > 0 else "not seen")
        elif spec.unit == "ratio":
            parts.append(f"{_share(now)} now, {_share(mx)} at most in 30 min")
        else:
            parts.append(f"{_fmt(now)}{_unit(spec.unit, now)} now, {_fmt(mx)}{_unit(spec.unit, mx)} at most in 30 min")
            rise = get(f"{signal}_rise30m")
            if np.isfinite(rise) and abs(rise) >= 0.5:
                parts.append(f"{rise:+.1f}{_unit(spec.unit, 2.0)} over 30 min")
    elif spec is not None and signal + "_3d" in FIDX:
        usual = get(signal + "_3d")
        if np.isfinite(usual):
            parts.append(f"{_fmt(usual)}{_unit(spec.unit, usual)} on average over the last 3 days")
    elif spec is not None and spec.kind == "peer":
        say = _share if spec.unit == "ratio" else _fmt
        parts.append(f"{say(get(signal + '_30m'))} over 30 min ({say(get(signal + '_5m'))} over 5 min)")
    elif spec is not None and spec.kind == "step":
        r30, r5, share = get(f"{signal}_30m"), get(f"{signal}_5m"), get("steptime_slow_share_30m")
        if np.isfinite(r30):
            parts.append(f"{r30:.2f}x its job's median at most in 30 min ({_ratio(r5)} in 5 min)")
        if np.isfinite(share) and share > 0:
            parts.append(f"slow in {share:.0%} of its judged steps")
    elif signal == "anomaly":
        return _describe_anomaly(get)
    parts += _against_peers(signal, get)
    if entity:
        parts.append(f"worst on {entity}")
    return f"{text}: {', '.join(parts)}" if parts else text


IB_LINK_SIGNALS = frozenset(sg.IB_LINK_ERRORS) | {"ib_link_err_port_max"}
GPU_ERROR_SIGNALS = frozenset(ft.GPU_ERRORS) | {"nvl_replay", "nvl_recovery", "nvl_crc", "nvl_ecc"}


def _against_peers(signal: str, get) -> list[str]:
    """What the node's peers show for the same signal: whether it is the node's own or everybody's."""
    if signal in IB_LINK_SIGNALS:
        ratio, share = get("link_err_vs_leaf_30m"), get("leaf_peers_link_err_frac_30m")
        if np.isfinite(share) and share >= 0.5:
            return [f"{share:.0%} of its leaf switch's other nodes too"]
        if np.isfinite(ratio) and ratio >= 2:
            return [f"{ratio:,.0f}x the other nodes under its leaf switch"]
    elif signal in GPU_ERROR_SIGNALS:
        ratio = get("gpu_err_vs_job_30m")
        if np.isfinite(ratio) and ratio >= 2:
            return [f"{ratio:,.0f}x its job's other nodes"]
    elif signal == "temp_max":
        gap = get("temp_vs_job_30m")
        if np.isfinite(gap) and abs(gap) >= 3:
            return [f"{gap:+.0f} degC against its job's other nodes"]
    return []


def _describe_anomaly(get) -> str:
    """The anomaly scores in words: the signal furthest above the node's own baseline, and how far
    above its peers the node is."""
    parts = []
    ratios = [(get(f"{n}_30m_vs_baseline"), n) for n in ft.BASELINED]
    ratios = [(r, n) for r, n in ratios if np.isfinite(r)]
    if ratios:
        r, n = max(ratios)
        if r >= 2:
            text = SIGNAL_BY_NAME[n].text
            parts.append(f"{text} at {r:,.0f}x this node's 3-day baseline")
    count = get("anomaly_signals_4x_baseline")
    if np.isfinite(count) and count >= 2:
        parts.append(f"{count:.0f} error signals at 4x their baseline or more at once")
    peers = get("anomaly_vs_peers")
    if np.isfinite(peers) and peers >= 1:
        parts.append(f"errors {2 ** peers:,.0f}x its job or leaf-switch peers'")
    return "Unusual for this node: " + "; ".join(parts) if parts else "Unusual for this node"


_KIND = np.array([SIGNAL_BY_NAME[ft.FEATURES[i].signal].kind if ft.FEATURES[i].signal in SIGNAL_BY_NAME
                  else ft.FEATURES[i].signal for i in range(ft.N_FEATURES)])
# a count signal is named only for what it counted: its windows, its day's decayed count and its
# steadiness, not its ratios to the baseline
_COUNTED = np.array([f.op in ("sum1", "sum5", "sum30", "decayed", "steady") for f in ft.FEATURES])
# ... and only from where `describe` says it: a day's count from about 1, a steadiness from
# STEADY_WORTH_SAYING; below those the signal would be named with nothing said of it. The step times
# from a ratio the fail-slow rule calls slow: 1.0 is as fast as the job, and a share of slow steps
# says something only beside such a ratio.
_SAID_FROM = np.array([1.0 if f.op == "decayed" else STEADY_WORTH_SAYING if f.op == "steady"
                       else stepcompare.RATIO if f.op in ("job_max5", "job_max30")
                       else np.inf if f.op == "slow_share30" else 0.0 for f in ft.FEATURES])
_GROUP_OF = np.zeros((ft.N_FEATURES, len(GROUP_NAMES)))
for _k, _name in enumerate(GROUP_NAMES):
    _GROUP_OF[GROUPS[_name], _k] = 1.0


def unusual(X: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """[n, groups]: whether each signal's features say something an operator can act on: a count,
    peer ratio or anomaly score above its healthy reference (never a zero), a gauge off it."""
    known = np.isfinite(X)
    ref = np.where(np.isfinite(reference), reference, 0.0)
    gauge = _KIND == "gauge"
    # a flag is named only while set (1), never from 0 beside a reference it lacks (NaN)
    off = np.where(gauge, X != reference, X > ref)
    off &= known & ((_KIND != "count") | (_COUNTED & (X > 0) & (X >= _SAID_FROM)))
    off &= (_KIND != "step") | (X >= _SAID_FROM)
    return (off.astype(np.float64) @ _GROUP_OF) > 0


def explain(estimator_proba, X: np.ndarray, probability: np.ndarray, reference: np.ndarray,
            top: int = 3, entities: list[dict[str, str]] | None = None,
            used_features: np.ndarray | None = None) -> list[list[Signal]]:
    """Top contributing signals for each row of X (rows already scored: `probability`).

    used_features: the feature columns the model reads at all (registry.LoadedModel.used_features);
    a signal none of whose features is among them contributes exactly 0 and is not re-scored.
    """
    n = len(X)
    if n == 0:
        return []
    g = len(GROUP_NAMES)
    live = list(range(g))
    if used_features is not None:
        used = np.zeros(X.shape[1], dtype=bool)
        used[np.asarray(used_features, dtype=np.intp)] = True
        live = [k for k, name in enumerate(GROUP_NAMES) if used[GROUPS[name]].any()]
    contrib = np.zeros((n, g))
    if live:
        occluded = np.repeat(X[:, None, :], len(live), axis=1)     # [n, live, F]
        for j, k in enumerate(live):
            cols = GROUPS[GROUP_NAMES[k]]
            occluded[:, j, cols] = reference[cols]
        p_occ = estimator_proba(occluded.reshape(n * len(live), -1)).reshape(n, len(live))
        contrib[:, live] = probability[:, None] - p_occ
    worth_naming = unusual(X, reference)
    out = []
    for i in range(n):
        order = np.argsort(-contrib[i], kind="stable")
        sigs = []
        for k in order:
            if contrib[i, k] <= 0:
                break
            name = GROUP_NAMES[k]
            if not worth_naming[i, k]:
                continue
            ent = (entities[i] or {}).get(name) if entities else None
            sigs.append(Signal(name, headline(name, X[i]), float(contrib[i, k]), describe(name, X[i], ent)))
            if len(sigs) == top:
                break
        out.append(sigs)
    return out


# per-entity maxima whose worst entity online.py tracks, for "worst on GPU 3"
ENTITY_SIGNALS = {
    "ecc_sbe": ("gpu", "ecc_sbe", "GPU"),
    "pcie_replay": ("gpu", "pcie_replay", "GPU"),
    "nvl_crc": ("nvlink", "nvl_errors", "GPU"),
    "nvl_replay": ("nvlink", "nvl_errors", "GPU"),
    "ib_symbol_error": ("rdma_port", "ib_link_errors", "port"),
    "ib_link_error_recovery": ("rdma_port", "ib_link_errors", "port"),
    "ecc_onset_bins": ("gpu", "ecc_onset", "GPU"),   # the GPU whose corrected ECC started (onset.py)
}
for _name, (_t, _c, _kind) in ENTITY_SIGNALS.items():
    assert _name in sg.STEP_INDEX
