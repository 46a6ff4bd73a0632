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


def to_html(report: dict, title: str = "Foreshock predictor evaluation") -> str:
    keys = ("pr_auc", "roc_auc", "brier", "threshold", "incident_recall_precursor", "incident_recall_all",
            "median_lead_minutes", "false_evacuations_per_1000_node_days", "false_evacuations", "evacuations")
    present = [n for n in NAMES if n in report]
    rows = "".join(f"<tr><th>{k}</th>" + "".join(f"<td>{_fmt(report[n].get(k))}</td>" for n in present) + "</tr>"
                   for k in keys)
    cat_rows = ""
    for c, v in sorted(report["model"].get("per_category", {}).items(), key=lambda kv: (not kv[1]["has_precursor"], kv[0])):
        cat_rows += (f"<tr><td>{html.escape(c)}</td><td>{'yes' if v['has_precursor'] else 'no (not credited)'}</td>"
                     f"<td>{v['incidents']}</td>" + "".join(
                         f"<td>{report[n]['per_category'].get(c, {}).get('detected', 0)}</td>" for n in present) + "</tr>")
    imgs = "".join(f'<figure><img src="data:image/png;base64,{b64}" alt="{k}"></figure>' for k, b64 in plots(report).items())
    meta = "".join(f"<li><b>{html.escape(k)}</b>: {_fmt(report.get(k))}</li>"
                   for k in ("data", "data_hash", "nodes", "node_days", "model_version", "budget", "budget_unit",
                             "horizon_minutes", "thresholds_from"))
    defs = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in report.get("definitions", {}).items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body><h1>{html.escape(title)}</h1>{overlap_banner(report)}<ul>{meta}</ul>
<h2>Metrics (at each predictor's manifest threshold for the budget)</h2>
<table><tr><th></th>{''.join(f'<th>{n}</th>' for n in present)}</tr>{rows}</table>
<h2>By false-evacuation budget (thresholds from the manifest's validation curves)</h2>{_budget_table(report)}
{_at_budgets_html(report)}
<h2>Incidents per category (detected)</h2>
<table><tr><th>category</th><th>precursor</th><th>incidents</th>{''.join(f'<th>{n}</th>' for n in present)}</tr>{cat_rows}</table>
<h2>Plots</h2>{imgs}<h2>Definitions</h2><ul>{defs}</ul></body></html>
"""
