"""The job-relative step-time signal (predictor/steptimes.py) and its features (features.STEP_TIMES): a rank
against its job's median by the service's comparison (foreshock/stepcompare.py), per node and step."""

from __future__ import annotations

import collections
from collections import Counter

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from foreshock import schema as sch
from foreshock import stepcompare
from foreshock.predictor import features as ft
from foreshock.predictor import steptimes as stt

STEP_NS = ft.STEP_SECONDS * 1_000_000_000
M0 = 29_666_667           # a feature step
NODES = ["n0", "n1", "n2", "n3"]


def _rows(samples, minute=M0):
    """samples: (node, job, rank, step, step_seconds, compute_seconds or None), ending in `minute`."""
    return sch.to_table("step_times", [
        {"ts": pd.Timestamp(minute * STEP_NS + 1_000_000 * k, tz="UTC"), "node": node, "job": job, "rank": rank,
         "step": step, "step_seconds": total, "compute_seconds": compute}
        for k, (node, job, rank, step, total, compute) in enumerate(samples)])


def _job(computes, *, job="j", step=0, total=2.0, nodes=NODES):
    return [(nodes[r], job, r, step, total, c) for r, c in enumerate(computes)]


def _by_node(got: stt.NodeMinutes) -> dict:
    return {n: v for n, v in zip(got.node.tolist(), got.values)}


def test_a_rank_half_again_as_slow_as_its_job_gets_the_ratio_and_is_counted_slow():
    got = _by_node(stt.node_minutes(_rows(_job([1.0, 1.0, 1.5, 1.0]) + _job([1.0, 1.0, 1.5, 1.0], step=1))))
    assert got["n2"].tolist() == [1.5, 2.0, 2.0]          # ratio, slow steps, judged steps
    assert got["n0"].tolist() == [1.0, 0.0, 2.0]


def test_a_nodes_value_is_its_slowest_ranks_median_over_its_judged_steps():
    """n0 holds ranks 0 and 4: rank 4 is 1.5x at one step of three (median 1.0), rank 0 1.25x at two;
    the counts are rank 0's, not the node's six judged steps with three slow."""
    nodes = ["n0", "n1", "n2", "n3", "n0"]
    samples = (_job([1.25, 1.0, 1.0, 1.0, 1.5], nodes=nodes, step=0) + _job([1.25, 1.0, 1.0, 1.0, 1.0], nodes=nodes, step=1)
               + _job([1.0, 1.0, 1.0, 1.0, 1.0], nodes=nodes, step=2))
    got = _by_node(stt.node_minutes(_rows(samples)))
    assert got["n0"].tolist() == [1.25, 2.0, 3.0]


def test_one_slow_gpu_of_eight_gives_its_node_that_ranks_share_of_slow_steps():
    """Four 8-GPU nodes in one job, one rank per GPU: n1's GPU 5 is 1.4x at every step, the rest even."""
    nodes = [n for n in NODES for _ in range(8)]
    steps = [1.0 + 0.01 * (r % 3) for r in range(32)]
    samples = []
    for step in range(6):
        samples += _job([1.4 if r == 13 else c for r, c in enumerate(steps)], nodes=nodes, step=step)
    got = _by_node(stt.node_minutes(_rows(samples)))
    assert got["n1"].tolist() == [pytest.approx(1.4 / 1.01), 6.0, 6.0]   # slow at all of its 6, not 6 of 48
    assert got["n0"][1:].tolist() == [0.0, 6.0]


def test_ranks_as_slow_as_each_other_give_the_same_counts_in_any_order_of_jobs():
    """n0 runs a rank of job a and one of job b, each its job's median (1.0x), one judged at 3 steps
    and one at 2: the node's counts are those of the one with more judged steps, whichever job's rows
    come first (the offline and online rows order jobs differently)."""
    a = [r for s in range(3) for r in _job([1.0, 0.9, 1.1], job="a", step=s, nodes=["n0", "n1", "n2"])]
    b = [r for s in range(2) for r in _job([1.0, 0.95, 1.05], job="b", step=s, nodes=["n0", "n3", "n1"])]
    for samples in (a + b, b + a):
        got = _by_node(stt.node_minutes(_rows(samples)))
        assert got["n0"].tolist() == [1.0, 0.0, 3.0]


@pytest.mark.parametrize("samples", [
    _job([1.0]),                                  # one rank
    _job([1.0, 1.5]),                             # fewer than stepcompare.MIN_RANKS
    [],                                           # no reports
], ids=["one rank", "two ranks", "none"])
def test_a_job_too_small_to_judge_gives_no_value_not_one(samples):
    got = stt.node_minutes(_rows(samples)) if samples else stt.node_minutes(None)
    assert len(got) == 0
    state = ft.FeatureState.empty(1)
    x = np.zeros((1, 1, len(ft.ALL_NAMES)))
    x[0, 0, ft.STEP_TIME_IDX] = stt.empty_values(1)[0]
    out, _ = ft.compute(x, np.array([M0]), state)
    assert np.isnan(out[0, 0, ft.STEP_TIME_COLS]).all()


def test_the_compute_part_is_compared_only_when_every_rank_of_the_step_measured_it():
    """A synchronous job: the whole steps are equal, the compute parts tell the slow rank. At step 1 one
    rank sent none, so the whole step is compared there and nobody is slow."""
    measured = [(n, "j", r, 0, 2.0, c) for r, (n, c) in enumerate(zip(NODES, [1.0, 1.0, 1.5, 1.0]))]
    partly = [(n, "j", r, 1, 2.0, c) for r, (n, c) in enumerate(zip(NODES, [1.0, None, 1.5, 1.0]))]
    assert _by_node(stt.node_minutes(_rows(measured)))["n2"].tolist() == [1.5, 1.0, 1.0]
    assert _by_node(stt.node_minutes(_rows(partly)))["n2"].tolist() == [1.0, 0.0, 1.0]
    # the service's rule decides by the same function: a measured 0 is no measurement there
    got = stepcompare.compare(np.full((1, 4), 2.0), np.array([[1.0, 0.0, 1.5, 1.0]]), 4)
    assert not got.use_compute[0] and not got.slow.any()


def test_bad_rows_are_skipped_and_counted_and_the_rest_judged():
    good = _job([1.0, 1.0, 1.5, 1.0])
    bad = [("n0", "j", 0, 5, -1.0, None), ("n1", "j", 1, 5, float("nan"), None), ("n2", "j", 2, 5, 1.0, 2.0),
           ("n3", "j", 3, 5, 1.0, -0.5), ("", "j", 0, 6, 1.0, None), ("n0", "", 0, 6, 1.0, None),
           ("n2", "j", 2, 0, 9.0, 9.0)]           # a repeat of rank 2's step 0: the first by time is kept
    skipped = Counter()
    got = _by_node(stt.node_minutes(_rows(good + bad), skipped))
    assert skipped == {"bad_step_seconds": 2, "bad_compute_seconds": 2, "no_node": 1, "no_job": 1, "repeated": 1}
    assert got["n2"].tolist() == [1.5, 1.0, 1.0]


def test_the_value_does_not_depend_on_the_rows_order_or_what_else_is_in_the_batch():
    rng = np.random.default_rng(4)
    samples = [(NODES[r % 4], f"j{r // 4}", r, s, 2.0, float(rng.uniform(0.9, 1.4)))
               for r in range(8) for s in range(5)]
    alone = stt.node_minutes(_rows(samples))
    other = _rows(samples, minute=M0 + 1)
    mixed = pa.concat_tables([other, _rows(samples)])
    mixed = mixed.take(pa.array(rng.permutation(mixed.num_rows)))
    got = stt.node_minutes(mixed)
    here = got.step == M0
    assert sorted(zip(got.node[here].tolist(), map(tuple, got.values[here].tolist()))) == \
        sorted(zip(alone.node.tolist(), map(tuple, alone.values.tolist())))


def test_the_windows_keep_a_slow_minute_5_and_30_minutes_and_share_the_slow_steps():
    t = 40
    x = np.full((1, t, len(ft.ALL_NAMES)), np.nan)
    x[0, :, ft.STEP_TIME_IDX] = stt.empty_values(t).T
    x[0, :, ft.STEP_TIME_IDX[0]] = 1.0
    x[0, :, ft.STEP_TIME_IDX[2]] = 4.0
    x[0, 2, ft.STEP_TIME_IDX[:2]] = [1.6, 4.0]         # step 2: every judged step slow, 1.6x
    out, _ = ft.compute(x, np.arange(t), ft.FeatureState.empty(1))
    r5, r30, share = (out[0, :, c] for c in range(ft.N_FEATURES)[ft.STEP_TIME_COLS])
    assert r5[2:7].tolist() == [pytest.approx(1.6)] * 5 and r5[7] == 1.0
    assert r30[31] == pytest.approx(1.6) and r30[32] == 1.0
    assert share[2] == pytest.approx(4 / 12) and share[31] == pytest.approx(4 / 120) and share[32] == 0.0
    assert np.isnan(out[0, 0, ft.STEP_TIME_COLS]).tolist() == [False, False, True]   # the ratio from the first step
    # two minutes judged, 8 steps: not yet the 12 the share needs (SLOW_SHARE_MIN_JUDGED); the third makes 12
    assert np.isnan(share[1]) and ft.SLOW_SHARE_MIN_JUDGED == 12


def test_a_first_minute_all_slow_does_not_decide_the_share_alone():
    """A job's first minute of a rank slow at every step (warm-up), then even: the share is unknown in
    that minute, and diluted by the next; judged minutes 29 apart still make two."""
    t = 40
    x = np.full((1, t, len(ft.ALL_NAMES)), np.nan)
    x[0, :, ft.STEP_TIME_IDX] = stt.empty_values(t).T
    x[0, 5, ft.STEP_TIME_IDX] = [1.6, 30.0, 30.0]      # its job's first minute: every judged step slow
    x[0, 6, ft.STEP_TIME_IDX] = [1.0, 0.0, 30.0]
    x[0, 35, ft.STEP_TIME_IDX] = [1.0, 0.0, 30.0]
    # offline as a block; online a step at a time, in the compiled kernel and in numpy: the same values
    for block, kernel in ((40, True), (1, True), (1, False)):
        state, share = ft.FeatureState.empty(1), []
        for a in range(0, t, block):
            out, state = ft.compute(x[:, a:a + block], np.arange(a, min(t, a + block)), state, kernel=kernel)
            share += out[0, :, ft.STEP_TIME_COLS.stop - 1].tolist()
        assert np.isnan(share[:6]).all() and share[6] == 0.5 and share[34] == 0.5, (block, kernel)
        assert share[35] == 0.0 and np.isnan(share[36:]).all(), (block, kernel)


def test_a_job_of_minute_long_steps_is_judged_on_as_many_steps_as_the_fail_slow_rule_needs():
    """One training step a minute: a rank slow in its first two (warm-up) has a share only from its twelfth
    judged step on, 2 of 12 then, never the 1.0 of its first two; a rank slow at every step reaches 1.0
    there, as the fail-slow rule would move it at its twelfth slow step (stepcompare.FAIL_SLOW_MIN_STEPS)."""
    t = 20
    x = np.full((2, t, len(ft.ALL_NAMES)), np.nan)
    ratio, slow, judged = ft.STEP_TIME_IDX
    x[:, :, ft.STEP_TIME_IDX] = stt.empty_values(t)[None]
    x[:, 3:, ratio], x[:, 3:, slow], x[:, 3:, judged] = 1.0, 0.0, 1.0   # its job starts at step 3
    x[0, 3:5, ratio], x[0, 3:5, slow] = 1.6, 1.0        # node 0: its first two steps slow
    x[1, 3:, ratio], x[1, 3:, slow] = 1.6, 1.0          # node 1: every step slow
    first = 3 + stepcompare.FAIL_SLOW_MIN_STEPS - 1     # the feature step of the twelfth judged step
    for block, kernel in ((t, True), (1, True), (1, False)):
        state, share = ft.FeatureState.empty(2), []
        for a in range(0, t, block):
            out, state = ft.compute(x[:, a:a + block], np.arange(a, min(t, a + block)), state, kernel=kernel)
            share.append(out[:, :, ft.STEP_TIME_COLS.stop - 1])
        share = np.concatenate(share, axis=1)
        assert np.isnan(share[:, :first]).all(), (block, kernel)
        assert share[0, first] == pytest.approx(2 / 12) and share[1, first] == 1.0, (block, kernel)
        assert share[0, -1] == pytest.approx(2 / 17) and share[1, -1] == 1.0, (block, kernel)


def test_the_step_time_columns_come_after_the_steadiness_ones_so_older_models_read_a_prefix():
    assert ft.FEATURE_NAMES[ft.STEP_TIME_COLS] == ("steptime_vs_job_5m", "steptime_vs_job_30m", "steptime_slow_share_30m")
    # only the fabric's (feature version 9), the context's (10), the warming's (11) and the onset's (14) columns
    # come after them
    assert ft.STEADY_COLS.stop == ft.STEP_TIME_COLS.start and ft.STEP_TIME_COLS.stop == ft.FABRIC_COLS.start
    assert ft.READABLE_VERSIONS == ("6", "7", "8", "9", "10", "11", "12", "13", "14") and ft.FEATURE_VERSION == "14"


def test_the_row_median_is_numpys_over_the_known_values():
    rng = np.random.default_rng(9)
    x = rng.random((200, 7))
    x[rng.random(x.shape) < 0.3] = np.nan
    x[0] = np.nan
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        want = np.nanmedian(x, axis=1)
    np.testing.assert_allclose(stepcompare.row_median(x), want, rtol=0, atol=1e-15)
    assert np.isnan(stepcompare.row_median(x)[0])


def test_explanations_name_the_step_times_only_from_a_slow_ratio():
    from foreshock.predictor import explain as ex

    row = np.full(ft.N_FEATURES, np.nan, dtype=np.float32)
    names = ("steptime_vs_job_5m", "steptime_vs_job_30m", "steptime_slow_share_30m")
    cols = [ft.FEATURE_NAMES.index(n) for n in names]
    k = ex.GROUP_NAMES.index("steptime_vs_job")
    reference = np.zeros(ft.N_FEATURES)
    rows = np.repeat(row[None], 4, axis=0)
    rows[0, cols] = [1.49, 1.52, 0.48]      # slow
    rows[1, cols] = [1.0, 1.01, 0.0]        # as fast as its job
    rows[2, cols] = [1.0, 1.1, 0.05]        # a slow step now and then, at no slow ratio
    # rows[3]: nothing judged (NaN)
    assert ex.unusual(rows, reference)[:, k].tolist() == [True, False, False, False]
    assert ex.describe("steptime_vs_job", rows[0]).endswith(
        "1.52x its job's median at most in 30 min (1.49x in 5 min), slow in 48% of its judged steps")
    assert ex.headline("steptime_vs_job", rows[0]) == pytest.approx(1.52)


def test_the_online_scorer_judges_a_minutes_step_times_between_rounds_reads_them_two_steps_later_and_counts_late_rows(
        tmp_path, tiny_model_dir):
    m = _Minutes(tmp_path, tiny_model_dir)
    scorer, first, slow = m.scorer(), m.first, m.slow
    col = ft.FEATURE_NAMES.index("steptime_vs_job_5m")
    seen = []
    for k in range(5):
        m.ingest(scorer, k)
        m.score(scorer, k)
        seen.append(float(scorer.features_of("n2")[col]))
    assert stt.LAG_STEPS == 2 and stt.OPEN_STEPS == 1
    assert np.isnan(seen[:3]).all() and seen[3:] == [1.5, 1.5]   # minute first+1, read at first+3
    # judged on the first ingest after step first+2 closed, not in a round
    assert scorer.stats["step_times_judged_in_round"] == 0
    scorer.ingest("step_times", slow)                                   # its step has been read
    scorer.ingest("step_times", _rows(_job([1.0, 1.0, 1.5, 1.0]), minute=first + 10 * 24 * 60))
    assert (scorer.stats["late_step_times"], scorer.stats["step_times_ahead"]) == (4, 4)


def test_a_round_that_closes_several_steps_with_no_ingest_between_judges_the_rows_itself_and_says_so(
        tmp_path, tiny_model_dir):
    from foreshock.predictor import online, registry, synthetic

    scorer = online.OnlineScorer(registry.load_model(tiny_model_dir(tmp_path / "m")), explain_top=0)
    first = synthetic.T0_NS // STEP_NS
    for i, n in enumerate(NODES):
        for name, t in synthetic.node_tables(n, 6, seed=i).items():
            scorer.ingest(name, t)
    scorer.ingest("step_times", _rows(_job([1.0, 1.0, 1.5, 1.0]), minute=first + 1))
    scorer.score((first + 6) * STEP_NS + 6_000_000_000)          # steps first .. first+5 at once
    assert scorer.stats["step_times_judged_in_round"] == 1
    assert scorer.features_of("n2")[ft.FEATURE_NAMES.index("steptime_vs_job_5m")] == np.float32(1.5)


def test_the_packed_order_is_lexsorts_with_repeats_negative_keys_and_ranges_too_wide_to_pack():
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        major = [rng.integers(-3, int(rng.integers(1, 50)), n) for _ in range(int(rng.integers(1, 5)))]
        minor = [rng.integers(0, 3, n).astype(float) for _ in range(int(rng.integers(0, 3)))]
        assert np.array_equal(stt._order(major, minor), np.lexsort(tuple(reversed(major + minor))))
    wide = [rng.integers(0, 2**40, 100), rng.integers(0, 3, 100), rng.integers(0, 2**40, 100)]   # lexsort's path
    minor = [rng.integers(0, 2, 100).astype(float)]
    assert np.array_equal(stt._order(wide, minor), np.lexsort(tuple(reversed(wide + minor))))


def _random_samples(rng) -> list[dict]:
    """step_times rows of a few jobs and placement generations: ranks that miss steps, ranks that run
    on another node for a step, steps whose ranks end in two minutes, unmeasured compute parts, ties."""
    out = []
    for job in range(int(rng.integers(1, 4))):
        for gen in range(int(rng.integers(1, 3))):
            width = int(rng.integers(2, 10))
            home = rng.integers(0, 6, width)
            slow = rng.random(width) < 0.2
            for step in range(int(rng.integers(1, 30))):
                end = M0 * STEP_NS + int(step * rng.uniform(4, 12) * 1e9)
                for rank in range(width):
                    if rng.random() < 0.15:
                        continue
                    node = home[rank] if rng.random() > 0.1 else rng.integers(0, 6)
                    total = 2.0 if rng.random() < 0.3 else float(rng.uniform(1.0, 2.0))
                    part = 0.5 if rng.random() < 0.3 else float(rng.uniform(0.4, 0.6))
                    compute = None if rng.random() < 0.05 else total * part * (1.5 if slow[rank] else 1.0)
                    out.append({"ts": pd.Timestamp(end + int(rng.integers(0, 3_000_000_000)), tz="UTC"),
                                "node": f"n{node}", "job": f"j{job}", "generation": gen, "rank": rank, "step": step,
                                "step_seconds": total, "compute_seconds": compute})
    return out


def _plainly(samples: list[dict]) -> dict:
    """node_minutes written plainly: each training step's part in a minute judged by stepcompare over
    the ranks that reported it, a rank's median over its steps in the minute from a sorted list, per
    node and minute the largest median and that rank's counts (of ranks as slow, the most slow steps,
    then the most judged)."""
    ranks = collections.defaultdict(set)
    steps = collections.defaultdict(list)
    for r in samples:
        minute = r["ts"].value // STEP_NS
        ranks[(r["job"], r["generation"], minute)].add(r["rank"])
        steps[(r["job"], r["generation"], minute, r["step"])].append(r)
    ratios, slow = collections.defaultdict(list), Counter()
    for (job, gen, minute, _), rows in steps.items():
        got = stepcompare.compare(np.array([[r["step_seconds"] for r in rows]]),
                                  np.array([[np.nan if r["compute_seconds"] is None else r["compute_seconds"]
                                             for r in rows]]), len(ranks[(job, gen, minute)]))
        if got.judged[0]:
            for k, r in enumerate(rows):
                key = (r["node"], minute, job, gen, r["rank"])
                ratios[key].append(float(got.ratio[0, k]))
                slow[key] += int(got.slow[0, k])
    out = {}
    for key, values in ratios.items():
        s = sorted(values)
        median = (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2.0
        out[key[:2]] = max(out.get(key[:2], (-np.inf, 0.0, 0.0)), (median, float(slow[key]), float(len(values))))
    return out


@pytest.mark.parametrize("chunk", [stt.CHUNK_CELLS, 8], ids=["whole", "minutes cut into chunks"])
def test_node_minutes_is_the_plain_per_step_judgement_bit_for_bit(monkeypatch, chunk):
    monkeypatch.setattr(stt, "CHUNK_CELLS", chunk)
    rng = np.random.default_rng(11)
    seen_slow = 0
    for _ in range(25):
        samples = _random_samples(rng)
        got = stt.node_minutes(sch.to_table("step_times", samples))
        mine = {(n, s): tuple(v) for n, s, v in zip(got.node.tolist(), got.step.tolist(), got.values.tolist())}
        assert mine == _plainly(samples)
        seen_slow += int(got.values[:, 1].sum())
    assert seen_slow > 0


def test_group_medians_are_each_groups_sorted_middle():
    rng = np.random.default_rng(3)
    n = rng.integers(1, 40, 300)
    values = rng.choice([0.5, 1.0, 1.25, 2.0], int(n.sum())) * rng.choice([1.0, rng.uniform(0.9, 1.1)], int(n.sum()))
    start = np.concatenate([[0], np.cumsum(n)[:-1]])
    got = stt._group_medians(values, start, n)
    for i, (a, k) in enumerate(zip(start.tolist(), n.tolist())):
        s = sorted(values[a:a + k].tolist())
        assert got[i] == (s[(k - 1) // 2] + s[k // 2]) / 2.0


class _Minutes:
    """Four nodes' telemetry, a sample a minute, and a job on them with node n2 half again as slow in
    the minute after the first (the scorer's setting in the tests above)."""

    def __init__(self, tmp_path, tiny_model_dir):
        from foreshock.predictor import registry, synthetic

        self.model = registry.load_model(tiny_model_dir(tmp_path / "m"))
        self.tables = {n: synthetic.node_tables(n, 8, seed=i) for i, n in enumerate(NODES)}
        self.first = synthetic.T0_NS // STEP_NS
        self.slow = _rows(_job([1.0, 1.0, 1.5, 1.0]), minute=self.first + 1)

    def scorer(self, **kw):
        from foreshock.predictor import online

        return online.OnlineScorer(self.model, explain_top=0, **kw)

    def ingest(self, scorer, k: int) -> None:
        from foreshock.predictor import synthetic

        synthetic.ingest_sample(scorer, self.tables, k)
        if k == 1:
            scorer.ingest("step_times", self.slow)

    def score(self, scorer, k: int):
        return scorer.score((self.first + k + 1) * STEP_NS + 6_000_000_000)


VS_JOB = ft.FEATURE_NAMES.index("steptime_vs_job_5m")


def test_the_judging_thread_gives_the_values_of_judging_on_the_scorers_thread(tmp_path, tiny_model_dir, monkeypatch):
    import threading

    m = _Minutes(tmp_path, tiny_model_dir)
    judged_on = []
    real = stt.node_minutes

    def recorded(rows, skipped=None):
        judged_on.append(threading.current_thread().name)
        return real(rows, skipped)

    monkeypatch.setattr(stt, "node_minutes", recorded)
    threaded, inline = m.scorer(), m.scorer(step_time_thread=False)
    for k in range(6):
        for scorer in (threaded, inline):
            m.ingest(scorer, k)
            if k == 2:   # a second minute's rows, of another job
                scorer.ingest("step_times", _rows(_job([1.0, 1.3, 1.0, 1.0], job="k"), minute=m.first + 2))
            m.score(scorer, k)
        for n in NODES:
            assert threaded.features_of(n).tobytes() == inline.features_of(n).tobytes()
    assert threaded.features_of("n2")[VS_JOB] == np.float32(1.5)
    assert threaded.features_of("n1")[VS_JOB] == np.float32(1.3)
    assert judged_on[0::2] == ["foreshock-step-times_0"] * 2 and judged_on[1::2] == ["MainThread"] * 2
    threaded.close()


def test_the_round_that_reads_a_judgement_still_running_waits_for_it_and_says_so(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    import threading

    from support import wait_until

    m = _Minutes(tmp_path, tiny_model_dir)
    release = threading.Event()
    real = stt.node_minutes
    monkeypatch.setattr(stt, "node_minutes", lambda rows, skipped=None: (release.wait(60), real(rows, skipped))[1])
    with m.scorer() as scorer:
        for k in range(3):
            m.ingest(scorer, k)
            m.score(scorer, k)
        m.ingest(scorer, 3)                  # the first ingest after step first+2 closed starts the judgement
        done = []
        round_ = threading.Thread(target=lambda: done.append(m.score(scorer, 3)))
        round_.start()
        assert wait_until(lambda: scorer.stats["step_times_round_waited"] == 1)
        assert round_.is_alive() and not done         # held until the judgement ends
        release.set()
        round_.join(60)
        assert done and scorer.features_of("n2")[VS_JOB] == np.float32(1.5)
        assert scorer.stats["step_times_judged_in_round"] == 0


def test_an_error_in_the_judging_thread_is_raised_by_the_next_ingest_or_round_and_the_scorer_goes_on(
        tmp_path, tiny_model_dir, monkeypatch):
    import concurrent.futures
    import threading

    m = _Minutes(tmp_path, tiny_model_dir)
    release = threading.Event()

    def broken(rows, skipped=None):
        release.wait(60)   # until the minute's ingest is over: its later batches would take the error
        raise RuntimeError("judging broke")

    monkeypatch.setattr(stt, "node_minutes", broken)
    for via in ("ingest", "round"):
        release.clear()
        scorer = m.scorer()
        for k in range(3):
            m.ingest(scorer, k)
            m.score(scorer, k)
        m.ingest(scorer, 3)
        assert scorer._judging is not None
        release.set()
        if via == "ingest":
            concurrent.futures.wait([scorer._judging[1]])
            with pytest.raises(RuntimeError, match="judging broke"):
                m.ingest(scorer, 3)      # not taken: the same rows again next
            m.ingest(scorer, 3)
        else:
            with pytest.raises(RuntimeError, match="judging broke"):
                m.score(scorer, 3)
            assert scorer._last_step == m.first + 2          # nothing of the round was done
        m.score(scorer, 3)
        assert scorer._last_step == m.first + 3
        assert np.isnan(scorer.features_of("n2")[VS_JOB])   # the minute's rows went with the error
        scorer.close()


def test_closing_the_scorer_ends_its_judging_thread_and_it_judges_on_the_callers_after(tmp_path, tiny_model_dir):
    m = _Minutes(tmp_path, tiny_model_dir)
    scorer = m.scorer()
    for k in range(4):
        m.ingest(scorer, k)
        if k == 3:
            threads = list(scorer._judge_pool._threads)
        m.score(scorer, k)
    assert threads and all(t.is_alive() for t in threads)
    scorer.close()
    assert not any(t.is_alive() for t in threads)
    scorer.ingest("step_times", _rows(_job([1.0, 1.0, 1.0, 1.4]), minute=m.first + 4))
    for k in (4, 5, 6):
        m.ingest(scorer, k)
        m.score(scorer, k)
    assert scorer._judge_pool is None and scorer.features_of("n3")[VS_JOB] == np.float32(1.4)
    scorer.close()   # again: nothing to do


def test_a_checkpoint_written_while_a_judgement_runs_is_the_one_written_after_it(tmp_path, tiny_model_dir,
                                                                                monkeypatch):
    """The checkpoint carries no step-time rows or judgements (they start over at a restore, as the
    windows do), and the judging thread writes nothing of the scorer's: save_state need not wait."""
    import concurrent.futures
    import json
    import threading

    m = _Minutes(tmp_path, tiny_model_dir)
    release = threading.Event()
    real = stt.node_minutes
    monkeypatch.setattr(stt, "node_minutes", lambda rows, skipped=None: (release.wait(60), real(rows, skipped))[1])
    scorer = m.scorer()
    for k in range(3):
        m.ingest(scorer, k)
        m.score(scorer, k)
    m.ingest(scorer, 3)
    scorer.save_state(tmp_path / "during.npz")
    assert not scorer._judging[1].done()
    release.set()
    concurrent.futures.wait([scorer._judging[1]])
    scorer.save_state(tmp_path / "after.npz")
    with np.load(tmp_path / "during.npz") as a, np.load(tmp_path / "after.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        metas = [json.loads(z["meta"].tobytes()) for z in (a, b)]
        assert [{k: v for k, v in meta.items() if k != "saved_at_ns"} for meta in metas] == [
            {k: v for k, v in metas[1].items() if k != "saved_at_ns"}] * 2
        for f in a.files:
            if f != "meta":
                assert np.array_equal(a[f], b[f], equal_nan=True), f
    m.score(scorer, 3)
    assert scorer.features_of("n2")[VS_JOB] == np.float32(1.5)
    scorer.close()


def _scorer_with_the_step_time_condition(tmp_path, tiny_model_dir):
    """An online scorer whose manifest names the step-time condition as hard evidence, NODES' telemetry,
    and the first feature step of it."""
    import json

    from foreshock.predictor import online, registry, synthetic

    d = tiny_model_dir(tmp_path / "m")
    man = json.loads((d / registry.MANIFEST_FILE).read_text())
    man["hard_evidence"] = ["steptime_slow_share_30m"]
    (d / registry.MANIFEST_FILE).write_text(json.dumps(man))
    scorer = online.OnlineScorer(registry.load_model(d), explain_top=0)
    return scorer, {n: synthetic.node_tables(n, 8, seed=i) for i, n in enumerate(NODES)}, synthetic.T0_NS // STEP_NS


def test_a_node_its_job_waits_for_is_named_as_hard_evidence_once_the_scorer_reads_its_steps(tmp_path, tiny_model_dir):
    """Through the online scorer, with a manifest that names the step-time condition: n2, slow at every
    judged step of its job, is named with the step times' reason from the round that reads its second slow
    minute (stt.LAG_STEPS after it; features.SLOW_SHARE_MIN_STEPS), its twelfth slow step
    (SLOW_SHARE_MIN_JUDGED); n3, slow at half of them, is never named, nor is anyone before."""
    from foreshock.predictor import synthetic

    scorer, tables, first = _scorer_with_the_step_time_condition(tmp_path, tiny_model_dir)
    ranks = NODES + ["n0"]                  # five ranks: two slow at a step stay fewer than half
    named = []
    for k in range(6):
        synthetic.ingest_sample(scorer, tables, k)
        if k >= 1:
            steps = [_job([1.0, 1.0, 1.5, 1.5 if j % 2 == 0 else 1.0, 1.0], step=6 * k + j, nodes=ranks)
                     for j in range(6)]
            scorer.ingest("step_times", _rows(sum(steps, []), minute=first + k))
        batch = scorer.score((first + k + 1) * STEP_NS + 6_000_000_000)
        named.append(dict(batch.evidence))
    assert [sorted(e) for e in named] == [[]] * (2 + stt.LAG_STEPS) + [["n2"]] * (4 - stt.LAG_STEPS)
    assert named[-1]["n2"] == ("Step time against its job's other ranks (its slowest rank): 1.50x its job's "
                               "median at most in 30 min (1.50x in 5 min), slow in 100% of its judged steps")
    share = scorer.features_of("n3")[ft.FEATURE_NAMES.index("steptime_slow_share_30m")]
    assert share == np.float32(0.5)


def test_one_slow_gpu_of_an_eight_gpu_node_names_its_node_as_hard_evidence(tmp_path, tiny_model_dir):
    """A rank per GPU, eight a node: n1's GPU 5 is 1.5x its job's median at every step. The node is named
    from the round that reads its second slow minute (its twelfth slow step), as a node with one rank is;
    its seven even ranks do not dilute it (features v12), and no other node is named."""
    from foreshock.predictor import synthetic

    scorer, tables, first = _scorer_with_the_step_time_condition(tmp_path, tiny_model_dir)
    ranks = [n for n in NODES for _ in range(8)]
    even = [1.0 + 0.01 * (r % 3) for r in range(len(ranks))]
    named = []
    for k in range(5):
        synthetic.ingest_sample(scorer, tables, k)
        if k >= 1:
            rows = []
            for step in range(6 * k, 6 * k + 6):
                rows += _job([1.5 if r == 13 else c for r, c in enumerate(even)], step=step, nodes=ranks)
            scorer.ingest("step_times", _rows(rows, minute=first + k))
        named.append(sorted(scorer.score((first + k + 1) * STEP_NS + 6_000_000_000).evidence))
    assert named == [[]] * (2 + stt.LAG_STEPS) + [["n1"]] * (3 - stt.LAG_STEPS)
    share = ft.FEATURE_NAMES.index("steptime_slow_share_30m")
    assert [scorer.features_of(n)[share] for n in NODES] == [0.0, 1.0, 0.0, 0.0]
    scorer.close()
