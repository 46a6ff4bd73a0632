"""A GPU whose corrected ECC starts and does not stop (predictor/onset.py): what the per-GPU state says, and
that it says the same whatever the batching, across a checkpoint, offline and through the sample stage."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from foreshock import schema as sch
from foreshock.predictor import explain, onset
from foreshock.predictor import features as ft
from foreshock.predictor import signals as sg

HOUR = 60   # steps of a minute
JUDGED_FROM = (onset.MIN_SEEN_HOURS * 3600 // onset.BIN_SECONDS + onset.RECENT_BINS) * onset.BIN_SECONDS // 60


def _gpus(t: int, rng) -> dict[int, np.ndarray]:
    """Per GPU key, its corrected-ECC delta per minute: one that starts at day 2 and does not stop, one that
    has always counted in half of its minutes, one with an hour's burst at day 2, one that never counts."""
    steps = np.arange(t)
    return {1: np.where(steps >= 48 * HOUR, 3.0, 0.0),
            2: (rng.random(t) < 0.5).astype(float),
            3: np.where((steps >= 48 * HOUR) & (steps < 49 * HOUR), 1.0, 0.0),
            4: np.zeros(t)}


def _rows(deltas: dict[int, np.ndarray], lo: int, hi: int, away: dict[int, np.ndarray] | None = None):
    """The rows of steps lo..hi, sorted by key then step, without those `away` marks (no sample)."""
    keys = np.concatenate([np.full(hi - lo, k) for k in deltas])
    steps = np.concatenate([np.arange(lo, hi) for _ in deltas])
    values = np.concatenate([d[lo:hi] for d in deltas.values()])
    if away is None:
        return keys, steps, values
    present = ~np.concatenate([away.get(k, np.zeros(len(d), dtype=bool))[lo:hi] for k, d in deltas.items()])
    return keys[present], steps[present], values[present]


def test_only_a_gpu_that_was_quiet_and_counts_for_hours_reads_high():
    t = 4 * 24 * HOUR
    deltas = _gpus(t, np.random.default_rng(1))
    v = onset.OnsetTracker().update(*_rows(deltas, 0, t), 60).reshape(len(deltas), t)
    # no GPU is judged before its usual has MIN_SEEN_HOURS of bins behind the recent ones
    assert np.isnan(v[:, :JUDGED_FROM]).all() and not np.isnan(v[:, JUDGED_FROM:]).any()
    started = 48 * HOUR
    # the new one: every whole bin since it started, 27 of 30 four and a half hours in, then all 30
    assert v[0, started + 4 * HOUR + 30] == 27 and v[0, started + 6 * HOUR] == 30
    assert v[0, started - 1] == 0
    # counting for days, it is its own usual again
    assert v[0, -1] == 0
    # the chronic GPU and the quiet one never read anything; the burst reads its six bins at most
    assert np.nanmax(v[1]) == 0 and np.nanmax(v[3]) == 0
    assert np.nanmax(v[2]) == 6


def test_any_batching_and_a_checkpoint_give_the_same_values():
    t = 3 * 24 * HOUR
    deltas = _gpus(t, np.random.default_rng(2))
    # GPU 4's deltas are unknown for two hours (not counted, not seen), then it has no sample for eight (a
    # node in repair: more bins than the recent ones), and it comes back counting; GPU 3 misses a bin
    deltas[4][38 * HOUR:40 * HOUR] = np.nan
    deltas[4][50 * HOUR:] = 2.0
    steps = np.arange(t)
    away = {4: (steps >= 40 * HOUR) & (steps < 48 * HOUR), 3: (steps >= 30 * HOUR) & (steps < 30 * HOUR + 15)}
    whole = onset.OnsetTracker().update(*_rows(deltas, 0, t, away), 60)
    rng = np.random.default_rng(3)
    cuts = np.sort(rng.choice(np.arange(1, t), 300, replace=False))
    tracker, parts = onset.OnsetTracker(), []
    for i, (lo, hi) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, t])):
        if i == 150:   # a restart from the checkpoint
            tracker = onset.OnsetTracker.from_state({k: v.copy() for k, v in tracker.state().items()})
        keys, at, values = _rows(deltas, lo, hi, away)
        parts.append((keys, at, tracker.update(keys, at, values, 60)))
    # the same rows in another order (by key, then step): each GPU's values alike
    keys = np.concatenate([p[0] for p in parts])
    at = np.concatenate([p[1] for p in parts])
    got = np.concatenate([p[2] for p in parts])
    order = np.lexsort((at, keys))
    np.testing.assert_array_equal(got[order], whole)
    gpu4 = whole[np.flatnonzero(np.sort(keys) == 4)]
    assert np.nanmax(gpu4) == 30   # its onset after its absence


def test_a_state_that_does_not_fit_is_refused_and_none_starts_over():
    tracker = onset.OnsetTracker()
    tracker.update(np.array([5, 5, 9]), np.array([0, 1, 0]), np.array([1.0, 0.0, 2.0]), 60)
    state = tracker.state()
    assert len(onset.OnsetTracker.from_state(state)) == 2
    assert len(onset.OnsetTracker.from_state({})) == 0
    with pytest.raises(ValueError, match="onset state: inconsistent arrays"):
        onset.OnsetTracker.from_state({**state, "onset.bin": state["onset.bin"][:1]})
    with pytest.raises(ValueError, match="onset.usual_seen missing"):
        onset.OnsetTracker.from_state({k: v for k, v in state.items() if k != "onset.usual_seen"})


def _gpu_table(hours: int, start_hour: int, node: str = "n1"):
    """One node's gpu rows, a sample a minute: GPU 0 counts corrected ECC in every minute from the start
    (chronic), GPU 2 from `start_hour` on, GPUs 1 and 3 never; the volatile counter is cumulative."""
    t0 = 1_780_000_000
    rows = []
    for m in range(hours * 60):
        ts = dt.datetime.fromtimestamp(t0 + 60 * m + 7, dt.timezone.utc)
        for gpu in range(4):
            if gpu == 0:
                count = 2 * m
            elif gpu == 2:
                count = 5 * max(0, m - start_hour * 60)
            else:
                count = 0
            rows.append({"ts": ts, "node": node, "gpu": gpu, "gpu_lost": False, "ecc_corrected_volatile": count})
    return sch.to_table("gpu", rows)


def test_the_node_signal_is_its_gpus_largest_offline_and_in_batches():
    table = _gpu_table(26, 19)
    base = sg.node_base_signals({"gpu": table})
    v = base["ecc_onset_bins"]
    minute = np.arange(len(v))
    # judged from its hours on; GPU 0's chronic errors read 0 and do not hide GPU 2's start
    assert np.isnan(v[minute < JUDGED_FROM - 10]).all()
    assert v[(minute >= JUDGED_FROM) & (minute < 19 * 60)].max() == 0
    assert v[-1] >= 27
    # through a stage fed in batches, with a restart from its state between them: the same signal
    stage, parts = sg.SampleStage(), []
    for i, lo in enumerate(range(0, table.num_rows, 4 * 97)):
        if i == 20:
            meta, arrays = stage.state()
            stage = sg.SampleStage.from_state(meta, arrays)
        parts.append(sg.reduce_steps("gpu", stage.samples("gpu", table.slice(lo, 4 * 97))))
    keys = np.concatenate([p.keys for p in parts])
    col = np.concatenate([p["ecc_onset_bins"] for p in parts])
    # a step split over two batches gives two partial rows: their maximum is the step's
    steps = keys % sg.STEP_SHIFT
    merged = np.full(len(v), np.nan)
    first = steps - steps.min()
    np.fmax.at(merged, first, col)
    np.testing.assert_array_equal(merged, v)


def test_an_operator_reads_how_many_of_the_last_bins_counted():
    row = np.full(ft.N_FEATURES, np.nan)
    row[ft.FEATURE_NAMES.index("ecc_onset_bins_now")] = 28.0
    said = explain.describe("ecc_onset_bins", row)
    assert said == ("Ten-minute bins in which a GPU that seldom counted corrected ECC counted: 28 of the last 30, "
                    "where it had counted in at most 20% of its bins before")
    row[ft.FEATURE_NAMES.index("ecc_onset_bins_now")] = 0.0
    assert "0 of" not in explain.describe("ecc_onset_bins", row)


def test_the_online_scorer_names_a_node_whose_gpu_starts_correcting_errors(tmp_path, tiny_model_dir):
    """Through the online scorer, a minute at a time: n1's GPU 2 starts counting corrected ECC at hour 19 and
    its node is named as hard evidence once 27 of its last 30 bins counted, with the condition's words; n2,
    whose GPU 0 has always counted, never is."""
    import json

    from foreshock.predictor import online, registry

    d = tiny_model_dir(tmp_path / "m")
    man = json.loads((d / registry.MANIFEST_FILE).read_text())
    man["hard_evidence"] = ["ecc_onset_bins_now"]
    (d / registry.MANIFEST_FILE).write_text(json.dumps(man))
    scorer = online.OnlineScorer(registry.load_model(d), explain_top=0)
    hours = 25
    sick = _gpu_table(hours, 19)
    chronic = _gpu_table(hours, hours + 1, node="n2")
    first = (1_780_000_000 + 7) // 60   # the step of _gpu_table's first sample
    named = {}
    for m in range(hours * 60):
        for table in (sick, chronic):
            scorer.ingest("gpu", table.slice(4 * m, 4))
        batch = scorer.score(((first + m + 1) * 60 + 6) * 1_000_000_000)
        for node, said in batch.evidence.items():
            named.setdefault(node, (m, said))
    assert list(named) == ["n1"] and scorer.stats["late_rows"] == 0
    # once 27 bins counted from its start at minute 19 * 60 (the first of them partly), from the next bin on;
    # the words name the GPU
    minute, said = named["n1"]
    assert 19 * 60 + 26 * 10 <= minute <= 19 * 60 + 28 * 10
    assert said == ("Ten-minute bins in which a GPU that seldom counted corrected ECC counted: 27 of the last 30, "
                    "where it had counted in at most 20% of its bins before, worst on GPU 2")
    assert scorer.features_of("n2")[ft.FEATURE_NAMES.index("ecc_onset_bins_now")] == 0.0
    scorer.close()
