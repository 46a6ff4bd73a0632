"""The evaluation report in a real browser (headless Chromium, installed by tests/setup.sh; the
`browse` fixture of conftest.py): the page renders, its headline and tables are there in words and
units, and nothing of a developer dump is left (issue 22, item 6). tests/test_demo.py does the same
for the demo's report."""

from __future__ import annotations

import json
import re
from pathlib import Path

from foreshock.predictor import registry, report

REPO = Path(__file__).resolve().parents[1]


def test_the_evaluation_report_reads_as_a_page_in_a_browser(tmp_path, browse):
    evaluation = json.loads((registry.default_model_path() / "evaluation.json").read_text())
    page = tmp_path / "evaluation.html"
    page.write_text(report.to_html(evaluation))
    dom, pixels = browse(page)
    headline = re.search(r'<p class="headline" id="headline">(.*?)</p>', dom, re.S)
    assert headline and "failures with precursors" in headline.group(1)
    m = evaluation["model"]
    caught = round(m["incident_recall_precursor"] * m["incidents_precursor"])
    assert f"warned of {caught} of {m['incidents_precursor']} failures" in headline.group(1)
    for section in ('id="summary"', 'id="by-budget"', 'id="fleet"', 'id="per-category"', 'id="plots"'):
        assert section in dom, section
    assert "Foreshock model" in dom and "DCGM-style rule" in dom and " min<" in dom
    assert dom.count("data:image/png;base64,") >= 3
    # no developer dump: no snake_case metric keys, no Python literals, no absolute path of the data
    for leftover in ("incident_recall_precursor<", "false_evacuations_per_1000_node_days<", ">True<",
                     ">None<", ">nan<", str(evaluation["data"])):
        assert leftover not in dom, leftover
    # the screenshot shows a page, not a blank one: text and the headline's tinted box
    assert pixels.std() > 0.05 and (pixels < 0.5).mean() > 0.005


def test_the_report_escapes_what_it_shows(tmp_path):
    evaluation = json.loads((registry.default_model_path() / "evaluation.json").read_text())
    evaluation["model_version"] = "<script>alert(1)</script>"
    html = report.to_html(evaluation)
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
