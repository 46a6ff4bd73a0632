"""The evaluation report as HTML: Jinja2 templates (foreshock/pages.py, autoescape) and plots
(matplotlib, embedded PNG).

Reads the report dict of evaluate.evaluate_dataset (the same content as the JSON) and writes one
self-contained page: the result in a sentence, the figures of the model and both baselines at the
manifest's thresholds for the budget and for budgets 1, 2 and 5, per family, signature and node type,
failures per category (those without precursors shown apart), the PR curves, the lead-time
histogram, the reliability curve and recall per category, and a red banner when the evaluated data
overlaps the model's training data or its nodes were sampled less often than once per feature step.
`leave_one_out_html` renders the report of leave_one_out.py.
"""

from __future__ import annotations

import base64
import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from foreshock import pages  # noqa: E402
from foreshock.predictor.evaluate import INTERVAL_LEVEL, overlap_warning  # noqa: E402
from foreshock.predictor.offline import telemetry_interval_warning  # noqa: E402

NAMES = ("model", "rule", "logistic")
COLORS = {"model": "#1f77b4", "rule": "#d62728", "logistic": "#2ca02c"}


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plots(report: dict) -> dict[str, str]:
    out = {}
    present = [n for n in NAMES if n in report]
    fig, ax = plt.subplots(figsize=(5, 4))
    for n in present:
        pr = report[n].get("pr_curve")
        if pr:
            ax.plot(pr["recall"], pr["precision"], label=f"{n} (AP {report[n]['pr_auc']:.3f})", color=COLORS[n])
    ax.set_xlabel("recall (steps)"), ax.set_ylabel("precision"), ax.set_title("Precision-recall")
    ax.legend(loc="upper right", fontsize=8)
    out["pr"] = _png(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    for n in present:
        leads = report[n].get("lead_minutes_precursor") or []
        if leads:
            ax.hist(leads, bins=15, alpha=0.5, label=n, color=COLORS[n])
    ax.set_xlabel("lead time (minutes, first alert to incident)"), ax.set_ylabel("incidents")
    ax.set_title("Lead time at the recommended threshold")
    ax.legend(fontsize=8)
    out["lead"] = _png(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot([0, 1], [0, 1], ":", color="gray")
    for n in present:
        rel = report[n].get("reliability") or []
        if rel:
            ax.plot([r["mean_predicted"] for r in rel], [r["observed"] for r in rel], "o-", label=n, color=COLORS[n])
    ax.set_xscale("symlog", linthresh=1e-3), ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("mean predicted probability"), ax.set_ylabel("observed frequency")
    ax.set_title("Reliability"), ax.legend(fontsize=8)
    out["reliability"] = _png(fig)
    cats = sorted(report["model"].get("per_category", {}),
                  key=lambda c: (not report["model"]["per_category"][c]["has_precursor"], c))
    if cats:
        fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(cats)), 4))
        width = 0.8 / len(present)
        for k, n in enumerate(present):
            pc = report[n].get("per_category", {})
            ax.bar([i + k * width for i in range(len(cats))], [pc.get(c, {}).get("recall", 0) for c in cats],
                   width, label=n, color=COLORS[n])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))])
        ax.set_xticklabels([c + ("" if report["model"]["per_category"][c]["has_precursor"] else " *") for c in cats],
                           rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("incident recall"), ax.set_ylim(0, 1.05)
        ax.set_title("Recall per category (* = no precursor: not creditable)"), ax.legend(fontsize=8)
        out["categories"] = _png(fig)
    return out


def _pct(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.0f}%"


def leave_one_out_html(report: dict, title: str = "Foreshock leave-one-out evaluation") -> str:
    """The leave-one-out report (leave_one_out.py) as a page: foreshock/templates/leave_one_out.html.j2."""
    from pathlib import PurePath

    kind = str(report["leave_one_out"]).replace("_", " ")
    rows, caught_without, total = [], 0, 0
    for name, entry in report["held_out"].items():
        if "error" in entry:
            rows.append({"name": name, "budget": "", "model": "", "missing": f"not trained: {entry['error']}"})
            continue
        for label, key in (("trained without it", "held_out_model"), ("trained on everything", "model_trained_on_everything")):
            for b, m in entry[key].items():
                row = {"name": name, "budget": f"{float(b):g}", "model": label, "missing": ""}
                if m.get("threshold") is None:
                    row["missing"] = m.get("missing") or "no threshold for this budget in the manifest"
                else:
                    row.update(caught=_caught(m), lead=_minutes(m.get("median_lead_minutes")),
                               false=_rate(m.get("false_evacuations_per_1000_node_days")))
                    if key == "held_out_model" and float(b) == float(report.get("budget", 2.0) or 2.0):
                        n = m.get("incidents_precursor") or 0
                        total += n
                        caught_without += round((m.get("incident_recall_precursor") or 0) * n) if n else 0
                rows.append(row)
    headline = (f"Trained without the {kind} it was then judged on, the model warned of {caught_without} of {total} "
                f"such failures with precursors at the budget of {float(report.get('budget', 2.0) or 2.0):g} false "
                f"evacuations per 1,000 node-days." if total else
                f"No {kind} held out had failures with precursors in the judged data.")
    definitions = [{"term": TERMS.get(k, k.replace("_", " ")), "text": v}
                   for k, v in (report.get("definitions") or {}).items()]
    return pages.render("leave_one_out.html.j2",
        title=title, kind=kind, train_name=PurePath(str(report.get("train_data", ""))).name,
        data_name=PurePath(str(report.get("data", ""))).name, nodes=report.get("nodes", ""),
        horizon=f"{report.get('horizon_minutes', 30):g}", overlap=overlap_warning(report.get("overlap")) or "",
        headline=headline, rows=rows, definitions=definitions)


LABELS = {"model": "Foreshock model", "rule": "DCGM-style rule", "logistic": "logistic regression"}
TERMS = {"incident_recall_precursor": "failures with precursors warned of",
         "incident_recall_all": "all failures warned of",
         "median_lead_minutes": "median warning",
         "false_evacuations_per_1000_node_days": "false evacuations per 1,000 node-days",
         "false_evacuations_strict_per_1000_node_days": "false evacuations per 1,000 node-days (strict)",
         "at_budgets": "at other budgets", "overlap": "overlap with the training data"}
GROUPS = (("per_family", "Failures with precursors warned of, per family (category)", False),
          ("per_signature", "Per failure mode (signature)", False),
          ("per_node_type", "Per node type (and false evacuations per 1,000 node-days of the type)", True))


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _caught(m: dict) -> str:
    """"6 of 14 (43 %)"."""
    n, r = m.get("incidents_precursor"), m.get("incident_recall_precursor")
    if _nan(r):
        return "no such failures"
    return f"{round(r * n)} of {n} ({_pct(r)})" if isinstance(n, int) else _pct(r)


def _minutes(v) -> str:
    return "-" if _nan(v) else f"{v:.0f} min" if v >= 10 else f"{v:.1f} min"


def _rate(v) -> str:
    return "-" if _nan(v) else f"{v:.2f}"


def _interval(bounds, fmt, before: str = "; ", after: str = "") -> str:
    """A figure's interval in words ("; 90 % interval 33%-55%"), or nothing for a report without one."""
    if not bounds or any(_nan(b) for b in bounds):
        return ""
    return f"{before}{INTERVAL_LEVEL:.0%} interval {fmt(bounds[0])}-{fmt(bounds[1])}{after}"


def _probability(v) -> str:
    from foreshock import risk

    return "-" if _nan(v) else risk.percent(v)


def _score(v, digits: int = 3) -> str:
    return "n/a" if _nan(v) else f"{v:.{digits}f}"


def _in_order(per: dict) -> list[tuple[str, dict]]:
    """A budget's predictors in NAMES order (the model first), then any other."""
    return sorted(per.items(), key=lambda kv: NAMES.index(kv[0]) if kv[0] in NAMES else len(NAMES))


def _headline(report: dict, present: list[str]) -> str:
    m = report["model"]
    n = m.get("incidents_precursor", 0)
    if not n:
        text = "There were no failures with precursors in this data, so the recall cannot be judged"
    else:
        caught = round(m["incident_recall_precursor"] * n)
        moved = m.get("threshold_in_force") or {}
        raised = (f" (raised by the fleet's score level in {moved['hours_raised']} of {moved['hours']} hours)"
                  if moved.get("hours_raised") else "")
        text = (f"At its threshold for {report['budget']:g} false evacuations per 1,000 node-days{raised}, the model warned "
                f"of {caught} of {n} failures with precursors ({_pct(m['incident_recall_precursor'])}"
                f"{_interval(m.get('incident_recall_precursor_interval'), _pct)})")
        if caught:
            text += f", a median {_minutes(m['median_lead_minutes'])} ahead"
    text += (f", with {_rate(m['false_evacuations_per_1000_node_days'])} false evacuations (healthy nodes "
             f"evacuated) per 1,000 node-days"
             f"{_interval(m.get('false_evacuations_per_1000_node_days_interval'), _rate, ' (', ')')}.")
    for name in present[1:]:
        b = report[name]
        text += (f" The {LABELS[name]} at its own threshold: {_caught(b)}, "
                 f"{_rate(b['false_evacuations_per_1000_node_days'])} false evacuations per 1,000 node-days.")
    return text


def _group_rows(ab: dict, key: str, with_false: bool) -> tuple[list[str], list[dict]]:
    names = sorted({g for per in ab.values() for m in per.values() for g in (m.get(key) or {})})
    cols = [(n, b) for n in NAMES for b in ab if n in ab[b]]
    columns = [f"{LABELS.get(n, n)}, budget {float(b):g}" for n, b in cols]
    rows = []
    for g in names:
        cells = []
        for n, b in cols:
            m = ab[b][n]
            v = (m.get(key) or {}).get(g)
            if m.get("threshold") is None:
                cells.append("no threshold")
            elif v is None:
                cells.append("-")
            else:
                text = f"{round(v['recall'] * v['incidents'])} of {v['incidents']}" if v["incidents"] else "none"
                if with_false:
                    text += f"; {_rate(v['false_evacuations_per_1000_node_days'])}"
                cells.append(text)
        rows.append({"name": g, "cells": cells})
    return columns, rows


FIGURE_CAPTIONS = {
    "pr": "Precision against recall over every step, for each predictor (the area is the PR-AUC).",
    "lead": "How long before each failure the first warning came, at each predictor's threshold.",
    "reliability": "Predicted probability against the observed failure frequency: on the diagonal, calibrated.",
    "categories": "Share of each category's failures warned of (* no precursor: not credited).",
}


def to_html(report: dict, title: str = "Foreshock predictor evaluation") -> str:
    """The evaluation report as a page a person forwards: a headline in words, readable numbers with
    units, labelled plots (foreshock/templates/evaluation.html.j2)."""
    from pathlib import PurePath

    present = [n for n in NAMES if n in report]
    predictors = [{"label": LABELS[n], "caught": _caught(report[n]), "lead": _minutes(report[n].get("median_lead_minutes")),
                   "false": _rate(report[n].get("false_evacuations_per_1000_node_days")),
                   "threshold": _probability(report[n].get("threshold")), "pr_auc": _score(report[n].get("pr_auc")),
                   "roc_auc": _score(report[n].get("roc_auc")), "brier": _score(report[n].get("brier"), 5)}
                  for n in present]
    budgets = []
    for b, per in (report.get("at_budgets") or {}).items():
        for n, m in _in_order(per):
            row = {"budget": f"{float(b):g}", "label": LABELS.get(n, n), "missing": ""}
            if m.get("threshold") is None:
                row["missing"] = m.get("missing") or "no threshold for this budget in the manifest"
            else:
                row.update(caught=_caught(m), lead=_minutes(m.get("median_lead_minutes")),
                           false=_rate(m.get("false_evacuations_per_1000_node_days")),
                           threshold=_probability(m.get("threshold")))
            budgets.append(row)
    fleet = None
    fc = report.get("fleet_calibrated") or {}
    if fc.get("at_budgets"):
        fleet = {"refit": f"{fc['refit_hours']:g} h", "prior": f"{fc['prior_node_days']:,.0f}", "rows": [
            {"budget": f"{float(b):g}", "caught": _caught(m), "lead": _minutes(m.get("median_lead_minutes")),
             "false": _rate(m.get("false_evacuations_per_1000_node_days")),
             "thresholds": ", ".join(_probability(t) for t in (
                 m["manifest_threshold"], m["thresholds_in_force"][0][1], m["thresholds_in_force"][-1][1]))}
            for b, m in fc["at_budgets"].items()]}
    fixed = None
    sl = report.get("score_level") or {}
    if sl.get("fixed_thresholds"):
        moved = (report["model"].get("threshold_in_force") or {})
        fixed = {"reference": _probability(sl["reference"]),
                 "raised": f"{moved.get('hours_raised', 0)} of {moved.get('hours', 0)} hours at budget {report['budget']:g}, "
                           f"up to {_probability(moved.get('max'))}",
                 "rows": [{"budget": f"{float(b):g}", "caught": _caught(per["model"]),
                           "lead": _minutes(per["model"].get("median_lead_minutes")),
                           "false": _rate(per["model"].get("false_evacuations_per_1000_node_days")),
                           "threshold": _probability(per["model"].get("threshold"))}
                          for b, per in sl["fixed_thresholds"].items() if per["model"].get("threshold") is not None]}
    parts = None
    pp = report.get("policy_parts")
    if pp:
        rows = [("its risk alone", pp["risk_alone"]), ("its hard evidence alone", pp["hard_evidence_alone"])]
        rows += [(f"condition {m['condition']} alone", m) for m in pp["conditions"]]
        parts = {"budget": f"{pp['budget']:g}", "added": pp["added_by_hard_evidence"],
                 "rows": [{"label": label, "caught": _caught(m), "lead": _minutes(m.get("median_lead_minutes")),
                           "false": _rate(m.get("false_evacuations_per_1000_node_days"))} for label, m in rows]}
    groups = []
    if report.get("at_budgets"):
        for key, heading, with_false in GROUPS:
            columns, rows = _group_rows(report["at_budgets"], key, with_false)
            groups.append({"title": heading, "columns": columns, "rows": rows})
    categories = []
    for c, v in sorted(report["model"].get("per_category", {}).items(),
                       key=lambda kv: (not kv[1]["has_precursor"], kv[0])):
        categories.append({"name": c, "precursor": "yes" if v["has_precursor"] else "no (not credited)",
                           "incidents": v["incidents"],
                           "detected": [report[n]["per_category"].get(c, {}).get("detected", 0) for n in present]})
    figures = [{"png": png, "caption": FIGURE_CAPTIONS.get(k, k)} for k, png in plots(report).items()]
    definitions = [{"term": TERMS.get(k, k.replace("_", " ")), "text": v}
                   for k, v in (report.get("definitions") or {}).items()]
    data = str(report.get("data", ""))
    return pages.render("evaluation.html.j2",
        title=title, model_version=report.get("model_version", ""), data_name=PurePath(data).name or data,
        data_hash=str(report.get("data_hash", ""))[:12], nodes=report.get("nodes", ""),
        node_days=f"{report.get('node_days', 0):,.0f}", horizon=f"{report.get('horizon_minutes', 30):g}",
        budget=f"{report.get('budget', 2):g}", overlap=overlap_warning(report.get("overlap")) or "",
        interval=telemetry_interval_warning(report.get("telemetry_interval")) or "",
        headline=_headline(report, present), predictors=predictors, budgets=budgets, fixed=fixed, fleet=fleet,
        parts=parts,
        groups=groups,
        categories=categories, figures=figures, definitions=definitions,
        thresholds_from=report.get("thresholds_from", ""))
