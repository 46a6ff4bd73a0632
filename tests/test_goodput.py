"""foreshock goodput: the published Clockwork figure, strategy ordering, monotonicity, the evaluation-report
path, bad input and the PNG plot, through the real command and the library functions."""

from __future__ import annotations

import json
import math

import pytest

from foreshock import cli
from foreshock.goodput import (
    GoodputError,
    evaluate,
    lost_progress_hours,
    plot_png,
    scenario_from,
    spare_shortfall,
)

CLOCKWORK_FLAGS = ["--gpus", "1024", "--usd-per-gpu-hour", "3", "--mttf-hours", "7.9",
                   "--checkpoint-interval-hours", "1.5", "--replace-minutes", "10", "--restart-minutes", "15",
                   "--identify-minutes", "0"]   # Clockwork: identification is inside the 15-minute restart
CLOCKWORK_USD_PER_MONTH = 307_000


def _report(tmp_path, name="report.json", **metrics):
    entry = {"pr_auc": 0.5, "roc_auc": 0.9, "brier": 0.05, "incident_recall_precursor": 0.9,
             "incident_recall_all": 0.4, "median_lead_minutes": 20.0,
             "false_evacuations_per_1000_node_days": 0.5}
    entry.update(metrics)
    path = tmp_path / name
    path.write_text(json.dumps({"gbdt": entry}))
    return path


def test_clockwork_figure_within_ten_percent(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert cli.main(["goodput", *CLOCKWORK_FLAGS, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    usd = data["checkpoint_restart"]["usd_per_month"]
    assert abs(usd - CLOCKWORK_USD_PER_MONTH) / CLOCKWORK_USD_PER_MONTH < 0.10, usd
    for key in ("checkpoint_restart", "checkpointless", "foreshock"):
        assert 0 < data[key]["goodput_expense"] < 1
        assert data[key]["usd_per_month"] > 0
    # The human table names every strategy.
    table = capsys.readouterr().out
    assert "checkpoint_restart" in table and "foreshock" in table and "%" in table


def test_toml_file_and_flags_precedence(tmp_path):
    config = tmp_path / "g.toml"
    config.write_text("[goodput]\ngpus = 2048\nmttf_hours = 7.9\n")
    out = tmp_path / "g.json"
    assert cli.main(["--config", str(config), "goodput", "--gpus", "1024", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["inputs"]["gpus"] == 1024 and data["inputs"]["mttf_hours"] == 7.9


def test_lost_progress_is_half_the_interval_when_failures_are_rare():
    assert lost_progress_hours(1e6, 1.5) == pytest.approx(0.75, rel=1e-4)
    # With failures as frequent as the interval it is well below half and never above the MTTF.
    assert lost_progress_hours(1.0, 10.0) < 1.0


@pytest.mark.parametrize("gpus", [1024, 16384, 100_000])
def test_strategy_ordering_under_defaults(gpus):
    r = evaluate(scenario_from({"gpus": gpus}))
    usd = {k: r[k]["usd_per_month"] for k in ("checkpoint_restart", "checkpointless", "foreshock")}
    assert usd["checkpointless"] <= usd["checkpoint_restart"] and usd["foreshock"] <= usd["checkpoint_restart"], usd
    if gpus <= 1024:
        assert usd["foreshock"] <= usd["checkpointless"], usd


def test_where_prediction_stops_paying_at_scale():
    """Issue 22, item 8: at 100k GPUs an evacuation that rebuilds the whole world (the conservative
    default) costs, with its false evacuations, more than the hot-spare restart it saves; built while
    the job trains (share 0) it pays again. At 64 GPUs nothing grows."""
    big = {"gpus": 100_000}
    conservative = evaluate(scenario_from(big))
    prebuilt = evaluate(scenario_from({**big, "evacuation_reinit_share": 0.0}))
    assert conservative["foreshock"]["usd_per_month"] > conservative["checkpointless"]["usd_per_month"]
    assert prebuilt["foreshock"]["usd_per_month"] < prebuilt["checkpointless"]["usd_per_month"]
    small = scenario_from({"gpus": 64})
    assert small.reinit_growth_hours() == 0 and small.evacuation_hours() == small.migration_hours
    at_5184 = scenario_from({"gpus": 5184})
    assert at_5184.hot_spare_restart_hours + at_5184.reinit_growth_hours() == pytest.approx(12.5 / 60)


def test_hangs_are_identified_late_and_crashes_at_once():
    """The default t_id is the mix's hang share times the watchdog (Llama 3: network switch/cable, NIC
    and NCCL watchdog timeouts, 49 of 419), and Minder-style detection shortens it."""
    s = scenario_from({})
    assert s.hang_share == pytest.approx(49 / 419)
    assert s.identify_hours == pytest.approx(49 / 419 * 8 / 60)
    minder = scenario_from({"hang_detect_minutes": 3.6 / 60})
    assert minder.identify_hours < s.identify_hours / 100
    assert scenario_from({"identify_minutes": 0}).identify_hours == 0
    slow, fast = evaluate(s), evaluate(minder)
    assert slow["checkpointless"]["usd_per_month"] > fast["checkpointless"]["usd_per_month"]


def test_more_failures_lose_more():
    losses = [evaluate(scenario_from({"failures_per_1000_node_days": rate}))
              for rate in (1.0, 4.0, 20.0)]
    for key in ("checkpoint_restart", "checkpointless", "foreshock"):
        values = [r[key]["gpu_hours_lost_per_month"] for r in losses]
        assert values == sorted(values) and values[0] < values[-1], (key, values)


def test_better_recall_loses_less(tmp_path):
    values = []
    for recall in (0.0, 0.5, 1.0):
        path = _report(tmp_path, f"r{recall}.json", incident_recall_precursor=recall)
        values.append(evaluate(scenario_from({"eval_report": str(path)}))["foreshock"]["usd_per_month"])
    assert values[0] > values[1] > values[2]


@pytest.mark.parametrize("fallback", ["checkpointless", "checkpoint_restart"])
def test_recall_zero_is_the_fallback_plus_false_evacuations(tmp_path, fallback):
    path = _report(tmp_path, incident_recall_precursor=0.0, false_evacuations_per_1000_node_days=5.0)
    r = evaluate(scenario_from({"eval_report": str(path), "foreshock_fallback": fallback,
                                "spare_nodes": 4, "mttf_hours": 7.9}))
    fs, base = r["foreshock"], r[fallback]
    assert fs["evacuated_share"] == 0
    assert fs["false_evacuation_gpu_hours_per_month"] > 0
    # every failure plays out as under the fallback; the false evacuations' pauses take running time,
    # so a month holds a little fewer failures
    assert fs["gpu_hours_per_interruption"] == pytest.approx(base["gpu_hours_per_interruption"], rel=1e-6)
    assert fs["interruptions_per_month"] < base["interruptions_per_month"]
    expected = (fs["interruptions_per_month"] * base["gpu_hours_per_interruption"]
                + fs["false_evacuation_gpu_hours_per_month"] + fs["spare_gpu_hours_per_month"])
    assert fs["gpu_hours_lost_per_month"] == pytest.approx(expected, rel=1e-6)


def test_report_false_evacuations_are_counted(tmp_path):
    low = evaluate(scenario_from({"eval_report": str(_report(tmp_path, "a.json"))}))
    high = evaluate(scenario_from({"eval_report": str(_report(
        tmp_path, "b.json", false_evacuations_per_1000_node_days=50.0))}))
    assert high["foreshock"]["false_evacuations_per_month"] > low["foreshock"]["false_evacuations_per_month"]
    assert high["foreshock"]["usd_per_month"] > low["foreshock"]["usd_per_month"]


def test_report_model_is_chosen_and_lead_matters(tmp_path):
    path = tmp_path / "two.json"
    base = json.loads(_report(tmp_path).read_text())["gbdt"]
    path.write_text(json.dumps({"models": {"fast": base, "late": {**base, "median_lead_minutes": 0.1}}}))
    fast = evaluate(scenario_from({"eval_report": str(path), "eval_model": "fast"}))["foreshock"]
    late = evaluate(scenario_from({"eval_report": str(path), "eval_model": "late"}))["foreshock"]
    assert fast["lead_sufficient_share"] > 0.9 > late["lead_sufficient_share"]
    assert fast["usd_per_month"] < late["usd_per_month"]
    with pytest.raises(GoodputError, match="--eval-model"):
        scenario_from({"eval_report": str(path), "eval_model": "missing"})


def test_derived_mttf_scales_with_job_size():
    small = scenario_from({"gpus": 1024})
    large = scenario_from({"gpus": 16384})
    assert large.mttf_hours == pytest.approx(small.mttf_hours / 16)
    assert 40 < small.mttf_hours < 60  # Llama 3: 3.79 failures per 1,000 node-days over 128 nodes


def test_spare_shortfall_falls_with_pool_size():
    values = [spare_shortfall(n, 2.0, 1.0) for n in range(0, 6)]
    assert values[0] == 1.0 and all(a > b for a, b in zip(values, values[1:]))
    assert values[1] == pytest.approx(1 - math.exp(-2.0))


@pytest.mark.parametrize("argv, flag", [
    (["--gpus", "0"], "--gpus"),
    (["--mttf-hours", "-1"], "--mttf-hours"),
    (["--usd-per-gpu-hour", "nan"], "--usd-per-gpu-hour"),
    (["--eval-report", "/nonexistent/report.json"], "--eval-report"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys, tmp_path):
    out = tmp_path / "g.json"
    assert cli.main(["goodput", *argv, "--json", str(out)]) == 2
    assert flag in capsys.readouterr().err
    assert not out.exists()


def test_bad_report_and_toml_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GoodputError, match="--eval-report.*not valid JSON"):
        scenario_from({"eval_report": str(bad)})
    out_of_range = _report(tmp_path, incident_recall_precursor=1.5)
    with pytest.raises(GoodputError, match="incident_recall_precursor"):
        scenario_from({"eval_report": str(out_of_range)})
    config = tmp_path / "g.toml"
    config.write_text("[goodput]\nspare_nodes = -2\n")
    assert cli.main(["--config", str(config), "goodput"]) == 2
    assert "spare_nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["goodput", "--gpus", "many"])
    assert "--gpus" in capsys.readouterr().err


def test_plot_is_a_png(tmp_path):
    png = tmp_path / "g.png"
    assert cli.main(["goodput", "--plot", str(png), "--json", str(tmp_path / "g.json")]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    raw = plot_png(scenario_from({}), sizes=[1000, 10000, 100000])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_report_with_a_definitions_table_reads_the_model_entry(tmp_path):
    from foreshock import goodput as gp
    entry = {"incident_recall_precursor": 0.5, "incident_recall_all": 0.2, "median_lead_minutes": 20.0,
             "false_evacuations_per_1000_node_days": 3.0}
    report = {"definitions": {k: "what it means" for k in entry}, "rule": {**entry, "incident_recall_precursor": 0.9},
              "model": entry}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(report))
    prediction = gp.load_prediction(str(path))
    assert prediction.incident_recall_precursor == 0.5
