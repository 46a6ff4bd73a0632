"""The evaluation report as HTML: metrics tables and plots (matplotlib, embedded PNG).

Reads the report dict of evaluate.evaluate_dataset (the same content as the JSON) and writes one
self-contained HTML file: PR curves, the lead-time histogram, the reliability curve and recall per
failure category (categories without precursors shown apart), for the model and both baselines; the
figures at the manifest's thresholds for budgets 1, 2 and 5 per family, signature and node type; and a
red banner when the evaluated data overlaps the model's training data. `leave_one_out_html` renders
the report of leave_one_out.py.
"""

from __future__ import annotations

import base64
import html
import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from foreshock.predictor.evaluate import overlap_warning  # noqa: E402

NAMES = ("model", "rule", "logistic")
COLORS = {"model": "#1f77b4", "rule": "#d62728", "logistic": "#2ca02c"}


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.3f}"
    return html.escape(str(v))


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


def _budget_table(report: dict) -> str:
    bb = report.get("by_budget") or {}
    if not bb:
        return ""
    head = "<tr><th>budget</th><th>predictor</th><th>threshold</th><th>recall (precursor)</th><th>recall (all)</th><th>median lead (min)</th><th>false evacuations / 1,000 node-days</th></tr>"
    rows = ""
    for b, per in bb.items():
        for n, m in per.items():
            rows += (f"<tr><td>{b}</td><td>{n}</td><td>{_fmt(m['threshold'])}</td><td>{_fmt(m['incident_recall_precursor'])}</td>"
                     f"<td>{_fmt(m['incident_recall_all'])}</td><td>{_fmt(m['median_lead_minutes'])}</td>"
                     f"<td>{_fmt(m['false_evacuations_per_1000_node_days'])}</td></tr>")
    return f"<table>{head}{rows}</table>"


STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}figure{display:inline-block;margin:4px}
.overlap{background:#b00020;color:#fff;font-weight:bold;font-size:1.2em;padding:1em;margin:1em 0;border-radius:4px}"""


def overlap_banner(report: dict) -> str:
    text = overlap_warning(report.get("overlap"))
    return f'<div class="overlap" role="alert">{html.escape(text)}</div>' if text else ""


def _pct(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.0f}%"


def _group_table(per_budget: dict, key: str, with_false: bool = False) -> str:
    """One row per group (family, signature, node type), one recall (and false evacuation) column per budget."""
    names = sorted({g for per in per_budget.values() for m in per.values() for g in (m.get(key) or {})})
    if not names:
        return "<p>none</p>"
    cols = [(b, n) for b, per in per_budget.items() for n in per]
    head = "<tr><th></th>" + "".join(f"<th>{html.escape(n)} @ {float(b):g}</th>" for b, n in cols) + "</tr>"
    rows = ""
    for g in names:
        cells = ""
        for b, n in cols:
            m = per_budget[b][n]
            v = (m.get(key) or {}).get(g)
            if m.get("threshold") is None:
                cells += "<td>no threshold</td>"
            elif v is None:
                cells += "<td>-</td>"
            else:
                text = f"{_pct(v['recall'])} of {v['incidents']}" if v["incidents"] else "no incidents"
                if with_false:
                    text += f"; {_fmt(v['false_evacuations_per_1000_node_days'])} FE/1k"
                cells += f"<td>{html.escape(text)}</td>"
        rows += f"<tr><th>{html.escape(g)}</th>{cells}</tr>"
    return f"<table>{head}{rows}</table>"


def _at_budgets_html(report: dict) -> str:
    ab = report.get("at_budgets") or {}
    if not ab:
        return ""
    head = ("<tr><th>budget</th><th>predictor</th><th>threshold</th><th>recall (precursor)</th>"
            "<th>median lead (min)</th><th>false evacuations / 1,000 node-days</th></tr>")
    rows = ""
    for b, per in ab.items():
        for n, m in per.items():
            if m.get("threshold") is None:
                rows += f"<tr><td>{float(b):g}</td><td>{n}</td><td colspan=4>{html.escape(m.get('missing', ''))}</td></tr>"
                continue
            rows += (f"<tr><td>{float(b):g}</td><td>{n}</td><td>{_fmt(m['threshold'])}</td>"
                     f"<td>{_fmt(m['incident_recall_precursor'])}</td><td>{_fmt(m['median_lead_minutes'])}</td>"
                     f"<td>{_fmt(m['false_evacuations_per_1000_node_days'])}</td></tr>")
    return (f"<h2>At the manifest's thresholds for budgets {', '.join(f'{float(b):g}' for b in ab)}</h2>"
            f"<table>{head}{rows}</table>"
            "<h3>Recall of precursor incidents per family (category)</h3>" + _group_table(ab, "per_family")
            + "<h3>Per signature (failure mode)</h3>" + _group_table(ab, "per_signature")
            + "<h3>Per node type (recall; false evacuations per 1,000 node-days of the type)</h3>"
            + _group_table(ab, "per_node_type", with_false=True))


def leave_one_out_html(report: dict, title: str = "Foreshock leave-one-out evaluation") -> str:
    kind = report["leave_one_out"]
    head = ("<tr><th>held out</th><th>budget</th><th>model</th><th>incidents</th><th>recall (precursor)</th>"
            "<th>median lead (min)</th><th>false evacuations / 1,000 node-days</th></tr>")
    rows = ""
    for name, entry in report["held_out"].items():
        if "error" in entry:
            rows += f"<tr><th>{html.escape(name)}</th><td colspan=6>not trained: {html.escape(entry['error'])}</td></tr>"
        for label, key in (("without it", "held_out_model"), ("trained on everything", "model_trained_on_everything")):
            for b, m in entry[key].items():
                if m.get("threshold") is None:
                    rows += (f"<tr><th>{html.escape(name)}</th><td>{float(b):g}</td><td>{label}</td>"
                             f"<td colspan=4>{html.escape(m.get('missing') or '')}</td></tr>")
                    continue
                rows += (f"<tr><th>{html.escape(name)}</th><td>{float(b):g}</td><td>{label}</td>"
                         f"<td>{m['incidents_precursor']}</td><td>{_fmt(m['incident_recall_precursor'])}</td>"
                         f"<td>{_fmt(m['median_lead_minutes'])}</td><td>{_fmt(m['false_evacuations_per_1000_node_days'])}</td></tr>")
    meta = "".join(f"<li><b>{html.escape(k)}</b>: {_fmt(report.get(k))}</li>"
                   for k in ("train_data", "data", "nodes", "horizon_minutes", "budget_unit"))
    defs = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in report.get("definitions", {}).items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body><h1>{html.escape(title)}: one {html.escape(kind)} out at a time</h1>{overlap_banner(report)}<ul>{meta}</ul>
<table>{head}{rows}</table><h2>Definitions</h2><ul>{defs}</ul></body></html>
"""


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


def _environment():
    from pathlib import Path

    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                              autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)


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
        text = (f"At its threshold for {report['budget']:g} false evacuations per 1,000 node-days, the model warned "
                f"of {caught} of {n} failures with precursors ({_pct(m['incident_recall_precursor'])})")
        if caught:
            text += f", a median {_minutes(m['median_lead_minutes'])} ahead"
    text += (f", with {_rate(m['false_evacuations_per_1000_node_days'])} false evacuations (healthy nodes "
             f"evacuated) per 1,000 node-days.")
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
        rows.append({"name": g.replace("_", " "), "cells": cells})
    return columns, rows


FIGURE_CAPTIONS = {
    "pr": "Precision against recall over every step, for each predictor (the area is the PR-AUC).",
    "lead": "How long before each failure the first warning came, at each predictor's threshold.",
    "reliability": "Predicted probability against the observed failure frequency: on the diagonal, calibrated.",
    "categories": "Share of each category's failures warned of (* no precursor: not credited).",
}


def to_html(report: dict, title: str = "Foreshock predictor evaluation") -> str:
    """The evaluation report as a page a person forwards: a headline in words, readable numbers with
    units, labelled plots (templates/evaluation.html.j2, rendered with autoescape)."""
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
    groups = []
    if report.get("at_budgets"):
        for key, heading, with_false in GROUPS:
            columns, rows = _group_rows(report["at_budgets"], key, with_false)
            groups.append({"title": heading, "columns": columns, "rows": rows})
    categories = []
    for c, v in sorted(report["model"].get("per_category", {}).items(),
                       key=lambda kv: (not kv[1]["has_precursor"], kv[0])):
        categories.append({"name": c.replace("_", " "), "precursor": "yes" if v["has_precursor"] else "no (not credited)",
                           "incidents": v["incidents"],
                           "detected": [report[n]["per_category"].get(c, {}).get("detected", 0) for n in present]})
    figures = [{"png": png, "caption": FIGURE_CAPTIONS.get(k, k)} for k, png in plots(report).items()]
    definitions = [{"term": TERMS.get(k, k.replace("_", " ")), "text": v}
                   for k, v in (report.get("definitions") or {}).items()]
    data = str(report.get("data", ""))
    return _environment().get_template("evaluation.html.j2").render(
        title=title, model_version=report.get("model_version", ""), data_name=PurePath(data).name or data,
        data_hash=str(report.get("data_hash", ""))[:12], nodes=report.get("nodes", ""),
        node_days=f"{report.get('node_days', 0):,.0f}", horizon=f"{report.get('horizon_minutes', 30):g}",
        budget=f"{report.get('budget', 2):g}", overlap=overlap_warning(report.get("overlap")) or "",
        headline=_headline(report, present), predictors=predictors, budgets=budgets, groups=groups,
        categories=categories, figures=figures, definitions=definitions,
        thresholds_from=report.get("thresholds_from", ""))
