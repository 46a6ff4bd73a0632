"""Goodput model: GPU-hours and dollars a training job loses to failures under three recovery strategies.

Reads a cluster/job description (flags or the `[goodput]` table of the TOML config, via
foreshock.config.resolve) and, optionally, a predictor evaluation report (the JSON written by
`foreshock evaluate --json`). Computes, per month, interruptions, GPU-hours lost, dollars lost and the
goodput expense (share of paid GPU-hours that do no useful work) for checkpoint restart, checkpointless
(hot-spare) restart and proactive evacuation with Foreshock. The per-interruption cost is the published
form (t_id + t_failover) * j_size + t_repair * b_radius (Clockwork / SemiAnalysis); the number of
interruptions comes from renewal theory over the job's running time. docs/goodput.md derives every term,
states every default and cites ../shared/reference/failure-figures.md.
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from foreshock.config import ConfigError, resolve

HOURS_PER_MONTH = 730.0  # 365 * 24 / 12: the average calendar month
GPUS_PER_NODE_DEFAULT = 8
SPARE_SHORTFALL_TARGET = 0.01  # auto spare pool: at most 1% of failures find no hot spare ready

# Llama 3 pre-training, unexpected interruptions by root cause (The Llama 3 Herd of Models, 2024, s. 3.3):
# (count, has a precursor visible in fabric/GPU telemetry before the job dies). A category counts as
# having a precursor only where the signals Foreshock reads typically degrade first (correctable ECC /
# row remaps before HBM and SRAM faults, symbol errors and link flaps before switch, cable and NIC
# failures, temperature drift before thermal-interface faults); the rest are treated as unpredictable.
# The third field says how a reactive strategy learns of the fault (docs/goodput.md, "Time to identify"):
# True = the job *hangs* (a fabric fault stalls the collectives: NCCL waits for its peers until the
# watchdog fires), False = it *crashes* (the process dies or raises, and its launcher sees it at once).
LLAMA3_MIX: dict[str, tuple[int, bool, bool]] = {
    "faulty_gpu": (148, False, False),
    "gpu_hbm3_memory": (72, True, False),
    "software_bug": (54, False, False),
    "network_switch_cable": (35, True, True),
    "host_maintenance": (32, False, False),
    "gpu_sram": (19, True, False),
    "gpu_system_processor": (17, False, False),
    "nic": (7, True, True),
    "nccl_watchdog_timeout": (7, False, True),
    "silent_data_corruption": (6, False, False),
    "gpu_thermal_interface_sensor": (6, True, False),
    "ssd": (3, False, False),
    "power_supply": (3, False, False),
    "server_chassis": (2, False, False),
    "io_expansion_board": (2, False, False),
    "dependency": (2, False, False),
    "cpu": (2, False, False),
    "system_memory": (2, False, False),
}
# Reactive identification of a hang: PyTorch's NCCL heartbeat monitor, TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
# 480 s (the ProcessGroupNCCL collective timeout is 10 min); Minder (NSDI 2025) detects in 3.6 s on
# average (failure-figures.md, "Recovery and timeouts" and "Detection and prediction results to beat").
HANG_DETECT_MINUTES_WATCHDOG = 8.0
# Failover at scale (failure-figures.md, "Recovery and timeouts"): a hot-spare / live-migration restart
# takes under 2 min on small jobs (AWS HyperPod; TorchPass on 64 H200), and at 5,184 GPUs re-initialising
# the job takes 10-15 min of whole-cluster time. Between and beyond those two points the
# re-initialisation is taken to grow as a power of the job size through (64 GPUs, 2 min) and
# (5,184 GPUs, 12.5 min): an assumption, two published points and no curve.
REINIT_SMALL_GPUS, REINIT_LARGE_GPUS, REINIT_LARGE_MINUTES = 64, 5184, 12.5
# 419 unexpected interruptions over 2,048 nodes x 54 days.
LLAMA3_FAILURES_PER_1000_NODE_DAYS = 419 / (2048 * 54) * 1000

# Used when no --eval-report is given; grounded in failure-figures.md (Desh: recall >= 85%, lead time
# about 3 min; Minder: precision 0.904). The false-evacuation rate is then derived from that precision:
# false = flagged-in-time * (1 - p) / p. See docs/goodput.md.
DEFAULT_EVAL = {
    "incident_recall_precursor": 0.85,
    "incident_recall_all": None,
    "median_lead_minutes": 3.0,
    "false_evacuations_per_1000_node_days": None,
}
DEFAULT_PRECISION = 0.904

STRATEGIES = ("checkpoint_restart", "checkpointless", "foreshock")
FALLBACKS = ("checkpointless", "checkpoint_restart")
RECALL_BASES = ("precursor_mix", "all")

# Every setting: key -> default. None means "derived" (see docs/goodput.md).
DEFAULTS: dict[str, Any] = {
    "gpus": 1024,
    "gpus_per_node": GPUS_PER_NODE_DEFAULT,
    "usd_per_gpu_hour": 3.0,
    "mttf_hours": None,
    "failures_per_1000_node_days": None,
    "mix": None,
    "blast_radius_gpus": None,
    "identify_minutes": None,
    "hang_detect_minutes": HANG_DETECT_MINUTES_WATCHDOG,
    "reinit_minutes_at_5184": REINIT_LARGE_MINUTES,
    "evacuation_reinit_share": 1.0,
    "checkpoint_interval_hours": 1.5,
    "restart_minutes": 15.0,
    "replace_minutes": 10.0,
    "hot_spare_restart_minutes": 2.0,
    "spare_nodes": None,
    "migration_seconds": 60.0,
    "eval_report": "",
    "eval_model": "",
    "recall_basis": "precursor_mix",
    "foreshock_fallback": "checkpointless",
    "hours_per_month": HOURS_PER_MONTH,
}


class GoodputError(ConfigError):
    """A goodput input that cannot be used; the message names the flag (and TOML key)."""


def _flag(key: str) -> str:
    return f"--{key.replace('_', '-')} ([goodput] {key})"


@dataclass(frozen=True)
class Prediction:
    """What the predictor evaluation says, reduced to what the model needs."""

    incident_recall_precursor: float
    incident_recall_all: float | None
    median_lead_minutes: float | None
    false_evacuations_per_1000_node_days: float | None  # None: derived from DEFAULT_PRECISION
    source: str = "defaults"
    model: str = ""


@dataclass(frozen=True)
class Scenario:
    gpus: int
    gpus_per_node: int
    usd_per_gpu_hour: float
    mttf_hours: float
    failures_per_1000_node_days: float
    mttf_source: str
    precursor_share: float
    blast_radius_gpus: int
    identify_hours: float            # mean time to identify a failure reactively (over the mix)
    checkpoint_interval_hours: float
    restart_hours: float
    replace_hours: float
    hot_spare_restart_hours: float
    spare_nodes: int | None
    migration_hours: float
    recall_basis: str
    foreshock_fallback: str
    hours_per_month: float
    prediction: Prediction
    mix: dict[str, tuple[int, bool, bool]] = field(default_factory=dict)
    identify_source: str = "given"
    hang_detect_hours: float = HANG_DETECT_MINUTES_WATCHDOG / 60
    reinit_large_hours: float = REINIT_LARGE_MINUTES / 60
    evacuation_reinit_share: float = 1.0

    @property
    def nodes(self) -> float:
        return self.gpus / self.gpus_per_node

    @property
    def hang_share(self) -> float:
        total = sum(c for c, _p, _h in self.mix.values())
        return sum(c for c, _p, h in self.mix.values() if h) / total if total else 0.0

    def reinit_growth_hours(self) -> float:
        """How much longer than at small scale a restart onto a spare (or a planned world change)
        takes at this job size: 0 up to 64 GPUs, 12.5 - 2 min at 5,184 (REINIT_*)."""
        small = self.hot_spare_restart_hours
        if self.gpus <= REINIT_SMALL_GPUS or small <= 0:
            return 0.0
        exponent = math.log(self.reinit_large_hours / small) / math.log(REINIT_LARGE_GPUS / REINIT_SMALL_GPUS)
        return max(small * (self.gpus / REINIT_SMALL_GPUS) ** exponent - small, 0.0)

    def evacuation_hours(self) -> float:
        """The whole job's pause for one evacuation: the measured migration plus the share
        `evacuation_reinit_share` of a restart's growth with job size (1, the default, is conservative:
        the new world is built as a restart builds it; 0: it was built while the job trained)."""
        return self.migration_hours + self.evacuation_reinit_share * self.reinit_growth_hours()


# ---------------------------------------------------------------------------------------------------
# inputs


def _number(cfg: Mapping[str, Any], key: str, *, integer: bool = False, positive: bool = False,
            minimum: float | None = None, maximum: float | None = None) -> Any:
    raw = cfg[key]
    try:
        if isinstance(raw, bool):
            raise ValueError
        value = int(raw) if integer and float(raw) == int(float(raw)) else float(raw)
        if integer and not isinstance(value, int):
            raise ValueError
    except (TypeError, ValueError):
        kind = "an integer" if integer else "a number"
        raise GoodputError(f"{_flag(key)}: expected {kind}, got {raw!r}") from None
    if not math.isfinite(value):
        raise GoodputError(f"{_flag(key)}: must be finite, got {raw!r}")
    if positive and value <= 0:
        raise GoodputError(f"{_flag(key)}: must be greater than 0, got {raw!r}")
    if minimum is not None and value < minimum:
        raise GoodputError(f"{_flag(key)}: must be at least {minimum:g}, got {raw!r}")
    if maximum is not None and value > maximum:
        raise GoodputError(f"{_flag(key)}: must be at most {maximum:g}, got {raw!r}")
    return value


def _mix(raw: Any) -> dict[str, tuple[int, bool, bool]]:
    """A category mix from TOML: {category = {count = N, precursor = bool, hang = bool}}; None means
    Llama 3. `hang` (default false): the fault stalls the job until a watchdog fires, not a crash."""
    if raw is None:
        return dict(LLAMA3_MIX)
    if not isinstance(raw, Mapping) or not raw:
        raise GoodputError(f"{_flag('mix')}: expected a table of categories, got {raw!r}")
    mix = {}
    for name, entry in raw.items():
        if not isinstance(entry, Mapping) or "count" not in entry:
            raise GoodputError(f"{_flag('mix')}: category {name!r} needs count = N and precursor = true|false")
        count, precursor, hang = entry["count"], entry.get("precursor", False), entry.get("hang", False)
        if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
            raise GoodputError(f"{_flag('mix')}: category {name!r} count must be >= 0, got {count!r}")
        if not isinstance(precursor, bool):
            raise GoodputError(f"{_flag('mix')}: category {name!r} precursor must be true or false")
        if not isinstance(hang, bool):
            raise GoodputError(f"{_flag('mix')}: category {name!r} hang must be true or false")
        mix[str(name)] = (count, precursor, hang)
    if sum(c for c, _p, _h in mix.values()) <= 0:
        raise GoodputError(f"{_flag('mix')}: the counts add up to 0")
    return mix


def _report_entry(data: Any, model: str, path: str) -> tuple[str, Mapping[str, Any]]:
    """The per-model metrics in an evaluation report: the top level, or a table of models."""
    key = "incident_recall_precursor"
    if isinstance(data, Mapping) and key in data:
        return "", data
    candidates: dict[str, Mapping[str, Any]] = {}
    if isinstance(data, Mapping):
        tables = [data] + [v for v in data.values() if isinstance(v, Mapping)]
        for table in tables:
            for name, value in table.items():
                # a report may also hold a table of definitions under the same keys: only numbers count
                if isinstance(value, Mapping) and isinstance(value.get(key), (int, float)):
                    candidates.setdefault(str(name), value)
    if not candidates:
        raise GoodputError(f"{_flag('eval_report')}: {path} has no model with {key}")
    if model:
        if model not in candidates:
            raise GoodputError(f"{_flag('eval_model')}: {model!r} is not in {path} "
                               f"(models: {', '.join(sorted(candidates))})")
        return model, candidates[model]
    name = "model" if "model" in candidates else next(iter(candidates))
    return name, candidates[name]


def _probability(value: Any, key: str, path: str, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise GoodputError(f"{_flag('eval_report')}: {path}: {key} must be a number in [0, 1], got {value!r}")
    return float(value)


def load_prediction(path: str, model: str = "") -> Prediction:
    """Read `foreshock evaluate --json` output; an empty path gives the documented defaults."""
    if not path:
        return Prediction(**DEFAULT_EVAL, source="defaults")
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GoodputError(f"{_flag('eval_report')}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GoodputError(f"{_flag('eval_report')}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise GoodputError(f"{_flag('eval_report')}: {path} is not valid JSON: {exc}") from None
    name, entry = _report_entry(data, model, path)
    recall_p = _probability(entry.get("incident_recall_precursor"), "incident_recall_precursor", path)
    recall_all = _probability(entry.get("incident_recall_all"), "incident_recall_all", path, optional=True)
    lead = entry.get("median_lead_minutes")
    if lead is not None and (isinstance(lead, bool) or not isinstance(lead, (int, float)) or lead < 0):
        raise GoodputError(f"{_flag('eval_report')}: {path}: median_lead_minutes must be >= 0 or null, got {lead!r}")
    fe = entry.get("false_evacuations_per_1000_node_days")
    if isinstance(fe, bool) or not isinstance(fe, (int, float)) or fe < 0 or not math.isfinite(fe):
        raise GoodputError(f"{_flag('eval_report')}: {path}: false_evacuations_per_1000_node_days "
                           f"must be a number >= 0, got {fe!r}")
    return Prediction(recall_p, recall_all, None if lead is None else float(lead), float(fe),
                      source=str(path), model=name)


def build_scenario(cfg: Mapping[str, Any]) -> Scenario:
    """Validate resolved settings and derive the MTTF, blast radius and precursor share."""
    gpus = _number(cfg, "gpus", integer=True, positive=True)
    per_node = _number(cfg, "gpus_per_node", integer=True, positive=True)
    mix = _mix(cfg["mix"])
    total = sum(c for c, _p, _h in mix.values())
    precursor_share = sum(c for c, p, _h in mix.values() if p) / total
    hang_share = sum(c for c, _p, h in mix.values() if h) / total
    hang_detect = _number(cfg, "hang_detect_minutes", minimum=0, maximum=24 * 60) / 60
    if cfg["identify_minutes"] is None:
        # Crashes are in the published restart times (fault to running); hangs wait for detection first.
        identify = hang_share * hang_detect
        identify_source = (f"{hang_share:.1%} of failures hang until detected after "
                           f"{hang_detect * 60:g} min; crashes are seen at once")
    else:
        identify = _number(cfg, "identify_minutes", minimum=0) / 60
        identify_source = "given"
    nodes = gpus / per_node
    if cfg["failures_per_1000_node_days"] is not None:
        rate = _number(cfg, "failures_per_1000_node_days", positive=True)
        rate_source = "flag"
    else:
        rate, rate_source = LLAMA3_FAILURES_PER_1000_NODE_DAYS, "llama3"
    if cfg["mttf_hours"] is not None:
        mttf = _number(cfg, "mttf_hours", positive=True)
        source = "given"
        # The per-node rate this MTTF implies, so that the job-size sweep scales from the given point.
        rate = 1000 * 24 / (mttf * nodes)
    else:
        mttf = 1000 * 24 / (rate * nodes)
        source = f"derived from {rate:.3g} failures per 1,000 node-days ({rate_source})"
    blast = per_node if cfg["blast_radius_gpus"] is None else _number(cfg, "blast_radius_gpus",
                                                                        integer=True, minimum=0)
    spare = None if cfg["spare_nodes"] is None else _number(cfg, "spare_nodes", integer=True, minimum=0)
    if cfg["recall_basis"] not in RECALL_BASES:
        raise GoodputError(f"{_flag('recall_basis')}: expected one of {', '.join(RECALL_BASES)}, "
                           f"got {cfg['recall_basis']!r}")
    if cfg["foreshock_fallback"] not in FALLBACKS:
        raise GoodputError(f"{_flag('foreshock_fallback')}: expected one of {', '.join(FALLBACKS)}, "
                           f"got {cfg['foreshock_fallback']!r}")
    prediction = load_prediction(str(cfg["eval_report"] or ""), str(cfg["eval_model"] or ""))
    if cfg["recall_basis"] == "all" and prediction.incident_recall_all is None:
        raise GoodputError(f"{_flag('recall_basis')}: 'all' needs incident_recall_all in the evaluation report")
    return Scenario(
        gpus=gpus, gpus_per_node=per_node,
        usd_per_gpu_hour=_number(cfg, "usd_per_gpu_hour", minimum=0),
        mttf_hours=mttf, failures_per_1000_node_days=rate, mttf_source=source,
        precursor_share=precursor_share, blast_radius_gpus=blast,
        identify_hours=identify, identify_source=identify_source, hang_detect_hours=hang_detect,
        reinit_large_hours=_number(cfg, "reinit_minutes_at_5184", positive=True, maximum=24 * 60) / 60,
        evacuation_reinit_share=_number(cfg, "evacuation_reinit_share", minimum=0, maximum=1),
        checkpoint_interval_hours=_number(cfg, "checkpoint_interval_hours", positive=True),
        restart_hours=_number(cfg, "restart_minutes", minimum=0) / 60,
        replace_hours=_number(cfg, "replace_minutes", minimum=0) / 60,
        hot_spare_restart_hours=_number(cfg, "hot_spare_restart_minutes", minimum=0) / 60,
        spare_nodes=spare,
        migration_hours=_number(cfg, "migration_seconds", minimum=0) / 3600,
        recall_basis=cfg["recall_basis"], foreshock_fallback=cfg["foreshock_fallback"],
        hours_per_month=_number(cfg, "hours_per_month", positive=True),
        prediction=prediction, mix=mix,
    )


def scenario_from(settings: Mapping[str, Any] | None = None) -> Scenario:
    """A scenario from a partial settings mapping (the rest are DEFAULTS); for library callers."""
    cfg = dict(DEFAULTS)
    for key, value in (settings or {}).items():
        if key not in DEFAULTS:
            raise GoodputError(f"{key}: unknown goodput setting (known: {', '.join(sorted(DEFAULTS))})")
        cfg[key] = value
    return build_scenario(cfg)


# ---------------------------------------------------------------------------------------------------
# the model


def lost_progress_hours(mttf: float, interval: float) -> float:
    """Mean work lost at a failure since the last checkpoint: E[T | T < tau], T ~ Exp(1/mttf).

    Tends to interval/2 when failures are rare against the interval, and to the MTTF when they are not.
    """
    x = interval / mttf
    if x < 1e-9:
        return interval / 2
    return mttf - interval / math.expm1(x)


def _poisson_sf(mean: float, k: int) -> float:
    """P(N >= k) for N ~ Poisson(mean)."""
    if k <= 0:
        return 1.0
    term, cdf = math.exp(-mean), 0.0
    for i in range(k):
        cdf += term
        term *= mean / (i + 1)
    return max(0.0, 1.0 - cdf)


def spare_shortfall(spares: int, arrivals_per_hour: float, refill_hours: float) -> float:
    """Probability that a failure finds no hot spare: S or more spares still awaiting their refill.

    Spares in use are an M/G/infinity queue (arrivals = failures and false evacuations, service = the
    replacement time), so their number is Poisson with mean arrivals * refill time.
    """
    return _poisson_sf(arrivals_per_hour * refill_hours, spares)


def auto_spares(arrivals_per_hour: float, refill_hours: float) -> int:
    spares = 1
    while spare_shortfall(spares, arrivals_per_hour, refill_hours) > SPARE_SHORTFALL_TARGET and spares < 10_000:
        spares += 1
    return spares


@dataclass(frozen=True)
class Outcome:
    """One way an interruption plays out: its probability, the time the job is down (not running, so
    not exposed to failures) and the time the job's GPUs do no useful work (down time + lost progress)."""

    name: str
    probability: float
    down_hours: float
    idle_hours: float


def effective_recall(s: Scenario) -> float:
    """Share of the cluster's failures the predictor flags: recall on precursor incidents times the
    precursor share of the category mix (unpredictable categories count as missed), or the report's
    incident_recall_all taken as is."""
    if s.recall_basis == "all":
        return float(s.prediction.incident_recall_all)
    return s.prediction.incident_recall_precursor * s.precursor_share


def lead_sufficient(s: Scenario) -> float:
    """Share of flagged failures whose warning comes early enough to migrate: lead times taken as
    exponential with the report's median, so P(lead >= migration) = 2 ** (-migration / median)."""
    median = s.prediction.median_lead_minutes
    if median is None or median <= 0:
        return 0.0
    return 2.0 ** (-(s.migration_hours * 60) / median)


def _restart_outcomes(s: Scenario, kind: str, shortfall: float) -> list[Outcome]:
    growth = s.reinit_growth_hours()   # re-initialising a bigger job takes longer, cold or hot
    if kind == "checkpoint_restart":
        # Cold: the job waits for a replacement node, restarts from the checkpoint and recomputes.
        # The published 15 min already hold a mid-sized job's re-initialisation; only a re-initialisation
        # longer than the whole restart lengthens it.
        restart = max(s.restart_hours, s.hot_spare_restart_hours + growth)
        down = s.identify_hours + s.replace_hours + restart
        lost = lost_progress_hours(s.mttf_hours, s.checkpoint_interval_hours)
        return [Outcome("checkpoint_restart", 1.0, down, down + lost)]
    ready = s.identify_hours + s.hot_spare_restart_hours + growth
    waiting = ready + s.replace_hours
    return [Outcome("hot_spare", 1.0 - shortfall, ready, ready),
            Outcome("hot_spare_wait_replacement", shortfall, waiting, waiting)]


def _account(s: Scenario, name: str, outcomes: list[Outcome], spares: int,
             false_per_running_hour: float = 0.0, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    H, j = s.hours_per_month, s.gpus
    down = sum(o.probability * o.down_hours for o in outcomes)
    idle = sum(o.probability * o.idle_hours for o in outcomes)
    # Renewal: a cycle is MTTF of running, the false evacuations' pauses during it, then the mean down
    # time of the failure that ends it (at scale a pause is minutes, not seconds: it takes running time).
    pause = s.evacuation_hours()
    interruptions = H / (s.mttf_hours * (1.0 + false_per_running_hour * pause) + down)
    false_evacuations_per_month = false_per_running_hour * s.mttf_hours * interruptions
    per_interruption = idle * j + s.replace_hours * s.blast_radius_gpus
    failure_gpu_hours = interruptions * per_interruption
    false_evac_cost = pause * j + s.replace_hours * s.blast_radius_gpus
    false_gpu_hours = false_evacuations_per_month * false_evac_cost
    spare_gpu_hours = spares * s.gpus_per_node * H
    lost = failure_gpu_hours + false_gpu_hours + spare_gpu_hours
    paid = (j + spares * s.gpus_per_node) * H
    result = {
        "interruptions_per_month": interruptions,
        "gpu_hours_per_interruption": per_interruption,
        "usd_per_interruption": per_interruption * s.usd_per_gpu_hour,
        "failure_gpu_hours_per_month": failure_gpu_hours,
        "false_evacuations_per_month": false_evacuations_per_month,
        "false_evacuation_gpu_hours_per_month": false_gpu_hours,
        "spare_nodes": spares,
        "spare_gpu_hours_per_month": spare_gpu_hours,
        "gpu_hours_lost_per_month": lost,
        "usd_per_month": lost * s.usd_per_gpu_hour,
        "paid_gpu_hours_per_month": paid,
        "goodput_expense": lost / paid,
        "outcomes": {o.name: {"probability": o.probability, "down_hours": o.down_hours,
                              "idle_hours": o.idle_hours} for o in outcomes if o.probability > 0},
    }
    result.update(extra or {})
    return result


def evaluate(s: Scenario) -> dict[str, Any]:
    """The monthly account of every strategy for one scenario (the JSON of `foreshock goodput`)."""
    failures_per_hour = 1.0 / s.mttf_hours
    recall = effective_recall(s)
    in_time = lead_sufficient(s)
    if s.prediction.false_evacuations_per_1000_node_days is None:
        false_per_hour = failures_per_hour * recall * in_time * (1 - DEFAULT_PRECISION) / DEFAULT_PRECISION
    else:
        false_per_hour = s.prediction.false_evacuations_per_1000_node_days * s.nodes / 1000 / 24
    # Spares are drawn by failures (and, with Foreshock, false evacuations) and refilled after the
    # replacement time; both spare-using strategies share one pool size so they are compared fairly.
    spares = s.spare_nodes
    if spares is None:
        spares = auto_spares(failures_per_hour + false_per_hour, s.replace_hours)
    short_hot = spare_shortfall(spares, failures_per_hour, s.replace_hours)
    short_fs = spare_shortfall(spares, failures_per_hour + false_per_hour, s.replace_hours)

    strategies = {
        "checkpoint_restart": _account(s, "checkpoint_restart", _restart_outcomes(s, "checkpoint_restart", 1.0), 0),
        "checkpointless": _account(s, "checkpointless", _restart_outcomes(s, "checkpointless", short_hot), spares),
    }
    # An evacuation needs a warning early enough and a spare to move to; anything else is a miss.
    hit = recall * in_time * (1.0 - short_fs)
    fallback = _restart_outcomes(s, s.foreshock_fallback, short_fs)
    pause = s.evacuation_hours()
    outcomes = [Outcome("evacuated", hit, pause, pause)]
    outcomes += [Outcome(f"missed_{o.name}", (1.0 - hit) * o.probability, o.down_hours, o.idle_hours)
                 for o in fallback]
    strategies["foreshock"] = _account(
        s, "foreshock", outcomes, spares,
        false_per_running_hour=false_per_hour,
        extra={"fallback": s.foreshock_fallback, "effective_recall": recall,
               "lead_sufficient_share": in_time, "evacuated_share": hit,
               "false_evacuations_per_1000_node_days": false_per_hour * 24 * 1000 / s.nodes})
    base = strategies["checkpoint_restart"]
    for acct in strategies.values():
        acct["usd_saved_vs_checkpoint_restart_per_month"] = base["usd_per_month"] - acct["usd_per_month"]
    inputs = asdict(s)
    inputs["mix"] = {k: {"count": c, "precursor": p, "hang": h} for k, (c, p, h) in s.mix.items()}
    inputs["nodes"] = s.nodes
    inputs["hang_share"] = s.hang_share
    inputs["reinit_growth_hours"] = s.reinit_growth_hours()
    inputs["evacuation_hours"] = s.evacuation_hours()
    return {"inputs": inputs, "strategies": strategies, **{k: strategies[k] for k in STRATEGIES}}


# ---------------------------------------------------------------------------------------------------
# job-size sweep and plot


def sweep(s: Scenario, sizes: list[int] | None = None) -> dict[str, list[float]]:
    """Goodput expense per strategy against job size at the scenario's per-node failure rate."""
    if sizes is None:
        sizes = [int(round(10 ** (3 + 2 * i / 20))) for i in range(21)]  # 1k .. 100k, log-spaced
    out: dict[str, list[float]] = {"gpus": [float(n) for n in sizes], **{k: [] for k in STRATEGIES}}
    for n in sizes:
        nodes = n / s.gpus_per_node
        sized = Scenario(**{**asdict(s), "prediction": s.prediction, "mix": s.mix, "gpus": n,
                            "mttf_hours": 1000 * 24 / (s.failures_per_1000_node_days * nodes),
                            "spare_nodes": s.spare_nodes})
        result = evaluate(sized)
        for k in STRATEGIES:
            out[k].append(result[k]["goodput_expense"])
    return out


_LABELS = {"checkpoint_restart": "checkpoint restart", "checkpointless": "checkpointless / hot spare",
           "foreshock": "Foreshock evacuation"}


def plot_figure(s: Scenario, sizes: list[int] | None = None):
    """A matplotlib Figure of goodput expense against job size (Agg; nothing is shown)."""
    from matplotlib.figure import Figure  # the object API needs no pyplot state or display

    data = sweep(s, sizes)
    fig = Figure(figsize=(7, 4.2), dpi=100)
    ax = fig.add_subplot()
    for k in STRATEGIES:
        label = _LABELS[k] + (f" ({s.foreshock_fallback} on a miss)" if k == "foreshock" else "")
        ax.plot(data["gpus"], [100 * v for v in data[k]], marker="o", markersize=3, label=label)
    # The same evacuations with the other fallback, so both comparisons the docs make are visible.
    other = next(f for f in FALLBACKS if f != s.foreshock_fallback)
    alt = sweep(Scenario(**{**asdict(s), "prediction": s.prediction, "mix": s.mix,
                            "foreshock_fallback": other}), sizes)
    ax.plot(alt["gpus"], [100 * v for v in alt["foreshock"]], linestyle="--", marker="o", markersize=3,
            label=f"{_LABELS['foreshock']} ({other} on a miss)")
    ax.set_xscale("log")
    ax.set_yscale("log")  # the strategies differ by orders of magnitude
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput expense (% of paid GPU-hours)")
    ax.set_title(f"{s.failures_per_1000_node_days:.3g} failures per 1,000 node-days, "
                 f"checkpoint every {s.checkpoint_interval_hours:g} h")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return fig


def plot_png(s: Scenario, sizes: list[int] | None = None) -> bytes:
    """The job-size plot as PNG bytes, for embedding in an HTML report."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plot_figure(s, sizes)
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------
# command


def format_table(result: Mapping[str, Any]) -> str:
    inp = result["inputs"]
    lines = [
        f"job: {inp['gpus']} GPUs ({inp['nodes']:g} nodes), ${inp['usd_per_gpu_hour']:g}/GPU-h, "
        f"MTTF {inp['mttf_hours']:.3g} h ({inp['mttf_source']}), month = {inp['hours_per_month']:g} h",
        f"identifying a failure: {inp['identify_hours'] * 60:.2g} min on average ({inp['identify_source']}); "
        f"a restart's re-initialisation {inp['reinit_growth_hours'] * 60:.2g} min longer than at 64 GPUs; "
        f"an evacuation pauses the job {inp['evacuation_hours'] * 60:.2g} min",
        f"predictor: {inp['prediction']['source']}"
        + (f" model {inp['prediction']['model']}" if inp['prediction']['model'] else "")
        + f"; Foreshock misses fall back to {inp['foreshock_fallback']}",
        "",
        f"{'strategy':<20} {'interruptions/mo':>16} {'GPU-h lost/mo':>14} {'$ lost/mo':>12} {'goodput expense':>16}",
    ]
    for k in STRATEGIES:
        a = result[k]
        lines.append(f"{k:<20} {a['interruptions_per_month']:>16.1f} {a['gpu_hours_lost_per_month']:>14,.0f} "
                     f"{a['usd_per_month']:>12,.0f} {100 * a['goodput_expense']:>15.2f}%")
    return "\n".join(lines)


TABLE_SIZES = (64, 1024, 5184, 16384, 100_000)


def format_sweep(s: Scenario, sizes=TABLE_SIZES) -> str:
    """Goodput expense of the three strategies across job sizes, at the scenario's per-node rate."""
    data = sweep(s, list(sizes))
    lines = [f"goodput expense by job size ({s.failures_per_1000_node_days:.3g} failures per 1,000 node-days; "
             f"a restart's re-initialisation grows to {s.reinit_large_hours * 60:g} min at 5,184 GPUs; an evacuation "
             f"pays {s.evacuation_reinit_share:.0%} of that growth):",
             f"{'GPUs':>8} " + " ".join(f"{k:>20}" for k in STRATEGIES)]
    for i, n in enumerate(data["gpus"]):
        lines.append(f"{int(n):>8,} " + " ".join(f"{100 * data[k][i]:>19.2f}%" for k in STRATEGIES))
    return "\n".join(lines)


def _add_flag(p, key: str, type_, help_: str, **kw) -> None:
    p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=type_, default=None, help=help_, **kw)


def register(subparsers) -> None:
    p = subparsers.add_parser("goodput", help="GPU-hours and dollars lost to failures per recovery strategy",
                              description=__doc__.splitlines()[0])
    _add_flag(p, "gpus", int, "GPUs in the job (default 1024)")
    _add_flag(p, "gpus_per_node", int, "GPUs per node (default 8)")
    _add_flag(p, "usd_per_gpu_hour", float, "price of a GPU-hour in dollars (default 3)")
    _add_flag(p, "mttf_hours", float, "job mean time to failure; default: derived from the per-node rate")
    _add_flag(p, "failures_per_1000_node_days", float,
              "per-node failure rate (default: Llama 3, 419 / (2048 nodes x 54 days) = 3.79)")
    _add_flag(p, "blast_radius_gpus", int, "GPUs taken out by one failure (default: one node)")
    _add_flag(p, "identify_minutes", float, "time to identify a failure, t_id, for every failure (default: "
              "the mix's hangs wait --hang-detect-minutes, crashes are seen at once)")
    _add_flag(p, "hang_detect_minutes", float, "how long a hang goes unnoticed (default 8: the NCCL heartbeat "
              "timeout; 0.06 for Minder's 3.6 s)")
    _add_flag(p, "reinit_minutes_at_5184", float, "a restart's re-initialisation at 5,184 GPUs (default 12.5, "
              "the published 10-15 min); it grows with job size from 2 min at 64 GPUs")
    _add_flag(p, "evacuation_reinit_share", float, "the share of that growth an evacuation's world change pays "
              "(default 1, conservative; 0 when the new world is built while the job trains)")
    _add_flag(p, "checkpoint_interval_hours", float, "checkpoint interval (default 1.5)")
    _add_flag(p, "restart_minutes", float, "checkpoint restore and job restart time (default 15)")
    _add_flag(p, "replace_minutes", float, "time to get a replacement node, t_repair (default 10)")
    _add_flag(p, "hot_spare_restart_minutes", float, "checkpointless restart onto a hot spare (default 2)")
    _add_flag(p, "spare_nodes", int, "hot spare pool in nodes (default: smallest with <= 1%% shortfall)")
    _add_flag(p, "migration_seconds", float, "measured time to evacuate a rank to a spare (default 60)")
    _add_flag(p, "eval_report", str, "JSON from `foreshock evaluate --json` (default: documented figures)",
              metavar="FILE")
    _add_flag(p, "eval_model", str, "which model of the report (default: the first)")
    _add_flag(p, "recall_basis", str, "precursor_mix (default) or all", choices=RECALL_BASES)
    _add_flag(p, "foreshock_fallback", str, "recovery for failures Foreshock misses (default checkpointless)",
              choices=FALLBACKS)
    _add_flag(p, "hours_per_month", float, "hours in a month (default 730)")
    p.add_argument("--json", metavar="FILE", help="write the full account as JSON ('-' for stdout)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of goodput expense against job size")
    p.set_defaults(run=run)


def run(args, file_data: Mapping[str, Any]) -> int:
    flags = {k: getattr(args, k, None) for k in DEFAULTS}
    try:
        cfg = resolve("goodput", DEFAULTS, file_data=file_data, flags=flags)
        scenario = build_scenario(cfg)
        result = evaluate(scenario)
        png = plot_png(scenario) if args.plot else None
    except ConfigError as exc:
        print(f"foreshock goodput: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            text = json.dumps(result, indent=2, sort_keys=False) + "\n"
            if args.json == "-":
                sys.stdout.write(text)
            else:
                Path(args.json).write_text(text)
        if png is not None:
            Path(args.plot).write_bytes(png)
    except OSError as exc:
        print(f"foreshock goodput: cannot write output: {exc}", file=sys.stderr)
        return 1
    if args.json != "-":
        print(format_table(result))
        print()
        print(format_sweep(scenario))
    return 0
