"""Node history ("lemon node") score: P(a node faults within a horizon of days) from its past incidents.

The 30-minute predictor reads telemetry; this score reads only the fault log, the schema-v1 `incidents`
table (foreshock/schema.py INCIDENTS), so it works on a fleet's own incident records and on public
fault traces. The parts:

- Import of the InfiniteHBD fault trace (StepFun, SIGCOMM 2025; format in
  ../shared/datasets/infinitehbd-trace/README.md) into `incidents` rows: `read_infinitehbd`, with the
  fault-type -> category mapping declared once in INFINITEHBD_CATEGORIES.
- `FaultLog`: the incidents as arrays, and `before(at)`, what was known at a cut-off.
- `NodeHistoryModel`: an empirical-Bayes Gamma-Poisson score on decayed fault counts, fitted on the
  history itself at rolling weekly cut-offs (label: a fault within the horizon after the cut-off), with
  every node of the fleet represented, the never-failed ones as zero-history rows.
- The published baselines (`count_score`, `decayed_count_score`), the top-fraction lift, and
  `fault_statistics` (repair times, time between faults). docs/predictor.md ("Node history score") has
  the measured figures.

Times inside this module are float days since an origin (`day0`), the unit of the trace and of the
horizon; `to_days` converts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

NS_PER_DAY = 86_400 * 10**9
INFINITEHBD_DAY0 = pd.Timestamp("2024-03-30T00:00:00Z")  # README.md: day 0 of the trace
INFINITEHBD_FLEET_SIZE = 400                              # README.md: servers in the cluster
METADATA_FILE = "history.json"                            # fleet size and origin, beside the tables

# InfiniteHBD (Level, Class, Desc) -> schema-v1 category, most specific first; a Desc or Class of None
# matches any. Categories are failure-figures.md's where one fits; the trace's own "Other Failure"
# kinds (a burn-in test the node failed, an unattributed error) keep names of their own.
INFINITEHBD_CATEGORIES: tuple[tuple[str, str | None, str | None, str], ...] = (
    ("Hardware Failure", "GPU", "GPU DBE(Double Bit ECC) > Threshold", "gpu_hbm"),
    ("Hardware Failure", "GPU", "GPU SBE(Single Bit ECC) > Threshold", "gpu_hbm"),
    ("Hardware Failure", "GPU", "GPU Temperature High", "gpu_thermal"),
    ("Hardware Failure", "GPU", None, "faulty_gpu"),
    ("Hardware Failure", "NIC", None, "nic"),
    ("Hardware Failure", "Parameter Plane Cable", None, "network_switch_cable"),
    ("Hardware Failure", "Power Supply", None, "power_supply"),
    ("Hardware Failure", "Fan", None, "server_chassis"),
    ("Hardware Failure", "Motherboard Battery", None, "server_chassis"),
    ("Hardware Failure", None, None, "hardware_other"),
    ("Software Failure", "Firmware", None, "dependency"),
    ("Software Failure", "Software Tool", None, "dependency"),
    ("Software Failure", None, None, "software_bug"),
    ("Other Failure", "Stress Test Failure", None, "stress_test_failure"),
    ("Other Failure", "Change", None, "host_maintenance"),
    ("Other Failure", "Training Task Troubleshooting", None, "suspect_node"),
    ("Other Failure", "System Crash", None, "host_crash"),
    (None, None, None, "unknown"),
)

# Categories of a hardware fault, the trace's and the simulator's (simulator/faults.py CATEGORIES).
HARDWARE_CATEGORIES = frozenset({
    "faulty_gpu", "gpu_hbm", "gpu_sram", "gpu_system_processor", "gpu_thermal", "nic", "network_switch_cable",
    "power_supply", "server_chassis", "io_expansion_board", "ssd", "cpu", "system_memory", "hardware_other",
    "nvlink_fabric",
})

EVENT_TYPES = ("fault_start", "fault_end")


class HistoryError(ValueError):
    """Input the history score cannot use; the message names the file (and the record)."""


def infinitehbd_category(level: str, cls: str, desc: str) -> str:
    for lv, c, d, category in INFINITEHBD_CATEGORIES:
        if (lv is None or lv == level) and (c is None or c == cls) and (d is None or d == desc):
            return category
    raise AssertionError("the catch-all row of INFINITEHBD_CATEGORIES matches everything")


def read_infinitehbd(path: str | Path, day0: pd.Timestamp = INFINITEHBD_DAY0, *,
                     left_out: list[str] | None = None) -> list[dict]:
    """The trace as schema-v1 `incidents` rows: one per fault_start, repaired_at from its fault_end.

    Records are taken in time order (among equal times, starts first, then in the file's order). A
    fault_end closes the oldest open fault of the same node and fault type (the trace has a node with
    two faults open at once), or, where none is open, the node's oldest open fault of another type (a
    fault reclassified when it was repaired). A fault still open at the end of the file has repaired_at
    null. A fault_end that finds no open fault of its node says nothing about when a fault started, so
    it is left out rather than the whole trace: its message (file, record index, why) goes to
    `left_out` where given.
    Raises HistoryError naming the file and the record index for anything malformed.
    """
    path = Path(path)
    try:
        records = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HistoryError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(records, list):
        raise HistoryError(f"{path}: expected a JSON list of events, got {type(records).__name__}")
    rows: list[dict] = []
    open_faults: dict[tuple, list[int]] = {}
    checked = []
    for i, rec in enumerate(records):
        where = f"{path}: record {i}"
        if not isinstance(rec, dict):
            raise HistoryError(f"{where}: expected an object, got {type(rec).__name__}")
        missing = {"node_id", "event_time", "event_type", "fault_type"} - set(rec)
        if missing:
            raise HistoryError(f"{where}: missing fields {sorted(missing)}")
        node, t, kind, ft = rec["node_id"], rec["event_time"], rec["event_type"], rec["fault_type"]
        if not isinstance(node, str) or not node:
            raise HistoryError(f"{where}: node_id must be a non-empty string")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t):
            raise HistoryError(f"{where}: event_time must be a finite number of days, got {t!r}")
        if kind not in EVENT_TYPES:
            raise HistoryError(f"{where}: unknown event_type {kind!r} (known: {', '.join(EVENT_TYPES)})")
        if not isinstance(ft, dict) or not all(isinstance(ft.get(k), str) for k in ("Level", "Class", "Desc")):
            raise HistoryError(f"{where}: fault_type must be an object with string Level, Class and Desc")
        checked.append((float(t), i, node, kind, ft))
    # at one time, starts before ends: a fault may start and end at once
    for t, i, node, kind, ft in sorted(checked, key=lambda c: (c[0], c[3] != "fault_start", c[1])):
        where = f"{path}: record {i}"
        ts = day0.value + round(t * NS_PER_DAY)
        key = (node, ft["Level"], ft["Class"], ft["Desc"])
        if kind == "fault_start":
            open_faults.setdefault(key, []).append(len(rows))
            rows.append({
                "ts": ts, "node": node, "incident_id": f"{node}-{i}", "scope": "node", "affected_nodes": [node],
                "category": infinitehbd_category(ft["Level"], ft["Class"], ft["Desc"]), "component": ft["Class"],
                "description": f"{ft['Level']} / {ft['Class']} / {ft['Desc']}", "has_precursor": None,
                "precursor_start": None, "repaired_at": None,
            })
            continue
        starts = open_faults.get(key) or min(
            (v for k, v in open_faults.items() if k[0] == node and v), key=lambda v: rows[v[0]]["ts"], default=None)
        if not starts:
            if left_out is not None:
                left_out.append(f"{where}: fault_end at day {t:g} with no open fault of node {node}: left out")
            continue
        rows[starts.pop(0)]["repaired_at"] = ts
    for row in rows:
        row["ts"] = pd.Timestamp(row["ts"], tz="UTC")
        if row["repaired_at"] is not None:
            row["repaired_at"] = pd.Timestamp(row["repaired_at"], tz="UTC")
    return rows


# -- the history as arrays ------------------------------------------------------------------------
@dataclass
class FaultLog:
    """Incidents as arrays of days since `day0`, one entry per (incident, affected node)."""

    node: np.ndarray        # str
    start: np.ndarray       # float days
    end: np.ndarray         # float days; inf while the fault is open
    hardware: np.ndarray    # bool
    category: np.ndarray    # str
    day0: pd.Timestamp

    @classmethod
    def from_incidents(cls, incidents: pd.DataFrame, day0: pd.Timestamp | None = None) -> FaultLog:
        """From an `incidents` frame (read_table(...).to_pandas()): every affected node gets the fault."""
        if incidents is None or len(incidents) == 0:
            return cls(*(np.array([], dtype=d) for d in (object, float, float, bool, object)),
                       day0=day0 if day0 is not None else INFINITEHBD_DAY0)
        df = incidents.copy()
        df["affected"] = [list(a) if a is not None and len(a) else [n]
                          for a, n in zip(df["affected_nodes"] if "affected_nodes" in df else [None] * len(df),
                                          df["node"])]
        df = df.explode("affected")
        ts = pd.to_datetime(df["ts"], utc=True)
        if day0 is None:
            day0 = ts.min().floor("D")
        start = (ts - day0).dt.total_seconds().to_numpy() / 86_400
        rep = pd.to_datetime(df["repaired_at"], utc=True) if "repaired_at" in df else pd.Series(pd.NaT, index=df.index)
        end = ((rep - day0).dt.total_seconds().to_numpy() / 86_400)
        end = np.where(np.isnan(end), np.inf, np.maximum(end, start))
        cat = df["category"].fillna("unknown").astype(str).to_numpy()
        return cls(df["affected"].astype(str).to_numpy(), start, end,
                   np.isin(cat, list(HARDWARE_CATEGORIES)), cat, day0)

    def to_days(self, when) -> float:
        """A time as days since day0: a number is taken as days already, anything else as a timestamp."""
        if isinstance(when, (int, float, np.floating, np.integer)) and not isinstance(when, bool):
            return float(when)
        ts = pd.Timestamp(when)
        ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
        return (ts - self.day0).total_seconds() / 86_400

    def before(self, at: float) -> FaultLog:
        """Only what was known at `at`: faults started before it, with repairs after it not yet known."""
        keep = self.start < at
        end = np.where(self.end[keep] < at, self.end[keep], np.inf)
        return FaultLog(self.node[keep], self.start[keep], end, self.hardware[keep], self.category[keep], self.day0)


HALF_LIVES_DAYS = (7.0, 14.0, 30.0, 60.0, 90.0, 180.0, 365.0)
OTHER_KIND_WEIGHTS = (0.0, 0.25, 0.5, 1.0)


def decayed_counts(log: FaultLog, nodes: list[str], at: float, half_life_days: float) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the decayed counts of its hardware and its other faults started before `at`."""
    known = log.before(at)
    index = {n: i for i, n in enumerate(nodes)}
    rows = np.array([index.get(n, -1) for n in known.node], dtype=np.int64)
    ok = rows >= 0
    w = 0.5 ** ((at - known.start[ok]) / half_life_days)
    hw = known.hardware[ok]
    return (np.bincount(rows[ok], weights=w * hw, minlength=len(nodes)),
            np.bincount(rows[ok], weights=w * ~hw, minlength=len(nodes)))


def decayed_exposure(at: float, since: float, half_life_days: float) -> float:
    """Days of observation behind a decayed count: the integral of the decay over the observed span."""
    return half_life_days / np.log(2) * (1 - 0.5 ** (max(at - since, 0.0) / half_life_days))


def labelled_population(log: FaultLog, fleet_size: int, at: float, horizon_days: float,
                        hardware_only: bool = False) -> tuple[list[str], np.ndarray]:
    """The fleet at `at` with labels (1: a fault starting in (at, at + horizon]): the nodes seen before
    `at` by name, then those first seen later (zero history at `at`: they were among the unnamed nodes
    then), then anonymous never-failed nodes up to `fleet_size`."""
    seen = sorted(set(log.node[log.start < at]))
    later = sorted(set(log.node[log.start >= at]) - set(seen))
    named = seen + later
    nodes = named + [f"_unseen_{i}" for i in range(max(fleet_size - len(named), 0))]
    window = (log.start > at) & (log.start <= at + horizon_days)
    if hardware_only:
        window &= log.hardware
    hit = set(log.node[window])
    return nodes, np.array([n in hit for n in nodes], dtype=np.int8)


# -- the estimator --------------------------------------------------------------------------------
def _gamma_poisson_p(a: float, b: float, count: np.ndarray, exposure: float, horizon: float) -> np.ndarray:
    """P(>= 1 fault in `horizon` days) for a node whose rate has a Gamma(a, b) prior (b in days) and
    `count` faults over `exposure` days: the posterior is Gamma(a + count, b + exposure)."""
    return 1.0 - ((b + exposure) / (b + exposure + horizon)) ** (a + count)


class NodeHistoryModel:
    """P(a node faults within `horizon_days`) from its fault history: empirical-Bayes Gamma-Poisson.

    A node's fault rate has a Gamma(a, b) prior shared by the fleet; its evidence is its decayed fault
    count (recent faults weigh more; half-life h) over the decayed exposure, a hardware fault counting 1
    and any other fault w. The posterior gives P(>= 1 fault in the horizon), so a node with one fault is
    shrunk towards the fleet and a node with ten is not, and a node with no history gets the prior's
    probability.

    fit(log, at) learns a_, b_ (maximum likelihood) for each h in `half_lives` and w in `other_weights`
    and keeps the (h, w) of best likelihood (half_life_days_, other_weight_). Its training cut-offs run
    every `step_days` back from `at - horizon_days` (so every label window closes before `at`: nothing
    at or after `at` is read) to `min_history_days` after the first fault or `training_window_days`
    before `at`, whichever is later; each contributes the whole fleet of `fleet_size` nodes, the
    never-failed ones as zero-history rows. With no cut-off or no fault after one, the prior is the
    fleet's mean rate since the first fault.
    """

    def __init__(self, horizon_days: float = 30.0, fleet_size: int = INFINITEHBD_FLEET_SIZE, step_days: float = 7.0,
                 min_history_days: float = 28.0, training_window_days: float = 365.0,
                 half_lives: tuple[float, ...] = HALF_LIVES_DAYS,
                 other_weights: tuple[float, ...] = OTHER_KIND_WEIGHTS, hardware_only: bool = False):
        self.horizon_days = horizon_days
        self.fleet_size = fleet_size
        self.step_days = step_days
        self.min_history_days = min_history_days
        self.training_window_days = training_window_days
        self.half_lives = half_lives
        self.other_weights = other_weights
        self.hardware_only = hardware_only

    def _check(self) -> None:
        for name in ("horizon_days", "step_days", "training_window_days"):
            if not getattr(self, name) > 0:
                raise ValueError(f"NodeHistoryModel: {name} must be > 0, got {getattr(self, name)}")
        if int(self.fleet_size) < 1:
            raise ValueError(f"NodeHistoryModel: fleet_size must be >= 1, got {self.fleet_size}")
        if not self.half_lives or min(self.half_lives) <= 0:
            raise ValueError(f"NodeHistoryModel: half_lives must be positive, got {self.half_lives}")
        if not self.other_weights or min(self.other_weights) < 0:
            raise ValueError(f"NodeHistoryModel: other_weights must be >= 0, got {self.other_weights}")

    def fit(self, log: FaultLog, at: float) -> NodeHistoryModel:
        from scipy.optimize import minimize

        self._check()
        log = log.before(at)
        self.at_ = float(at)
        self.day0_ = log.day0
        self.first_fault_ = float(log.start.min()) if len(log.start) else float(at)
        last = at - self.horizon_days
        lo = max(self.first_fault_ + self.min_history_days, at - self.training_window_days)
        self.cutoffs_ = np.arange(last, lo - 1e-9, -self.step_days)[::-1] if last >= lo else np.array([])
        population = [labelled_population(log, self.fleet_size, t, self.horizon_days, self.hardware_only)
                      for t in self.cutoffs_]
        labels = np.concatenate([y for _, y in population]) if population else np.array([])
        self.n_training_rows_ = int(len(labels))
        self.base_rate_ = float(labels.mean()) if len(labels) else float("nan")
        # Until fitted (and when there is nothing to fit): a Gamma(1, b) prior at the fleet's mean rate.
        faults = int((log.hardware if self.hardware_only else np.ones(len(log.start), bool)).sum())
        days = max(at - self.first_fault_, self.horizon_days)
        self.a_, self.b_ = 1.0, float(self.fleet_size * days / max(faults, 1))
        self.half_life_days_, self.other_weight_ = float(self.half_lives[0]), 1.0
        self.log_loss_ = float("nan")
        if not len(labels) or labels.min() == labels.max():
            return self
        best = None
        for h in self.half_lives:
            exposure = np.concatenate([np.full(len(n), decayed_exposure(t, self.first_fault_, h))
                                       for t, (n, _) in zip(self.cutoffs_, population)])
            parts = [decayed_counts(log, n, t, h) for t, (n, _) in zip(self.cutoffs_, population)]
            for w in self.other_weights:
                count = np.concatenate([hw + w * other for hw, other in parts])

                def loss(theta, count=count, exposure=exposure):
                    p = np.clip(_gamma_poisson_p(np.exp(theta[0]), np.exp(theta[1]), count, exposure,
                                                 self.horizon_days), 1e-9, 1 - 1e-9)
                    return -np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p))

                res = minimize(loss, np.log([self.a_, self.b_]), method="Nelder-Mead",
                               options={"xatol": 1e-4, "fatol": 1e-7, "maxiter": 2000})
                if best is None or res.fun < best[0]:
                    best = (res.fun, h, w, res.x)
        self.log_loss_, self.half_life_days_, self.other_weight_ = float(best[0]), float(best[1]), float(best[2])
        self.a_, self.b_ = (float(v) for v in np.exp(best[3]))
        return self

    def predict_proba(self, log: FaultLog, nodes: list[str], at: float) -> np.ndarray:
        """P(fault within the horizon after `at`) per node, from the faults before `at` only."""
        hw, other = decayed_counts(log, nodes, at, self.half_life_days_)
        count = hw + self.other_weight_ * other
        exposure = decayed_exposure(at, self.first_fault_, self.half_life_days_)
        return _gamma_poisson_p(self.a_, self.b_, count, exposure, self.horizon_days)

    def default_proba(self, log: FaultLog, at: float) -> float:
        """The score of a node with no fault before `at`."""
        return float(self.predict_proba(log, ["_never_failed"], at)[0])


# -- the published baselines ------------------------------------------------------------------------
def count_score(log: FaultLog, nodes: list[str], at: float, window_days: float = 90.0,
                hardware_only: bool = False) -> np.ndarray:
    """The node's fault count in the `window_days` before `at` (the InfiniteHBD README's baseline)."""
    known = log.before(at)
    keep = known.start >= at - window_days
    if hardware_only:
        keep &= known.hardware
    counts = pd.Series(known.node[keep]).value_counts()
    return np.array([counts.get(n, 0) for n in nodes], dtype=float)


def decayed_count_score(log: FaultLog, nodes: list[str], at: float, half_life_days: float = 30.0,
                        hardware_only: bool = False) -> np.ndarray:
    """Exponentially decayed fault count before `at`."""
    known = log.before(at)
    keep = known.hardware if hardware_only else np.ones(len(known.start), bool)
    w = pd.Series(0.5 ** ((at - known.start[keep]) / half_life_days)).groupby(known.node[keep]).sum()
    return np.array([w.get(n, 0.0) for n in nodes], dtype=float)


def top_lift(scores: np.ndarray, labels: np.ndarray, fraction: float = 0.05) -> float:
    """Fault rate of the top `fraction` of nodes by score over the base rate; ties at the boundary are
    taken in proportion (the expectation over a random order of tied nodes)."""
    labels = np.asarray(labels, dtype=float)
    base = labels.mean()
    if base == 0:
        return float("nan")
    k = fraction * len(scores)
    frame = pd.DataFrame({"s": scores, "y": labels}).groupby("s", sort=True)["y"].agg(["sum", "count"])[::-1]
    taken, hits = 0.0, 0.0
    for total, count in zip(frame["sum"], frame["count"]):
        share = min(count, k - taken)
        hits += total * share / count
        taken += share
        if taken >= k:
            break
    return float(hits / k / base)


# -- repair and failure figures ---------------------------------------------------------------------
def fault_statistics(log: FaultLog, fleet_size: int, span_days: float) -> dict:
    """Repair time and time between failures from a fault log (docs/goodput.md cites these).

    Repair time: fault start to its repair, closed faults only. Time between failures: the fleet's
    node-hours per fault (the MTBF of one node) and, for nodes that faulted again, the gap between
    consecutive fault starts.
    """
    closed = np.isfinite(log.end)
    repair_h = (log.end[closed] - log.start[closed]) * 24
    gaps = []
    for node in np.unique(log.node):
        starts = np.sort(log.start[log.node == node])
        gaps.extend(np.diff(starts))
    gaps = np.asarray(gaps)
    hw_repair_h = (log.end[closed & log.hardware] - log.start[closed & log.hardware]) * 24
    other_repair_h = (log.end[closed & ~log.hardware] - log.start[closed & ~log.hardware]) * 24
    counts = pd.Series(log.node).value_counts().to_numpy()
    counts = np.sort(np.concatenate([counts, np.zeros(max(fleet_size - len(counts), 0))]))[::-1]
    worst = max(int(round(0.1 * fleet_size)), 1)
    return {
        "faults": int(len(log.start)),
        "nodes_with_faults": int(len(np.unique(log.node))),
        "fleet_size": int(fleet_size),
        "span_days": float(span_days),
        "faults_per_1000_node_days": float(len(log.start) / (fleet_size * span_days) * 1000),
        "fleet_mtbf_hours_per_node": float(fleet_size * span_days * 24 / max(len(log.start), 1)),
        "repairs_closed": int(closed.sum()),
        "repair_hours_median": float(np.median(repair_h)) if len(repair_h) else float("nan"),
        "repair_hours_p90": float(np.percentile(repair_h, 90)) if len(repair_h) else float("nan"),
        "repair_hours_median_hardware": float(np.median(hw_repair_h)) if len(hw_repair_h) else float("nan"),
        "repair_hours_median_other": float(np.median(other_repair_h)) if len(other_repair_h) else float("nan"),
        "repeat_fault_gap_days_median": float(np.median(gaps)) if len(gaps) else float("nan"),
        "repeat_fault_gap_days_p10": float(np.percentile(gaps, 10)) if len(gaps) else float("nan"),
        "worst_10pct_nodes_fault_share": float(counts[:worst].sum() / max(counts.sum(), 1)),
        "hardware_share": float(log.hardware.mean()) if len(log.hardware) else float("nan"),
    }


# -- the dataset directory ---------------------------------------------------------------------------
def write_metadata(root: str | Path, *, fleet_size: int, day0: pd.Timestamp, source: str, fmt: str) -> None:
    meta = {"fleet_size": int(fleet_size), "day0": day0.isoformat(), "source": source, "format": fmt}
    (Path(root) / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def load(root: str | Path) -> tuple[FaultLog, int]:
    """A dataset's fault log and fleet size (METADATA_FILE, else the nodes of `inventory` and
    `incidents` together). `root`: a directory or a URI, read through its filesystem (dataset.DatasetRoot)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    from foreshock import dataset

    try:
        root = dataset.open_dataset_root(root)
    except dataset.DatasetError as exc:
        raise HistoryError(str(exc)) from None
    if not dataset.partition_files(root, "incidents"):
        raise HistoryError(f"{root}: no incidents table (foreshock history import, or a fleet's own records)")
    incidents = dataset.read_table(root, "incidents").to_pandas()
    meta_path = root.join(METADATA_FILE)
    meta = {}
    if root.fs.get_file_info(meta_path).type == pafs.FileType.File:
        try:
            with root.fs.open_input_stream(meta_path) as fh:
                meta = json.loads(fh.read().decode())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, pa.ArrowException) as exc:
            raise HistoryError(f"{root.show(meta_path)}: not JSON: {exc}") from None
    day0 = pd.Timestamp(meta["day0"]) if "day0" in meta else None
    log = FaultLog.from_incidents(incidents, day0)
    fleet = meta.get("fleet_size")
    if fleet is None:
        inventory = dataset.read_table(root, "inventory", columns=["node"]).column("node").to_pylist()
        fleet = len(set(inventory) | set(log.node))
    if fleet < len(set(log.node)):
        raise HistoryError(f"{root}: fleet size {fleet} is smaller than the {len(set(log.node))} nodes with faults")
    return log, int(fleet)


def score_dataset(root: str | Path, at=None, *, horizon_days: float = 30.0,
                  hardware_only: bool = False) -> tuple[dict[str, float], float, NodeHistoryModel, float]:
    """Fit on a dataset directory's incidents before `at` (days since its day 0, or a timestamp; None:
    now) and score its nodes: ({node: P}, P for a node with no history, the fitted model, `at` in days)."""
    log, fleet = load(root)
    at_days = log.to_days(pd.Timestamp.now(tz="UTC") if at is None else at)
    model = NodeHistoryModel(horizon_days=horizon_days, fleet_size=fleet, hardware_only=hardware_only).fit(log, at_days)
    nodes = sorted(set(log.node[log.start < at_days]))
    scores = {n: float(p) for n, p in zip(nodes, model.predict_proba(log, nodes, at_days))}
    return scores, model.default_proba(log, at_days), model, at_days
