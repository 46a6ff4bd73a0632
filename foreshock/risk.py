"""The risk scale people read: a node's probability of failing within the model's horizon, and its
level against the evacuation threshold in force.

A calibrated probability is the honest number, but at a deployment's base rate it is small (the
shipped model evacuates at about 0.4 % within 30 minutes), so a fixed colour scale (0.2 / 0.5 / 0.8)
paints every evacuated node green and "risk 0.6 %" reads as nothing to worry about. The **level** is
the probability over the threshold the policy evacuates at: 1.0 means "at the evacuation threshold",
whatever the model or the budget it was chosen for, and the bands below say what each range means.
The control plane exports both (`foreshock_node_failure_risk`, `foreshock_node_risk_level`); the
dashboard (deploy/grafana/foreshock.json), the alerts (deploy/prometheus/foreshock-rules.yaml), the
demo's live view and its report use the level's bands, and docs/operations.md ("The risk scale")
explains them. The YAML and JSON cannot import this module; tests/test_deploy_metrics.py checks that
their colour steps and alert thresholds are these numbers.
"""

from __future__ import annotations

import math

import numpy as np

WATCH_LEVEL = 0.5      # from half the evacuation threshold: worth a look, no action yet
EVACUATE_LEVEL = 1.0   # at the threshold: the policy evacuates (after its hysteresis)

BANDS = (("evacuate", EVACUATE_LEVEL), ("watch", WATCH_LEVEL), ("normal", 0.0))


def level(probability: float, threshold: float | None) -> float:
    """The probability over the evacuation threshold (NaN when no threshold is in force)."""
    if threshold is None or not threshold > 0 or probability is None or math.isnan(probability):
        return float("nan")
    return float(probability) / float(threshold)


def at_or_above(probability, threshold):
    """Which probabilities reach the evacuation threshold (arrays or numbers, broadcast): p >= threshold,
    except that a threshold of 1 or more is reached by none. 1 is where the fleet's score level caps a
    threshold (predictor/fleetlevel.py `governed`): the fleet's healthy scores run so high that none is to be
    trusted, and a probability of exactly 1 is a score saturated in float32, not a certainty. Hard evidence
    and fatal events alarm whatever the threshold."""
    return (np.asarray(probability) >= threshold) & (np.asarray(threshold) < 1.0)


def band(lvl: float) -> str:
    """"evacuate" from EVACUATE_LEVEL, "watch" from WATCH_LEVEL, else "normal" (also when unknown)."""
    for name, lo in BANDS:
        if lvl >= lo:
            return name
    return "normal"


def percent(probability: float) -> str:
    """A probability as a person reads it: "0.62 %", "12 %", "< 0.01 %"."""
    p = 100.0 * float(probability)
    if p <= 0:
        return "0 %"
    if p < 0.01:
        return "< 0.01 %"
    return f"{p:.2g} %" if p < 10 else f"{p:.0f} %"


def words(probability: float, threshold: float | None, horizon_seconds: int | float) -> str:
    """"0.62 % within 30 min, 1.6x the evacuation threshold (evacuate)"."""
    text = f"{percent(probability)} within {horizon_seconds / 60:.0f} min"
    lvl = level(probability, threshold)
    if math.isnan(lvl):
        return text
    return f"{text}, {times(lvl)} the evacuation threshold ({band(lvl)})"


def times(lvl: float) -> str:
    """A level as "12x", "1.6x", "1.0x" (just over the threshold), "0.42x"."""
    if math.isnan(lvl):
        return "-"
    return f"{lvl:.0f}x" if lvl >= 10 else f"{lvl:.1f}x" if lvl >= 1 else f"{lvl:.2f}x"


def pick_threshold(curve, budget: float) -> float:
    """The threshold for a false-evacuation budget on a curve [(threshold, false evacuations per 1,000
    node-days, recall), ...] sorted by threshold: the lowest whose rate is within `budget`; the highest
    when none is (1.0 for an empty curve). The one rule: train chooses a manifest's thresholds by it,
    the registry and the control plane read them by it, calibration re-fits them by it."""
    for th, fe, _recall in curve:
        if fe <= budget:
            return th
    return curve[-1][0] if curve else 1.0


def threshold_for_budget(manifest: dict, budget: float | None = None, model: str = "model") -> float | None:
    """The evacuation threshold a model manifest gives for `budget` false evacuations per 1,000
    node-days (None: the model's recommended threshold, chosen for the budget it was trained for).

    From the manifest's validation curve by pick_threshold; a manifest with only a table of thresholds
    per budget gives the loosest whose budget is within the one asked (the strictest when none is);
    None when it names no threshold at all."""
    if budget is None:
        value = manifest.get("recommended_threshold") if model == "model" else None
        if value is not None:
            return float(value)
        budget = float(manifest.get("budget", 2.0))
    curve = (manifest.get("threshold_curves") or {}).get(model)
    if curve:
        return float(pick_threshold(curve, budget))
    table = manifest.get("thresholds") if model == "model" else (manifest.get("baseline_thresholds") or {}).get(model)
    pairs = []
    for key, value in (table or {}).items() if isinstance(table, dict) else ():
        try:
            pairs.append((float(key), float(value)))
        except (TypeError, ValueError):
            continue
    if pairs:
        within = [t for b, t in pairs if b <= budget]
        return min(within) if within else max(t for _, t in pairs)
    value = manifest.get("recommended_threshold") if model == "model" else None
    return float(value) if value is not None else None
