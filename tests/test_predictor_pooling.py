"""`foreshock pool`: evaluate reports of one model summed into one figure per budget, and the reports
it refuses (another model, the same data twice, other thresholds, not a report), each named."""

from __future__ import annotations

import json

import pytest

from foreshock import cli
from foreshock.predictor import evaluate as ev
from foreshock.predictor import pooling


def _report(data_hash: str, caught: int, failures: int, false: int, node_days: float, *, model="m-1",
            threshold=0.02, lead=20.0, overlaps=False, families=None) -> dict:
    entry = {"threshold": threshold, "incidents_precursor": failures,
             "incident_recall_precursor": caught / failures, "median_lead_minutes": lead,
             "false_evacuations": false, "node_days": node_days,
             "false_evacuations_per_1000_node_days": 1000.0 * false / node_days,
             "per_family": families or {"gpu_hbm": {"incidents": failures, "detected": caught, "recall": caught / failures}}}
    return {"model_version": model, "data_hash": data_hash, "data": f"/d/{data_hash}", "node_days": node_days,
            "budget": 2.0, "overlap": {"overlaps": overlaps},
            "at_budgets": {"2.0": {"model": entry, "rule": {**entry, "threshold": 0.5}},
                           "5.0": {"model": {"threshold": None, "missing": "the manifest lists no threshold"}}}}


def _write(tmp_path, name: str, report) -> str:
    path = tmp_path / name
    path.write_text(report if isinstance(report, str) else json.dumps(report))
    return str(path)


def test_reports_pool_to_summed_counts_with_their_intervals(tmp_path, capsys):
    a = _report("aa", 3, 10, 2, 1000.0, lead=30.0,
                families={"gpu_hbm": {"incidents": 4, "detected": 1}, "faulty_gpu": {"incidents": 6, "detected": 2}})
    b = _report("bb", 7, 20, 4, 2000.0, lead=10.0, families={"gpu_hbm": {"incidents": 20, "detected": 7}})
    pooled = pooling.pool([("a.json", a), ("b.json", b)])
    m = pooled["at_budgets"]["2.0"]["model"]
    assert (m["detected_precursor"], m["incidents_precursor"]) == (10, 30)
    assert m["incident_recall_precursor"] == pytest.approx(1 / 3)
    assert m["incident_recall_precursor_interval"] == ev.proportion_interval(10, 30)
    assert m["false_evacuations_per_1000_node_days"] == pytest.approx(2.0)
    assert m["false_evacuations_per_1000_node_days_interval"] == ev.rate_interval(6, 3000.0)
    assert m["median_lead_minutes_per_report"] == [30.0, 10.0]
    assert m["per_family"]["gpu_hbm"] == {"incidents": 24, "detected": 8, "recall": pytest.approx(1 / 3)}
    assert m["per_family"]["faulty_gpu"]["detected"] == 2
    assert list(pooled["at_budgets"]["2.0"]) == ["model", "rule"]
    assert pooled["at_budgets"]["5.0"]["model"]["threshold"] is None
    assert pooled["node_days"] == 3000.0 and pooled["overlaps"] == []
    # the command: the pooled line, the JSON, and an overlapping report said to be no evidence
    paths = [_write(tmp_path, "a.json", a), _write(tmp_path, "b.json", {**b, "overlap": {"overlaps": True}})]
    out_json = tmp_path / "pooled.json"
    assert cli.main(["pool", *paths, "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    assert "caught 10 of 30: recall(p) 33%" in captured.out and "median lead per report 30, 10 min" in captured.out
    assert "gpu_hbm 8/24" in captured.out
    assert "WARNING" in captured.err and paths[1] in captured.err and "not evidence" in captured.err
    assert json.loads(out_json.read_text())["at_budgets"]["2.0"]["model"]["false_evacuations"] == 6


@pytest.mark.parametrize("second, why", [
    (_report("bb", 1, 5, 0, 100.0, model="m-2"), "model m-2"),
    (_report("aa", 1, 5, 0, 100.0), "the same data as"),
    (_report("bb", 1, 5, 0, 100.0, threshold=0.03), "threshold is 0.03"),
    ({"at_budgets": {}}, "not a `foreshock evaluate --json` report"),
    ("{not json", "not a readable JSON report"),
])
def test_a_report_that_cannot_be_pooled_is_named_and_nothing_is_written(tmp_path, capsys, second, why):
    first = _write(tmp_path, "first.json", _report("aa", 1, 5, 0, 100.0))
    bad = _write(tmp_path, "second.json", second)
    out_json = tmp_path / "pooled.json"
    assert cli.main(["pool", first, bad, "--json", str(out_json)]) == 1
    err = capsys.readouterr().err
    assert why in err and bad in err, err
    assert not out_json.exists()


def test_one_report_is_not_a_pool(tmp_path, capsys):
    only = _write(tmp_path, "only.json", _report("aa", 1, 5, 0, 100.0))
    assert cli.main(["pool", only]) == 1
    assert f"at least {pooling.MIN_REPORTS} reports" in capsys.readouterr().err


def _parts(risk: tuple, hard: tuple, links: tuple, added: int, budget: float = 2.0,
           conditions=("nvl_links_down_now", "ib_link_downed_30m")) -> dict:
    """evaluate.policy_parts of a report: (caught, failures, false evacuations, node-days) per part."""
    def row(caught, failures, false, node_days):
        return {"incidents_precursor": failures, "incident_recall_precursor": caught / failures,
                "median_lead_minutes": 8.0, "false_evacuations": false, "node_days": node_days,
                "false_evacuations_per_1000_node_days": 1000.0 * false / node_days}
    rows = [row(*links)] + [row(0, links[1], 0, links[3])] * (len(conditions) - 1)
    return {"budget": budget, "risk_alone": row(*risk), "hard_evidence_alone": row(*hard),
            "conditions": [{"condition": c, **r} for c, r in zip(conditions, rows)], "added_by_hard_evidence": added}


def test_the_parts_of_the_model_pool_part_by_part_and_only_when_they_match(tmp_path, capsys):
    """Where the alarms come from (evaluate.policy_parts) sums over the reports like the figures do; reports
    whose parts differ in budget or conditions pool their figures without the parts."""
    a = {**_report("aa", 3, 10, 2, 1000.0), "policy_parts": _parts((1, 10, 1, 1000.0), (2, 10, 1, 1000.0),
                                                                    (2, 10, 1, 1000.0), 2)}
    b = {**_report("bb", 7, 20, 4, 2000.0), "policy_parts": _parts((0, 20, 1, 2000.0), (7, 20, 3, 2000.0),
                                                                    (5, 20, 3, 2000.0), 7)}
    pp = pooling.pool([("a.json", a), ("b.json", b)])["policy_parts"]
    assert (pp["risk_alone"]["detected_precursor"], pp["risk_alone"]["incidents_precursor"]) == (1, 30)
    assert pp["hard_evidence_alone"]["false_evacuations_per_1000_node_days"] == pytest.approx(4 / 3)
    assert pp["hard_evidence_alone"]["incident_recall_precursor_interval"] == ev.proportion_interval(9, 30)
    assert [c["condition"] for c in pp["conditions"]] == ["nvl_links_down_now", "ib_link_downed_30m"]
    assert pp["conditions"][0]["detected_precursor"] == 7 and pp["added_by_hard_evidence"] == 9
    paths = [_write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)]
    assert cli.main(["pool", *paths]) == 0
    out = capsys.readouterr().out
    assert "its hard evidence adds 9 precursor failures" in out and "hard evidence alone caught 9 of 30" in out
    other = {**b, "policy_parts": _parts((0, 20, 1, 2000.0), (7, 20, 3, 2000.0), (5, 20, 3, 2000.0), 7, budget=5.0)}
    assert "policy_parts" not in pooling.pool([("a.json", a), ("b.json", other)])
    fewer = {**b, "policy_parts": _parts((0, 20, 1, 2000.0), (7, 20, 3, 2000.0), (5, 20, 3, 2000.0), 7,
                                         conditions=("nvl_links_down_now",))}
    assert "policy_parts" not in pooling.pool([("a.json", a), ("b.json", fewer)])
    assert "policy_parts" not in pooling.pool([("a.json", a), ("b.json", _report("bb", 7, 20, 4, 2000.0))])
