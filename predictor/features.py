"""Features (stage 2): windows, baselines, trends and peer comparisons over the per-step base signals.

Reads the base signals of signals.py (one vector per node and step; error counts are the worst
device's, scaled to one step's worth across sampling gaps) and computes, per node and step:
error counts over 1, 5 and 30 minutes; the 30-minute rate relative to the node's own slowly moving
baseline (an EWMA with a 3-day half-life, bias-corrected); gauges now and their 30-minute maximum;
the temperature rise over 30 minutes; minutes since the last fatal/early-warning Xid and link event;
peer comparisons: link errors relative to the other nodes under the same leaf switch and the share
of those peers with link errors (a switch fault shows on all of them), throughput, GPU errors,
hottest GPU and lowest clock relative to the node's job peers (a straggler, also when the whole job
slows with it), and TCP retransmissions of the other nodes of the site; and three anomaly scores
derived from those (ANOMALY: how far the node is from its own history and from its peers), which
need no failure seen before. Last, from the job-relative step-time signal of steptimes.py (a node's
slowest rank's step time over its job's median, by the comparison the service's fail-slow rule makes):
its maximum over 5 and 30 minutes and the share of its slowest rank's judged steps in the last 30
minutes that were slow (STEP_TIMES). Last of all, the NVLink fabric's (signals.FABRIC_SIGNALS): each
fabric health-mask flag and the registration flag now and at any time in 30 minutes, and fatal and
non-fatal (correctable included) NVSwitch SXids in the step, over 30 minutes and minutes since the last
(FABRIC). Then how loud the node's neighbourhood usually is: per error family, the 3-day EWMA of the mean
count of the other nodes under its leaf switch (CONTEXT). Then whether a GPU's HBM warms apart from its
die (signals.WARMING_SIGNALS): that gap's recent level against the node's usual, the same of the gap
between its hottest and coolest dies (temp_spread), and the HBM's where the node remapped an HBM row in
about the last 12 hours and its dies did not warm apart as much (WARMING). Last, the ten-minute bins of the
last five hours in which a GPU that seldom counted corrected ECC counted (ONSET, predictor/onset.py).

ONE implementation serves the offline pipeline and the online scorer: `compute(x, steps, state)`
takes a block of steps `x[nodes, steps, signals]` and the carried `FeatureState`, and returns the
features of every step of the block and the new state. Offline calls it once per node with all of
its steps; online calls it for all nodes with the step(s) just closed. Windows are sums of shifted
slices added in a fixed order and the EWMA is scipy's lfilter carrying its state, so both paths give
bit-identical values (tests/test_predictor_skew.py asserts it).

FEATURE_VERSION changes whenever a feature's definition changes; a model trained with other features
is refused by the registry. The estimators read the first N_MODEL columns (MODEL_FEATURE_NAMES), and
a model trained with `foreshock train --steadiness-columns N` the first N STEADINESS columns after them
too (model.estimator_feature_names); the STEADINESS columns feed the novelty alarm (novelty.py), and
the STEP_TIMES, FABRIC and CONTEXT columns after those are read by no shipped model (explanations name
them where a model does: explain.py). Feature version 7 only appended the STEADINESS columns, version 8
the STEP_TIMES columns, version 9 the FABRIC columns (and read the step times a step later:
steptimes.LAG_STEPS), version 10 the CONTEXT columns (and four counts to PEER_INPUTS) and version 11 the
WARMING columns, so a model of version 6 to 10, whose names are a prefix of FEATURE_NAMES, still loads
(READABLE_VERSIONS, registry.check_compatible). Version 12 took the step-time slow share over the node's
slowest rank's steps instead of all its ranks' (steptimes.py; the same on a node with one rank), known
from a second judged minute on (SLOW_SHARE_MIN_STEPS); version 13 knows it only once as many training
steps were judged as the fail-slow rule needs to move a rank (SLOW_SHARE_MIN_JUDGED). Version 14 appended
the ONSET column, a GPU whose corrected ECC starts and does not stop (predictor/onset.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter

from foreshock import stepcompare
from foreshock.predictor import signals as sg
from foreshock.predictor import steptimes as stt

FEATURE_VERSION = "14"
# 7 appended the STEADINESS columns, 8 the STEP_TIMES columns, 9 the FABRIC columns, 10 the CONTEXT
# columns, 11 the WARMING columns and 14 the ONSET column; 12 and 13 changed no name (the slow share
# counts the slowest rank's steps, from a second judged minute on; from its twelfth judged step on); the
# model columns are 6's. Within 9, the sxid_nonfatal columns count Correctable SXids as well, which they did not at
# first: no model reads them, and names and layout stay 9's, so 9's checkpoints and models fit.
READABLE_VERSIONS = ("6", "7", "8", "9", "10", "11", "12", "13", "14")
# Scorer checkpoints (online.OnlineScorer.save_state) of these versions restore: version 10 only added
# the CONTEXT filter's state and 11 the WARMING filters' (FeatureState.CARRIED_SINCE), so an older
# checkpoint keeps every node's baselines across the upgrade and what it lacks starts from zero; 12
# and 13 carry what 11 did (an 11 checkpoint's step-time counts are all ranks' for their last 30 minutes);
# 14's onset state is the sample stage's, and an older checkpoint's GPUs start it over (onset.OnsetTracker).
RESTORABLE_VERSIONS = ("9", "10", "11", "12", "13", "14")
STEP_SECONDS = sg.STEP_SECONDS
HISTORY = 30                     # steps of history the longest window needs
BASELINE_HALF_LIFE_STEPS = 3 * 24 * 60
EWMA_ALPHA = 1.0 - 2.0 ** (-1.0 / BASELINE_HALF_LIFE_STEPS)
RECENT_HALF_LIFE_STEPS = 2 * 60  # the "last hours" rate, for precursors that build over hours
RECENT_ALPHA = 1.0 - 2.0 ** (-1.0 / RECENT_HALF_LIFE_STEPS)
SINCE_CAP_MINUTES = 1440.0
DECAYED_HALF_LIFE_STEPS = 12 * 60   # "over the last day": a count that halves every 12 hours
DECAYED_KEEP = 2.0 ** (-1.0 / DECAYED_HALF_LIFE_STEPS)
# The WARMING columns: a signal's recent level is its EWMA over known steps with a 15-minute half-life,
# its usual the same with the baselines' 3-day half-life; judged from 6 hours of known steps on (a node's
# first hours have no usual). The node is remapping where an HBM row remapped for correctable errors is
# still counted at half or more of one (remap_correctable_decayed_12h: within about the last 12 hours),
# and its HBM warms apart where its dies' spread rose by less than WARMING_DIE_SHARE of the HBM gap's
# rise (a GPU that runs hot heats its die first, and its HBM with it).
WARMING_HALF_LIFE_STEPS = 15
WARMING_ALPHA = 1.0 - 2.0 ** (-1.0 / WARMING_HALF_LIFE_STEPS)
WARMING_MIN_KNOWN = 1.0 - (1.0 - EWMA_ALPHA) ** (6 * 60)
WARMING_REMAPPED = 0.5
WARMING_DIE_SHARE = 0.5

# Peer base signals, computed across nodes per step (peer_signals below) and appended to the base.
PEER_SIGNALS: tuple[sg.BaseSignal, ...] = (
    sg.BaseSignal("leaf_peers_link_err_frac", "peer", "share of the other nodes under this leaf switch with link errors", "ratio"),
    sg.BaseSignal("link_err_vs_leaf", "peer", "link errors relative to the other nodes under this leaf switch", "x"),
    sg.BaseSignal("traffic_vs_job", "peer", "throughput per device relative to the other nodes of its job", "x"),
    sg.BaseSignal("site_peers_tcp_retrans", "peer", "TCP retransmissions per minute of the other nodes of its site", "segments"),
    sg.BaseSignal("gpu_err_vs_job", "peer", "GPU errors (ECC, PCIe, NVLink) relative to the other nodes of its job", "x"),
    sg.BaseSignal("temp_vs_job", "peer", "hottest GPU against the other nodes of its job", "degC"),
    sg.BaseSignal("sm_clock_vs_job", "peer", "lowest SM clock relative to the other nodes of its job", "x"),
)
# How loud the node's neighbourhood is: per error family, the mean count per step of the other nodes
# under its leaf switch. Healthy fleets differ pod by pod (a batch of marginal HBM, a cable plant whose
# links recover now and then, a hot row), and a count that is a precursor in a quiet pod is the
# neighbourhood's normal in a loud one. Computed with the peer signals (peer_signals), laid out last.
# Per family: its name, the PEER_INPUTS count it averages, what that counts, the unit.
CONTEXT_FAMILIES = (("ecc", "ecc_sbe", "HBM corrected ECC errors", "errors"),
                    ("remaps", "remap_correctable", "HBM rows remapped for correctable errors", "rows"),
                    ("pcie_replay", "pcie_replay", "PCIe replays", "replays"),
                    ("link_err", "link_err", "IB link errors", "errors"),
                    ("link_recovery", "ib_link_error_recovery", "IB link error recoveries", "recoveries"))
CONTEXT_SIGNALS: tuple[sg.BaseSignal, ...] = tuple(
    sg.BaseSignal(f"leaf_peers_{family}", "peer", f"{what} per minute of the other nodes under this leaf switch", unit)
    for family, _, what, unit in CONTEXT_FAMILIES)
# The job-relative step-time signals (predictor/steptimes.py), per node and step, appended after them,
# the NVLink fabric's (signals.FABRIC_SIGNALS), the warming's (signals.WARMING_SIGNALS) and the onset's
# (signals.ONSET_SIGNALS) after those and the CONTEXT_SIGNALS last (all_signals lays a block out so).
ALL_SIGNALS: tuple[sg.BaseSignal, ...] = (sg.BASE_SIGNALS + PEER_SIGNALS + stt.SIGNALS + sg.FABRIC_SIGNALS
                                          + sg.WARMING_SIGNALS + sg.ONSET_SIGNALS + CONTEXT_SIGNALS)
ALL_NAMES = tuple(s.name for s in ALL_SIGNALS)
IDX = {n: i for i, n in enumerate(ALL_NAMES)}
PEER_GROUPS = ("leaf_switch", "job", "site")
# The peer groups whose nodes a sharded deployment spreads over shards: a shard owns whole leaf
# switches (service/shardmap.py), so only these need the other shards' totals (docs/scaling.md).
CROSS_SHARD_GROUPS = ("job", "site")

# count signals not worth windowing on their own (denominators, raw traffic: used through ratios/peers).
# RDMA out-of-sequence packets are among them: with adaptive routing a QP's packets take different
# paths and arrive out of order by design (NVIDIA MLNX_OFED, "Out-of-Order (OOO) Data Placement"), so
# the count follows routing and congestion, not the link's health; a failing link shows in its symbol
# errors, link error recoveries, ACK timeouts and retransmissions (docs/predictor.md: what counting it
# as an error did on a fleet with more congestion).
NOT_WINDOWED = {"tcp_out", "nvl_traffic", "ib_traffic", "ib_xmit_wait", "ib_cnp", "ib_out_of_sequence"}
# Error signals judged against the node's own slowly moving baseline. Traffic and congestion are not:
# jobs start, end and change, so a node's traffic against its own days is the job's story, not the
# node's; they are judged against the job's other nodes (PEER_SIGNALS) instead. The HBM temperature
# is judged against its own days too: failing HBM can creep warmer for hours with few corrected
# errors, a rise no 30-minute window shows.
BASELINED = ("ecc_sbe", "nvl_crc", "nvl_replay", "nvl_recovery", "ib_symbol_error", "ib_link_error_recovery",
             "ib_rcv_errors", "ib_retrans", "ib_ack_timeout", "ib_xmit_discards",
             "pcie_replay", "tcp_retrans", "eth_errors", "hbm_temp_max")
SINCE = ("xid_fatal", "xid_precursor", "xid_nvlink", "link_state_events", "ib_link_downed")
# Events counted over the last day (a count decayed with a 12-hour half-life), absolute, not against a
# baseline: a GPU that remapped HBM rows several times today, a PCIe link whose replay bursts come back
# after quiet hours, a port that went down more than once. The 30-minute windows forget them between
# bursts, and a lifetime total (remap_rows_total) cannot tell today from last year.
DECAYED = ("remap_correctable", "remap_uncorrectable", "pcie_replay", "ib_link_downed")
RISE = ("temp_max", "hbm_temp_max")
# Steadiness: per error signal, the share of the last hours' steps in which it counted at all (an EWMA
# of "counted in this step", 2-hour half-life) minus the node's own share over its days (3-day
# half-life), both bias-corrected: in [-1, 1]. It reads for how long a signal is active, not how much
# it counts: a benign burst is one strong quarter of an hour, a failing device counts step after step
# for hours at any magnitude, and a device that always counts is its own baseline. The novelty alarm
# beside the model reads these columns (novelty.py; docs/predictor.md, "Novelty alarm"); the trees do
# not: given to them they learnt splits that held in the training period and not after it
# (benchmarks/results/predictor-persistence-2026-12-05.md).
# IB transmit discards are not among them: a port discards what it cannot send while it is down or
# congested (IBTA PortXmitDiscards), so under a heavy job they count steadily for hours on a healthy
# port, the way congestion does (ib_xmit_wait, ib_cnp).
STEADY = ("ecc_sbe", "remap_correctable", "pcie_replay", "nvl_crc", "nvl_replay", "nvl_recovery",
          "ib_symbol_error", "ib_link_error_recovery", "ib_rcv_errors", "ib_retrans", "ib_ack_timeout",
          "ib_link_downed", "tcp_retrans", "eth_errors", "xid_precursor", "link_state_events")

COUNT_IDX = [IDX[s.name] for s in sg.BASE_SIGNALS if s.kind == "count" and s.name not in NOT_WINDOWED]
GAUGE_IDX = [IDX[s.name] for s in sg.BASE_SIGNALS if s.kind in ("gauge", "flag")]
PEER_IDX = [IDX[s.name] for s in PEER_SIGNALS]
BASE_IDX = [IDX[n] for n in BASELINED]
SINCE_IDX = [IDX[n] for n in SINCE]
DECAYED_IDX = [IDX[n] for n in DECAYED]
RISE_IDX = [IDX[n] for n in RISE]
STEADY_IDX = [IDX[n] for n in STEADY]
STEP_TIME_IDX = [IDX[n] for n in stt.NAMES]
FABRIC_IDX = [IDX[n] for n in sg.FABRIC_NAMES]   # the flags, then the counts
CONTEXT_IDX = [IDX[s.name] for s in CONTEXT_SIGNALS]
WARMING_IDX = [IDX[n] for n in sg.WARMING_NAMES + ("temp_spread",)]   # what the WARMING filters follow
ONSET_IDX = [IDX[n] for n in sg.ONSET_NAMES]
PEER_WIDTH = len(PEER_SIGNALS) + len(CONTEXT_SIGNALS)   # the columns peer_signals returns


def all_signals(x: np.ndarray, peers: np.ndarray, step_times: np.ndarray, *, kernel: bool = False) -> np.ndarray:
    """[..., S] in ALL_NAMES order from a block's per-step signals x [..., signals.STEP_NAMES] (the
    base signals, then the fabric's and the warming's), its peer and context signals (peer_signals:
    PEER_SIGNALS, then CONTEXT_SIGNALS) and its step-time signals: the layout compute reads, the same
    for the offline and the online path. kernel: a block of one step [N, 1, ...] copied row by row in
    the compiled kernel where numba is importable; False: np.concatenate, the written reference (the
    same values)."""
    from foreshock.predictor import kernels

    nb, npeer = len(sg.BASE_NAMES), len(PEER_SIGNALS)
    if kernel and kernels.AVAILABLE and x.ndim == 3 and x.shape[1] == 1:
        n = x.shape[0]
        out = np.empty((n, 1, x.shape[2] + peers.shape[2] + step_times.shape[2]))
        kernels.assemble_signals(*(np.ascontiguousarray(a[:, 0], dtype=np.float64) for a in (x, peers, step_times)),
                                 nb, npeer, out[:, 0])
        return out
    return np.concatenate([x[..., :nb], peers[..., :npeer], step_times, x[..., nb:], peers[..., npeer:]], axis=-1)


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    signal: str       # the base/peer signal it is computed from (explanations group by it)
    op: str           # sum1 sum5 sum30 vs_baseline recent_vs_baseline now max30 rise30 since mean5 mean30 decayed
                      # steady job_max5 job_max30 slow_share30 context warming warming_remapping onset


def _specs() -> tuple[FeatureSpec, ...]:
    out = []
    for i in COUNT_IDX:
        n = ALL_NAMES[i]
        out += [FeatureSpec(f"{n}_1m", n, "sum1"), FeatureSpec(f"{n}_5m", n, "sum5"), FeatureSpec(f"{n}_30m", n, "sum30")]
    for n in BASELINED:
        out.append(FeatureSpec(f"{n}_30m_vs_baseline", n, "vs_baseline"))
    for n in BASELINED:
        out.append(FeatureSpec(f"{n}_2h_vs_baseline", n, "recent_vs_baseline"))
    for i in GAUGE_IDX:
        n = ALL_NAMES[i]
        out += [FeatureSpec(f"{n}_now", n, "now"), FeatureSpec(f"{n}_max30m", n, "max30")]
    for n in RISE:
        out.append(FeatureSpec(f"{n}_rise30m", n, "rise30"))
    for n in SINCE:
        out.append(FeatureSpec(f"minutes_since_{n}", n, "since"))
    for i in PEER_IDX:
        n = ALL_NAMES[i]
        out += [FeatureSpec(f"{n}_5m", n, "mean5"), FeatureSpec(f"{n}_30m", n, "mean30")]
    for n in DECAYED:   # last: the compiled one-step kernel writes the columns before them
        out.append(FeatureSpec(f"{n}_decayed_12h", n, "decayed"))
    return tuple(out)


CORE_FEATURES: tuple[FeatureSpec, ...] = _specs()
N_CORE = len(CORE_FEATURES)
N_KERNEL = N_CORE - len(DECAYED)   # the columns kernels.feature_step writes

# Anomaly scores: pure functions of one row of the core features, needing no failure seen before.
# How far the node's most unusual error signal is above its own 3-day baseline (log2 of the ratio),
# how many error signals are at least 4x their baseline at once, and how far the node is above its
# leaf and job peers (log2 of the ratio): the node against its own history and against its peers of
# the same job and switch, in the spirit of Minder's per-machine similarity (NSDI 2025). The model
# is constrained to rise with them (model.monotonic_constraints), so a precursor of a shape or a
# signal the training data never had still raises the risk through them.
ANOMALY: tuple[FeatureSpec, ...] = (
    FeatureSpec("anomaly_vs_own_history", "anomaly", "anomaly_own"),
    FeatureSpec("anomaly_signals_4x_baseline", "anomaly", "anomaly_count"),
    FeatureSpec("anomaly_vs_peers", "anomaly", "anomaly_peers"),
)
ANOMALY_RATIO = 4.0
STEADINESS: tuple[FeatureSpec, ...] = tuple(FeatureSpec(f"{n}_steadiness_2h", n, "steady") for n in STEADY)
# Step times against the job's (predictor/steptimes.py): the node's slowest rank's ratio to its job's
# median, at most, over 5 and 30 minutes (NaN: no step of it judged), and the share of its slowest rank's
# steps (each minute's) judged in the last 30 minutes that were slow. A node that slows its job's steps
# shows here whatever slows it (a throttling GPU, a failing HBM stack, a link retraining); the fail-slow
# rule of the service (service/steptimes.py) acts on the same comparison. The shipped estimator does not
# read them (`foreshock train --step-time-columns` does; judged, not shipped: docs/predictor.md, Results).
# The share is known (else NaN) once training steps of at least SLOW_SHARE_MIN_STEPS feature steps of the
# window were judged, at least SLOW_SHARE_MIN_JUDGED of them: a job's first minute (compilation, a rank
# loading its checkpoint or starting its data loaders) never decides it alone, nor do the first few steps
# of a job whose steps take a minute or more, its warm-up steps most of them; and the hard evidence never
# drains a node on fewer of its rank's steps than the fail-slow rule needs to move that rank.
SLOW_SHARE_MIN_STEPS = 2
SLOW_SHARE_MIN_JUDGED = stepcompare.FAIL_SLOW_MIN_STEPS
STEP_TIMES: tuple[FeatureSpec, ...] = (
    FeatureSpec("steptime_vs_job_5m", "steptime_vs_job", "job_max5"),
    FeatureSpec("steptime_vs_job_30m", "steptime_vs_job", "job_max30"),
    FeatureSpec("steptime_slow_share_30m", "steptime_vs_job", "slow_share30"),
)
# The NVLink fabric (signals.FABRIC_SIGNALS): per health-mask flag and the registration flag, its value
# now (1: a GPU of the node reports it; 0: its GPUs with fabric information do not; NaN: none has any)
# and its maximum over 30 minutes (NaN: no value known in them); per SXid class, its count in the step
# (NaN: no events rows), over 30 minutes (NaN: none known in them) and minutes since the last (capped
# like the Xids'). A fabric fault of an NVL72 rack shows on every node of its NVLink domain at once:
# the per-node columns say what the node saw, and the service's fabric-incident rule (service/policy.py,
# scope nvlink_domain) is what names the domain. No estimator reads them yet: they wait for a retrain
# judged on them.
FABRIC: tuple[FeatureSpec, ...] = (
    *(spec for n in sg.FABRIC_FLAGS for spec in (FeatureSpec(f"{n}_now", n, "now"),
                                                  FeatureSpec(f"{n}_max30m", n, "max30"))),
    *(spec for n in sg.FABRIC_COUNTS for spec in (FeatureSpec(f"{n}_1m", n, "sum1"),
                                                   FeatureSpec(f"{n}_30m", n, "sum30"),
                                                   FeatureSpec(f"minutes_since_{n}", n, "since"))),
)
# The neighbourhood's usual: per CONTEXT signal, its 3-day EWMA (bias-corrected, unknown counted as 0),
# the baselines' own filter, so the trees can judge a node's counts against what its leaf's other nodes
# do (`foreshock train --context-columns`; docs/predictor.md, "Context").
CONTEXT: tuple[FeatureSpec, ...] = tuple(FeatureSpec(f"{s.name}_3d", s.name, "context")
                                         for s in CONTEXT_SIGNALS)
# HBM warming apart from its die (signals.WARMING_SIGNALS): the HBM gap's recent level less its usual, in
# degC (NaN: no gap known this step, or under WARMING_MIN_KNOWN of usual); the same of the dies' spread
# (temp_spread); and the HBM gap's where the node remapped an HBM row recently and its dies' spread rose
# by less than WARMING_DIE_SHARE of it (0 where not). A failing HBM stack remaps rows and heats apart from
# its die; a GPU that runs hot heats its die and its HBM, and a single remap does not warm.
WARMING: tuple[FeatureSpec, ...] = (FeatureSpec("hbm_gap_excess_vs_usual", "hbm_gap_excess", "warming"),
                                    FeatureSpec("temp_spread_vs_usual", "temp_spread", "warming"),
                                    FeatureSpec("hbm_gap_excess_remapping", "hbm_gap_excess", "warming_remapping"))
# A GPU whose corrected ECC starts and does not stop (predictor/onset.py, signals.ONSET_SIGNALS): the node's
# value in the step, the ten-minute bins of the last 30 in which such a GPU counted. Its state is per GPU
# and lives in the sample stage (signals.SampleStage.onset), so the column is the signal as it is.
ONSET: tuple[FeatureSpec, ...] = (FeatureSpec("ecc_onset_bins_now", "ecc_onset_bins", "onset"),)
N_MODEL = N_CORE + len(ANOMALY)   # the columns an estimator reads
FEATURES: tuple[FeatureSpec, ...] = (CORE_FEATURES + ANOMALY + STEADINESS + STEP_TIMES + FABRIC + CONTEXT
                                     + WARMING + ONSET)
FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in FEATURES)
MODEL_FEATURE_NAMES: tuple[str, ...] = FEATURE_NAMES[:N_MODEL]
N_FEATURES = len(FEATURES)
STEADY_COLS = slice(N_MODEL, N_MODEL + len(STEADINESS))
STEP_TIME_COLS = slice(STEADY_COLS.stop, STEADY_COLS.stop + len(STEP_TIMES))
FABRIC_COLS = slice(STEP_TIME_COLS.stop, STEP_TIME_COLS.stop + len(FABRIC))
CONTEXT_COLS = slice(FABRIC_COLS.stop, FABRIC_COLS.stop + len(CONTEXT))
WARMING_COLS = slice(CONTEXT_COLS.stop, CONTEXT_COLS.stop + len(WARMING))
ONSET_COLS = slice(WARMING_COLS.stop, N_FEATURES)
_REMAP_DECAYED_COL = FEATURE_NAMES.index("remap_correctable_decayed_12h")
_VS_BASELINE_COLS = np.array([FEATURE_NAMES.index(f"{n}_30m_vs_baseline") for n in BASELINED], dtype=np.intp)
_VS_PEER_COLS = np.array([FEATURE_NAMES.index(f"{n}_30m") for n in ("link_err_vs_leaf", "gpu_err_vs_job")],
                         dtype=np.intp)


def anomaly_scores(out: np.ndarray) -> None:
    """Fill the ANOMALY columns of float32 feature rows `out` [M, N_FEATURES] from their core columns.

    Both compute paths call it on the same float32 values, so they agree bit for bit. NaN (nothing
    known) counts as not unusual: 0. The largest log2 of a row's ratios, floored at 0, is taken as the
    log2 of its largest ratio floored at 1: log2 is monotone, so the same value for one log2 a row
    instead of one a ratio.
    """
    own = out[:, _VS_BASELINE_COLS]
    peers = out[:, _VS_PEER_COLS]
    one = np.float32(1.0)
    base = N_CORE
    out[:, base] = np.log2(np.fmax(np.fmax.reduce(own, axis=1), one))
    out[:, base + 1] = (own >= ANOMALY_RATIO).sum(axis=1)
    out[:, base + 2] = np.log2(np.fmax(np.fmax.reduce(peers, axis=1), one))


def full_width(row) -> np.ndarray:
    """[N_FEATURES] float32 from a row that may be shorter (a version-6 model's reference values):
    the columns it lacks are 0, not unusual; None: all 0."""
    out = np.zeros(N_FEATURES, dtype=np.float32)
    if row is not None:
        got = np.asarray(row, dtype=np.float32)[:N_FEATURES]
        out[:len(got)] = got
    return out


def feature_names() -> list[str]:
    return list(FEATURE_NAMES)


# A node's first step of telemetry has no counter deltas (nothing to difference against: they read 0)
# and no rates for its peers to be compared with, a row unlike any the model learned from
# (docs/predictor.md says what scoring it did). Its rows are scored from this many steps after its
# first one, offline and online alike (a scorer restored from its checkpoint keeps each node's first step).
FIRST_SCORED_STEP = 1


def scoreable(steps_since_first: np.ndarray) -> np.ndarray:
    """Per row, whether it is scored: `steps_since_first` counts steps since the node's first
    telemetry (0 at that step)."""
    return np.asarray(steps_since_first) >= FIRST_SCORED_STEP


# The summed signals, laid out so that the count, rise and peer columns are contiguous ranges (a
# slice is a view, an index list a copy); each column's arithmetic is independent of the layout.
SUM_IDX = list(dict.fromkeys(COUNT_IDX + BASE_IDX + RISE_IDX + PEER_IDX))
_SUM_POS = {i: j for j, i in enumerate(SUM_IDX)}


def _as_slice(pos: list[int]):
    if pos and pos == list(range(pos[0], pos[0] + len(pos))):
        return slice(pos[0], pos[0] + len(pos))
    return pos


S_COUNT = _as_slice([_SUM_POS[i] for i in COUNT_IDX])
S_RISE = _as_slice([_SUM_POS[i] for i in RISE_IDX])
S_PEER = _as_slice([_SUM_POS[i] for i in PEER_IDX])
S_BASE = _as_slice([_SUM_POS[i] for i in BASE_IDX])
RING = HISTORY          # cumulative sums kept for the last RING steps
GRING = HISTORY - 1     # gauge values kept for the last GRING steps


@dataclass
class FeatureState:
    """What compute() carries between blocks of steps, for N nodes: bounded (HISTORY steps + scalars).

    Window sums are differences of running cumulative sums (C_t - C_{t-w}); the state keeps the
    cumulative sums of the last RING steps in a ring (time-major, position `head` is the oldest) and
    the gauge values of the last GRING steps (their maximum is order-free, so any layout works).
    All N nodes share `head`: the online scorer advances every node every step.
    """
    cum: np.ndarray         # [N, K] cumulative sums of the SUM signals (NaN counted as 0)
    cumv: np.ndarray        # [N, K] cumulative count of known values
    ring: np.ndarray        # [RING, N, K] cum of the last RING steps
    ringv: np.ndarray       # [RING, N, K]
    gring: np.ndarray       # [GRING, N, G] the last gauge values (NaN: none)
    head: int               # ring position of the oldest entry (= the next to overwrite)
    ghead: int
    z: np.ndarray           # [N, B] EWMA state (lfilter's zi), 3-day baseline
    zr: np.ndarray          # [N, B] EWMA state, the recent (2-hour half-life) rate
    seen: np.ndarray        # [N] steps seen (EWMA bias correction)
    last_event: np.ndarray  # [N, E] step index of the last event of each SINCE signal (-inf: never)
    zd: np.ndarray          # [N, D] the decayed counts of the DECAYED signals, after the last step
    za: np.ndarray          # [N, P] EWMA state of "counted in the step" of the STEADY signals, 3-day
    zar: np.ndarray         # [N, P] the same, 2-hour
    tring: np.ndarray       # [GRING, N, 3] the step-time signals of the last GRING steps (NaN ratio, 0 counts: none)
    thead: int
    fring: np.ndarray       # [GRING, N, 2C] the SXid counts of the last GRING steps (unknown: 0), then whether known
    fhead: int
    flast: np.ndarray       # [N, 2F + C] the last step of each fabric flag at 1, of it known, of each SXid count > 0
    zc: np.ndarray          # [N, X] EWMA state of the CONTEXT signals, 3-day
    zw: np.ndarray          # [N, 8] EWMA states of the WARMING filters: per WARMING_IDX signal (value x known,
                            # known), recent, then usual
    gmax: "_SlidingMax | None" = None   # the one-step path's running maximum of gring (None: rebuild)
    # the compiled one-step path's running sums of the step-time and SXid rings (_RingSums; None: rebuild)
    rings: "_RingSums | None" = None

    @classmethod
    def empty(cls, n: int) -> "FeatureState":
        k, g = len(SUM_IDX), len(GAUGE_IDX)
        return cls(np.zeros((n, k)), np.zeros((n, k)), np.zeros((RING, n, k)), np.zeros((RING, n, k)),
                   np.full((GRING, n, g), np.nan), 0, 0, np.zeros((n, len(BASE_IDX))),
                   np.zeros((n, len(BASE_IDX))), np.zeros(n),
                   np.full((n, len(SINCE_IDX)), -np.inf), np.zeros((n, len(DECAYED_IDX))),
                   np.zeros((n, len(STEADY_IDX))), np.zeros((n, len(STEADY_IDX))),
                   np.repeat(stt.empty_values(GRING)[:, None, :], n, axis=1), 0,
                   np.zeros((GRING, n, 2 * len(sg.FABRIC_COUNTS))), 0,
                   np.full((n, 2 * len(sg.FABRIC_FLAGS) + len(sg.FABRIC_COUNTS)), -np.inf),
                   np.zeros((n, len(CONTEXT_IDX))), np.zeros((n, 4 * len(WARMING_IDX))))

    def grow(self, n: int) -> "FeatureState":
        """The same state with n new nodes appended (their history empty, as offline starts them)."""
        add = FeatureState.empty(n)
        cat = np.concatenate
        return FeatureState(cat([self.cum, add.cum]), cat([self.cumv, add.cumv]),
                            cat([self.ring, add.ring], axis=1), cat([self.ringv, add.ringv], axis=1),
                            cat([self.gring, add.gring], axis=1), self.head, self.ghead,
                            cat([self.z, add.z]), cat([self.zr, add.zr]), cat([self.seen, add.seen]),
                            cat([self.last_event, add.last_event]), cat([self.zd, add.zd]),
                            cat([self.za, add.za]), cat([self.zar, add.zar]),
                            cat([self.tring, add.tring], axis=1), self.thead,
                            cat([self.fring, add.fring], axis=1), self.fhead, cat([self.flast, add.flast]),
                            cat([self.zc, add.zc]), cat([self.zw, add.zw]))

    def __len__(self) -> int:
        return len(self.seen)

    # What a checkpoint keeps (OnlineScorer.save_state): the running sums, the baselines, the day-long
    # counts, the steadiness shares, the last events (the fabric's too), the neighbourhood's usual and the
    # HBM gap's filters, a few numbers per node. Not the 30-step rings (the step times' and SXids' too), 30x
    # the rest and refilled by 30 steps of telemetry.
    CARRIED = ("cum", "cumv", "z", "zr", "seen", "last_event", "zd", "za", "zar", "flast", "zc", "zw")
    # the feature version that began to carry each array a checkpoint of an earlier one lacks
    CARRIED_SINCE = {"zc": "10", "zw": "11"}

    def carried(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(getattr(self, k)) for k in self.CARRIED}

    @classmethod
    def from_carried(cls, arrays: dict[str, np.ndarray], version: str = FEATURE_VERSION) -> "FeatureState":
        """A state from carried() arrays of feature version `version` (RESTORABLE_VERSIONS): the rings
        hold the running sums as they are now, so each window starts over from the next step (as a
        node's do at its first steps) and the gauges' 30-step maxima from the next value; an array the
        version did not carry yet (CARRIED_SINCE) starts from zero, its filter climbing back over its
        half-life; everything else continues as if nothing had stopped. Raises ValueError when an
        array is missing or its shape is not this code's."""
        n = len(arrays["seen"])
        state = cls.empty(n)
        for k in cls.CARRIED:
            if k not in arrays and int(version) < int(cls.CARRIED_SINCE.get(k, "0")):
                continue
            if k not in arrays:
                raise ValueError(f"feature state {k}: missing from a version-{version} state")
            want = getattr(state, k).shape
            got = np.asarray(arrays[k], dtype=np.float64)
            if got.shape != want:
                raise ValueError(f"feature state {k}: shape {got.shape}, this code's is {want}")
            setattr(state, k, got.copy())
        state.ring[:] = state.cum[None]
        state.ringv[:] = state.cumv[None]
        return state


class _SlidingMax:
    """The maximum of the GRING carried gauge values, kept as the one-step path pushes (exact: fmax).

    Van Herk / Gil-Werman: at a rebuild the ring's values, oldest first, are a_0..a_{W-1}, and
    `suffix[j]` = max(a_j..a_{W-1}); after m pushes the ring holds a_m..a_{W-1} and the m new values,
    whose maximum is `prefix`, so the ring's maximum is fmax(suffix[m], prefix). After W pushes the
    ring is all new values and the next query rebuilds: W-1 fmax per W steps instead of W per step.
    """

    def __init__(self, gring: np.ndarray, ghead: int):
        w = gring.shape[0]
        order = (ghead + np.arange(w)) % w
        self.suffix = np.empty((w + 1,) + gring.shape[1:])
        self.suffix[w] = np.nan
        self.suffix[w - 1] = gring[order[w - 1]]
        for j in range(w - 2, -1, -1):
            np.fmax(gring[order[j]], self.suffix[j + 1], out=self.suffix[j])
        self.prefix = np.full(gring.shape[1:], np.nan)
        self.m = 0

    def current(self) -> np.ndarray:
        return np.fmax(self.suffix[self.m], self.prefix)

    def push(self, g: np.ndarray) -> bool:
        """Account for g entering the ring; False when the structure must be rebuilt."""
        np.fmax(self.prefix, g, out=self.prefix)
        self.m += 1
        return self.m < self.suffix.shape[0] - 1


class _RingSums:
    """What the compiled one-step path keeps so as not to read every slot of tring and fring each step.

    The step-time counts and the SXid counts and flags in the rings are whole numbers, so their window
    sums are exact in any order: a running sum (add the new slot, take away the one it overwrites)
    equals numpy's sum over the slots. `sums` [N, 2 + 2C] holds, per node, tring's two count columns
    then fring's, summed over the slots; `unsafe` [N] counts the node's slots holding a value that is
    not such a number (not whole, over 2**40, infinite, -0.0): while it is not 0 the kernel sums that
    node's slots as numpy does. `peak` keeps the maximum of tring's ratio column as gmax does the
    gauges'. Rebuilt from the rings whenever any other path has written them (FeatureState.rings None).
    """

    LIMIT = 2.0 ** 40

    def __init__(self, tring: np.ndarray, thead: int, fring: np.ndarray):
        values = np.concatenate([tring[:, :, 1:3], fring], axis=2)           # [GRING, N, 2 + 2C]
        with np.errstate(invalid="ignore"):
            whole = (values == np.floor(values)) & (np.abs(values) <= self.LIMIT) & ~((values == 0) & np.signbit(values))
        # a slot of either ring with a value that is not whole counts once
        self.unsafe = ((~whole[:, :, :2]).any(axis=2).sum(axis=0)
                       + (~whole[:, :, 2:]).any(axis=2).sum(axis=0)).astype(np.int64)
        self.sums = np.ascontiguousarray(np.where(whole, values, 0.0).sum(axis=0))
        self.peak = _SlidingMax(tring[:, :, 0:1], thead)


def _lagged(block: np.ndarray, ring: np.ndarray, head: int, w: int) -> np.ndarray:
    """Cumulative value w steps before each step of the block: block [T, N, K] -> [T, N, K]."""
    t = block.shape[0]
    r = ring.shape[0]
    n_ring = min(w, t)
    # step j needs C_{j-w}: from the ring when j - w < 0 (m = w - j steps before the block)
    idx = [(head + r - (w - j)) % r for j in range(n_ring)]
    from_ring = ring[idx]
    if t <= w:
        return from_ring
    return np.concatenate([from_ring, block[: t - w]], axis=0)


def _oldest_first(ring: np.ndarray, head: int) -> np.ndarray:
    """A ring's rows in time order, the oldest first (a copy)."""
    return ring[(head + np.arange(ring.shape[0])) % ring.shape[0]]


def _windows(ring: np.ndarray, head: int, block: np.ndarray) -> np.ndarray:
    """[T, ..., HISTORY]: each of the block's T steps with the HISTORY - 1 before it, from a ring of the
    last GRING steps and the block (a view over their concatenation, the last axis oldest first)."""
    return np.lib.stride_tricks.sliding_window_view(np.concatenate([_oldest_first(ring, head), block]), HISTORY,
                                                    axis=0)


def _push(ring: np.ndarray, head: int, block: np.ndarray) -> int:
    r, t = ring.shape[0], block.shape[0]
    if t == 1:  # the online case: a basic-slice write, no fancy indexing
        ring[head] = block[0]
        return (head + 1) % r
    if t >= r:
        ring[:] = np.roll(block[t - r:], head, axis=0)
        return head
    pos = (head + np.arange(t)) % r
    ring[pos] = block
    return (head + t) % r


def compute(x: np.ndarray, steps: np.ndarray, state: FeatureState, *,
            kernel: bool = True) -> tuple[np.ndarray, FeatureState]:
    """Features of a block of T consecutive steps for N nodes; updates `state` in place and returns it.

    x: [N, T, S] base, peer and step-time signals (ALL_NAMES order); steps: [T] the step indices (ts // step).
    Returns ([N, T, N_FEATURES] float32, state). `kernel`: a single step (the online scorer's every
    round) runs in the compiled kernel where numba is importable; False: in numpy
    (_compute_step_numpy, the written reference the kernel is tested against). Bit-identical either way.
    """
    n, t, _ = x.shape
    if t == 1:
        return _compute_step(x[:, 0], steps, state, kernel), state
    xt = np.ascontiguousarray(np.swapaxes(x, 0, 1))              # [T, N, S] time-major
    out = np.empty((t, n, N_FEATURES), dtype=np.float64)
    out[:, :, N_CORE:] = 0.0
    col = 0

    xs = xt[:, :, SUM_IDX]
    vs = ~np.isnan(xs)
    xs = np.where(vs, xs, 0.0)
    # sequential from the carried sum, so that any split of the steps into blocks rounds the same
    if t == 1:  # the same additions as the cumsum below, without building the concatenation
        c = state.cum[None] + xs
        cv = state.cumv[None] + vs
    else:
        c = np.cumsum(np.concatenate([state.cum[None], xs]), axis=0)[1:]
        cv = np.cumsum(np.concatenate([state.cumv[None], vs.astype(np.float64)]), axis=0)[1:]

    lags: dict[tuple[str, int], np.ndarray] = {}

    def lag(which, w):
        # each lag of the cumulative sums is built once and shared by every window that needs it
        got = lags.get((which, w))
        if got is None:
            got = lags[(which, w)] = (_lagged(c, state.ring, state.head, w) if which == "c"
                                      else _lagged(cv, state.ringv, state.head, w))
        return got

    def window(w, cols):
        return (c[:, :, cols] - lag("c", w)[:, :, cols], cv[:, :, cols] - lag("v", w)[:, :, cols])

    # counts over 1, 5, 30 steps (NaN when nothing in the window was known)
    k = len(COUNT_IDX)
    cols = S_COUNT
    s1 = np.where(vs[:, :, cols], xs[:, :, cols], np.nan)
    a5, n5 = window(5, cols)
    a30, n30 = window(HISTORY, cols)
    block = np.stack([s1, np.where(n5 > 0, a5, np.nan), np.where(n30 > 0, a30, np.nan)], axis=-1)
    out[:, :, col:col + 3 * k] = block.reshape(t, n, 3 * k)
    col += 3 * k

    # 30-minute rate against the node's own EWMA baseline (lfilter recursion: y = a x + z, z = (1-a) y)
    xb = xs[:, :, S_BASE]
    seen = state.seen[None, :] + np.arange(1, t + 1, dtype=np.float64)[:, None]

    def ewma(alpha, z, xin=xb):
        y_, zf_ = _ewma(alpha, z, xin)
        return y_ / (1.0 - (1.0 - alpha) ** seen)[:, :, None], zf_

    baseline, zf = ewma(EWMA_ALPHA, state.z)
    recent, zrf = ewma(RECENT_ALPHA, state.zr)
    b30, nb30 = window(HISTORY, S_BASE)
    eps = 1.0 / HISTORY
    with np.errstate(invalid="ignore", divide="ignore"):
        rate30 = np.where(nb30 > 0, b30 / np.maximum(nb30, 1.0), np.nan)
    out[:, :, col:col + len(BASE_IDX)] = (rate30 + eps) / (baseline + eps)
    col += len(BASE_IDX)
    out[:, :, col:col + len(BASE_IDX)] = (recent + eps) / (baseline + eps)
    col += len(BASE_IDX)

    # gauges and flags: now and the maximum over 30 steps (exact and order-free: np.fmax skips NaN)
    g = xt[:, :, GAUGE_IDX]
    hist = np.fmax.reduce(state.gring, axis=0)                     # [N, G] max of the carried steps
    if t == 1:
        gmax = np.fmax(g, hist[None])
    else:
        ext = np.concatenate([_oldest_first(state.gring, state.ghead), g], axis=0)
        gmax = g.copy()
        for kk in range(1, HISTORY):
            gmax = np.fmax(gmax, ext[GRING - kk: GRING - kk + t])
    k = len(GAUGE_IDX)
    out[:, :, col:col + 2 * k] = np.stack([g, gmax], axis=-1).reshape(t, n, 2 * k)
    col += 2 * k

    # rise over 30 steps: mean of the last 5 minus the mean of the 5 ending 25 steps back
    cr = S_RISE
    ra, rn = window(5, cr)
    old_a = lag("c", 25)[:, :, cr] - lag("c", 30)[:, :, cr]
    old_n = lag("v", 25)[:, :, cr] - lag("v", 30)[:, :, cr]
    with np.errstate(invalid="ignore", divide="ignore"):
        out[:, :, col:col + len(RISE_IDX)] = np.where((rn > 0) & (old_n > 0), ra / rn - old_a / old_n, np.nan)
    col += len(RISE_IDX)

    # minutes since the last event of each kind (capped; never = the cap)
    ev = np.nan_to_num(xt[:, :, SINCE_IDX]) > 0                  # [T, N, E]
    st = steps.astype(np.float64)[:, None, None]
    stamp = np.where(ev, st, -np.inf)
    last = np.maximum.accumulate(np.concatenate([state.last_event[None], stamp], axis=0), axis=0)[1:]
    out[:, :, col:col + len(SINCE_IDX)] = np.minimum((st - last) * (STEP_SECONDS / 60.0), SINCE_CAP_MINUTES)
    col += len(SINCE_IDX)

    # peers: means over 5 and 30 steps
    p5, pn5 = window(5, S_PEER)
    p30, pn30 = window(HISTORY, S_PEER)
    with np.errstate(invalid="ignore", divide="ignore"):
        m5 = np.where(pn5 > 0, p5 / np.maximum(pn5, 1.0), np.nan)
        m30 = np.where(pn30 > 0, p30 / np.maximum(pn30, 1.0), np.nan)
    k = len(PEER_IDX)
    out[:, :, col:col + 2 * k] = np.stack([m5, m30], axis=-1).reshape(t, n, 2 * k)
    col += 2 * k

    # counts over the last day: d_t = x_t + keep * d_{t-1} (lfilter's recursion, as the one-step path)
    xd = xt[:, :, DECAYED_IDX]
    xd = np.where(np.isnan(xd), 0.0, xd)
    decayed, zz = lfilter([1.0], [1.0, -DECAYED_KEEP], xd, axis=0, zi=state.zd[None])
    out[:, :, col:col + len(DECAYED_IDX)] = decayed
    col += len(DECAYED_IDX)
    assert col == N_CORE

    counted = _counted(xt[:, :, STEADY_IDX])
    share_days, zaf = ewma(EWMA_ALPHA, state.za, counted)
    share_hours, zarf = ewma(RECENT_ALPHA, state.zar, counted)
    out[:, :, STEADY_COLS] = share_hours - share_days
    out[:, :, STEP_TIME_COLS] = _step_times(xt[:, :, STEP_TIME_IDX], state)
    out[:, :, FABRIC_COLS] = _fabric(xt[:, :, FABRIC_IDX], steps, state)
    usual, zcf = ewma(EWMA_ALPHA, state.zc, np.nan_to_num(xt[:, :, CONTEXT_IDX]))
    out[:, :, CONTEXT_COLS] = usual
    out[:, :, WARMING_COLS] = _warming(xt[:, :, WARMING_IDX], out[:, :, _REMAP_DECAYED_COL].astype(np.float32), state)
    out[:, :, ONSET_COLS] = xt[:, :, ONSET_IDX]

    # carry the state
    h0 = state.head
    state.head = _push(state.ring, h0, c)
    _push(state.ringv, h0, cv)
    state.ghead = _push(state.gring, state.ghead, g)
    state.gmax = None
    state.cum, state.cumv = c[-1].copy(), cv[-1].copy()
    state.z = np.asarray(zf)
    state.zr = np.asarray(zrf)
    state.seen = state.seen + t
    state.last_event = last[-1].copy()
    state.zd = np.asarray(zz[0])
    state.za, state.zar = np.asarray(zaf), np.asarray(zarf)
    state.zc = np.asarray(zcf)
    result = np.ascontiguousarray(np.swapaxes(out, 0, 1), dtype=np.float32)
    anomaly_scores(result.reshape(n * t, N_FEATURES))
    return result, state


def _positions(s) -> np.ndarray:
    return np.arange(len(SUM_IDX), dtype=np.int64)[s] if isinstance(s, slice) else np.asarray(s, dtype=np.int64)


_KERNEL_INDEX = None   # the kernel's column positions, built on first use


def _compute_step(x: np.ndarray, steps: np.ndarray, state: FeatureState, kernel: bool = True) -> np.ndarray:
    """compute() for one step: the compiled kernel (predictor/kernels.py) when asked for and numba is
    there, else the numpy path below; bit-identical (tests/test_predictor_speedpaths.py runs both)."""
    from foreshock.predictor import kernels

    if not (kernel and kernels.AVAILABLE):
        return _compute_step_numpy(x, steps, state)
    global _KERNEL_INDEX
    if _KERNEL_INDEX is None:
        _KERNEL_INDEX = tuple(np.asarray(a, dtype=np.int64) for a in (
            SUM_IDX, _positions(S_COUNT), _positions(S_BASE), _positions(S_RISE), _positions(S_PEER),
            GAUGE_IDX, SINCE_IDX, DECAYED_IDX, STEADY_IDX, CONTEXT_IDX, STEP_TIME_IDX, FABRIC_IDX))
    n = x.shape[0]
    x = np.ascontiguousarray(x, dtype=np.float64)
    out = np.empty((n, N_FEATURES), dtype=np.float32)
    seen = state.seen + 1.0
    den_base = 1.0 - (1.0 - EWMA_ALPHA) ** seen
    den_recent = 1.0 - (1.0 - RECENT_ALPHA) ** seen
    if state.gmax is None:
        state.gmax = _SlidingMax(state.gring, state.ghead)
    hist = np.ascontiguousarray(state.gmax.current())
    for name in ("cum", "cumv", "z", "zr", "last_event", "zd", "za", "zar", "zc", "flast", "tring",
                 "fring"):   # updated in place by the kernels
        a = getattr(state, name)
        if not (a.flags.c_contiguous and a.flags.writeable and a.dtype == np.float64):
            setattr(state, name, np.array(a, dtype=np.float64))
    h = state.head
    st = float(steps[0])
    threads = kernel_threads()
    kernels.run_rows(kernels.feature_step, n, threads, (
        x, *_KERNEL_INDEX[:7], state.cum, state.cumv, state.ring, state.ringv, h, state.z, state.zr, den_base,
        den_recent, hist, state.last_event, st, EWMA_ALPHA, RECENT_ALPHA, 1.0 / HISTORY,
        STEP_SECONDS / 60.0, SINCE_CAP_MINUTES, out))
    # _decayed_step, _steady_step, _step_times, _fabric and _context_step in one pass per node
    if state.rings is None:
        state.rings = _RingSums(state.tring, state.thead, state.fring)
    rings = state.rings
    peak = np.ascontiguousarray(rings.peak.current()[:, 0])
    kernels.run_rows(kernels.feature_rest_step, n, threads, (
        x, *_KERNEL_INDEX[7:], len(sg.FABRIC_FLAGS), state.zd, state.za, state.zar, state.zc,
        state.tring, state.thead, state.fring, state.fhead, state.flast, rings.sums, rings.unsafe, peak,
        _RingSums.LIMIT, den_base, den_recent, DECAYED_KEEP,
        EWMA_ALPHA, RECENT_ALPHA, st, float(HISTORY), STEP_SECONDS / 60.0, SINCE_CAP_MINUTES,
        float(SLOW_SHARE_MIN_STEPS), float(SLOW_SHARE_MIN_JUDGED), N_KERNEL,
        STEADY_COLS.start, STEP_TIME_COLS.start, FABRIC_COLS.start, CONTEXT_COLS.start, out))
    if not rings.peak.push(state.tring[state.thead, :, 0:1]):
        rings.peak = _SlidingMax(state.tring[:, :, 0:1], (state.thead + 1) % GRING)
    state.thead = (state.thead + 1) % GRING
    state.fhead = (state.fhead + 1) % GRING
    out[:, WARMING_COLS] = _warming(x[None, :, WARMING_IDX], out[None, :, _REMAP_DECAYED_COL], state)[0]
    out[:, ONSET_COLS] = x[:, ONSET_IDX]
    anomaly_scores(out)
    g = x[:, GAUGE_IDX]
    state.head = (h + 1) % RING
    state.gring[state.ghead] = g
    state.ghead = (state.ghead + 1) % GRING
    if not state.gmax.push(g):
        state.gmax = None
    state.seen = seen
    return out[:, None, :]


def _decayed_step(x: np.ndarray, state: FeatureState, out: np.ndarray) -> None:
    """The DECAYED columns of one step (x [N, S]) into out [N, N_FEATURES]; carries state.zd. The
    block path's lfilter recursion, element by element: y = 1.0 * x + z, z = keep * y."""
    xd = x[:, DECAYED_IDX]
    y = np.where(np.isnan(xd), 0.0, xd) + state.zd
    out[:, N_KERNEL:N_CORE] = y
    state.zd = DECAYED_KEEP * y


def _counted(x: np.ndarray) -> np.ndarray:
    """1.0 where a count signal counted in the step, else 0.0 (unknown counts as not counted)."""
    return (np.nan_to_num(x) > 0).astype(np.float64)


def _steady_step(x: np.ndarray, state: FeatureState, out: np.ndarray, den_base: np.ndarray,
                 den_recent: np.ndarray) -> None:
    """The STEADINESS columns of one step (x [N, S]) into out; carries state.za and state.zar. The
    block path's EWMA recursion element by element (y = a x + z, z = (1 - a) y), bias-corrected by the
    step's denominators (1 - (1 - alpha) ** seen, the baselines' own)."""
    counted = _counted(x[:, STEADY_IDX])
    y = EWMA_ALPHA * counted + state.za
    state.za = (1.0 - EWMA_ALPHA) * y
    yr = RECENT_ALPHA * counted + state.zar
    state.zar = (1.0 - RECENT_ALPHA) * yr
    out[:, STEADY_COLS] = yr / den_recent[:, None] - y / den_base[:, None]


def _context_step(x: np.ndarray, state: FeatureState, out: np.ndarray, den_base: np.ndarray) -> None:
    """The CONTEXT columns of one step (x [N, S]) into out; carries state.zc. The block path's EWMA
    recursion element by element (y = a x + z, z = (1 - a) y), bias-corrected like the baselines."""
    y = EWMA_ALPHA * np.nan_to_num(x[:, CONTEXT_IDX]) + state.zc
    state.zc = (1.0 - EWMA_ALPHA) * y
    out[:, CONTEXT_COLS] = y / den_base[:, None]


def _ewma(alpha: float, z: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An EWMA over a block x [T, N, K] from the carried state z [N, K] (lfilter's zi), not bias-corrected:
    (y [T, N, K], the state after it). lfilter's recursion on a block, the same recursion element by
    element on one step (y = a x + z, z = (1 - a) y): both paths' values alike."""
    if x.shape[0] == 1:
        y = alpha * x + z[None]
        return y, (1.0 - alpha) * y[-1]
    y, zz = lfilter([alpha], [1.0, -(1.0 - alpha)], x, axis=0, zi=z[None])
    return y, zz[0]


def _warming(v: np.ndarray, remapped: np.ndarray, state: FeatureState) -> np.ndarray:
    """The WARMING columns of a block of steps: v [T, N, 2] the HBM gap (signals.WARMING_SIGNALS) and the
    dies' spread (WARMING_IDX), remapped [T, N] the node's remap_correctable_decayed_12h as its float32
    feature column reads; carries state.zw. Each level is a weighted mean over the known steps: the EWMA
    of value x known over the EWMA of known (the filters start at 0, so no bias correction is needed).
    One function for any block: lfilter's recursion on a block, the same recursion element by element on
    one step (y = a x + z, z = (1 - a) y), as the baselines' (tests/test_predictor_skew.py)."""
    known = ~np.isnan(v)
    series = np.concatenate([np.where(known, v, 0.0), known.astype(np.float64)], axis=-1)   # [T, N, 4]
    k = series.shape[-1]
    levels = []
    for j, alpha in ((0, WARMING_ALPHA), (k, EWMA_ALPHA)):
        y, state.zw[:, j:j + k] = _ewma(alpha, state.zw[:, j:j + k], series)
        levels.append(y)
    recent, usual = levels
    m = v.shape[-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        rise = np.where(known & (usual[..., m:] >= WARMING_MIN_KNOWN),
                        recent[..., :m] / recent[..., m:] - usual[..., :m] / usual[..., m:], np.nan)
    hbm, die = rise[..., 0], rise[..., 1]
    apart = ~(die >= WARMING_DIE_SHARE * hbm)     # a die spread not known is no sign of a hot GPU
    gated = np.where(np.isnan(hbm), np.nan, np.where((remapped >= WARMING_REMAPPED) & apart, hbm, 0.0))
    return np.concatenate([rise, gated[..., None]], axis=-1)


def _step_times(v: np.ndarray, state: FeatureState) -> np.ndarray:
    """The STEP_TIMES columns of a block of steps, v [T, N, 3] the step-time signals (stt.SIGNALS);
    carries state.tring. One function for any block, the one-step paths' too: a maximum and sums of
    whole counts over each step's window, exact in any order, so a single step's shortcut gives the
    block's values (tests/test_predictor_skew.py, test_block_size_does_not_change_features)."""
    v = v.astype(np.float64, copy=True)
    v[:, :, 1:] = np.nan_to_num(v[:, :, 1:])
    out = np.empty(v.shape)
    if v.shape[0] == 1:
        # the online round: the ring reduced in place, no window copies (fmax and whole sums: the same)
        ring, cur = state.tring, v[0]
        recent = [(state.thead - k) % GRING for k in range(1, 5)]
        out[0, :, 0] = np.fmax(np.fmax.reduce(ring[recent, :, 0], axis=0), cur[:, 0])
        out[0, :, 1] = np.fmax(np.fmax.reduce(ring[:, :, 0], axis=0), cur[:, 0])
        slow, judged = ring[:, :, 1].sum(axis=0) + cur[:, 1], ring[:, :, 2].sum(axis=0) + cur[:, 2]
        steps_judged = (ring[:, :, 2] > 0).sum(axis=0) + (cur[:, 2] > 0)
    else:
        win = _windows(state.tring, state.thead, v)                          # [T, N, 3, HISTORY]
        out[:, :, 0] = np.fmax.reduce(win[:, :, 0, -5:], axis=-1)
        out[:, :, 1] = np.fmax.reduce(win[:, :, 0], axis=-1)
        slow, judged = win[:, :, 1].sum(axis=-1), win[:, :, 2].sum(axis=-1)
        steps_judged = (win[:, :, 2] > 0).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        known = (judged >= SLOW_SHARE_MIN_JUDGED) & (steps_judged >= SLOW_SHARE_MIN_STEPS)
        out[:, :, 2] = np.where(known, slow / judged, np.nan)
    state.thead = _push(state.tring, state.thead, v)
    state.rings = None
    return out


def _fabric(v: np.ndarray, steps: np.ndarray, state: FeatureState) -> np.ndarray:
    """The FABRIC columns of a block of steps, v [T, N, F] the fabric signals (signals.FABRIC_NAMES: the
    flags, then the SXid counts); carries state.flast and state.fring. One function for any block: the
    30-minute flag is read from the last step each flag was 1 and was known (a running maximum), the
    SXid windows are sums of whole counts (exact in any order), so the one-step paths' values are the
    block's (tests/test_predictor_skew.py)."""
    t, n = v.shape[0], v.shape[1]
    nf, nc = len(sg.FABRIC_FLAGS), len(sg.FABRIC_COUNTS)
    flags, counts = v[:, :, :nf], v[:, :, nf:]
    st = steps.astype(np.float64)[:, None, None]
    known = ~np.isnan(counts)
    stamps = np.concatenate([np.where(flags > 0, st, -np.inf), np.where(~np.isnan(flags), st, -np.inf),
                             np.where(known & (counts > 0), st, -np.inf)], axis=2)
    if t == 1:
        last = np.maximum(state.flast, stamps[0])[None]
    else:
        last = np.maximum.accumulate(np.concatenate([state.flast[None], stamps]), axis=0)[1:]
    out = np.empty((t, n, len(FABRIC)))
    start = st - HISTORY     # the window: the step and the HISTORY - 1 before it
    out[:, :, 0:2 * nf:2] = flags
    out[:, :, 1:2 * nf:2] = np.where(last[:, :, :nf] > start, 1.0,
                                     np.where(last[:, :, nf:2 * nf] > start, 0.0, np.nan))
    cur = np.concatenate([np.where(known, counts, 0.0), known], axis=2)   # [T, N, 2C], as the ring keeps it
    if t == 1:
        tot = state.fring.sum(axis=0)[None] + cur
    else:
        tot = _windows(state.fring, state.fhead, cur).sum(axis=-1)           # [T, N, 2C]
    c = 2 * nf
    out[:, :, c::3] = counts
    out[:, :, c + 1::3] = np.where(tot[:, :, nc:] > 0, tot[:, :, :nc], np.nan)
    out[:, :, c + 2::3] = np.minimum((st - last[:, :, 2 * nf:]) * (STEP_SECONDS / 60.0), SINCE_CAP_MINUTES)
    state.fhead = _push(state.fring, state.fhead, cur)
    state.flast = last[-1].copy()
    state.rings = None
    return out


def kernel_threads() -> int:
    """Threads for the one-step kernel over many nodes: FORESHOCK_PREDICT_THREADS, else up to 2."""
    import os

    try:
        n = int(os.environ.get("FORESHOCK_PREDICT_THREADS", "0"))
    except ValueError:
        n = 0
    return n if n > 0 else min(2, os.cpu_count() or 1)


def _compute_step_numpy(x: np.ndarray, steps: np.ndarray, state: FeatureState) -> np.ndarray:
    """compute() for one step (the online scorer's every round): x [N, S] -> [N, 1, N_FEATURES].

    The same arithmetic on the same operands as the block path above, element by element, so the
    values are bit-identical (tests/test_predictor_skew.py, test_block_size_does_not_change_features);
    only the layout differs: ring entries are read as views, each window is one subtraction over all
    summed columns, and the features are written straight into the float32 result.
    """
    n = x.shape[0]
    out = np.empty((n, N_FEATURES), dtype=np.float32)
    r, h = RING, state.head
    xs = x[:, SUM_IDX]
    vs = ~np.isnan(xs)
    xs[~vs] = 0.0
    c = state.cum + xs
    cv = state.cumv + vs
    lag5, lag5v = state.ring[(h - 5) % r], state.ringv[(h - 5) % r]
    lag30, lag30v = state.ring[h % r], state.ringv[h % r]          # HISTORY == RING steps back
    d5, n5 = c - lag5, cv - lag5v
    d30, n30 = c - lag30, cv - lag30v
    col = 0

    k = len(COUNT_IDX)
    # interleaved per signal (1m, 5m, 30m), as the block path's stack(..., axis=-1)
    out[:, col:col + 3 * k:3] = np.where(vs[:, S_COUNT], xs[:, S_COUNT], np.nan)
    out[:, col + 1:col + 3 * k:3] = np.where(n5[:, S_COUNT] > 0, d5[:, S_COUNT], np.nan)
    out[:, col + 2:col + 3 * k:3] = np.where(n30[:, S_COUNT] > 0, d30[:, S_COUNT], np.nan)
    col += 3 * k

    xb = xs[:, S_BASE]
    seen = state.seen + 1.0
    den_base = 1.0 - (1.0 - EWMA_ALPHA) ** seen
    den_recent = 1.0 - (1.0 - RECENT_ALPHA) ** seen
    eps = 1.0 / HISTORY
    y = EWMA_ALPHA * xb + state.z
    zf = (1.0 - EWMA_ALPHA) * y
    baseline = y / den_base[:, None]
    yr = RECENT_ALPHA * xb + state.zr
    zrf = (1.0 - RECENT_ALPHA) * yr
    recent = yr / den_recent[:, None]
    b30, nb30 = d30[:, S_BASE], n30[:, S_BASE]
    with np.errstate(invalid="ignore", divide="ignore"):
        rate30 = np.where(nb30 > 0, b30 / np.maximum(nb30, 1.0), np.nan)
    nb = len(BASE_IDX)
    base_eps = baseline + eps
    out[:, col:col + nb] = (rate30 + eps) / base_eps
    col += nb
    out[:, col:col + nb] = (recent + eps) / base_eps
    col += nb

    g = x[:, GAUGE_IDX]
    if state.gmax is None:
        state.gmax = _SlidingMax(state.gring, state.ghead)
    gmax = np.fmax(g, state.gmax.current())
    k = len(GAUGE_IDX)
    out[:, col:col + 2 * k:2] = g
    out[:, col + 1:col + 2 * k:2] = gmax
    col += 2 * k

    cr = S_RISE
    ra, rn = d5[:, cr], n5[:, cr]
    l25, l25v = state.ring[(h - 25) % r][:, cr], state.ringv[(h - 25) % r][:, cr]
    old_a = l25 - lag30[:, cr]
    old_n = l25v - lag30v[:, cr]
    with np.errstate(invalid="ignore", divide="ignore"):
        out[:, col:col + len(RISE_IDX)] = np.where((rn > 0) & (old_n > 0), ra / rn - old_a / old_n, np.nan)
    col += len(RISE_IDX)

    st = float(steps[0])
    ev = np.nan_to_num(x[:, SINCE_IDX]) > 0
    last = np.maximum(state.last_event, np.where(ev, st, -np.inf))
    out[:, col:col + len(SINCE_IDX)] = np.minimum((st - last) * (STEP_SECONDS / 60.0), SINCE_CAP_MINUTES)
    col += len(SINCE_IDX)

    p5, pn5 = d5[:, S_PEER], n5[:, S_PEER]
    p30, pn30 = d30[:, S_PEER], n30[:, S_PEER]
    k = len(PEER_IDX)
    with np.errstate(invalid="ignore", divide="ignore"):
        out[:, col:col + 2 * k:2] = np.where(pn5 > 0, p5 / np.maximum(pn5, 1.0), np.nan)
        out[:, col + 1:col + 2 * k:2] = np.where(pn30 > 0, p30 / np.maximum(pn30, 1.0), np.nan)
    col += 2 * k
    assert col == N_KERNEL
    _decayed_step(x, state, out)
    _steady_step(x, state, out, den_base, den_recent)
    out[:, STEP_TIME_COLS] = _step_times(x[None, :, STEP_TIME_IDX], state)[0]
    out[:, FABRIC_COLS] = _fabric(x[None, :, FABRIC_IDX], steps, state)[0]
    _context_step(x, state, out, den_base)
    out[:, WARMING_COLS] = _warming(x[None, :, WARMING_IDX], out[None, :, _REMAP_DECAYED_COL], state)[0]
    out[:, ONSET_COLS] = x[:, ONSET_IDX]
    anomaly_scores(out)

    state.ring[h] = c
    state.ringv[h] = cv
    state.head = (h + 1) % r
    state.gring[state.ghead] = g
    state.ghead = (state.ghead + 1) % GRING
    if not state.gmax.push(g):
        state.gmax = None
    state.cum, state.cumv = c, cv
    state.z, state.zr = zf, zrf
    state.seen = seen
    state.last_event = last
    return out[:, None, :]


# -- peers -------------------------------------------------------------------------------------------
# base signals the context averages as they are (the link errors it averages are summed below)
CONTEXT_COUNTS = ("ecc_sbe", "remap_correctable", "pcie_replay", "ib_link_error_recovery")
PEER_INPUTS = ("link_err", "traffic", "tcp_retrans", "gpu_err", "temp", "sm_clock") + CONTEXT_COUNTS
# The PEER_INPUTS the CONTEXT_SIGNALS average over the leaf switch's other nodes, in their order.
CONTEXT_INPUTS = [PEER_INPUTS.index(counted) for _, counted, _, _ in CONTEXT_FAMILIES]
GPU_ERRORS = ("ecc_sbe", "pcie_replay", "nvl_err_gpu_max")


def step_inputs(x: np.ndarray, *, kernel: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(peer_inputs(x) [N, T, I], present [N, T]: the node reported a value in the step) of a block's
    per-step signals x [N, T, signals.STEP_NAMES]. kernel: a block of one step in one compiled pass
    over the rows where numba is importable; False: numpy, the written reference (the same values)."""
    from foreshock.predictor import kernels

    if kernel and kernels.AVAILABLE and x.shape[1] == 1:
        n = x.shape[0]
        own, present = np.empty((n, 1, len(PEER_INPUTS))), np.empty((n, 1), dtype=bool)
        kernels.peer_inputs_step(np.ascontiguousarray(x[:, 0], dtype=np.float64), *_peer_input_columns(),
                                 own[:, 0], present[:, 0])
        return own, present
    return peer_inputs(x), ~np.all(np.isnan(x), axis=2)


def _peer_input_columns() -> tuple:
    b = sg.BASE_INDEX
    return (np.array([b[n] for n in sg.IB_LINK_ERRORS], dtype=np.int64),
            np.array([b["ib_traffic"], b["nvl_traffic"]], dtype=np.int64), b["tcp_retrans"],
            np.array([b[n] for n in GPU_ERRORS], dtype=np.int64), b["temp_max"], b["sm_clock_min"],
            np.array([b[n] for n in CONTEXT_COUNTS], dtype=np.int64))


def peer_inputs(base: np.ndarray) -> np.ndarray:
    """[..., S_base] -> [..., len(PEER_INPUTS)]: a node's own link errors, traffic, TCP
    retransmissions, GPU errors, hottest GPU and lowest SM clock per step, then four counts the
    CONTEXT_SIGNALS average beside the link errors (corrected ECC, rows remapped, PCIe replays, link
    error recoveries; unknown: 0).

    Integer-valued (or multiples of 1/64 for gap-scaled counts), so sums over a group are exact
    whatever the order (offline and online agree).
    """
    link = np.nansum(base[..., [sg.BASE_INDEX[n] for n in sg.IB_LINK_ERRORS]], axis=-1)
    traffic = np.nansum(base[..., [sg.BASE_INDEX["ib_traffic"], sg.BASE_INDEX["nvl_traffic"]]], axis=-1)
    retrans = np.nan_to_num(base[..., sg.BASE_INDEX["tcp_retrans"]])
    gpu_err = np.nansum(base[..., [sg.BASE_INDEX[n] for n in GPU_ERRORS]], axis=-1)
    temp = np.nan_to_num(base[..., sg.BASE_INDEX["temp_max"]])
    clock = np.nan_to_num(base[..., sg.BASE_INDEX["sm_clock_min"]])
    context = [np.nan_to_num(base[..., sg.BASE_INDEX[n]]) for n in CONTEXT_COUNTS]
    return np.stack([link, traffic, retrans, gpu_err, temp, clock, *context], axis=-1)


@dataclass
class GroupTotals:
    """Per group (and step): nodes present, sum of each peer input, nodes with a nonzero value."""
    count: np.ndarray   # [G, ...]
    total: np.ndarray   # [G, ..., 3]
    nonzero: np.ndarray  # [G, ..., 3]


# One group's totals at one step as a flat row: [count, the totals of PEER_INPUTS, their nonzero counts]
# (offline.PeerTotals stores its rows so; shards exchange them so, service/coordinator.py).
TOTALS_WIDTH = 1 + 2 * len(PEER_INPUTS)


def check_totals_row(row, where: str) -> np.ndarray:
    """A totals row from outside (another shard's) as float64 [TOTALS_WIDTH]; ValueError naming `where`
    and the fault when it cannot be one: wrong length, not finite, negative, more nonzero than nodes."""
    try:
        a = np.asarray(row, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: not numbers") from None
    if a.shape != (TOTALS_WIDTH,):
        raise ValueError(f"{where}: {a.size} values, a totals row has {TOTALS_WIDTH} "
                         f"(count, {len(PEER_INPUTS)} totals, {len(PEER_INPUTS)} nonzero counts)")
    k = len(PEER_INPUTS)
    if not np.isfinite(a).all():
        raise ValueError(f"{where}: values not finite")
    if a[0] < 1 or a[0] != np.floor(a[0]):
        raise ValueError(f"{where}: count {a[0]} is not a positive whole number")
    nz = a[1 + k:]
    if (nz < 0).any() or (nz > a[0]).any() or (nz != np.floor(nz)).any():
        raise ValueError(f"{where}: nonzero counts {nz.tolist()} not whole numbers within 0..{a[0]:g}")
    return a


def peer_signals(own: np.ndarray, present: np.ndarray, codes: dict[str, np.ndarray],
                 totals: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], *, kernel: bool = False) -> np.ndarray:
    """The PEER_SIGNALS, then the CONTEXT_SIGNALS, of nodes given their own inputs and their groups'
    totals (self included).

    own [M, I]; present [M] (the node had data this step); codes[group] [M] (-1: no group);
    totals[group] = (count [M], total [M, I], nonzero [M, I]) looked up for each row's group, I =
    len(PEER_INPUTS). Gauges (temperature, clock) average over the peers that reported them (nonzero).
    kernel: row by row in the compiled kernel where numba is importable; False: the numpy below, the
    written reference (the same values).
    """
    from foreshock.predictor import kernels

    m = len(own)
    if kernel and kernels.AVAILABLE and m:
        def f64(a):
            return np.ascontiguousarray(a, dtype=np.float64)

        out = np.empty((m, PEER_WIDTH))
        (lc, lt, ln), (jc, jt, jn), (sc, st, _) = (totals[g] for g in ("leaf_switch", "job", "site"))
        kernels.peer_signals_step(f64(own), np.ascontiguousarray(present, dtype=np.bool_),
                                  *(np.ascontiguousarray(codes[g], dtype=np.int64) for g in ("leaf_switch", "job", "site")),
                                  f64(lc), f64(lt), f64(ln), f64(jc), f64(jt), f64(jn), f64(sc), f64(st),
                                  np.asarray(CONTEXT_INPUTS, dtype=np.int64), len(PEER_SIGNALS), out)
        return out
    out = np.full((m, PEER_WIDTH), np.nan)
    p = present.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        cnt, tot, nz = totals["leaf_switch"]
        others = cnt - p
        ok = (codes["leaf_switch"] >= 0) & (others > 0)
        own_nz = (own[:, 0] > 0) * p
        out[:, 0] = np.where(ok, (nz[:, 0] - own_nz) / others, np.nan)
        mean_others = (tot[:, 0] - own[:, 0] * p) / others
        out[:, 1] = np.where(ok & present, (own[:, 0] + 1.0) / (mean_others + 1.0), np.nan)
        # the neighbourhood is as loud whether or not the node itself reported this step
        usual = (tot[:, CONTEXT_INPUTS] - own[:, CONTEXT_INPUTS] * p[:, None]) / others[:, None]
        out[:, len(PEER_SIGNALS):] = np.where(ok[:, None], usual, np.nan)
        cnt, tot, nz = totals["job"]
        others = cnt - p
        ok = (codes["job"] >= 0) & (others > 0) & present
        mean_others = (tot[:, 1] - own[:, 1] * p) / others
        out[:, 2] = np.where(ok & (mean_others > 0), own[:, 1] / mean_others, np.nan)
        cnt, tot, nz = totals["site"]
        others = cnt - p
        ok = (codes["site"] >= 0) & (others > 0)
        out[:, 3] = np.where(ok, (tot[:, 2] - own[:, 2] * p) / others, np.nan)
        cnt, tot, nz = totals["job"]
        others = cnt - p
        ok = (codes["job"] >= 0) & (others > 0) & present
        mean_others = (tot[:, 3] - own[:, 3] * p) / others
        out[:, 4] = np.where(ok, (own[:, 3] + 1.0) / (mean_others + 1.0), np.nan)
        for col, k, relative in ((5, 4, False), (6, 5, True)):
            own_known = own[:, k] > 0
            reporting = nz[:, k] - own_known * p
            mean_others = (tot[:, k] - own[:, k] * p) / reporting
            ok = (codes["job"] >= 0) & (reporting > 0) & present & own_known
            out[:, col] = np.where(ok, own[:, k] / mean_others if relative else own[:, k] - mean_others, np.nan)
    out[~present, :len(PEER_SIGNALS)] = np.nan
    return out
