"""Durable control-plane state: job placements, directives and their acknowledgements, in SQLite (WAL).

Why SQLite: one file, transactions, a partial unique index that makes "one active directive per job and
node" a database invariant (so a directive is never issued twice, even across a restart), and WAL mode
so readers never block the writer. `synchronous=FULL`: an acknowledged write survives a power cut. Writes
are few: registrations, directives and acks, one step report per job every few seconds (the migrator's
`report_interval_s`, 5 s) and the telemetry sequences once a second; each commit is an fsync under the
store's one lock, so on a loaded machine a step report can wait for another's commit (docs/service.md).

Tables (created on open, versioned by `PRAGMA user_version`):
- jobs(job_id, generation, spares, max_concurrent, fallback, step, step_seconds, step_at_ns, ...)
- ranks(job_id, rank, node, gpus)
- directives(directive_id, job_id, kind, ranks, from_node, to_node, at_step, deadline_ns, reason, risk,
  signals, issued_at_ns, state, generation, updated_at_ns, origin)
- acks(directive_id, rank, phase, reason, phase_seconds, at_ns): every acknowledgement, kept.
- telemetry_sequences(collector_id, sequence, updated_at_ns): the last telemetry batch of each collector
  that was taken (checked and scored), so a batch re-sent after a restart is not taken twice; written
  once a second in one transaction, rows of collectors silent for a week pruned. The proto's sequence
  is a uint64 and SQLite's INTEGER a signed 64-bit one, so `sequence` holds the sequence minus 2^63
  (SEQUENCE_OFFSET): every uint64 fits, and the order, which the save's max() relies on, is kept.
  Schema version 2 introduced that offset; a version-1 database is moved to it on open.
- node_actions(node, state, reason, fatal, alarm_since_ns, requested_at_ns, updated_at_ns, attempts,
  next_try_ns, done, detail, unsure): what service/actions.py did or holds back per node (drain, taint), so
  the circuit breaker's count survives a restart. Added beside version 2's tables (an older build
  ignores it), so the version stays 2.
- shard_progress(shard, epoch, sequence, ...), shard_nodes(node, shard, risk, alarm, fatal_*, topology, ...):
  the jobs coordinator's record of the shards' events (service/coordinator.py), and
  shard_fabric_findings(node, unit, finding, shard, since_ns): one row per fabric-service finding a
  shard forwarded and has not cleared (service/fabricunits.py ForwardedFindings), and
  shard_reconfirmations(shard, epoch, until_ns, alarms, findings): one row per restarted shard whose
  reconfirmation is pending, the risk alarms (JSON nodes) and findings (JSON [node, unit, finding]) its
  previous instance left that its new one has not raised again yet. Added beside version 2's tables, as
  node_actions.

The rows are the domain types of service/domain.py.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from foreshock.service.domain import (
    ACK_TO_STATE, ACTIVE_STATES, AckPhase, AckRecord, Directive, DirectiveKind, DirectiveState, Fallback, Job,
    Rank, SignalRecord)
from foreshock.service.errors import FailedPrecondition, NotFound

SCHEMA_VERSION = 2
SEQUENCE_OFFSET = 1 << 63   # stored = sequence - SEQUENCE_OFFSET: uint64 onto SQLite's signed 64 bits
SEQUENCE_MAX = (1 << 64) - 1


_DDL = """
CREATE TABLE IF NOT EXISTS jobs(
  job_id TEXT PRIMARY KEY, generation INTEGER NOT NULL, spares TEXT NOT NULL,
  max_concurrent INTEGER NOT NULL, fallback INTEGER NOT NULL, step INTEGER NOT NULL,
  step_seconds REAL NOT NULL, step_at_ns INTEGER NOT NULL, registered_at_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ranks(
  job_id TEXT NOT NULL, rank INTEGER NOT NULL, node TEXT NOT NULL, gpus TEXT NOT NULL,
  PRIMARY KEY(job_id, rank));
CREATE INDEX IF NOT EXISTS ranks_node ON ranks(node);
CREATE TABLE IF NOT EXISTS directives(
  directive_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, kind INTEGER NOT NULL, ranks TEXT NOT NULL,
  from_node TEXT NOT NULL, to_node TEXT NOT NULL, at_step INTEGER NOT NULL, deadline_ns INTEGER NOT NULL,
  reason TEXT NOT NULL, risk REAL NOT NULL, signals TEXT NOT NULL, issued_at_ns INTEGER NOT NULL,
  state INTEGER NOT NULL, generation INTEGER NOT NULL, updated_at_ns INTEGER NOT NULL, origin TEXT NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS directives_one_active
  ON directives(job_id, from_node) WHERE state IN (1, 2, 3);
CREATE INDEX IF NOT EXISTS directives_job ON directives(job_id, state);
CREATE TABLE IF NOT EXISTS acks(
  directive_id TEXT NOT NULL, rank INTEGER NOT NULL, phase INTEGER NOT NULL, reason TEXT NOT NULL,
  phase_seconds REAL NOT NULL, at_ns INTEGER NOT NULL, PRIMARY KEY(directive_id, rank, phase));
CREATE TABLE IF NOT EXISTS telemetry_sequences(
  collector_id TEXT PRIMARY KEY, sequence INTEGER NOT NULL, updated_at_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS node_actions(
  node TEXT PRIMARY KEY, state TEXT NOT NULL, reason TEXT NOT NULL, fatal INTEGER NOT NULL,
  alarm_since_ns INTEGER NOT NULL, requested_at_ns INTEGER NOT NULL, updated_at_ns INTEGER NOT NULL,
  attempts INTEGER NOT NULL, next_try_ns INTEGER NOT NULL, done TEXT NOT NULL, detail TEXT NOT NULL,
  unsure INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS shard_progress(
  shard TEXT PRIMARY KEY, epoch INTEGER NOT NULL, sequence INTEGER NOT NULL, model_version TEXT NOT NULL,
  updated_at_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS shard_nodes(
  node TEXT PRIMARY KEY, shard TEXT NOT NULL, risk REAL NOT NULL, scored_at_ns INTEGER NOT NULL,
  alarm INTEGER NOT NULL, alarm_since_ns INTEGER NOT NULL, reason TEXT NOT NULL, signals TEXT NOT NULL,
  fatal_ts_ns INTEGER NOT NULL, fatal_kind TEXT NOT NULL, fatal_description TEXT NOT NULL,
  fatal_recorded_ns INTEGER NOT NULL, leaf_switch TEXT NOT NULL, site TEXT NOT NULL, nvlink_domain TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shard_fabric_findings(
  node TEXT NOT NULL, unit TEXT NOT NULL, finding TEXT NOT NULL, shard TEXT NOT NULL, since_ns INTEGER NOT NULL,
  PRIMARY KEY(node, unit, finding));
CREATE TABLE IF NOT EXISTS shard_reconfirmations(
  shard TEXT PRIMARY KEY, epoch INTEGER NOT NULL, until_ns INTEGER NOT NULL, alarms TEXT NOT NULL,
  findings TEXT NOT NULL);
"""


def _job_from_row(row, ranks: tuple) -> Job:
    (jid, generation, spares, max_conc, fallback, step, step_seconds, step_at, reg_at) = row
    return Job(jid, ranks, tuple(json.loads(spares)), max_conc, Fallback(fallback), step, step_seconds,
               step_at, generation, reg_at)


class StateStore:
    """The control plane's durable state. Thread-safe (one connection behind a lock)."""

    def __init__(self, path: str | Path, *, clock=time.time_ns):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, SCHEMA_VERSION):
            raise FailedPrecondition(f"state database {self.path} has schema version {version}; "
                                     f"this build reads version {SCHEMA_VERSION}")
        self._db.executescript(_DDL)
        # The policy reads every job and active directive each scoring round (ten a second), more often
        # than anything writes: those two reads are cached until the next transaction (rows are frozen).
        self._writes = 0
        self._cache: dict[str, tuple[int, list]] = {}
        self._depth = 0              # transactions inside a batch() are savepoints of it
        with self._tx() as db:
            if version == 1:  # sequences stored as they were (all below 2^63 then): move them by the offset
                db.execute("UPDATE telemetry_sequences SET sequence = sequence - ? - 1", (SEQUENCE_OFFSET - 1,))
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- transactions ------------------------------------------------------------------------------
    def _tx(self, savepoint: bool = True):
        """A write transaction. The outermost one commits; one inside a batch() is a savepoint, so a
        write that fails there undoes only itself (savepoint=False: a single write statement, which
        SQLite undoes by itself when it fails)."""
        store = self

        class _Tx:
            def __enter__(self_inner):
                store._lock.acquire()
                self_inner.depth = store._depth
                store._depth += 1
                self_inner.savepoint = savepoint and self_inner.depth > 0
                if self_inner.depth == 0:
                    store._db.execute("BEGIN IMMEDIATE")
                elif self_inner.savepoint:
                    store._db.execute(f"SAVEPOINT s{self_inner.depth}")
                return store._db

            def __exit__(self_inner, exc_type, exc, tb):
                try:
                    store._depth -= 1
                    if self_inner.depth == 0:
                        store._db.execute("ROLLBACK" if exc_type else "COMMIT")
                    elif self_inner.savepoint:
                        if exc_type:
                            store._db.execute(f"ROLLBACK TO s{self_inner.depth}")
                        store._db.execute(f"RELEASE s{self_inner.depth}")
                finally:
                    store._writes += 1   # the read caches below are stale now
                    store._lock.release()
                return False

        return _Tx()

    @contextlib.contextmanager
    def batch(self):
        """One transaction (one commit, one fsync) for the writes inside it, in this thread: a policy
        round that issues twenty directives waits for the disk once, not twenty times. Other threads'
        writes wait for it to end."""
        with self._tx():
            yield

    # -- jobs ----------------------------------------------------------------------------------------
    def put_job(self, job: Job) -> Job:
        """Register a job or replace its placement; the generation bumps when the placement changes."""
        now = self._clock()
        with self._tx() as db:
            old = self._job(db, job.job_id)
            generation = 1
            if old is not None:
                same = (old.ranks == job.ranks and old.spares == job.spares)
                generation = old.generation if same else old.generation + 1
            job = replace(job, generation=generation, step_at_ns=now,
                          registered_at_ns=old.registered_at_ns if old else now)
            self._write_job(db, job)
            if old is not None:
                # Directives from nodes that no longer host the job's ranks are moot.
                for d in self._directives(db, "job_id=? AND state IN (1,2,3)", (job.job_id,)):
                    if d.from_node not in job.nodes():
                        self._set_state(db, d.directive_id, DirectiveState.CANCELLED, now)
        return job

    def _write_job(self, db, job: Job) -> None:
        db.execute("INSERT OR REPLACE INTO jobs VALUES (?,?,?,?,?,?,?,?,?)",
                   (job.job_id, job.generation, json.dumps(list(job.spares)), job.max_concurrent,
                    int(job.fallback), job.step, job.step_seconds, job.step_at_ns, job.registered_at_ns))
        db.execute("DELETE FROM ranks WHERE job_id=?", (job.job_id,))
        db.executemany("INSERT INTO ranks VALUES (?,?,?,?)",
                       [(job.job_id, r.rank, r.node, json.dumps(list(r.gpus))) for r in job.ranks])

    def _job(self, db, job_id: str) -> Job | None:
        row = db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if row is None:
            return None
        ranks = tuple(Rank(r, n, tuple(json.loads(g))) for r, n, g in db.execute(
            "SELECT rank, node, gpus FROM ranks WHERE job_id=? ORDER BY rank", (job_id,)))
        return _job_from_row(row, ranks)

    def job(self, job_id: str) -> Job:
        with self._lock:
            job = self._job(self._db, job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} is not registered")
        return job

    def find_job(self, job_id: str) -> Job | None:
        with self._lock:
            return self._job(self._db, job_id)

    def _cached(self, key: str, read):
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == self._writes:
                return list(hit[1])
            rows = read()
            self._cache[key] = (self._writes, rows)
            return list(rows)

    def jobs(self) -> list[Job]:
        def read():
            ranks: dict[str, list[Rank]] = {}
            for jid, r, n, g in self._db.execute("SELECT job_id, rank, node, gpus FROM ranks ORDER BY job_id, rank"):
                ranks.setdefault(jid, []).append(Rank(r, n, tuple(json.loads(g))))
            return [_job_from_row(row, tuple(ranks.get(row[0], ())))
                    for row in self._db.execute("SELECT * FROM jobs ORDER BY job_id")]
        return self._cached("jobs", read)

    def report_step(self, job_id: str, step: int, step_seconds: float) -> Job:
        now = self._clock()
        with self._tx() as db:
            n = db.execute("UPDATE jobs SET step=?, step_seconds=?, step_at_ns=? WHERE job_id=?",
                           (step, step_seconds, now, job_id)).rowcount
            if not n:
                raise NotFound(f"job {job_id!r} is not registered")
            return self._job(db, job_id)

    def delete_job(self, job_id: str) -> list[Directive]:
        """Deregister a job; its active directives are cancelled (and returned, to notify watchers)."""
        now = self._clock()
        with self._tx() as db:
            if self._job(db, job_id) is None:
                raise NotFound(f"job {job_id!r} is not registered")
            cancelled = []
            for d in self._directives(db, "job_id=? AND state IN (1,2,3)", (job_id,)):
                cancelled.append(self._set_state(db, d.directive_id, DirectiveState.CANCELLED, now,
                                                 reason_suffix="job deregistered"))
            db.execute("DELETE FROM ranks WHERE job_id=?", (job_id,))
            db.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))
            return cancelled

    # -- directives --------------------------------------------------------------------------------
    def insert_directive(self, d: Directive) -> tuple[Directive | None, bool]:
        """Store a new directive; if the job already has an active one from that node, return that one.

        Returns (directive, created), or (None, False) when the job's placement has changed since the
        directive was decided (its generation is not the job's: a move completed, the job registered
        anew or left): a policy round reads the jobs, then the active directives, and a move completing
        in between would otherwise evacuate ranks from a node they have already left. The next round
        decides again on the new placement. The checks and the insert are one transaction, and the
        partial unique index backs it, so two rounds (or a round and a drain) can never both issue one.
        """
        with self._tx(savepoint=False) as db:
            row = db.execute("SELECT generation FROM jobs WHERE job_id=?", (d.job_id,)).fetchone()
            if row is None or row[0] != d.generation:
                return None, False
            if not d.directive_id:
                d = replace(d, directive_id=uuid.uuid4().hex)
            # One statement, the index deciding: each statement hands the GIL over, and under load
            # getting it back waits up to a switch interval while the event loop runs.
            cur = db.execute("INSERT OR IGNORE INTO directives VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                             (d.directive_id, d.job_id, int(d.kind), json.dumps(list(d.ranks)), d.from_node,
                              d.to_node, d.at_step, d.deadline_ns, d.reason, float(d.risk),
                              json.dumps([s.__dict__ for s in d.signals]), d.issued_at_ns, int(d.state),
                              d.generation, d.issued_at_ns, d.origin))
            if cur.rowcount == 1:
                return d, True
            existing = self._directives(db, "job_id=? AND from_node=? AND state IN (1,2,3)",
                                        (d.job_id, d.from_node))
            if existing:
                return existing[0], False
            raise FailedPrecondition(f"directive {d.directive_id!r} already exists")

    def _directives(self, db, where: str, args: tuple) -> list[Directive]:
        rows = db.execute(f"SELECT * FROM directives WHERE {where} ORDER BY issued_at_ns, directive_id",
                          args).fetchall()
        return [_directive_from_row(r) for r in rows]

    def directive(self, directive_id: str) -> Directive:
        with self._lock:
            found = self._directives(self._db, "directive_id=?", (directive_id,))
        if not found:
            raise NotFound(f"directive {directive_id!r} does not exist")
        return found[0]

    def directives(self, job_id: str | None = None, *, active_only: bool = False) -> list[Directive]:
        where, args = [], []
        if job_id is not None:
            where.append("job_id=?")
            args.append(job_id)
        if active_only:
            where.append("state IN (1,2,3)")
        if job_id is None and active_only:
            return self._cached("active", lambda: self._directives(self._db, where[0], ()))
        with self._lock:
            return self._directives(self._db, " AND ".join(where) or "1=1", tuple(args))

    def _set_state(self, db, directive_id: str, state: DirectiveState, now: int,
                   reason_suffix: str = "") -> Directive:
        if reason_suffix:
            db.execute("UPDATE directives SET state=?, updated_at_ns=?, reason=reason || ? WHERE directive_id=?",
                       (int(state), now, f"; {reason_suffix}", directive_id))
        else:
            db.execute("UPDATE directives SET state=?, updated_at_ns=? WHERE directive_id=?",
                       (int(state), now, directive_id))
        return self._directives(db, "directive_id=?", (directive_id,))[0]

    def cancel(self, directive_id: str, reason: str) -> tuple[Directive, bool]:
        """Cancel an active directive. Returns (directive, changed); cancelling a finished one changes nothing."""
        now = self._clock()
        with self._tx() as db:
            found = self._directives(db, "directive_id=?", (directive_id,))
            if not found:
                raise NotFound(f"directive {directive_id!r} does not exist")
            d = found[0]
            if d.state not in ACTIVE_STATES:
                return d, False
            return self._set_state(db, directive_id, DirectiveState.CANCELLED, now,
                                   reason_suffix=f"cancelled: {reason}" if reason else "cancelled"), True

    def expire(self, now_ns: int) -> list[Directive]:
        """Fail active directives whose deadline has passed (the job never completed them)."""
        with self._tx() as db:
            late = self._directives(db, "state IN (1,2,3) AND deadline_ns < ?", (now_ns,))
            return [self._set_state(db, d.directive_id, DirectiveState.FAILED, now_ns,
                                    reason_suffix="deadline passed without completion") for d in late]

    def ack(self, a: AckRecord) -> tuple[Directive, bool]:
        """Record an acknowledgement and advance the directive's state. Returns (directive, changed).

        States only move forward (PENDING < ACCEPTED < STATE_TRANSFERRED < COMPLETED; FAILED from any
        active state). A repeated or late ack is recorded and changes nothing. COMPLETED applies the move
        to the job's placement (the ranks now live on `to_node`) and bumps its generation, in the same
        transaction, so a restart can never see one without the other.
        """
        with self._tx() as db:
            found = self._directives(db, "directive_id=?", (a.directive_id,))
            if not found:
                raise NotFound(f"directive {a.directive_id!r} does not exist")
            d = found[0]
            db.execute("INSERT OR IGNORE INTO acks VALUES (?,?,?,?,?,?)",
                       (a.directive_id, a.rank, int(a.phase), a.reason, a.phase_seconds, a.at_ns))
            target = ACK_TO_STATE[a.phase]
            if d.state not in ACTIVE_STATES:
                return d, False
            if target != DirectiveState.FAILED and target <= d.state:
                return d, False
            suffix = f"failed: {a.reason}" if target == DirectiveState.FAILED and a.reason else ""
            d = self._set_state(db, d.directive_id, target, a.at_ns, reason_suffix=suffix)
            if target == DirectiveState.COMPLETED:
                self._apply_move(db, d)
            return d, True

    def _apply_move(self, db, d: Directive) -> None:
        job = self._job(db, d.job_id)
        if job is None:
            return
        moved = set(d.ranks)
        if d.kind == DirectiveKind.EVACUATE and d.to_node:
            ranks = tuple(replace(r, node=d.to_node) if r.rank in moved else r for r in job.ranks)
            spares = tuple(s for s in job.spares if s != d.to_node)
        elif d.kind == DirectiveKind.SHRINK:
            ranks = tuple(r for r in job.ranks if r.rank not in moved)
            spares = job.spares
        else:  # checkpoint-and-exit: the launcher restarts the job, which registers anew
            ranks, spares = job.ranks, job.spares
        self._write_job(db, replace(job, ranks=ranks, spares=spares, generation=job.generation + 1))

    def acks(self, directive_id: str) -> list[AckRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM acks WHERE directive_id=? ORDER BY at_ns, rank, phase",
                                    (directive_id,)).fetchall()
        return [AckRecord(r[0], r[1], AckPhase(r[2]), r[3], r[4], r[5]) for r in rows]

    # -- node actions (service/actions.py) -----------------------------------------------------------
    def node_actions(self) -> list:
        from foreshock.service.actions import NodeAction

        with self._lock:
            rows = self._db.execute("SELECT * FROM node_actions ORDER BY requested_at_ns, node").fetchall()
        return [NodeAction(n, st, r, bool(f), since, req, upd, att, nxt, tuple(json.loads(done)), detail, bool(u))
                for n, st, r, f, since, req, upd, att, nxt, done, detail, u in rows]

    def put_node_actions(self, rows: list, dropped: list[str] = ()) -> None:
        """Write node-action rows (one transaction) and delete the rows of `dropped` nodes."""
        if not rows and not dropped:
            return
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO node_actions VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                           [(a.node, a.state, a.reason, int(a.fatal), a.alarm_since_ns, a.requested_at_ns,
                             a.updated_at_ns, a.attempts, a.next_try_ns, json.dumps(list(a.done)), a.detail,
                             int(a.unsure))
                            for a in rows])
            db.executemany("DELETE FROM node_actions WHERE node=?", [(n,) for n in dropped])

    # -- shards' events (the jobs coordinator, service/coordinator.py) -------------------------------
    def shard_progress(self) -> dict[str, tuple[int, int, str]]:
        """shard -> (epoch, last sequence applied, model version)."""
        with self._lock:
            rows = self._db.execute("SELECT shard, epoch, sequence, model_version FROM shard_progress").fetchall()
        return {shard: (epoch, seq, version) for shard, epoch, seq, version in rows}

    def record_shard_events(self, shard: str, epoch: int, sequence: int, model_version: str, nodes: list[tuple],
                            now_ns: int, *, findings: Iterable[tuple] = (), cleared: Iterable[tuple] = (),
                            reconfirm: tuple | None = None, reconfirm_ended: bool = False) -> None:
        """One shard's events applied up to `sequence`, the shard_nodes rows they changed and the
        fabric findings they raised (rows) or cleared ((node, unit, finding)), in one write (a savepoint
        of the caller's batch, so the directives they lead to commit with them). `reconfirm`, the
        shard's pending reconfirmation as it stands now ((epoch, until_ns, alarms, findings)), replaces
        its row; `reconfirm_ended` deletes it."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO shard_progress VALUES (?,?,?,?,?)",
                       (shard, epoch, sequence, model_version, now_ns))
            db.executemany("INSERT OR REPLACE INTO shard_nodes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", nodes)
            db.executemany("INSERT OR REPLACE INTO shard_fabric_findings VALUES (?,?,?,?,?)", findings)
            db.executemany("DELETE FROM shard_fabric_findings WHERE node=? AND unit=? AND finding=?", cleared)
            if reconfirm_ended:
                db.execute("DELETE FROM shard_reconfirmations WHERE shard=?", (shard,))
            if reconfirm is not None:
                db.execute("INSERT OR REPLACE INTO shard_reconfirmations VALUES (?,?,?,?,?)", (shard, *reconfirm))

    def shard_nodes(self) -> list[tuple]:
        with self._lock:
            return self._db.execute("SELECT * FROM shard_nodes ORDER BY node").fetchall()

    def shard_fabric_findings(self) -> list[tuple]:
        """(node, unit, finding, shard, since_ns) of every finding held."""
        with self._lock:
            return self._db.execute("SELECT node, unit, finding, shard, since_ns FROM shard_fabric_findings "
                                    "ORDER BY node, unit, finding").fetchall()

    def shard_reconfirmations(self) -> list[tuple]:
        """(shard, epoch, until_ns, alarms, findings) of every pending reconfirmation, the last two JSON."""
        with self._lock:
            return self._db.execute("SELECT shard, epoch, until_ns, alarms, findings FROM shard_reconfirmations "
                                    "ORDER BY shard").fetchall()

    def last_directive_time(self, nodes: Iterable[str] | None = None) -> dict[str, int]:
        """Per from_node, the latest time a directive was issued or changed state (for cool-down)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT from_node, MAX(updated_at_ns) FROM directives GROUP BY from_node").fetchall()
        out = {n: t for n, t in rows}
        if nodes is not None:
            wanted = set(nodes)
            out = {n: t for n, t in out.items() if n in wanted}
        return out


def save_sequences(store: StateStore, sequences: dict[str, int], now_ns: int,
                   keep_ns: int = 7 * 86_400 * 1_000_000_000) -> list[str]:
    """Record each collector's last taken telemetry sequence (never lowers one). A sequence that is no
    uint64 is left out and its collector returned, so that one stream can never fail the others' save."""
    rows, refused = [], []
    for collector, sequence in sequences.items():
        if 0 <= sequence <= SEQUENCE_MAX:
            rows.append((collector, int(sequence) - SEQUENCE_OFFSET, now_ns))
        else:
            refused.append(collector)
    if rows:
        with store._tx() as db:
            db.executemany("INSERT INTO telemetry_sequences VALUES(?,?,?) ON CONFLICT(collector_id) DO UPDATE SET "
                           "sequence=max(sequence, excluded.sequence), updated_at_ns=excluded.updated_at_ns", rows)
            db.execute("DELETE FROM telemetry_sequences WHERE updated_at_ns < ?", (now_ns - keep_ns,))
    return refused


def load_sequences(store: StateStore) -> dict[str, int]:
    with store._lock:
        rows = store._db.execute("SELECT collector_id, sequence FROM telemetry_sequences").fetchall()
    return {collector: stored + SEQUENCE_OFFSET for collector, stored in rows}


def counts(store: StateStore) -> dict[tuple[int, int], int]:
    """(kind, state) -> number of directives, for the metrics."""
    with store._lock:
        rows = store._db.execute("SELECT kind, state, COUNT(*) FROM directives GROUP BY kind, state").fetchall()
    return {(k, s): n for k, s, n in rows}


def job_count(store: StateStore) -> int:
    with store._lock:
        return store._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]


def _directive_from_row(r) -> Directive:
    (did, job_id, kind, ranks, from_node, to_node, at_step, deadline_ns, reason, risk, signals, issued,
     state, generation, updated, origin) = r
    return Directive(did, job_id, DirectiveKind(kind), tuple(json.loads(ranks)), from_node, to_node, at_step,
                     deadline_ns, reason, risk, tuple(SignalRecord(**s) for s in json.loads(signals)), issued,
                     DirectiveState(state), generation, updated, origin)
