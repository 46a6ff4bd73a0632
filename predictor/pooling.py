"""Pooling evaluations: several `foreshock evaluate --json` reports of one model, one figure per budget.

Why: one evaluation holds a few dozen failures with precursors and a handful of false evacuations, and
a judgement (benchmarks/results/) pools several held-out periods, clusters or seeds: recall is the
failures caught over the failures, summed over the reports, and the false-evacuation rate the false
evacuations over the node-days, summed likewise, each with its interval (evaluate.INTERVAL_LEVEL).
The inputs are evaluate's JSON reports (evaluate.py: `at_budgets`, `model_version`, `data_hash`,
`overlap`). They must be of one model version at the same thresholds and of distinct data; a report
whose data overlaps the model's training data makes the pool no evidence, and the pool says so.
Medians do not pool: each report's median lead is listed. The reports' `policy_parts` (the model's risk
alone, its hard evidence alone, each condition) pool the same way when every report has them at one
budget.
"""

from __future__ import annotations

import json
from pathlib import Path

from foreshock.predictor import evaluate as ev

MIN_REPORTS = 2


class PoolError(ValueError):
    """A report that cannot be pooled with the others; the message names it."""


def read_report(path: str | Path) -> dict:
    """One evaluate report (JSON), checked to be one: PoolError names the file otherwise."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PoolError(f"{path}: not a readable JSON report ({exc})") from None
    missing = [k for k in ("at_budgets", "model_version", "data_hash", "node_days") if not isinstance(report, dict)
               or k not in report]
    if missing:
        raise PoolError(f"{path}: not a `foreshock evaluate --json` report (no {', '.join(missing)})")
    return report


def pool(reports: list[tuple[str, dict]]) -> dict:
    """The pooled figures of `reports` ((path, report) pairs): per budget and predictor, the summed
    counts, the pooled recall and rate with their intervals, each report's median lead, and per family
    the summed failures and those caught. Raises PoolError naming the report that differs (model
    version, a threshold) or repeats another's data, or when fewer than MIN_REPORTS are given."""
    if len(reports) < MIN_REPORTS:
        raise PoolError(f"pooling needs at least {MIN_REPORTS} reports, got {len(reports)}")
    first_path, first = reports[0]
    seen: dict[str, str] = {}
    for path, rep in reports:
        if rep["model_version"] != first["model_version"]:
            raise PoolError(f"{path}: model {rep['model_version']}, where {first_path} has {first['model_version']}: "
                            "pool reports of one model")
        if rep["data_hash"] in seen:
            raise PoolError(f"{path}: the same data as {seen[rep['data_hash']]} (data hash {rep['data_hash'][:12]})")
        seen[rep["data_hash"]] = path
    budgets = [b for b in first["at_budgets"] if all(b in rep["at_budgets"] for _, rep in reports)]
    out = {"model_version": first["model_version"], "budget": float(first.get("budget", 2.0)),
           "interval_level": ev.INTERVAL_LEVEL,
           "reports": [{"path": str(path), "data": rep.get("data"), "data_hash": rep["data_hash"],
                        "node_days": rep["node_days"], "overlaps": bool((rep.get("overlap") or {}).get("overlaps"))}
                       for path, rep in reports],
           "node_days": float(sum(rep["node_days"] for _, rep in reports)), "at_budgets": {}}
    out["overlaps"] = [r["path"] for r in out["reports"] if r["overlaps"]]
    for b in budgets:
        present = [n for n in first["at_budgets"][b] if all(n in rep["at_budgets"][b] for _, rep in reports)]
        names = [n for n in ev.MODEL_NAMES if n in present] + [n for n in present if n not in ev.MODEL_NAMES]
        out["at_budgets"][b] = {name: _pool_one([(path, rep["at_budgets"][b][name]) for path, rep in reports], b, name)
                                for name in names}
    parts = _pool_parts([rep.get("policy_parts") for _, rep in reports])
    if parts is not None:
        out["policy_parts"] = parts
    return out


def _pool_one(entries: list[tuple[str, dict]], budget: str, name: str) -> dict:
    first_path, first = entries[0]
    if first.get("threshold") is None:
        return {"threshold": None, "missing": first.get("missing", "no threshold")}
    families: dict[str, dict] = {}
    for path, m in entries:
        if m.get("threshold") != first["threshold"]:
            raise PoolError(f"{path}: {name}'s budget-{float(budget):g} threshold is {m.get('threshold')}, where "
                            f"{first_path} has {first['threshold']}: pool reports made at the same thresholds")
        for fam, f in (m.get("per_family") or {}).items():
            acc = families.setdefault(fam, {"incidents": 0, "detected": 0})
            acc["incidents"] += int(f["incidents"])
            acc["detected"] += int(f["detected"])
    for f in families.values():
        f["recall"] = f["detected"] / f["incidents"] if f["incidents"] else float("nan")
    return {"threshold": first["threshold"], **_pooled_counts([m for _, m in entries]),
            "per_family": dict(sorted(families.items()))}


def _pooled_counts(rows: list[dict]) -> dict:
    """evaluate rows (precursor failures, recall, false evacuations, node-days) summed: the pooled recall
    and rate with their intervals, and each row's median lead."""
    incidents = sum(int(m["incidents_precursor"]) for m in rows)
    detected = sum(round(m["incident_recall_precursor"] * int(m["incidents_precursor"]))
                   for m in rows if m["incidents_precursor"])
    false = sum(int(m["false_evacuations"]) for m in rows)
    node_days = float(sum(float(m["node_days"]) for m in rows))
    return {"incidents_precursor": incidents, "detected_precursor": detected,
            "incident_recall_precursor": detected / incidents if incidents else float("nan"),
            "incident_recall_precursor_interval": ev.proportion_interval(detected, incidents),
            "false_evacuations": false, "node_days": node_days,
            "false_evacuations_per_1000_node_days": 1000.0 * false / node_days if node_days else float("nan"),
            "false_evacuations_per_1000_node_days_interval": ev.rate_interval(false, node_days),
            "median_lead_minutes_per_report": [m.get("median_lead_minutes") for m in rows]}


def _pool_parts(parts: list[dict | None]) -> dict | None:
    """The reports' `policy_parts` pooled part by part, when every report has them at one budget with the
    same conditions; else None."""
    if not parts or not all(parts) or len({p["budget"] for p in parts}) != 1 or len(
            {tuple(c["condition"] for c in p["conditions"]) for p in parts}) != 1:
        return None
    return {"budget": parts[0]["budget"],
            "risk_alone": _pooled_counts([p["risk_alone"] for p in parts]),
            "hard_evidence_alone": _pooled_counts([p["hard_evidence_alone"] for p in parts]),
            "conditions": [{"condition": c["condition"], **_pooled_counts([p["conditions"][j] for p in parts])}
                           for j, c in enumerate(parts[0]["conditions"])],
            "added_by_hard_evidence": sum(int(p["added_by_hard_evidence"]) for p in parts)}
