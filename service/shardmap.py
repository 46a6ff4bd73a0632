"""The shard map: which `foreshock serve --shard NAME` instance serves which nodes, and at what address.

A sharded control plane splits the cluster by leaf switch (docs/scaling.md, "Past one instance:
sharding"): every node of a leaf lands in one shard, so a leaf's peers, its blast radius and its fabric
incidents stay in one scorer. The same TOML file is read by every shard (`foreshock serve --shard NAME
--shard-map FILE`) and by every collector (`foreshock collect --shard-map FILE`):

    [shards.a]
    address = "shard-a.foreshock:7443"       # HOST:PORT the shard's collectors stream to
    leaves = ["leaf-01", "leaf-02"]          # the leaf switches it owns ...
    [shards.b]
    address = "shard-b.foreshock:7443"
    selector = { site = "dc2" }              # ... or every node whose inventory labels match all of these

Rules, each refused with an error naming the file and the offending shard, key, leaf or node:
- the file holds one table, `shards`; each shard has a name of letters, digits, `.`, `_`, `-`, an
  `address` (HOST:PORT, no two shards alike: they would redirect to each other) and `leaves`, a
  `selector`, or both;
- a selector's labels are among SELECTOR_LABELS: the ones every node of a leaf shares (a label that may
  differ within a leaf, such as an NVLink domain or a job, would split the leaf across shards);
- a leaf listed by two shards, and a node that a shard's leaves and another shard's selector (or two
  selectors) both claim, is in two shards: refused.
Given the cluster's inventory (node -> leaf switch and labels), `check_inventory` also refuses a leaf
the map names that the inventory does not have, and leaves (and nodes without a leaf) that no shard owns.

`ShardMap.shard_of(node, leaf_switch, labels)` is the one routing rule both sides use. A shard refuses a
collector of another shard with FAILED_PRECONDITION and the right shard in the trailing metadata
(SHARD_KEY, ADDRESS_KEY); a collector sends its labels as call metadata (LABEL_KEYS) so a shard can place
it before any inventory arrives. `ShardMapFile` is the map of a file that may change under a running
collector or shard (re-read when its mtime changes, or when asked on SIGHUP; a shard also refuses a
version that `shard_check` refuses: one that drops the shard, or does not fit the inventory).

A shard that takes a new map re-places every node it admitted (`ShardGate.take`): the nodes the map
now puts elsewhere are `departed` once (for the service to forget them: their risk, alarms and
per-node metrics) and `gone` until they are admitted here again, and their next batch is refused with
the new owner's address, so their collectors move. `changes` says in words what moved.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import threading
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from foreshock.config import parse_listen

log = logging.getLogger(__name__)

# Inventory labels a selector may use: leaf-wide ones only (see the module docstring).
SELECTOR_LABELS = ("site", "spine")
# Everything a node is placed by: its leaf switch and the selector labels.
PLACEMENT_LABELS = ("leaf_switch",) + SELECTOR_LABELS
SHARD_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# A label's value as a collector may send it: gRPC metadata carries printable ASCII only.
LABEL_VALUE_RE = re.compile(r"^[\x21-\x7e]{0,256}$")

# gRPC metadata. The redirect, in a refusal's trailing metadata: the shard the node belongs to and its
# address. A collector's labels, in its stream's call metadata: label -> metadata key.
SHARD_KEY = "foreshock-shard"
ADDRESS_KEY = "foreshock-shard-address"
LABEL_KEYS = {label: "foreshock-" + label.replace("_", "-") for label in PLACEMENT_LABELS}

MAX_NAMES = 10   # offending names an error lists before it says how many more
# An inventory table a shard decodes on the event loop to place a node: one node's rows are a few KB;
# a bigger one is left to ingest's round (the node is then placed by what else is known of it).
MAX_PLACING_INVENTORY_BYTES = 64 << 10


class ShardMapError(ValueError):
    """A shard map that cannot be used, or a node it cannot place; the message names the file and the
    offending shard, key, leaf or node."""


def _names(items: Iterable[str]) -> str:
    items = sorted(items)
    more = f" and {len(items) - MAX_NAMES} more" if len(items) > MAX_NAMES else ""
    return ", ".join(items[:MAX_NAMES]) + more


@dataclass(frozen=True)
class Shard:
    name: str
    address: str                                 # HOST:PORT its collectors stream to
    leaves: frozenset[str] = frozenset()         # leaf switches it owns by name
    selector: tuple[tuple[str, str], ...] = ()   # (label, value): it owns every node matching all of them

    def owns(self, leaf_switch: str, labels: Mapping[str, str]) -> bool:
        if leaf_switch and leaf_switch in self.leaves:
            return True
        return bool(self.selector) and all(labels.get(k) == v for k, v in self.selector)


@dataclass(frozen=True)
class ShardMap:
    source: str                   # the file it was read from (named in every error)
    shards: tuple[Shard, ...]     # in the file's order

    def names(self) -> list[str]:
        return [s.name for s in self.shards]

    @functools.cached_property
    def digest(self) -> str:
        """The map's identity: a hash of what it says (not of the file's bytes, so comments and order
        do not change it), the same in every shard that holds the same map."""
        h = hashlib.sha256()
        for s in sorted(self.shards, key=lambda s: s.name):
            h.update(repr((s.name, s.address, sorted(s.leaves), s.selector)).encode())
        return h.hexdigest()[:12]

    def shard(self, name: str) -> Shard:
        """The shard called `name`; ShardMapError naming it and the map's shards if there is none."""
        for s in self.shards:
            if s.name == name:
                return s
        raise ShardMapError(f"shard map {self.source}: no shard {name!r} (it has {', '.join(self.names())})")

    def owners(self, leaf_switch: str, labels: Mapping[str, str]) -> list[Shard]:
        return [s for s in self.shards if s.owns(leaf_switch, labels)]

    def shard_of(self, node: str, leaf_switch: str, labels: Mapping[str, str] | None = None) -> Shard:
        """The one shard that serves `node`, on leaf `leaf_switch` with inventory `labels` (site, spine);
        ShardMapError naming the node and its leaf when no shard, or more than one, claims it."""
        labels = labels or {}
        owners = self.owners(leaf_switch, labels)
        if len(owners) == 1:
            return owners[0]
        where = f"node {node!r} (leaf switch {leaf_switch!r}" + "".join(
            f", {k} {labels[k]!r}" for k in SELECTOR_LABELS if labels.get(k)) + ")"
        if not owners:
            raise ShardMapError(f"shard map {self.source}: {where} is in no shard")
        raise ShardMapError(f"shard map {self.source}: {where} is in two shards: "
                            f"{', '.join(s.name for s in owners)}")

    def check_inventory(self, inventory: Mapping[str, Mapping[str, str]]) -> None:
        """Hold the map to the cluster's inventory, node -> its labels (leaf_switch, site, spine): a leaf
        the map names that the inventory has not, a node in two shards, and leaves (or nodes without a
        leaf) no shard owns are refused together, each list naming its offenders."""
        known_leaves = {labels.get("leaf_switch") or "" for labels in inventory.values()} - {""}
        problems = []
        unknown = {leaf for s in self.shards for leaf in s.leaves} - known_leaves
        if unknown:
            problems.append(f"leaves the inventory does not have: {_names(unknown)}")
        twice, unowned, leafless = [], set(), set()
        for node, labels in inventory.items():
            leaf = labels.get("leaf_switch") or ""
            owners = self.owners(leaf, labels)
            if len(owners) > 1:
                twice.append(f"{node} ({', '.join(s.name for s in owners)})")
            elif not owners:
                if leaf:
                    unowned.add(leaf)
                else:
                    leafless.add(node)
        if twice:
            problems.append(f"nodes in two shards: {_names(twice)}")
        if unowned:
            problems.append(f"leaves no shard owns: {_names(unowned)}")
        if leafless:
            problems.append(f"nodes without a leaf switch that no selector places: {_names(leafless)}")
        if problems:
            raise ShardMapError(f"shard map {self.source} against the inventory of {len(inventory)} nodes: "
                                + "; ".join(problems))


def parse(data: Mapping, source: str) -> ShardMap:
    """A shard map from its TOML tables; `source` names it in errors."""
    def err(where: str, what: str) -> ShardMapError:
        return ShardMapError(f"shard map {source}: {where}: {what}")

    extra = sorted(set(data) - {"shards"})
    if extra:
        raise err(extra[0], "unknown key (the file holds one table, [shards.NAME])")
    table = data.get("shards")
    if not isinstance(table, Mapping) or not table:
        raise err("[shards]", "missing or empty: give at least one [shards.NAME] with address and leaves")
    shards: list[Shard] = []
    owner_of_leaf: dict[str, str] = {}
    owner_of_address: dict[str, str] = {}
    for name, spec in table.items():
        where = f"[shards.{name}]"
        if not SHARD_NAME_RE.match(name):
            raise err(where, "a shard name is 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        if not isinstance(spec, Mapping):
            raise err(where, "must be a table with address and leaves or selector")
        extra = sorted(set(spec) - {"address", "leaves", "selector"})
        if extra:
            raise err(f"{where} {extra[0]}", "unknown key (known: address, leaves, selector)")
        address = spec.get("address")
        if not isinstance(address, str) or not address:
            raise err(f"{where} address", "missing: HOST:PORT the shard's collectors stream to")
        try:
            _, port = parse_listen(address)
        except ValueError as exc:
            raise err(f"{where} address", str(exc)) from None
        if not port or address.startswith(":"):
            raise err(f"{where} address", f"{address!r} must name a host and a port other than 0")
        if address in owner_of_address:
            raise err(f"{where} address", f"{address!r} is shard {owner_of_address[address]!r}'s too")
        owner_of_address[address] = name
        leaves = spec.get("leaves", [])
        if not isinstance(leaves, list) or not all(isinstance(x, str) and x for x in leaves):
            raise err(f"{where} leaves", "must be a list of leaf switch names")
        for leaf in leaves:
            if leaf in owner_of_leaf:
                other = owner_of_leaf[leaf]
                raise err(f"{where} leaves", f"leaf {leaf!r} is in two shards: "
                                             f"{other}{'' if other == name else ', ' + name}")
            owner_of_leaf[leaf] = name
        selector = spec.get("selector", {})
        if not isinstance(selector, Mapping):
            raise err(f"{where} selector", "must be a table of label = value")
        for label, value in selector.items():
            if label not in SELECTOR_LABELS:
                raise err(f"{where} selector {label}", f"not a label a selector may use ({', '.join(SELECTOR_LABELS)}: "
                                                       "the ones every node of a leaf shares)")
            if not isinstance(value, str) or not value:
                raise err(f"{where} selector {label}", "must be a non-empty string")
        if not leaves and not selector:
            raise err(where, "owns nothing: give leaves, a selector, or both")
        shards.append(Shard(name, address, frozenset(leaves), tuple(sorted(selector.items()))))
    # Two selectors, or one shard's leaves and another's selector, may both claim a node: caught where
    # the node is seen (check_inventory at a start, shard_of at routing), since the map alone cannot tell.
    return ShardMap(source, tuple(shards))


def load(path: str | os.PathLike) -> ShardMap:
    """Read and check a shard map file; ShardMapError naming the file on any problem."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ShardMapError(f"shard map {p}: does not exist") from None
    except OSError as exc:
        raise ShardMapError(f"shard map {p}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ShardMapError(f"shard map {p}: not valid TOML: {exc}") from None
    return parse(data, str(p))


class ShardMapFile:
    """The map in a file that may change while a collector or a shard runs: `current()` re-reads it when
    its mtime (or size) changed, or after `request_reload()` (SIGHUP); the cost when nothing changed is
    one stat(). A new version that does not load, or that a check refuses (`check`, `add_check`: a
    callable raising ShardMapError), is logged naming the file and why, and the last good map stays in
    force (`refused` says why until a later version is taken). The first version's error is raised."""

    def __init__(self, path: str | os.PathLike, check: Callable[[ShardMap], None] | None = None):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._reload = False
        self._checks = [check] if check is not None else []
        self._stamp = self._stat()
        self._map = self._read()
        self.reloads = 0   # new versions taken
        self.failed_reloads = 0
        self.refused = ""  # why the file's latest version is not in force; "": it is

    def add_check(self, check: Callable[[ShardMap], None]) -> None:
        """Refuse, from now on, versions `check` raises ShardMapError for; the map in force must pass it."""
        check(self._map)
        self._checks.append(check)

    def _read(self) -> ShardMap:
        fresh = load(self.path)
        for check in self._checks:
            check(fresh)
        return fresh

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def request_reload(self) -> None:
        """Re-read the file at the next `current()` whatever its mtime (safe from a signal handler)."""
        self._reload = True

    def current(self) -> ShardMap:
        stamp = self._stat()
        if stamp == self._stamp and not self._reload:
            return self._map
        with self._lock:
            self._reload = False
            self._stamp = stamp
            try:
                fresh = load(self.path)
                if fresh == self._map:
                    self.refused = ""
                    return self._map   # the same map: its readers have nothing to redo
                for check in self._checks:
                    check(fresh)
            except ShardMapError as exc:
                self.failed_reloads += 1
                self.refused = str(exc)
                log.error("%s; the map read before (%s) stays in force", exc, self._map.digest)
                return self._map
            self.reloads += 1
            self.refused = ""
            log.info("shard map %s: read again (%d shards, digest %s)", self.path, len(fresh.shards), fresh.digest)
            self._map = fresh
            return fresh


def inventory_labels(root: str) -> dict[str, dict[str, str]]:
    """Each node's placement labels in the latest inventory row of the dataset at `root`; ShardMapError
    naming the dataset when it has none or cannot be read."""
    from foreshock.dataset import read_table

    try:
        rows = read_table(root, "inventory", columns=["node", "ts", *PLACEMENT_LABELS]).to_pylist()
    except (OSError, ValueError) as exc:
        raise ShardMapError(f"shard inventory {root}: {exc}") from None
    if not rows:
        raise ShardMapError(f"shard inventory {root}: no inventory rows (a dataset with an inventory table)")
    return {row["node"]: {k: row[k] or "" for k in PLACEMENT_LABELS} for row in rows}   # sorted by ts: the last wins


def shard_check(name: str, inventory_root: str = "",
                inventory: Mapping[str, Mapping[str, str]] | None = None) -> Callable[[ShardMap], None]:
    """What a shard holds every version of its map to: it names shard `name`, and it fits the inventory
    (the dataset at `inventory_root`, read again each time, so a new leaf there counts; and/or a fixed
    node -> labels mapping). A ShardMapFile check: ShardMapError naming the file and the offenders."""
    def check(m: ShardMap) -> None:
        m.shard(name)
        if inventory_root:
            m.check_inventory(inventory_labels(inventory_root))
        if inventory:
            m.check_inventory(inventory)
    return check


def changes(old: ShardMap, new: ShardMap, name: str) -> str:
    """What `new` changes for shard `name` against `old`, in words for a log line: the leaves and the
    selector it took and gave up, its address, and the shards added, removed or moved elsewhere."""
    mine_old, mine_new = old.shard(name), new.shard(name)
    parts = []
    came, went = mine_new.leaves - mine_old.leaves, mine_old.leaves - mine_new.leaves
    if came:
        parts.append(f"leaves moved in: {_names(came)}")
    if went:
        owners = {leaf: next((s.name for s in new.shards if leaf in s.leaves), "no shard") for leaf in went}
        parts.append("leaves moved out: " + _names(f"{leaf} (to {owners[leaf]})" for leaf in went))
    if mine_old.selector != mine_new.selector:
        def sel(selector):
            return "{" + ", ".join(f"{k} = {v!r}" for k, v in selector) + "}" if selector else "none"
        parts.append(f"selector {sel(mine_old.selector)} -> {sel(mine_new.selector)}")
    if mine_old.address != mine_new.address:
        parts.append(f"its address {mine_old.address} -> {mine_new.address}")
    before = {s.name: s for s in old.shards}
    after = {s.name: s for s in new.shards}
    if set(after) - set(before):
        parts.append(f"shards added: {_names(set(after) - set(before))}")
    if set(before) - set(after):
        parts.append(f"shards removed: {_names(set(before) - set(after))}")
    moved = {n for n in set(before) & set(after) if n != name and before[n] != after[n]}
    if moved:
        parts.append(f"shards changed: {_names(moved)}")
    return "; ".join(parts) or "nothing for this shard"


def labels_of(topology) -> dict[str, str]:
    """A node's placement labels from anything with the attributes (service.nodes.Topology)."""
    return {k: getattr(topology, k, "") or "" for k in PLACEMENT_LABELS}


def labels_from_metadata(metadata) -> dict[str, str]:
    """The placement labels a collector's stream carries (LABEL_KEYS), from gRPC call metadata."""
    by_key = {key: label for label, key in LABEL_KEYS.items()}
    out = dict.fromkeys(PLACEMENT_LABELS, "")
    for key, value in metadata or ():
        label = by_key.get(key)
        if label is not None and isinstance(value, str):
            out[label] = value[:256]
    return out


def labels_in_inventory(arrow_ipc: bytes, node: str) -> dict[str, str] | None:
    """The placement labels of `node` in a whole schema-v1 inventory table (Arrow IPC); None when it
    does not parse, is over MAX_PLACING_INVENTORY_BYTES or has no row of the node (ingest then says
    why, in the batch's ack)."""
    import pyarrow as pa

    if len(arrow_ipc) > MAX_PLACING_INVENTORY_BYTES:
        return None
    try:
        rows = pa.ipc.open_stream(arrow_ipc).read_all().select(["node", *PLACEMENT_LABELS]).to_pylist()
    except Exception:  # noqa: BLE001 - bytes a collector sent; ingest refuses them with the reason
        return None
    for row in reversed(rows):
        if row["node"] == node:
            return {k: row[k] or "" for k in PLACEMENT_LABELS}
    return None


class ShardGate:
    """This shard's admission rule for telemetry: a node is taken only if the map places it here.

    A node is placed by the freshest labels there are: an inventory row of it in the batch, else the
    topology this service holds for it, else the labels its collector's stream carries (else, for a
    node that a new map moved away, the labels it was last admitted under). A node of another shard is
    refused with WrongShard (FAILED_PRECONDITION, the right shard and its address); a node the map
    cannot place (no shard, two shards, no labels at all) with FailedPrecondition saying why. Refused
    telemetry is never acknowledged, so its collector keeps it for the right shard.

    `take(new_map)` puts a new map in force (see the module docstring); `generation` counts the maps
    taken, so a stream admitted under an older one is placed again."""

    def __init__(self, shard_map: ShardMap, name: str):
        self.name = name
        self._in_force = (shard_map, shard_map.shard(name))   # one object: admit reads the pair at once
        self.generation = 0
        self._lock = threading.Lock()
        self.redirected: dict[str, int] = {}   # the right shard -> streams sent there
        self.unplaced = 0                      # streams of nodes the map places nowhere (or twice)
        self._placed: dict[str, dict[str, str]] = {}   # node -> the labels it was last admitted under
        # Nodes a new map moved away, until admitted here again (their labels, to redirect a stream
        # that names none); read without the lock by the rounds, so replaced rather than changed.
        self.gone: dict[str, dict[str, str]] = {}
        self._departed: dict[str, str] = {}   # node -> its new shard ("" none), not yet forgotten
        self.moved_away = 0                   # nodes that new maps moved away

    @property
    def map(self) -> ShardMap:
        return self._in_force[0]

    @property
    def shard(self) -> Shard:
        return self._in_force[1]

    def admit(self, node: str, labels: Mapping[str, str]) -> None:
        from foreshock.service.errors import FailedPrecondition, WrongShard

        shard_map, shard = self._in_force
        if not any(labels.get(k) for k in PLACEMENT_LABELS):
            labels = self.gone.get(node, labels)
        leaf = labels.get("leaf_switch") or ""
        if not any(labels.get(k) for k in PLACEMENT_LABELS):
            with self._lock:
                self.unplaced += 1
            raise FailedPrecondition(
                f"node {node!r}: shard {shard.name!r} cannot tell which shard serves it: no inventory from "
                f"it yet and its stream names no leaf switch (a collector of a sharded control plane is given "
                f"--leaf-switch, or sends its inventory first)")
        try:
            owner = shard_map.shard_of(node, leaf, labels)
        except ShardMapError as exc:
            with self._lock:
                self.unplaced += 1
            raise FailedPrecondition(f"{exc}: shard {shard.name!r} takes none of its telemetry") from None
        if owner.name != shard.name:
            with self._lock:
                self.redirected[owner.name] = self.redirected.get(owner.name, 0) + 1
            raise WrongShard(f"node {node!r} on leaf switch {leaf!r} belongs to shard {owner.name!r} at "
                             f"{owner.address}, not to this shard {shard.name!r}: stream to {owner.address}",
                             owner.name, owner.address)
        placed = {k: labels.get(k) or "" for k in PLACEMENT_LABELS}
        with self._lock:
            self._placed[node] = placed
            if self._in_force[0] is not shard_map:
                # A map taken since this node was placed: this batch is taken, the stream's next one is
                # placed again; meanwhile the new map judges the node as take() judged the others.
                moved = self._owners(self._in_force[0], [node])
                if moved:
                    self._moved(moved)
                    return
            if node in self.gone:
                self.gone = {n: v for n, v in self.gone.items() if n != node}
                self._departed.pop(node, None)

    def take(self, new_map: ShardMap) -> dict[str, str]:
        """Put `new_map` in force (it names this shard: ShardMapError if not). Returns the nodes admitted
        here that it places elsewhere, node -> their shard ("": none): they are `gone` from now on, and
        `take_departed` hands them over once."""
        shard = new_map.shard(self.name)
        with self._lock:
            moved = self._owners(new_map, list(self._placed))
            self._moved(moved)
            self._in_force = (new_map, shard)
            self.generation += 1
        return moved

    def _owners(self, shard_map: ShardMap, nodes: list[str]) -> dict[str, str]:
        """Those of `nodes` (admitted here) that `shard_map` places elsewhere -> their shard ("": none)."""
        out = {}
        for node in nodes:
            labels = self._placed[node]
            try:
                owner = shard_map.shard_of(node, labels["leaf_switch"], labels).name
            except ShardMapError:
                owner = ""
            if owner != self.name:
                out[node] = owner
        return out

    def _moved(self, moved: dict[str, str]) -> None:
        if moved:
            self.gone = {**self.gone, **{node: self._placed.pop(node) for node in moved}}
            self._departed.update(moved)
            self.moved_away += len(moved)

    def take_departed(self) -> dict[str, str]:
        """The nodes moved away since the last call, node -> their new shard ("": none), once each."""
        if not self._departed:
            return {}
        with self._lock:
            out, self._departed = self._departed, {}
        return out
