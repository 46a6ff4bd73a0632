"""Datasets addressed through pyarrow's filesystem layer (foreshock/dataset.py, DatasetRoot): `foreshock
train` and `foreshock evaluate` on a file:// URI give what the plain path gives; every read of the
readers, the feature builder and the dataset hash goes through the filesystem they are handed (a
pyarrow PyFileSystem whose handler serves the dataset under a path that does not exist on disk, and
records what it is asked); a URI of an unknown scheme, or of storage that does not answer, is refused
naming it, within a deadline."""

from __future__ import annotations

import json
import os
import contextlib
import socket
import threading
import time

import numpy as np
import pyarrow.fs as pafs
import pytest

from foreshock import cli
from foreshock import dataset as ds
from foreshock.predictor import evaluate as ev
from foreshock.predictor import offline, train
from support import free_port

VIRTUAL = "/nowhere-on-disk/dataset"   # where the recording filesystem serves the dataset


class RecordingHandler(pafs.FileSystemHandler):
    """LocalFileSystem under VIRTUAL -> `real`: a path that bypassed the filesystem would name a
    directory that does not exist. Records every path asked for; refuses any outside VIRTUAL.
    Picklable (by reference to this module), so a process pool's workers read through it too."""

    def __init__(self, real: str):
        self.real = str(real)
        self.local = pafs.LocalFileSystem()
        self.asked: list[str] = []
        self.opened: list[str] = []

    def __reduce__(self):
        return RecordingHandler, (self.real,)

    def _map(self, path: str) -> str:
        self.asked.append(path)
        if path != VIRTUAL and not path.startswith(VIRTUAL + "/"):
            raise PermissionError(f"outside the dataset: {path}")
        return self.real + path[len(VIRTUAL):]

    def _back(self, info: pafs.FileInfo) -> pafs.FileInfo:
        return pafs.FileInfo(VIRTUAL + info.path[len(self.real):], info.type, size=info.size,
                             mtime_ns=info.mtime_ns)

    def get_type_name(self):
        return "recording"

    def equals(self, other):
        return isinstance(other, RecordingHandler) and other.real == self.real

    def get_file_info(self, paths):
        return [self._back(i) for i in self.local.get_file_info([self._map(p) for p in paths])]

    def get_file_info_selector(self, selector):
        sel = pafs.FileSelector(self._map(selector.base_dir), allow_not_found=selector.allow_not_found,
                                recursive=selector.recursive)
        return [self._back(i) for i in self.local.get_file_info(sel)]

    def open_input_stream(self, path):
        self.opened.append(path)
        return self.local.open_input_stream(self._map(path))

    def open_input_file(self, path):
        self.opened.append(path)
        return self.local.open_input_file(self._map(path))

    def normalize_path(self, path):
        return path

    def _read_only(self, *args):
        raise PermissionError("the readers write nothing to a dataset")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _read_only
    move = copy_file = open_output_stream = open_append_stream = _read_only


@pytest.fixture(scope="module")
def data(small_world):
    return small_world


def _features(root, **kw) -> dict[str, tuple]:
    with offline.FeatureBuilder(root, **kw) as fb:
        return {nf.node: (nf.steps, nf.X) for nf in fb}


def _same_features(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for node in a:
        assert np.array_equal(a[node][0], b[node][0]) and np.array_equal(a[node][1], b[node][1], equal_nan=True), node


@pytest.mark.slow
def test_train_and_evaluate_on_a_file_uri_give_what_the_plain_path_gives(data, small_world_model, tmp_path, capsys,
                                                                         monkeypatch):
    uri = f"file://{data}"
    r = ds.open_dataset_root(uri)
    assert r.path == str(data) and r.local and str(r) == uri
    for table in ("gpu", "inventory", "incidents"):
        assert ds.read_table(uri, table).equals(ds.read_table(data, table)), table
    assert ds.list_nodes(uri, "gpu") == ds.list_nodes(data, "gpu")
    assert offline.dataset_hash(uri) == offline.dataset_hash(data)
    # the process pool's workers get the root pickled, its filesystem with it, and read there
    _same_features(_features(data, workers=1), _features(uri, workers=2))
    plain, a = small_world_model
    b = train.train(uri, tmp_path / "uri", max_iter=15)
    for key in ("thresholds", "recommended_threshold", "threshold_curves", "metrics"):   # as JSON: NaN == NaN
        assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True), key
    assert a["training"]["data_hash"] == b["training"]["data_hash"] and b["training"]["data"] == uri
    # the command line: a relative plain path (to the cwd) and the URI
    monkeypatch.chdir(data.parent)
    reports = []
    for given in (data.name, uri):
        js = tmp_path / f"e{len(reports)}.json"
        rc = cli.main(["evaluate", "--data", given, "--model", str(plain), "--json", str(js)])
        assert rc == 0, capsys.readouterr().err
        reports.append(json.loads(js.read_text()))
    assert reports[1]["data"] == uri
    for rep in reports:   # the same but for where the data was named
        assert rep.pop("data") == rep["overlap"]["evaluated"].pop("data")
    assert json.dumps(reports[0], sort_keys=True) == json.dumps(reports[1], sort_keys=True)


def test_every_read_goes_through_the_filesystem_it_is_handed(data):
    handler = RecordingHandler(data)
    root = ds.DatasetRoot(pafs.PyFileSystem(handler), VIRTUAL, "recording://dataset")
    assert not os.path.exists(VIRTUAL)
    plain = {t: ds.read_table(data, t) for t in ("gpu", "rdma_port", "inventory", "incidents")}
    for table, want in plain.items():
        assert ds.read_table(root, table).equals(want), table
        assert ds.list_nodes(root, table) == ds.list_nodes(data, table), table
    node = ds.list_nodes(data, "gpu")[3]
    assert ds.read_table(root, "gpu", nodes=[node]).equals(ds.read_table(data, "gpu", nodes=[node]))
    assert [n for n, _ in ds.iter_node_tables(root, "gpu")] == ds.list_nodes(data, "gpu")
    assert [p.name for p in ds.partition_files(root, "gpu")] == [p.name for p in ds.partition_files(data, "gpu")]
    assert offline.list_dataset_nodes(root) == offline.list_dataset_nodes(data)
    got, want = offline.read_node(root, node), offline.read_node(data, node)
    assert set(got) == set(want) and all(got[t].equals(want[t]) for t in want)
    handler.opened.clear()
    assert offline.dataset_hash(root) == offline.dataset_hash(data)
    on_disk = sorted(str(p.relative_to(data)) for p in data.rglob("*.parquet") if not p.name.startswith("."))
    assert sorted(p[len(VIRTUAL) + 1:] for p in handler.opened) == on_disk   # each file, through the handler
    # the feature builder: in this process (every file it reads recorded), then in a pool of processes
    # that get the filesystem pickled (a read around it would find nothing at VIRTUAL and fail)
    handler.opened.clear()
    serial = _features(root, workers=1)
    _same_features(_features(data, workers=1), serial)
    read = {p[len(VIRTUAL) + 1:] for p in handler.opened}
    assert {p for p in on_disk if p.startswith(("table=gpu/", "table=inventory/"))} <= read
    _same_features(serial, _features(root, workers=2))
    assert handler.asked and all(p.startswith(VIRTUAL) for p in handler.asked)
    # the evaluation's own reads (incidents, inventory, the hash) too
    scored = ev.score_dataset(root, {"zero": lambda X: np.zeros(len(X))}, 1800)
    assert scored.identity["data_hash"] == offline.dataset_hash(data) and scored.identity["data"] == "recording://dataset"


@contextlib.contextmanager
def _silent_listener():
    """A loopback port that accepts connections and never answers (storage that hangs): its port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        for c in held:
            c.close()
        srv.close()


@pytest.mark.slow
def test_an_unknown_scheme_or_storage_that_does_not_answer_is_refused_naming_it(tmp_path, capsys):
    t0 = time.monotonic()
    rc = cli.main(["train", "--data", "nosuch://bucket/archive", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert rc == 2 and "'nosuch://bucket/archive'" in err and "Unrecognized filesystem type" in err, err
    assert time.monotonic() - t0 < 5
    rc = cli.main(["evaluate", "--data", str(tmp_path / "missing")])
    assert rc == 2 and f"dataset directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    # nothing listens: refused once the client gives up, well within the command's deadline
    uri = f"s3://bucket/archive?endpoint_override=127.0.0.1:{free_port()}&scheme=http&region=us-east-1"
    t0 = time.monotonic()
    rc = cli.main(["evaluate", "--data", uri])
    err = capsys.readouterr().err
    assert rc == 2 and f"dataset {uri!r}:" in err, err
    assert time.monotonic() - t0 < ds.OPEN_TIMEOUT_S + 5
    # a server that takes the connection and never answers: refused at the deadline, the URI named
    with _silent_listener() as port:
        at = f"endpoint_override=127.0.0.1:{port}&scheme=http"
        for uri in (f"gs://bucket/archive?{at}", f"s3://bucket/archive?{at}&region=us-east-1",
                    f"s3://bucket/archive?{at}"):   # no region: opening it asks the bucket's
            t0 = time.monotonic()
            with pytest.raises(ds.DatasetError, match="does not answer within 2 s") as got:
                ds.open_dataset_root(uri, timeout_s=2)
            assert repr(uri) in str(got.value)
            assert time.monotonic() - t0 < 6


@pytest.mark.slow
def test_an_archive_on_storage_that_does_not_answer_is_refused_at_start_within_the_deadline(monkeypatch):
    from foreshock.service.archive import Archive, ArchiveError, ArchiveSettings
    monkeypatch.setattr(ds, "OPEN_TIMEOUT_S", 2.0)
    with _silent_listener() as port:
        uri = f"gs://bucket/archive?endpoint_override=127.0.0.1:{port}&scheme=http"
        t0 = time.monotonic()
        with pytest.raises(ArchiveError, match="cannot be written") as got:
            Archive(ArchiveSettings(uri))
        assert repr(uri) in str(got.value) and "does not answer within 2 s" in str(got.value)
        assert time.monotonic() - t0 < 6
