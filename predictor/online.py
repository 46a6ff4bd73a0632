"""The online scorer: schema-v1 batches in, each node's calibrated risk and its reasons out.

The service (issue 5) feeds it the rows collectors stream (`ingest(table, batch)`, any nodes, any
order within the open step) and the topology (`set_inventory`), and calls `score(now_ns)` once per
scoring round. It runs exactly the offline code (signals.py then features.py) on the steps that have
closed, so a model trained offline sees the same feature values online (tests/test_predictor_skew.py).

Time is cut into steps of features.STEP_SECONDS aligned to the epoch; `score(now)` closes every step
that ended at least `grace_seconds` before `now` (or, `score(now, close_ns)`, by close_ns: the service
knows from the collectors' watermarks when a step's rows are all in), advances every known node
through them in one vectorised block, and scores every node on the features of the last closed step.
Rows for a step that has already closed are dropped and counted (`stats["late_rows"]`), kernel events
as well; a row's NVLink fabric reading that the data cannot mean is left out and counted by reason
(`stats[reason]`, signals.MALFORMED), as offline. Everything is bounded: nodes
(`max_nodes`), rows waiting for their step to close (`max_pending_rows`: the oldest are dropped and
counted), and per-node history (features.HISTORY steps plus a few scalars).

In a sharded deployment (docs/scaling.md) a scorer holds only some nodes of a job or a site. With
`share_totals` it keeps, per closed step, its nodes' totals of every job and site group
(`take_local_totals`, for the coordinator to sum across shards), and `set_remote_totals` gives it the
other shards' sums, which it adds to its own for the job and site peer signals. They arrive after the
step they describe has closed here, so step s uses the other shards' totals of the latest step in
s - remote_lag_steps .. s (with the default 1, normally s - 1), and its own nodes alone when none are
that recent (`stats["remote_totals_missing"]`; `"remote_totals_lagged"` counts steps that used an
earlier step's). Without remote totals, as outside a sharded deployment, the features are the offline
ones exactly.

Step times (`ingest("step_times", rows)`: schema-v1 `step_times` rows, which the service hands over as
its Jobs API accepts them, service/steptimes.py) wait by the step they ended in until the step after it
closes (steptimes.OPEN_STEPS); the next ingest hands them to the scorer's judging thread, which judges
them into the job-relative step-time signal (predictor/steptimes.py) of every node they name while the
scorer goes on, and when step s closes, the signal of step s - steptimes.LAG_STEPS is its features',
exactly as offline: the round takes the judgement, waiting for it if it is still running
(`stats["step_times_round_waited"]`), and an error in it is raised by the ingest or round that takes
it. One thread, one judgement at a time, started at the first; `close()` ends it, called by the
scorer's owner (the service as it stops, or the scoring worker process as it ends: service/server.py,
service/worker.py, through PredictorScorer.close). Rows of a step no longer
taken are dropped and counted (`stats["late_step_times"]`), as are rows further ahead of the scorer's
steps than it catches up at once (`"step_times_ahead"`: their ends are the ranks' wall clock, the
scorer's steps may run on another), rows of nodes the scorer has no telemetry or topology of
(`"step_times_unknown_node"`) and rows steptimes.py cannot judge (`"step_times_<reason>"`). A job's
ranks run on many nodes, and the comparison needs all of a job's step: in a sharded deployment the jobs
coordinator sends a shard's scorer every rank's rows of the jobs with a node on it
(service/steptimefeed.py), so its nodes' values are those of one scorer holding every node; the values
of the job's nodes on other shards are counted as `"step_times_unknown_node"` and let go.

Explanations (explain.py) are computed for the `explain_top` riskiest nodes of a round; the others
get an empty signal list.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from foreshock import schema as sch
from foreshock.predictor import explain as ex
from foreshock.predictor import features as ft
from foreshock.predictor import signals as sg
from foreshock.predictor import steptimes as stt
from foreshock.predictor.explain import Signal

log = logging.getLogger(__name__)

__all__ = ["OnlineScorer", "ScoreBatch", "Signal"]


@dataclass
class ScoreBatch:
    """One scoring round: for each node, its probability of failing within the horizon and why."""
    nodes: list[str]
    probability: np.ndarray                  # [len(nodes)] float
    signals: list[list[Signal]]              # per node, the top contributing signals (may be empty)
    step_end_ns: int | None = None           # end of the step the features describe
    horizon_seconds: int = 0
    model_version: str = ""
    features: np.ndarray | None = None       # [len(nodes), F] the feature values scored
    duration_s: float = 0.0
    # node -> what its hard evidence shows (model.HardEvidence), for the nodes whose features meet a
    # condition the model's manifest names: they alarm whatever their probability
    evidence: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.nodes)


class OnlineScorer:
    def __init__(self, model, *, max_nodes: int = 50_000, max_pending_rows: int = 5_000_000,
                 grace_seconds: float = 5.0, explain_top: int = 16, signals_per_node: int = 3,
                 max_catchup_steps: int = 6 * 60, clock=time.time, kernel: bool = True,
                 share_totals: bool = False, remote_lag_steps: int = 1, step_time_thread: bool = True):
        """model: a registry.LoadedModel (or anything with probability(X) and a manifest dict).
        kernel: each round's features and peer totals in the compiled kernels (predictor/kernels.py)
        where numba is importable; False: in numpy, the written reference (the same values).
        share_totals: keep each closed step's job and site totals for take_local_totals (a shard);
        remote_lag_steps: how many steps older than the step closing the other shards' totals may be
        (0 .. REMOTE_KEEP_STEPS - 1; see the module docstring).
        step_time_thread: judge a closed step's step times on a thread of the scorer's own, beside its
        ingests (module docstring; close() ends it); False: on the calling thread, at the next ingest
        (the same values)."""
        self.model = model
        self.kernel = bool(kernel)
        manifest = getattr(model, "manifest", {}) or {}
        if int(manifest.get("step_seconds", ft.STEP_SECONDS)) != ft.STEP_SECONDS:
            raise ValueError(f"model step {manifest.get('step_seconds')} s differs from the code's {ft.STEP_SECONDS} s")
        self.step_ns = ft.STEP_SECONDS * 1_000_000_000
        self.max_nodes = int(max_nodes)
        self.max_pending_rows = int(max_pending_rows)
        self.grace_ns = int(grace_seconds * 1e9)
        self.explain_top = int(explain_top)
        self.signals_per_node = int(signals_per_node)
        self.max_catchup_steps = int(max_catchup_steps)
        if not 0 <= int(remote_lag_steps) < REMOTE_KEEP_STEPS:
            raise ValueError(f"remote_lag_steps {remote_lag_steps!r}: 0 .. {REMOTE_KEEP_STEPS - 1}")
        self.remote_lag_steps = int(remote_lag_steps)
        self.share_totals = bool(share_totals)
        # step -> group -> label -> totals row (ft.TOTALS_WIDTH): this scorer's own (to send), and the
        # other shards' sums (received); each holds the last REMOTE_KEEP_STEPS steps
        self._local_totals: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        self._remote_totals: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        self._clock = clock
        self.reference = ft.full_width(manifest.get("reference_features"))
        self._stage = sg.SampleStage(ft.STEP_SECONDS)
        self._pending: dict[str, list[sg.Samples]] = collections.defaultdict(list)
        # per (table, step) still open, every part's reduction merged as it arrives (_StepAccumulator):
        # a collector streaming once a second sends 60 parts a step, and the round then takes one frame
        self._acc: dict[tuple[str, int], _StepAccumulator] = {}
        self._part_steps: dict[str, list[int]] = collections.defaultdict(list)   # each pending part's step
        self._pending_rows = 0
        self._step_rows: dict[int, list[pa.Table]] = {}   # step -> step_times rows that ended in it
        self._step_rows_n = 0
        self._step_judged: dict[int, stt.NodeMinutes] = {}   # step -> its rows judged, waiting to be read
        # One judgement at a time beside the scorer's thread, (step, future): its rows, one step's, are
        # the only ones outside the pending bound. The thread starts at the first judgement.
        self._judging: tuple[int, concurrent.futures.Future] | None = None
        self._judge_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._threaded = bool(step_time_thread)
        self._nodes: list[str] = []
        self._index: dict[str, int] = {}
        self._state = ft.FeatureState.empty(0)
        self._next_step: int | None = None
        self._last_step: int | None = None                 # the last step closed
        self._features = np.zeros((0, ft.N_FEATURES), dtype=np.float32)
        self._scored = np.zeros(0, dtype=bool)            # nodes past their first step (ft.scoreable)
        self._first_step = np.zeros(0, dtype=np.int64)     # each node's first step with telemetry (-1: none)
        self._scored_names: tuple[np.ndarray, list[str]] | None = None   # (indices, names) last scored
        self._labels: dict[str, dict[str, str | None]] = {}
        self._group_codes: dict[str, dict[str, int]] = {g: {} for g in ft.PEER_GROUPS}
        self._code_arrays: dict[str, np.ndarray] | None = None   # per group, per node; rebuilt on change
        # per explained signal, each node's worst entity key (-1: none yet); labels made when explained
        self._worst = {signal: np.zeros(0, dtype=np.int64) for signal in ex.ENTITY_SIGNALS}
        self.stats = collections.Counter()
        if self.kernel:
            from foreshock.predictor import kernels
            kernels.warm_up()   # the first round is not the one that loads the compiled kernels ...
        getattr(model, "fast_predictor", None)   # ... or builds and checks the model's fast path

    # -- input -----------------------------------------------------------------------------------
    def ingest(self, table: str, batch: pa.Table) -> int:
        """Take schema-v1 rows of one table (any nodes). Returns the rows accepted.

        Raises SchemaError for a table or batch that does not fit schema v1 (nothing is taken).
        """
        self._judge_step_times()
        if table == "inventory":
            self.set_inventory(batch)
            return batch.num_rows
        if table == "step_times":
            return self._ingest_step_times(batch)
        if table not in sg.REDUCTIONS:
            if table in sch.TABLES:
                return 0  # a schema-v1 table no feature reads (nvlink_link, incidents)
            raise sch.SchemaError(f"unknown table {table!r}")
        if not isinstance(batch, pa.Table):
            raise sch.SchemaError(f"table {table!r}: expected a pyarrow.Table, got {type(batch).__name__}")
        if batch.num_rows == 0:
            return 0
        batch = sch.conform(table, batch)
        nodes = batch.column("node").unique().to_pylist()
        new = [n for n in nodes if n not in self._index]
        if len(self._nodes) + len(new) > self.max_nodes:
            self.stats["rejected_rows_max_nodes"] += batch.num_rows
            raise sch.SchemaError(f"table {table!r}: {len(new)} new nodes would exceed max_nodes={self.max_nodes}")
        self._add_nodes(new)
        samples = self._stage.samples(table, batch)
        if self._stage.stats.malformed:
            # fabric readings left out (signals.MALFORMED): the scorer's counters say so, as offline's
            for reason, k in self._stage.stats.malformed.items():
                self.stats[reason] += k
            self._stage.stats.malformed.clear()
        if self._next_step is not None and len(samples):
            late = samples.step < self._next_step
            if late.any():
                # Kernel events too: counted in a later step than offline, a late event doubled that
                # step's count (the demo then evacuated a benign node in 2 runs of 4; 0 of 3 dropping).
                self.stats["late_rows"] += int(late.sum())
                samples = samples.select(~late)
        if len(samples):
            self._track_worst(table, [samples])   # here, not in the round: the round stays short
            for part in _by_step(samples):
                step = int(part.step[0])
                self._pending[table].append(part)
                self._part_steps[table].append(step)
                acc = self._acc.get((table, step))
                if acc is None:
                    acc = self._acc[(table, step)] = _StepAccumulator(table, len(self._nodes), self.kernel)
                acc.merge(sg.reduce_steps(table, part), part)
                self._pending_rows += len(part)
            self._bound_pending()
        self.stats[f"rows_{table}"] += batch.num_rows
        return batch.num_rows

    def _ingest_step_times(self, batch: pa.Table) -> int:
        """Keep step_times rows by the step they ended in until they are judged (module docstring)."""
        if not isinstance(batch, pa.Table):
            raise sch.SchemaError(f"table 'step_times': expected a pyarrow.Table, got {type(batch).__name__}")
        if batch.num_rows == 0:
            return 0
        batch = sch.conform("step_times", batch).select(list(stt.COLUMNS))
        ts = batch.column("ts").cast(pa.int64()).to_numpy(zero_copy_only=False)
        step = ts // self.step_ns
        if self._next_step is not None:
            late = step < self._next_step - stt.OPEN_STEPS
            # stamped by the ranks' wall clock: on a scorer whose steps run on another clock (the demo's
            # simulated one) they would wait for steps that never close
            ahead = step > self._next_step + self.max_catchup_steps
            if late.any() or ahead.any():
                self.stats["late_step_times"] += int(late.sum())
                self.stats["step_times_ahead"] += int(ahead.sum())
                keep = ~(late | ahead)
                batch, step = batch.filter(pa.array(keep)), step[keep]
        for s in np.unique(step).tolist():
            part = batch if len(step) and step[0] == step[-1] == s else batch.filter(pa.array(step == s))
            self._step_rows.setdefault(int(s), []).append(part)
            self._step_rows_n += part.num_rows
        while self._step_rows_n > self.max_pending_rows and self._step_rows:
            oldest = min(self._step_rows)
            dropped = sum(p.num_rows for p in self._step_rows.pop(oldest))
            self._step_rows_n -= dropped
            self.stats["dropped_pending_rows"] += dropped
        self.stats["rows_step_times"] += batch.num_rows
        return batch.num_rows

    def _judge_step_times(self) -> None:
        """Judge the rows of every step no more rows are taken for (stt.OPEN_STEPS), off the scoring
        round: on the judging thread, whose result the round that reads it (stt.LAG_STEPS) takes, waiting
        if it is still running. A judgement that has finished is taken here first, so that an error in it
        is raised by an ingest, as one in a judgement on the calling thread is."""
        if self._judging is not None and self._judging[1].done():
            self._take_judgement()
        if self._next_step is None or not self._step_rows:
            return
        for step in sorted(s for s in self._step_rows if s < self._next_step - stt.OPEN_STEPS):
            if self._judging is not None:
                self._take_judgement()   # one at a time (a round that closed several steps at once)
            if self._threaded:
                if self._judge_pool is None:
                    self._judge_pool = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="foreshock-step-times")
                self._judging = (step, self._judge_pool.submit(_judge_rows, self._take_rows(step)))
            else:
                self._step_judged[step] = self._judge(step)

    def _take_judgement(self) -> None:
        """The judgement under way, waited for: its result kept for the round, its error raised."""
        step, future = self._judging
        self._judging = None
        self._step_judged[step] = self._count_skipped(*future.result())

    def _judge(self, step: int) -> stt.NodeMinutes:
        return self._count_skipped(*_judge_rows(self._take_rows(step)))

    def _take_rows(self, step: int) -> list[pa.Table]:
        parts = self._step_rows.pop(step)
        self._step_rows_n -= sum(p.num_rows for p in parts)
        return parts

    def _count_skipped(self, got: stt.NodeMinutes, skipped: collections.Counter) -> stt.NodeMinutes:
        for reason, n in skipped.items():
            self.stats[f"step_times_{reason}"] += n
        return got

    def close(self) -> None:
        """End the step-time judging thread, after the judgement under way (an error in it is logged:
        nothing reads it any more). The scorer may still be used: it then judges on the calling thread."""
        self._threaded = False
        if self._judging is not None:
            try:
                self._take_judgement()
            except Exception:   # noqa: BLE001 - the owner is stopping; the error must not stop it
                log.exception("online scorer: judging step times failed")
        if self._judge_pool is not None:
            self._judge_pool.shutdown(wait=True)
            self._judge_pool = None

    def __enter__(self) -> "OnlineScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step_time_values(self, steps: np.ndarray) -> np.ndarray:
        """[N, T, len(stt.SIGNALS)]: every node's step-time signal at the closing steps, from the rows
        that ended LAG_STEPS before each (judged already, or now where no ingest came between two
        rounds); the rows of earlier steps, never to be read, are let go."""
        out = np.repeat(stt.empty_values(len(steps))[None], len(self._nodes), axis=0)
        first = int(steps[0]) - stt.LAG_STEPS
        for s in [s for s in self._step_rows if s < first or s > int(steps[-1]) + self.max_catchup_steps]:
            n = sum(p.num_rows for p in self._step_rows.pop(s))
            self._step_rows_n -= n
            if s > first:   # taken before the first step closed, and further ahead than ingest allows
                self.stats["step_times_ahead"] += n
        for s in [s for s in self._step_judged if s < first]:
            del self._step_judged[s]
        for j, step in enumerate(steps.tolist()):
            read = step - stt.LAG_STEPS
            got = self._step_judged.pop(read, None)
            if got is None and read in self._step_rows:
                self.stats["step_times_judged_in_round"] += 1   # no ingest came between two rounds
                got = self._judge(read)
            if got is None or not len(got):
                continue
            idx = np.array([self._index.get(n, -1) for n in got.node.tolist()], dtype=np.int64)
            if (idx < 0).any():
                self.stats["step_times_unknown_node"] += int((idx < 0).sum())
            out[idx[idx >= 0], j] = got.values[idx >= 0]
        return out

    def set_inventory(self, batch: pa.Table) -> None:
        """Topology labels (schema-v1 inventory rows): the latest row of each node wins."""
        batch = sch.conform("inventory", batch)
        df = batch.select(["ts", "node", *ft.PEER_GROUPS]).to_pandas().sort_values("ts", kind="stable")
        for row in df.itertuples(index=False):
            self._labels[row.node] = {g: getattr(row, g) for g in ft.PEER_GROUPS}
        self._code_arrays = None
        self._add_nodes([n for n in df["node"].unique() if n not in self._index])

    def _add_nodes(self, new: list[str]) -> None:
        if not new:
            return
        for n in new:
            self._index[n] = len(self._nodes)
            self._nodes.append(n)
            # the stage's node codes are the scorer's node indices
            assert self._stage.node_code(n) == self._index[n]
        self._state = self._state.grow(len(new))
        self._features = np.concatenate([self._features, np.full((len(new), ft.N_FEATURES), np.nan, np.float32)])
        self._scored = np.concatenate([self._scored, np.zeros(len(new), dtype=bool)])
        self._first_step = np.concatenate([self._first_step, np.full(len(new), -1, np.int64)])
        self._worst = {k: np.concatenate([v, np.full(len(new), -1, np.int64)]) for k, v in self._worst.items()}
        self._code_arrays = None

    def _bound_pending(self) -> None:
        while self._pending_rows > self.max_pending_rows:
            table = max(self._pending, key=lambda t: sum(len(p) for p in self._pending[t]))
            if not self._pending[table]:
                break
            dropped = self._pending[table].pop(0)
            self._part_steps[table].pop(0)
            for step in np.unique(dropped.step).tolist():   # its rows are in the step's sums: redo them
                acc = self._acc.get((table, int(step)))
                if acc is not None:
                    acc.valid = False
            self._pending_rows -= len(dropped)
            self.stats["dropped_pending_rows"] += len(dropped)
            log.warning("online scorer: pending rows over %d; dropped %d oldest %s rows",
                        self.max_pending_rows, len(dropped), table)

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    # -- scoring ---------------------------------------------------------------------------------
    def _group_code_array(self, group: str) -> np.ndarray:
        codes = self._group_codes[group]
        out = np.full(len(self._nodes), -1, dtype=np.int64)
        for i, n in enumerate(self._nodes):
            label = (self._labels.get(n) or {}).get(group)
            if label:
                out[i] = codes.setdefault(label, len(codes))
        return out

    def _group_code_arrays(self) -> dict[str, np.ndarray]:
        # the topology changes only with inventory rows or new nodes, not every round
        if self._code_arrays is None:
            self._code_arrays = {g: self._group_code_array(g) for g in ft.PEER_GROUPS}
        return self._code_arrays

    def advance(self, now_ns: int | None = None, close_ns: int | None = None) -> int:
        """Close the steps that ended before now - grace, and those that end by close_ns (the caller
        knows their rows are all in); returns how many steps were advanced."""
        now_ns = int(self._clock() * 1e9) if now_ns is None else int(now_ns)
        close = (now_ns - self.grace_ns) // self.step_ns   # steps < close are closed
        if close_ns is not None:
            close = max(close, int(close_ns) // self.step_ns)
        if self._next_step is None:
            firsts = [int(p.step.min()) for parts in self._pending.values() for p in parts if len(p)]
            if not firsts:
                return 0
            self._next_step = min(firsts)
        if close <= self._next_step:
            return 0
        if self._judging is not None:
            # a step the closing steps read, or an older one; taken before anything changes, so that
            # its error leaves the scorer as it was
            if not self._judging[1].done():
                self.stats["step_times_round_waited"] += 1
            self._take_judgement()
        if close - self._next_step > self.max_catchup_steps:
            skipped = close - self.max_catchup_steps - self._next_step
            self.stats["skipped_steps"] += int(skipped)
            self._next_step = close - self.max_catchup_steps
        steps = np.arange(self._next_step, close, dtype=np.int64)
        frames = []
        for table, parts in list(self._pending.items()):
            if not parts:
                continue
            frames.extend(self._close_table(table, parts, close))
        base = sg.finish(frames, kernel=self.kernel)
        n, t = len(self._nodes), len(steps)
        if t == 1 and len(base) == n and np.array_equal(base.node, np.arange(n)):
            x = base.values[:, None, :]                            # every node, in node order
        else:
            x = np.full((n, t, len(sg.STEP_NAMES)), np.nan)
            if len(base):
                x[base.node, base.step - int(steps[0])] = base.values
        own, present = ft.step_inputs(x, kernel=self.kernel)    # [N, T, len(PEER_INPUTS)], [N, T]
        codes = self._group_code_arrays()
        peers = np.empty((n, t, ft.PEER_WIDTH))
        for j in range(t):
            totals, shared = {}, {}
            for g, c in codes.items():
                if self.share_totals and g in ft.CROSS_SHARD_GROUPS:
                    shared[g] = group_sums(c, present[:, j], own[:, j])
                    totals[g] = per_node_totals(c, *shared[g])
                else:
                    totals[g] = group_totals_lookup(c, present[:, j], own[:, j], kernel=self.kernel)
            step = int(steps[j])
            if self.share_totals:
                self._keep_local_totals(step, shared)
            remote = self._remote_for(step)
            if remote is not None:
                for g in ft.CROSS_SHARD_GROUPS:
                    totals[g] = self._add_remote(g, codes[g], totals[g], remote.get(g, {}))
            peers[:, j] = ft.peer_signals(own[:, j], present[:, j], codes, totals, kernel=self.kernel)
        feats, self._state = ft.compute(ft.all_signals(x, peers, self._step_time_values(steps), kernel=self.kernel),
                                        steps, self._state, kernel=self.kernel)
        self._features = feats[:, -1]
        new = (self._first_step < 0) & present.any(axis=1)
        if new.any():
            self._first_step[new] = steps[np.argmax(present[new], axis=1)]
        self._scored = (self._first_step >= 0) & ft.scoreable(int(steps[-1]) - self._first_step)
        self._last_step = int(steps[-1])
        self._next_step = int(close)
        return t

    # -- totals across shards ---------------------------------------------------------------------
    def _keep_local_totals(self, step: int, sums: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """Keeps this step's group_sums of the CROSS_SHARD_GROUPS, by group label, for take_local_totals."""
        kept = {}
        for g in ft.CROSS_SHARD_GROUPS:
            cnt, tot, nz = sums[g]
            label_of = {code: label for label, code in self._group_codes[g].items()}
            kept[g] = {label_of[c]: np.concatenate([[cnt[c]], tot[c], nz[c]])
                       for c in np.flatnonzero(cnt).tolist()}
        self._local_totals[step] = kept
        _trim(self._local_totals)

    def take_local_totals(self) -> list[tuple[int, dict[str, dict[str, np.ndarray]]]]:
        """The job and site totals of this scorer's nodes at each step closed since the last call
        (oldest first; at most REMOTE_KEEP_STEPS): [(step, {group: {label: totals row}})]."""
        out = sorted(self._local_totals.items())
        self._local_totals.clear()
        return out

    def set_remote_totals(self, step: int, totals: dict) -> None:
        """The other shards' summed totals at `step`: {group: {label: row}}, group one of
        ft.CROSS_SHARD_GROUPS, row ft.TOTALS_WIDTH numbers. Replaces what an earlier call gave for the
        step. Raises ValueError naming the fault (a group, a label's row, a step too old to be used or
        too far ahead of this scorer's steps) and changes nothing."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"remote totals: step {step!r} is not a whole number")
        step = int(step)
        if self._last_step is not None:
            if step < self.oldest_remote_step():
                raise ValueError(f"remote totals: step {step} is older than any step still to close "
                                 f"can use (next {self._last_step + 1}, lag {self.remote_lag_steps})")
            if step > self._last_step + self.max_catchup_steps:
                raise ValueError(f"remote totals: unknown step {step}, {step - self._last_step} steps "
                                 f"past this scorer's last closed step {self._last_step}")
        if not isinstance(totals, dict):
            raise ValueError(f"remote totals of step {step}: expected {{group: {{label: row}}}}")
        parsed: dict[str, dict[str, np.ndarray]] = {}
        for g, rows in totals.items():
            if g not in ft.CROSS_SHARD_GROUPS:
                raise ValueError(f"remote totals of step {step}: group {g!r} is not one of {ft.CROSS_SHARD_GROUPS}")
            if not isinstance(rows, dict):
                raise ValueError(f"remote totals of step {step}, group {g}: expected {{label: row}}")
            parsed[g] = {str(label): ft.check_totals_row(row, f"remote totals of step {step}, {g} {label!r}")
                         for label, row in rows.items() if label}
        self._remote_totals[step] = parsed
        _trim(self._remote_totals)

    def oldest_remote_step(self) -> int | None:
        """The oldest step whose remote totals a step still to close can use (None: none closed yet)."""
        return None if self._last_step is None else self._last_step + 1 - self.remote_lag_steps

    def _remote_for(self, step: int):
        if not self._remote_totals:
            if self.share_totals:
                self.stats["remote_totals_missing"] += 1
            return None
        for r in range(step, step - self.remote_lag_steps - 1, -1):
            if r in self._remote_totals:
                self.stats["remote_totals_used"] += 1
                if r != step:
                    self.stats["remote_totals_lagged"] += 1
                return self._remote_totals[r]
        self.stats["remote_totals_missing"] += 1
        return None

    def _add_remote(self, group: str, codes: np.ndarray, local, remote: dict[str, np.ndarray]):
        """local (count, total, nonzero) per node plus the remote row of each node's group (by label)."""
        if not remote:
            return local
        label_codes = self._group_codes[group]
        by_code = np.zeros((len(label_codes) + 1, ft.TOTALS_WIDTH))   # the last row: no group, zeros
        for label, row in remote.items():
            c = label_codes.get(label)
            if c is not None:
                by_code[c] = row
        rows = by_code[np.where(codes >= 0, codes, len(label_codes))]
        k = len(ft.PEER_INPUTS)
        cnt, tot, nz = local
        return cnt + rows[:, 0], tot + rows[:, 1:1 + k], nz + rows[:, 1 + k:]

    def _close_table(self, table: str, parts: list[sg.Samples], close: int) -> list[sg.StepSignals]:
        """The (node, step) signals of one table's rows of the closing steps; the rest stays pending.

        Parts are one step each (ingest splits a batch that spans two) and every part's reduction
        was merged into its step's _StepAccumulator as it arrived, so a closing step is one frame
        per table whatever the batching. Only when the pending-rows bound dropped rows of a step, or
        steps were skipped, are the closing rows reduced together here, exactly as one batch would be.
        """
        lo = self._next_step
        first = self._part_steps[table]          # every pending part is one step (_by_step)
        closing = sorted({f for f in first if f < close})
        accs = [self._acc.get((table, step)) for step in closing]
        if all(step >= lo for step in closing) and all(a is not None and a.valid for a in accs):
            frames = [a.frame(step, len(self._nodes), kernel=self.kernel) for a, step in zip(accs, closing)]
            for step in closing:
                del self._acc[(table, step)]
            keep = [i for i, f in enumerate(first) if f >= close]
            self._pending_rows -= sum(len(p) for p, f in zip(parts, first) if f < close)
            self._pending[table] = [parts[i] for i in keep]
            self._part_steps[table] = [first[i] for i in keep]
            return [f for f in frames if len(f)]
        for key in [k for k in self._acc if k[0] == table and k[1] < close]:
            del self._acc[key]
        self.stats["steps_reduced_again"] += 1   # rows dropped by the bound, or steps skipped
        data = sg.Samples.concat(parts)
        done = data.step < close
        old = data.step < lo
        n_old, n_done = int(old.sum()), int(done.sum())
        if n_old:
            self.stats["late_rows"] += n_old
        use = data if n_done == len(data) and not n_old else data.select(done & ~old)
        rest = sg.Samples.empty() if n_done == len(data) else data.select(~done)
        self._pending[table] = list(_by_step(rest)) if len(rest) else []
        self._part_steps[table] = [int(p.step[0]) for p in self._pending[table]]
        self._pending_rows -= n_done
        if not len(use):
            return []
        return [sg.reduce_steps(table, use)]

    def _track_worst(self, table: str, parts: list[sg.Samples]) -> None:
        # only rows with errors can make an entity the worst (the values are counts, never negative)
        cols = {c for tbl, c, _k in ex.ENTITY_SIGNALS.values() if tbl == table}
        pick = []
        for p in parts:
            if any(c in p.cols and (p.cols[c] < 0).any() for c in cols):
                pick = [sg.Samples(q.node, q.step, q.key, {c: q.cols[c] for c in cols if c in q.cols})
                        for q in parts]   # not counts after all: keep every row
                break
            keep = np.zeros(len(p), dtype=bool)
            for c in cols:
                if c in p.cols:
                    keep |= p.cols[c] > 0
            if keep.any():
                pick.append(sg.Samples(p.node[keep], p.step[keep], p.key[keep],
                                       {c: p.cols[c][keep] for c in cols if c in p.cols}))
        if pick:
            self._track_worst_rows(table, sg.Samples.concat(pick))

    def _track_worst_rows(self, table: str, samples: sg.Samples) -> None:
        """Per node, the entity (GPU, port) with the most errors in its latest ingested rows with
        errors, for "worst on GPU 3". Kept at ingest, so the scoring round does not pay for it."""
        done: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
        grouped = None
        for signal, (tbl, column, kind) in ex.ENTITY_SIGNALS.items():
            if tbl != table or column not in samples.cols:
                continue
            if column not in done:
                if grouped is None:
                    grouped = sg.group_keys(samples.key)
                keys, starts, order = grouped
                v = np.nan_to_num(samples.cols[column])
                sums = np.add.reduceat(v if order is None else v[order], starts) if len(v) else v
                ok = sums > 0
                if not ok.any():
                    done[column] = None
                else:
                    k, sm = keys[ok], sums[ok]           # keys ascending, so nodes are grouped
                    nodes = k // sg.NODE_SHIFT
                    seg = sg._segments(nodes)
                    top = np.repeat(np.maximum.reduceat(sm, seg), np.diff(np.append(seg, len(sm))))
                    hit = np.flatnonzero(sm == top)      # the largest sum; a tie: the smallest key
                    first = hit[sg._segments(np.searchsorted(seg, hit, side="right"))]
                    done[column] = (nodes[first], k[first])
            got = done[column]
            if got is not None:
                self._worst[signal][got[0]] = got[1]

    def _entities(self, i: int) -> dict[str, str]:
        return {signal: self._stage.entity_label(int(keys[i]))
                for signal, keys in self._worst.items() if keys[i] >= 0}

    def score(self, now_ns: int | None = None, close_ns: int | None = None) -> ScoreBatch:
        """Advance the closed steps (advance()) and score every node past its first step of telemetry
        (ft.scoreable). Vectorised across nodes."""
        t0 = time.perf_counter()
        self.advance(now_ns, close_ns)
        idx = np.flatnonzero(self._scored)
        cached = self._scored_names
        if cached is None or not np.array_equal(cached[0], idx):
            cached = self._scored_names = (idx, [self._nodes[i] for i in idx.tolist()])
        nodes = list(cached[1])   # the scored nodes seldom change between rounds
        # every node scored (the usual round): the features themselves, not a copy; a round replaces
        # self._features, never writes into it
        X = self._features if len(idx) == len(self._features) else self._features[idx]
        prob = (self.model.probability(X) if len(X) else np.zeros(0)).astype(np.float64)
        signals: list[list[Signal]] = [[] for _ in nodes]
        k = min(self.explain_top, len(nodes))
        if k:
            top = _top(prob, k)
            top = top[prob[top] > 0]
            if len(top):
                ents = [self._entities(int(idx[i])) for i in top]
                explained = ex.explain(self.model.probability, X[top], prob[top], self.reference,
                                       top=self.signals_per_node, entities=ents,
                                       used_features=getattr(self.model, "used_features", None))
                for i, s in zip(top, explained):
                    signals[i] = s
        evidence = {}
        hard = getattr(self.model, "hard_evidence", None)
        if hard is not None and len(X):
            for i in np.flatnonzero(hard.met(X)).tolist():
                evidence[nodes[i]] = "; ".join(hard.reasons(X[i], self._entities(int(idx[i]))))
        manifest = getattr(self.model, "manifest", {}) or {}
        end = self._last_step
        return ScoreBatch(nodes=nodes, probability=prob, signals=signals,
                          step_end_ns=None if end is None else (end + 1) * self.step_ns,
                          horizon_seconds=int(manifest.get("horizon_seconds", 0)),
                          model_version=str(manifest.get("version", "")), features=X,
                          duration_s=time.perf_counter() - t0, evidence=evidence)

    # -- checkpoint --------------------------------------------------------------------------------
    STATE_FORMAT = "foreshock-scorer-state/1"

    def save_state(self, path) -> int:
        """Write what a restarted scorer needs to carry on (see restore_state) to `path`, atomically
        (a temporary file beside it, fsync, rename). An .npz of plain arrays plus a JSON header: no
        pickle. Returns the bytes written. A step-time judgement under way is not waited for: the
        checkpoint carries no step-time rows or judgements (they start over at a restore, as the
        30-minute windows do), and the judging thread writes nothing of the scorer's."""
        import json
        import os
        from pathlib import Path

        path = Path(path)
        stage_meta, stage_arrays = self._stage.state()
        meta = {"format": self.STATE_FORMAT, "feature_version": ft.FEATURE_VERSION,
                "step_seconds": ft.STEP_SECONDS, "model_version": str((getattr(self.model, "manifest", {}) or {})
                                                                     .get("version", "")),
                "saved_at_ns": time.time_ns(), "next_step": self._next_step,
                "last_step": self._last_step, "nodes": list(self._nodes),
                "labels": self._labels, "group_codes": self._group_codes, "stage": stage_meta}
        arrays = {f"features.{k}": v for k, v in self._state.carried().items()}
        arrays.update({f"stage.{k}": v for k, v in stage_arrays.items()})
        arrays.update({f"worst.{k}": v for k, v in self._worst.items()})
        arrays["first_step"] = self._first_step
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path.stat().st_size

    def restore_state(self, path) -> str:
        """Carry on from a save_state file, on a scorer that has taken no rows yet: per node, its 3-day
        baselines, day-long counts, last events, first step and each device's last counter values;
        the topology; the next step to close. The 30-minute windows start over (they refill in 30
        steps: features.FeatureState.from_carried), and the steps the service was down are skipped
        (max_catchup_steps). Nodes are scored from the first step that closes after the restore.

        A checkpoint of an earlier feature version in features.RESTORABLE_VERSIONS restores too, what
        it did not carry yet starting over (features.FeatureState.CARRIED_SINCE).

        Returns a line saying what was restored. Raises ValueError naming the file and the reason
        (not a state file, a feature version it cannot restore, parts that do not fit) and changes
        nothing."""
        import json

        if self._nodes or self._pending_rows:
            raise ValueError(f"{path}: a scorer restores only before it takes rows")
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            meta = json.loads(arrays.pop("meta").tobytes().decode())
        except (OSError, ValueError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a scorer state file ({exc})") from None
        if meta.get("format") != self.STATE_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, this code reads {self.STATE_FORMAT!r}")
        version = str(meta.get("feature_version"))
        if version not in ft.RESTORABLE_VERSIONS or meta.get("step_seconds") != ft.STEP_SECONDS:
            raise ValueError(f"{path}: saved with feature version {meta.get('feature_version')!r} and "
                             f"{meta.get('step_seconds')} s steps; this code computes {ft.FEATURE_VERSION!r} "
                             f"with {ft.STEP_SECONDS} s and restores versions {', '.join(ft.RESTORABLE_VERSIONS)}")
        try:
            nodes = [str(n) for n in meta["nodes"]]
            stage = sg.SampleStage.from_state(meta["stage"], {k[len("stage."):]: v for k, v in arrays.items()
                                                             if k.startswith("stage.")}, ft.STEP_SECONDS)
            if stage.node_names != nodes:
                raise ValueError("the sample stage's nodes are not the scorer's")
            state = ft.FeatureState.from_carried({k[len("features."):]: v for k, v in arrays.items()
                                                  if k.startswith("features.")}, version)
            first_step = np.asarray(arrays["first_step"], dtype=np.int64)
            worst = {k: np.asarray(arrays[f"worst.{k}"], dtype=np.int64) for k in ex.ENTITY_SIGNALS
                     if f"worst.{k}" in arrays}
            if len(state) != len(nodes) or len(first_step) != len(nodes) or any(len(v) != len(nodes)
                                                                                 for v in worst.values()):
                raise ValueError("per-node arrays of different lengths")
            if len(nodes) > self.max_nodes:
                raise ValueError(f"{len(nodes)} nodes, more than max_nodes={self.max_nodes}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        self._stage = stage
        self._nodes = nodes
        self._index = {n: i for i, n in enumerate(nodes)}
        self._state = state
        self._first_step = first_step
        self._scored = np.zeros(len(nodes), dtype=bool)
        self._features = np.full((len(nodes), ft.N_FEATURES), np.nan, np.float32)
        self._worst = {k: worst.get(k, np.full(len(nodes), -1, np.int64)) for k in ex.ENTITY_SIGNALS}
        self._labels = {str(k): dict(v) for k, v in meta["labels"].items()}
        self._group_codes = {g: {str(k): int(v) for k, v in meta["group_codes"].get(g, {}).items()}
                             for g in ft.PEER_GROUPS}
        self._code_arrays = None
        self._scored_names = None
        self._next_step = meta["next_step"]
        if meta.get("last_step") is not None:
            self._last_step = int(meta["last_step"])
        age_min = (time.time_ns() - int(meta["saved_at_ns"])) / 60e9
        return f"restored {len(nodes)} nodes from {path} (saved {age_min:.1f} min ago, next step {self._next_step})"

    def left_out(self) -> dict[str, int]:
        """Rows taken in but left out of the features, by reason (LEFT_OUT, then steptimes' and the
        fabric readings' own reasons), since the scorer started: what the service exports as
        foreshock_scorer_rows_left_out_total{reason}."""
        out = {r: int(self.stats[r]) for r in LEFT_OUT}
        out["not_newer_rows"] = int(sum(self._stage.stats.dropped_late.values()))
        return out

    def features_of(self, node: str) -> np.ndarray:
        """The feature vector of a node at the last closed step (for tests and debugging)."""
        return self._features[self._index[node]].copy()


REMOTE_KEEP_STEPS = 4
# Why rows taken in are left out of the features (OnlineScorer.left_out): not newer than their entity's
# last sample (a repeat; the sample stage counts them), late for their step, past the pending bound or
# max_nodes, step times late, too far ahead, of a node the scorer does not know or that steptimes.py
# cannot judge, fabric readings the data cannot mean.
LEFT_OUT: tuple[str, ...] = ("not_newer_rows", "late_rows", "dropped_pending_rows", "rejected_rows_max_nodes",
                             "late_step_times",
                             "step_times_ahead", "step_times_unknown_node",
                             *(f"step_times_{r}" for r in stt.SKIP_REASONS), *sg.MALFORMED)


def _judge_rows(parts: list[pa.Table]) -> tuple[stt.NodeMinutes, collections.Counter]:
    """One step's step_times rows judged (steptimes.node_minutes), and the rows skipped by reason. Reads
    nothing of the scorer's: it runs on the judging thread."""
    skipped = collections.Counter()
    return stt.node_minutes(pa.concat_tables(parts) if len(parts) > 1 else parts[0], skipped), skipped


def _trim(by_step: dict) -> None:
    for step in sorted(by_step)[:-REMOTE_KEEP_STEPS]:
        del by_step[step]


def group_sums(codes: np.ndarray, present: np.ndarray, own: np.ndarray):
    """Per group code: (count [G], total [G, I], nonzero [G, I]) over the nodes present."""
    ok = (codes >= 0) & present
    g = int(codes.max()) + 1 if len(codes) and codes.max() >= 0 else 1
    cnt = np.bincount(codes[ok], minlength=g).astype(np.float64)
    tot = np.zeros((g, own.shape[1]))
    nz = np.zeros((g, own.shape[1]))
    for c in range(own.shape[1]):
        tot[:, c] = np.bincount(codes[ok], weights=own[ok, c], minlength=g)
        nz[:, c] = np.bincount(codes[ok], weights=(own[ok, c] > 0).astype(np.float64), minlength=g)
    return cnt, tot, nz


def group_totals_lookup(codes: np.ndarray, present: np.ndarray, own: np.ndarray, *, kernel: bool = True):
    """Per node: its group's (count, total [3], nonzero [3]) over the nodes present, self included.
    kernel: the compiled kernel where numba is importable; False: the bincount path below, the written
    reference (the same additions in the same order)."""
    from foreshock.predictor import kernels

    if kernel and kernels.AVAILABLE and len(codes):
        n = len(codes)
        cnt, tot, nz = np.empty(n), np.empty((n, own.shape[1])), np.empty((n, own.shape[1]))
        kernels.group_totals(np.ascontiguousarray(codes, dtype=np.int64), np.ascontiguousarray(present),
                             np.ascontiguousarray(own, dtype=np.float64), cnt, tot, nz)
        return cnt, tot, nz
    return per_node_totals(codes, *group_sums(codes, present, own))


def per_node_totals(codes: np.ndarray, cnt: np.ndarray, tot: np.ndarray, nz: np.ndarray):
    """group_sums indexed per node: each node's group's row (a node in no group, code -1, gets group 0's
    row, which peer_signals ignores for it)."""
    safe = np.where(codes >= 0, codes, 0)
    return cnt[safe], tot[safe], nz[safe]


def _top(prob: np.ndarray, k: int) -> np.ndarray:
    """np.argsort(-prob, kind="stable")[:k] (the k largest, ties by index), sorting only the rows that
    can be among them."""
    neg = -prob
    if k >= len(prob):
        return np.argsort(neg, kind="stable")[:k]
    kth = np.partition(neg, k - 1)[k - 1]
    if np.isnan(kth):   # fewer than k numbers: NaN sorts last, as argsort puts it
        return np.argsort(neg, kind="stable")[:k]
    near = np.flatnonzero(neg <= kth)   # ascending: a stable sort of them breaks ties by index
    return near[np.argsort(neg[near], kind="stable")][:k]


def _by_step(samples: sg.Samples) -> list[sg.Samples]:
    """The rows of each step apart (a batch seldom spans two steps: one taken at a step boundary)."""
    if len(samples) == 0:
        return []
    if samples.step.min() == samples.step.max():
        return [samples]
    return [samples.select(samples.step == s) for s in np.unique(samples.step).tolist()]


def _across_entities(per_entity: np.ndarray, combine, n_nodes: int) -> np.ndarray:
    """combine (np.fmax, np.fmin) over the entity columns of a [node, entity] array: per node, NaN where
    no entity is known or the node has no row. A node has a handful of entities: one ufunc per entity
    column over all nodes is far cheaper than numpy's reduce along the short last axis (the same
    result)."""
    out = np.full(n_nodes, np.nan)
    if per_entity.size:
        r = per_entity[:, 0].copy()
        for c in range(1, per_entity.shape[1]):
            combine(r, per_entity[:, c], out=r)
        out[:len(per_entity)] = r
    return out


def _grown(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A [node, entity] array with at least `rows` x `cols`, new cells unknown (NaN); `a` itself when it fits."""
    rows, cols = max(a.shape[0], rows), max(a.shape[1], cols)
    if (rows, cols) == a.shape:
        return a
    grown = np.full((rows, cols), np.nan)
    grown[:a.shape[0], :a.shape[1]] = a
    return grown


class _StepAccumulator:
    """One table's open step: the (node) signals of every part merged as parts arrive.

    reduce_steps is exact whatever the batching (its sums are of integer-valued columns, max and min
    are order-free), so merging parts' reductions gives what one reduction of all the rows gives:
    sums add (unknown only if unknown in every part), maxima and minima combine with fmax/fmin. A
    per-entity maximum of sums ("emax": the worst GPU's count) cannot be merged from node values, so
    each entity's partial sum is kept too (NaN until a part has a known value of it: one array to read
    when the step closes, not a sum and a count) and the maximum is taken when the step closes;
    likewise each entity's running maximum for a minimum over entities ("emin_max": the coolest GPU's
    peak). Dense arrays by node and entity code: merging a part costs the part's size.
    """

    def __init__(self, table: str, n_nodes: int, running: bool = False):
        """running: also keep each node's worst entity sum as parts arrive (the round then reads one
        number per node and signal); False: only the per-entity sums, the maximum taken when the step
        closes (the written reference; the same values)."""
        self.spec = sg.REDUCTIONS[table]
        self.names = tuple(sig for sig, _, _ in self.spec)
        self.vals = np.full((max(n_nodes, 1), len(self.spec)), np.nan)
        self.touched = np.zeros(max(n_nodes, 1), dtype=bool)
        # per emax column: [node, entity code] sum of known values (NaN: none known yet; entity codes
        # are shared across nodes: GPU 3 has one code on every node)
        self.entity = {j: np.zeros((0, 0)) for j, (_sig, _col, how) in enumerate(self.spec) if how == "emax"}
        # per emin_max column: [node, entity code] maximum so far (NaN: no known value yet)
        self.entity_peak = {j: np.zeros((0, 0)) for j, (_sig, _col, how) in enumerate(self.spec)
                            if how == "emin_max"}
        # per emax column, each node's largest entity sum so far. The sums of whole counts only grow as
        # parts arrive, so the largest sum seen is the largest at the close; a part that would make a
        # sum shrink (a negative or unknown total) drops them (None) and the close takes the maximum
        self.best: dict[int, np.ndarray] | None = ({j: np.zeros(0) for j in self.entity} if running else None)
        self._column_of = np.zeros(0, dtype=np.int64)   # entity code -> column (-1: none yet)
        self._columns = 0
        self.valid = True

    def _grow_nodes(self, n: int) -> None:
        if n > len(self.touched):
            add = n - len(self.touched)
            self.vals = np.concatenate([self.vals, np.full((add, self.vals.shape[1]), np.nan)])
            self.touched = np.concatenate([self.touched, np.zeros(add, dtype=bool)])

    def merge(self, reduced: sg.StepSignals, part: sg.Samples) -> None:
        if len(reduced) == 0:
            return
        nodes = reduced.keys // sg.STEP_SHIFT
        self._grow_nodes(int(nodes.max()) + 1)
        for j, (_sig, _column, how) in enumerate(self.spec):
            if how in ("emax", "emin_max"):
                continue
            cur, new = self.vals[nodes, j], reduced.values[:, j]
            if how == "sum":
                self.vals[nodes, j] = np.where(np.isnan(cur), new, np.where(np.isnan(new), cur, cur + new))
            elif how == "max":
                self.vals[nodes, j] = np.fmax(cur, new)
            else:
                self.vals[nodes, j] = np.fmin(cur, new)
        self.touched[nodes] = True
        if self.entity or self.entity_peak:
            keys, starts, order = sg.group_keys(part.key)
            node, code = keys // sg.NODE_SHIFT, keys % sg.NODE_SHIFT
            node_starts = sg._segments(node) if self.best is not None else None   # keys ascending: by node
            # entity codes count every table's entities; this table's few get columns of their own
            if int(code.max()) >= len(self._column_of):
                self._column_of = np.concatenate([self._column_of, np.full(int(code.max()) + 1 - len(self._column_of), -1)])
            fresh = np.unique(code[self._column_of[code] < 0])
            self._column_of[fresh] = self._columns + np.arange(len(fresh))
            self._columns += len(fresh)
            code = self._column_of[code]
            for j, acc in self.entity.items():
                v = part.cols[self.spec[j][1]]
                v = v if order is None else v[order]
                known = ~np.isnan(v)
                total = np.add.reduceat(np.where(known, v, 0.0), starts)
                count = np.add.reduceat(known.astype(np.float64), starts)
                self.entity[j] = acc = _grown(acc, int(node.max()) + 1, int(code.max()) + 1)
                rows = acc.shape[0]
                # one row per entity after grouping: plain fancy writes; a part with no known value of
                # an entity leaves it as it was (unknown, or its sum so far)
                cur = acc[node, code]
                new = np.where(count > 0, np.where(np.isnan(cur), 0.0, cur) + total, cur)
                acc[node, code] = new
                if self.best is not None:
                    if ((count > 0) & ~(total >= 0)).any():
                        self.best = None
                    else:
                        best = self.best[j]
                        if len(best) < rows:
                            best = self.best[j] = np.concatenate([best, np.full(rows - len(best), np.nan)])
                        at = node[node_starts]
                        best[at] = np.fmax(best[at], np.fmax.reduceat(new, node_starts))
            for j, peak in self.entity_peak.items():
                v = part.cols[self.spec[j][1]]
                v = v if order is None else v[order]
                self.entity_peak[j] = peak = _grown(peak, int(node.max()) + 1, int(code.max()) + 1)
                peak[node, code] = np.fmax(peak[node, code], np.fmax.reduceat(v, starts))

    def frame(self, step: int, n_nodes: int, kernel: bool = False) -> sg.StepSignals:
        """The step's signals of every node that reported in it, as reduce_steps gives them. The worst
        entity sums kept as parts arrived (`running`) where they could be; else, and for the minima,
        kernel: over the entities in the compiled kernel where numba is importable (one pass over the
        nodes that reported); False: _across_entities, the written reference (the same values).

        When every node reported, the frame's values are the accumulator's own rows, not a copy: the
        step is closed, and the columns written here are written from the entity state, so a second
        call gives the same frame."""
        from foreshock.predictor import kernels

        self._grow_nodes(n_nodes)
        idx = np.flatnonzero(self.touched)
        every = len(idx) == len(self.touched)
        values = self.vals if every else self.vals[idx]
        if self.best is not None:
            for j, best in self.best.items():
                if len(idx) and idx[-1] >= len(best):   # a node this column never had a row of
                    best = np.concatenate([best, np.full(idx[-1] + 1 - len(best), np.nan)])
                values[:, j] = best[:len(idx)] if every else best[idx]
        if kernel and kernels.AVAILABLE:
            for j, total in self.entity.items() if self.best is None else ():
                kernels.across_entities(total, True, idx, values, j)
            for j, peak in self.entity_peak.items():
                kernels.across_entities(peak, False, idx, values, j)
        else:
            n = len(self.touched)
            for j, total in self.entity.items() if self.best is None else ():
                values[:, j] = _across_entities(total, np.fmax, n)[idx]
            for j, peak in self.entity_peak.items():
                values[:, j] = _across_entities(peak, np.fmin, n)[idx]
        return sg.StepSignals(idx.astype(np.int64) * sg.STEP_SHIFT + int(step), self.names, values)
