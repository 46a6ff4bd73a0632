"""Shared test fixtures: where the real-format fixtures live (../shared beside the checkout), a control
plane on a loopback port, and headless Chromium for the HTML reports."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # tests/support.py, the helpers the tests share

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FORESHOCK_SHARED", REPO.parent / "shared"))
PROCFS_FIXTURE = SHARED / "fixtures" / "procfs"
XID_LINES = SHARED / "fixtures" / "kmsg" / "xid-lines.txt"
GOLDEN = REPO / "tests" / "golden"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    assert SHARED.is_dir(), f"../shared is missing beside the checkout ({SHARED}); set FORESHOCK_SHARED"
    return SHARED


@pytest.fixture(scope="session")
def procfs_fixture(shared_dir) -> Path:
    return PROCFS_FIXTURE


@pytest.fixture(scope="session")
def xid_lines(shared_dir) -> Path:
    return XID_LINES


@pytest.fixture
def plane_settings() -> dict:
    """Settings.insecure_loopback overrides for `plane`: no model (NullScorer). A test module that needs
    others (a policy, a decision flush period, the shipped model) overrides this fixture."""
    # imported here, not at the top: most test modules start no control plane
    from foreshock.service.scoring import NullScorer

    return {"scorer": NullScorer()}


@pytest.fixture
def plane(tmp_path, plane_settings):
    """A control plane started on a loopback port (plaintext, state in tmp_path/state), stopped after the
    test; its address is `plane.address`."""
    from foreshock.service.server import Settings, build_server

    p = build_server(Settings.insecure_loopback(tmp_path / "state", **plane_settings))
    p.start()
    yield p
    p.stop(grace=0.5)


@pytest.fixture
def browse(tmp_path):
    """browse(page) -> (the DOM headless Chromium builds from an HTML file, a screenshot as an RGB array).
    Chromium comes from Debian's package (tests/setup.sh)."""
    import shutil
    import subprocess

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "chromium is missing: tests/setup.sh installs Debian's package"

    def run(page: Path):
        flags = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"]
        dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
        assert dom.returncode == 0, dom.stderr[-2000:]
        shot = tmp_path / "page.png"
        made = subprocess.run([*flags, "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
                              capture_output=True, text=True, timeout=120)
        assert made.returncode == 0 and shot.is_file(), made.stderr[-2000:]
        import matplotlib.image

        return dom.stdout, matplotlib.image.imread(shot)[..., :3]

    return run


@pytest.fixture(scope="session")
def small_world(tmp_path_factory) -> Path:
    """A small simulated cluster (12 nodes x 2 days, failures at 200x), written once per run; read only."""
    from foreshock import cli
    out = tmp_path_factory.mktemp("small-world") / "d"
    assert cli.main(["simulate", "--nodes", "12", "--days", "2", "--interval", "60", "--seed", "5",
                     "--rate-scale", "200", "--workers", "1", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def small_world_model(small_world, tmp_path_factory) -> tuple[Path, dict]:
    """(the model directory, its manifest) that train.train gives on small_world with 15 boosting
    iterations and the defaults otherwise: the reference other ways of training must reproduce.
    Trained once per run; read only."""
    from foreshock.predictor import train
    out = tmp_path_factory.mktemp("small-world-model") / "m"
    return out, train.train(small_world, out, max_iter=15)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(path) -> path: predictor.synthetic.tiny_model_dir's model at `path`, fitted once per
    run and copied, so that each test still has a model directory of its own."""
    import shutil

    from foreshock.predictor import synthetic
    fitted = synthetic.tiny_model_dir(tmp_path_factory.mktemp("tiny-model") / "m")

    def copy(path: Path) -> Path:
        shutil.copytree(fitted, path)
        return path

    return copy
