"""The round scheduler (service/rounds.py) with its in-process pipeline: the order a round works in
(events checked and acted on before the bulk is checked), scoring every round for a scorer without
steps, and a failed scoring that still lets the policy act. The worker pipeline's rounds are covered
end to end in test_service_steps.py, test_service_worker.py and test_service_risk.py."""

from __future__ import annotations

import numpy as np

from foreshock.service.rounds import InProcessPipeline, RoundScheduler
from foreshock.service.scoring import NullScorer, ScoreResult


class _Scorer(NullScorer):
    """No steps: every round scores. Records what it is fed; `fail` makes score() raise."""

    def __init__(self, order: list):
        self.order = order
        self.fail = False

    def ingest(self, table, data):
        self.order.append(("ingest", table))

    def score(self, now_ns, close_ns=None):
        if self.fail:
            raise RuntimeError("no scores this time")
        self.order.append(("score", now_ns))
        return ScoreResult(["n0"], np.array([0.5]))


def _scheduler(order):
    scorer = _Scorer(order)

    def prepare(items):
        order.append(("check", sorted(t for item in items for t in item)))
        return {}

    def on_round(result, now_ns, why, seconds):
        order.append(("policy", why, result.fresh))

    pipeline = InProcessPipeline(scorer, prepare=prepare)
    return scorer, RoundScheduler(scorer, pipeline, prepare=prepare, on_round=on_round, clock=lambda: 7)


def test_an_event_round_acts_on_the_events_before_it_checks_the_bulk_here():
    order: list = []
    _, rounds = _scheduler(order)
    rounds.enqueue({"gpu": "a"})
    rounds.enqueue({"events": "xid"})
    rounds.enqueue({"nvlink": "b"})
    rounds.run_round("events")
    assert order == [("check", ["events"]),            # the event batch, at once
                     ("policy", "events", False),       # acted on with the last scores
                     ("check", ["gpu", "nvlink"]),      # then the bulk, in one drain
                     ("score", 7),
                     ("policy", "events", True)]
    assert rounds.backlog() == 0 and rounds.rounds == {"events": 1}


def test_a_scorer_without_steps_scores_every_round_and_a_quiet_round_acts_alone():
    order: list = []
    _, rounds = _scheduler(order)
    rounds.run_round()
    rounds.run_round()
    assert order == [("score", 7), ("policy", "interval", True)] * 2


def test_a_failed_scoring_is_counted_and_the_policy_still_acts_on_the_last_scores():
    order: list = []
    scorer, rounds = _scheduler(order)
    assert rounds.run_round().fresh
    scorer.fail = True
    order.clear()
    result = rounds.run_round()
    assert rounds.score_errors == 1 and not result.fresh and result.nodes == ["n0"]
    assert order == [("policy", "interval", False)]
