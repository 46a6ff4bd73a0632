"""The scenario catalogue: every knob of a simulated world, its clean value and its random range, as data.

`foreshock simulate --world clean` (the default) is the world the simulator always made: each knob at its
clean value. `--world random` draws every pod-level knob per POD (the nodes under one leaf switch), from
a stream keyed by (seed, pod), so one dataset holds as many worlds as it has leaves; episode-level knobs
are drawn per episode from the episode's own stream. A scenario file sets single knobs in a
`[simulate.knobs]` table: a number (or a string for a choice) fixes the knob in every pod, a two-number
list [low, high] draws it uniformly from that range per pod, in either world.

Each entry names its source (../shared/reference/failure-figures.md, signals.md, the InfiniteHBD trace in
../shared/datasets/infinitehbd-trace) or says "assumption". docs/simulator.md has the same table, and
tests/test_simulator_worlds.py checks that it lists every knob. The physics that reads a knob is in
foreshock.simulator.model and .faults; precursor shapes are defined here (`shape_intensity`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

WORLDS = ("clean", "random")
NS = 1_000_000_000
DAY_NS = 86400 * NS


@dataclass(frozen=True)
class Knob:
    """One knob. `draw` is ("uniform" | "loguniform", low, high) or ("choice", values, weights)."""

    name: str
    level: str            # pod: one value per pod | world: one per run | episode: one per episode
    clean: object
    draw: tuple
    source: str
    meaning: str

    def sample(self, rng: np.random.Generator, override=None):
        kind, *args = self.draw
        if override is not None:
            if isinstance(override, (list, tuple)):
                lo, hi = (float(v) for v in override)
                return float(rng.uniform(lo, hi))
            rng.random()  # the same number of draws as the catalogue's, so other knobs do not move
            return override
        if kind == "uniform":
            return float(rng.uniform(*args))
        if kind == "loguniform":
            return float(math.exp(rng.uniform(math.log(args[0]), math.log(args[1]))))
        values, weights = args
        p = np.asarray(weights, float) / sum(weights)
        return values[int(rng.choice(len(values), p=p))]


# Knobs drawn from a stream of their own (name -> stream number), so that adding them moved no other draw.
OWN_STREAM = {"job_traffic_imbalance": 1, "link_recovery_per_device_day": 2}

SHAPES = ("ramp", "step", "bursts", "exponential", "drift")
# Alternative signatures a failure mode can take; the first is the clean world's. Some carry a shape.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "hbm": ("ecc", "remaps+temp", "ecc_step"),
    "gpu_off_bus_pcie": ("replays", "replay_bursts", "x8"),
    "ib_cable": ("symbols", "recoveries"),
    "straggler": ("peer_lag", "job_slow"),
    "nvlink": ("crc",), "sram": ("ecc",), "thermal": ("temp",), "nic": ("cqe",),
    "leaf_switch": ("ports",), "scale_across": ("tcp",), "nvswitch": ("sxid",),
}
SIGNATURE_SHAPE = {"ecc_step": "step", "replay_bursts": "bursts"}
# Look-alikes only: what a benign episode of a mode may show in the random world besides its signatures.
LOOKALIKE_SIGNATURES = {"hbm": ("single_remap",)}

FF, SIG, HBD = ("../shared/reference/failure-figures.md", "../shared/reference/signals.md",
                "../shared/datasets/infinitehbd-trace (StepFun, SIGCOMM 2025)")

KNOBS: tuple[Knob, ...] = (
    # node types
    Knob("gpus_per_node", "pod", 0, ("choice", (8, 4), (0.6, 0.4)), "assumption (HGX 8-GPU boards; "
         "4-GPU boards such as GH200 or PCIe servers)", "GPUs per node, at most --gpus-per-node (0: that many)"),
    Knob("hcas_per_node", "pod", 0, ("choice", (8, 4), (0.6, 0.4)), "assumption (one 400G HCA per GPU, "
         "or one per two)", "HCAs per node, at most --hcas-per-node (0: that many)"),
    Knob("nvlinks_per_gpu", "pod", 0, ("choice", (18, 12), (0.6, 0.4)), f"{SIG}: H100/H200 have 18 links; "
         "A100 has 12 (assumption)", "NVLink links per GPU (0: 18): links_total; NVLink bytes scale with it"),
    Knob("pcie_gen", "pod", 0, ("choice", (5, 4), (0.6, 0.4)), "assumption (H100 is Gen5, A100 Gen4)",
         "PCIe generation (0: 5): pcie_link_gen_max"),
    # healthy-fleet nuisances
    Knob("chronic_sigma_add", "pod", 0.0, ("uniform", 0.0, 1.0), "assumption (heavy tail: sigma up to 3.5)",
         "added to every healthy device's lognormal rate spread (sigma 1-2.5 in the clean world)"),
    Knob("chronic_scale", "pod", 1.0, ("loguniform", 0.3, 3.0), "assumption",
         "multiplies every healthy device's chronic error rate"),
    Knob("marginal_scale", "pod", 1.0, ("uniform", 0.5, 3.0), "assumption",
         "multiplies the share of marginal-but-stable devices"),
    Knob("burst_scale", "pod", 1.0, ("loguniform", 0.5, 4.0), "assumption",
         "multiplies the rate of benign bursts (a counter spikes for minutes and stops)"),
    Knob("link_recovery_per_device_day", "pod", 0.0, ("loguniform", 0.02, 0.5), "issue 16: on independently "
         "written histories, single NVLink recovery errors and IB link error recoveries on healthy devices were "
         "among the shipped model's false alarms; rate assumed", "median benign link recoveries per device-day "
         "on healthy devices (NVLink DL recoveries per GPU, IB link error recoveries per HCA; lognormal "
         "device spread, sigma 1.5), on top of the rates of the clean world"),
    Knob("idle_pcie_downtrain", "pod", 0, ("choice", (0, 1), (0.3, 0.7)), f"{SIG} (link gen/width readings); "
         "assumption: ASPM power saving drops an idle link to Gen1", "1: idle GPUs report pcie_link_gen 1"),
    Knob("site_temp_amp_c", "pod", 0.0, ("uniform", 3.0, 6.0), "assumption",
         "daily swing of rack inlet temperature (+-degC on GPU and HBM temperature, peak at 15:00 UTC)"),
    Knob("load_spread", "pod", 0.06, ("uniform", 0.06, 0.35), "assumption",
         "a job's load moves by up to this between six-hour segments (the clean world's 0.06)"),
    Knob("load_diurnal", "pod", 0.0, ("uniform", 0.0, 0.25), "assumption",
         "a job's load falls by up to this at night (follows the day)"),
    Knob("job_gap_share", "pod", 0.0, ("uniform", 0.0, 0.2), "assumption",
         "share of six-hour segments in which a job's nodes sit idle between runs"),
    Knob("job_traffic_imbalance", "pod", 0.0, ("uniform", 0.0, 0.25), "assumption: pipeline stages, "
         "embedding shards and rails carry unequal bytes, so healthy nodes of one job differ in traffic",
         "each node of a job carries 1 +- up to this of its job's fabric traffic per device, fixed for "
         "the job's run (drawn per node and run)"),
    Knob("job_epoch_h", "world", 0.0, ("choice", (12.0, 24.0, 48.0, 96.0), (1, 1, 1, 1)), "assumption",
         "every this many hours the jobs end and new ones start on rotated nodes, so nodes move between jobs "
         "and the spares; the inventory gets a row at each change (0: never)"),
    # collection noise
    Knob("ts_jitter_s", "pod", 0.0, ("uniform", 0.5, 4.0), "assumption",
         "a node's collector runs up to this behind the tick (per node and day), and 1 % of its samples up to "
         "this later again"),
    Knob("missing_share", "pod", 0.0, ("loguniform", 0.001, 0.02), "assumption", "samples lost at random"),
    Knob("outages_per_node_day", "pod", 0.0, ("loguniform", 0.005, 0.05), "assumption",
         "collector outages (a node's rows missing for 5 min to 3 h, lognormal median 30 min)"),
    Knob("reloads_per_node_day", "pod", 0.0, ("loguniform", 0.002, 0.02), "assumption",
         "driver reloads / benign reboots: every volatile counter restarts from 0, no failure"),
    Knob("pma_clears_per_node_day", "pod", 0.0, ("choice", (1 / 7, 0.05, 0.0), (0.4, 0.4, 0.2)),
         f"{SIG}: narrow PMA error counters saturate and are cleared (fabric manager, perfquery -x); "
         "rate assumed", "clears of the IB PMA error counters of every port of a node"),
    # faults
    Knob("lead_sigma", "pod", 0.0, ("uniform", 1.2, 1.6), f"{FF} (Desh/Aarohi: minutes; Minder: > 5 min); "
         "spread assumed", "lognormal sigma of precursor leads (0: the clean world's 0.8-0.9 per mode); "
         "leads from 3 min to 36 h"),
    Knob("faint_share", "pod", 0.0, ("uniform", 0.1, 0.3), "assumption",
         "share of failures whose precursor peaks at only 0.1-0.3 of a failing device's"),
    Knob("repair_median_h", "pod", 0.0, ("choice", (20.4,), (1.0,)), f"{HBD}: repair median 20.4 h",
         "median repair time (0: the clean world's per-category assumptions)"),
    Knob("repair_sigma", "pod", 0.7, ("choice", (2.13,), (1.0,)), f"{HBD}: 90th percentile 312 h, "
         "sigma = ln(312/20.4)/1.2816", "lognormal sigma of repair times (capped at 60 days)"),
    Knob("clean_pod_share", "world", 0.0, ("uniform", 0.3, 0.4), "assumption: fleets differ, and a well-kept "
         "one is as real as a messy one", "share of pods whose every knob keeps its clean value (their "
         "episodes too: ramps of the clean signatures), so the family of worlds holds the clean one"),
    Knob("lookalike_scale", "world", 1.0, ("uniform", 1.5, 4.0), "assumption",
         "multiplies the degrade-then-recover episodes; in the random world they come from every "
         "precursor mode alike (a single remap, a cable fixed by a reseat, a hot GPU that cools)"),
    Knob("shape", "episode", "ramp", ("choice", SHAPES, (1, 1, 1, 1, 1)), "assumption",
         "precursor shape (shape_intensity); some signatures fix it"),
    Knob("signature", "episode", "first", ("choice", ("any",), (1.0,)), "assumption",
         "which of the mode's signatures (SIGNATURES) the episode shows, uniformly"),
)
KNOB = {k.name: k for k in KNOBS}


class WorldError(ValueError):
    """A world or knob setting that does not exist or is out of range; the message names it."""


class World:
    """The knob values of one run: per pod (the nodes under one leaf), per run, and the episode draws."""

    def __init__(self, kind: str = "clean", *, seed: int = 0, n_pods: int = 1, knobs: dict | None = None):
        if kind not in WORLDS:
            raise WorldError(f"world must be one of {', '.join(WORLDS)}, got {kind!r}")
        knobs = dict(knobs or {})
        unknown = sorted(set(knobs) - {k.name for k in KNOBS if k.level != "episode"})
        if unknown:
            raise WorldError(f"[simulate.knobs] {unknown[0]}: unknown knob (known: "
                             f"{', '.join(k.name for k in KNOBS if k.level != 'episode')})")
        for name, value in knobs.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if isinstance(value, (list, tuple)) and (len(value) != 2 or not value[0] <= value[1]):
                raise WorldError(f"[simulate.knobs] {name}: a range is [low, high], got {value!r}")
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values):
                raise WorldError(f"[simulate.knobs] {name}: must be a number >= 0 or [low, high], got {value!r}")
        self.kind, self.seed, self.n_pods, self.overrides = kind, int(seed), int(n_pods), knobs
        self.values: dict[str, np.ndarray] = {}
        # the run's knobs first: a pod's draws read clean_pod_share (the streams are apart, so the
        # order of drawing changes no value)
        wrng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x3D0, 0xFFFF]))
        for k in KNOBS:
            if k.level == "world":
                v = k.sample(wrng, knobs.get(k.name)) if self.random else knobs.get(k.name, k.clean)
                self.values[k.name] = np.array([v])
        pod_draws = [self._draw_pod(p) for p in range(self.n_pods)]
        for k in KNOBS:
            if k.level == "pod":
                self.values[k.name] = np.array([d[k.name] for d in pod_draws])
        self.values["clean_pod"] = np.array([d["clean_pod"] for d in pod_draws], dtype=bool)

    @property
    def random(self) -> bool:
        return self.kind == "random"

    @property
    def varied(self) -> bool:
        """Anything but the clean world as it always was: a random world, or a clean one with knobs set."""
        return self.random or bool(self.overrides)

    def _draw_pod(self, pod: int) -> dict:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x3D0, pod]))
        out = {}
        own = {}
        for k in KNOBS:
            if k.level != "pod":
                continue
            if k.name in OWN_STREAM:
                # a knob added to the catalogue later draws from its own stream: the worlds of every seed
                # keep the values they had for the knobs before it
                own[k.name] = np.random.default_rng(np.random.SeedSequence([self.seed, 0x3D1, pod, OWN_STREAM[k.name]]))
            if self.random or isinstance(self.overrides.get(k.name), (list, tuple)):
                out[k.name] = k.sample(own.get(k.name, rng), self.overrides.get(k.name))
            else:
                out[k.name] = self.overrides.get(k.name, k.clean)
        # drawn after every knob, so that it moves none of them
        out["clean_pod"] = bool(rng.random() < float(self.scalar("clean_pod_share")))
        if out["clean_pod"]:
            out.update({k.name: self.overrides.get(k.name, k.clean) for k in KNOBS
                        if k.level == "pod" and not isinstance(self.overrides.get(k.name), (list, tuple))})
        return out

    def pod(self, name: str, pod: int):
        return self.values[name][pod]

    def per_node(self, name: str, pod_of: np.ndarray) -> np.ndarray:
        return self.values[name][pod_of]

    def scalar(self, name: str):
        return self.values[name][0]

    def episode_draws(self, mode: str, episode_seed: int, pod: int, span_s: float, lookalike: bool = False) -> dict:
        """The random world's per-episode draws (shape, signature, faintness), from the episode's stream."""
        rng = np.random.default_rng(np.random.SeedSequence([episode_seed & ((1 << 63) - 1), 0x5A7E]))
        if self.values["clean_pod"][pod]:
            signature = SIGNATURES.get(mode, ("default",))[0]
            return {"shape": "ramp", "signature": signature, "faint": False, "faint_factor": 1.0,
                    "shape_params": shape_params("ramp", rng, span_s), "hbm_temp_c": 0.0}
        signatures = SIGNATURES.get(mode, ("default",)) + (LOOKALIKE_SIGNATURES.get(mode, ()) if lookalike else ())
        signature = signatures[int(rng.integers(len(signatures)))]
        shape = KNOB["shape"].sample(rng)
        shape = SIGNATURE_SHAPE.get(signature, shape)
        faint = bool(rng.random() < self.pod("faint_share", pod))
        params = shape_params(shape, rng, span_s)
        return {"shape": shape, "signature": signature, "faint": faint, "faint_factor": float(rng.uniform(0.1, 0.3)),
                "shape_params": params, "hbm_temp_c": float(rng.uniform(3.0, 10.0))}

    def collection_events(self, node: int, pod: int, day: int) -> tuple:
        """(outages [(start, end) ns], reloads [ns], clears [ns]) that start on UTC day `day` on a node:
        drawn from a stream keyed by (seed, node, day), so any block or chunk sees the same ones."""
        return _collection_events(self.seed, node, day, float(self.pod("outages_per_node_day", pod)),
                                  float(self.pod("reloads_per_node_day", pod)),
                                  float(self.pod("pma_clears_per_node_day", pod)))


@functools.lru_cache(maxsize=65536)
def _collection_events(seed: int, node: int, day: int, outages: float, reloads: float, clears: float) -> tuple:
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xC011, node, day]))
    t0 = day * DAY_NS

    def times(rate):
        return tuple(sorted(t0 + int(u * DAY_NS) for u in rng.random(rng.poisson(rate))))

    starts = times(outages)
    lengths = np.clip(1800.0 * np.exp(1.0 * rng.standard_normal(len(starts))), 300.0, 3 * 3600.0)
    return (tuple((s, s + int(L * NS)) for s, L in zip(starts, lengths)), times(reloads), times(clears))


def shape_params(shape: str, rng: np.random.Generator, span_s: float) -> tuple:
    """The per-episode parameters of a shape (fixed when the episode is drawn, so every block agrees)."""
    if shape == "step":
        return (float(rng.uniform(0.0, 0.6)),)                      # where the step happens
    if shape == "exponential":
        return (float(rng.uniform(3.0, 8.0)),)                      # growth over the span, e-folds
    if shape == "bursts":
        n = int(rng.integers(6, 20))
        centres = np.sort(rng.random(n) ** (1.0 / 3.0))            # density rises as x^2
        width = np.clip(600.0 * np.exp(0.6 * rng.standard_normal(n)) / max(span_s, 1.0), 0.005, 0.08)
        return tuple((float(c - w / 2), float(c + w / 2)) for c, w in zip(centres, width))
    return ()


STEP_LEVEL = 0.4   # a step holds a constant rate at this share of a failing device's peak rate


def shape_intensity(shape: str, x: np.ndarray, params: tuple = ()) -> np.ndarray:
    """A precursor's intensity in [0, 1] over its span x in [0, 1]."""
    if shape == "ramp":
        return x ** 2
    if shape == "step":
        return np.where(x >= params[0], STEP_LEVEL, 0.0)
    if shape == "exponential":
        k = params[0]
        return np.expm1(k * x) / math.expm1(k)
    if shape == "drift":
        return x.astype(float)
    if shape == "bursts":
        out = np.zeros(x.shape)
        for lo, hi in params:
            out[(x >= lo) & (x < hi)] = 1.0
        return out
    raise WorldError(f"unknown precursor shape {shape!r}")


def shape_mean(shape: str, params: tuple = ()) -> float:
    """The mean intensity over the span, so 'about N events over the precursor' holds for every shape."""
    if shape == "ramp":
        return 1.0 / 3.0
    return max(float(shape_intensity(shape, np.linspace(0.0, 1.0, 4001), params).mean()), 1e-3)


def knob_table() -> str:
    """The catalogue as a markdown table (docs/simulator.md carries it)."""
    lines = ["| knob | level | clean | random | source | meaning |", "|---|---|---|---|---|---|"]
    for k in KNOBS:
        kind, *args = k.draw
        if kind == "choice":
            rnd = " / ".join(str(round(v, 3) if isinstance(v, float) else v) for v in args[0])
        else:
            rnd = f"{kind} {args[0]:g}-{args[1]:g}"
        lines.append(f"| `{k.name}` | {k.level} | {k.clean} | {rnd} | {k.source} | {k.meaning} |")
    return "\n".join(lines)


__all__ = ["KNOBS", "KNOB", "Knob", "SHAPES", "SIGNATURES", "World", "WorldError", "WORLDS", "knob_table",
           "shape_intensity", "shape_mean"]
