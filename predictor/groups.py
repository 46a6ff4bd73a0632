"""The groups evaluation reports by and leave-one-out holds out: incident families, failure signatures, node types.

* An incident's *family* is its `category` (schema-v1 `incidents`, foreshock/schema.py); its
  *signature* is the family and, when the description names a failure mode before a ':'
  ("PCIe: replays climb, ..."), that mode: "faulty_gpu: PCIe" (labels.Incidents carries both).
* A node's *type* is its GPU and HCA counts from the latest `inventory` row that has them
  ("8 GPU / 8 HCA"); a node without them is of type "unknown".
* A `HoldOut` is what a leave-one-out training run leaves out (train.train(holdout=...)): for a
  family or a signature, every step of the nodes its incidents affect from (incident - label gap -
  horizon) to the repair, neither positive nor negative; for a node type, every step of its nodes.
  docs/predictor.md, "Leave one out", defines the evaluation around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

UNKNOWN_TYPE = "unknown"
# the incident column each kind of incident group is read from (labels.Incidents.frame)
INCIDENT_GROUPS = {"family": "category", "signature": "signature"}
KINDS = (*INCIDENT_GROUPS, "node_type")


def signature(category: str, description: str | None) -> str:
    """The incident's failure mode: "category: mode" when the description starts "mode: ...", else the category."""
    if isinstance(description, str) and ":" in description:
        mode = description.split(":", 1)[0].strip()
        if mode:
            return f"{category}: {mode}"
    return category


def node_type(gpus, hcas) -> str:
    if gpus is None or hcas is None or np.isnan(float(gpus)) or np.isnan(float(hcas)):
        return UNKNOWN_TYPE
    return f"{int(gpus)} GPU / {int(hcas)} HCA"


def node_types(inventory: pa.Table | None, nodes=()) -> dict[str, str]:
    """{node: type} from the inventory table (its latest row with both counts); `nodes` missing from it: unknown."""
    out = {node: UNKNOWN_TYPE for node in nodes}
    if inventory is None or inventory.num_rows == 0:
        return out
    df = inventory.select(["ts", "node", "gpus", "hcas"]).to_pandas()
    df = df.dropna(subset=["gpus", "hcas"]).sort_values(["node", "ts"], kind="stable")
    for row in df.groupby("node", sort=False).tail(1).itertuples(index=False):
        out[row.node] = node_type(row.gpus, row.hcas)
    return out


@dataclass(frozen=True)
class HoldOut:
    """Steps a training run leaves out: per node, closed intervals of step ends (ns); None: every step."""

    kind: str
    name: str
    windows: dict[str, list[tuple[int, int]] | None] = field(default_factory=dict)

    def mask(self, node: str, step_end_ns: np.ndarray) -> np.ndarray:
        """[T] bool: the node's steps this run leaves out."""
        if node not in self.windows:
            return np.zeros(len(step_end_ns), dtype=bool)
        spans = self.windows[node]
        if spans is None:
            return np.ones(len(step_end_ns), dtype=bool)
        out = np.zeros(len(step_end_ns), dtype=bool)
        for lo, hi in spans:
            out[np.searchsorted(step_end_ns, lo, side="left"):np.searchsorted(step_end_ns, hi, side="right")] = True
        return out


def incident_holdout(incidents, kind: str, name: str, horizon_s: float, label_gap_s: float) -> HoldOut:
    """The HoldOut of one family or signature: its incidents' nodes from (ts - gap - horizon) to the repair."""
    f = incidents.frame
    part = f[f[INCIDENT_GROUPS[kind]] == name]
    before = int((label_gap_s + horizon_s) * 1e9)
    windows: dict[str, list[tuple[int, int]]] = {}
    for node, ts, end in zip(part["node"], part["ts"].to_numpy(np.int64), part["end"].to_numpy(np.int64)):
        windows.setdefault(node, []).append((int(ts) - before, int(end)))
    return HoldOut(kind, name, windows)


def node_type_holdout(types: dict[str, str], name: str) -> HoldOut:
    return HoldOut("node_type", name, {node: None for node, t in types.items() if t == name})
