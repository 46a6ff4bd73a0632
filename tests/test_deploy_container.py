"""deploy/container/Containerfile: what the image would contain, checked without building it.

No container engine or base image is reachable here, so the test reads the Containerfile's
instructions and (1) checks that its install line is the README set-up's install command (the Makefile
recipe `make demo` / `make test` run) minus the editable flag and the test-only extras, (2) copies
exactly the files its COPY instructions name into an empty directory and builds a wheel from them with
pip, as the image's `pip install '.'` would, then checks that wheel holds every package and the
`foreshock` command, and (3) checks the runtime stage runs as the same non-root uid the Kubernetes
manifests expect and exposes their ports.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in CONTAINERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Containerfile ends inside a continued line"
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for word, rest in instructions():
        if word == "FROM":
            result.append([])
        assert result, "an instruction before the first FROM"
        result[-1].append((word, rest))
    return result


def pip_install(argv: list[str]) -> tuple[set[str], str, set[str]]:
    """(flags, target, extras) of a `python -m pip install ...` command line."""
    i = argv.index("pip")
    assert argv[i - 1] == "-m" and argv[i + 1] == "install", argv
    args = argv[i + 2:]
    flags = {a for a in args if a.startswith("-")}
    (target,) = [a for a in args if not a.startswith("-")]
    match = re.fullmatch(r"\.(?:\[([a-z0-9_,-]*)\])?", target)
    assert match, f"installs {target!r}, not the project directory"
    extras = set(filter(None, (match.group(1) or "").split(",")))
    return flags, target, extras


def makefile_install() -> list[str]:
    (line,) = [ln for ln in (REPO / "Makefile").read_text().splitlines() if "-m pip install" in ln and "-e" in ln]
    return shlex.split(line.strip())


def image_install() -> list[str]:
    runs = [shlex.split(rest) for word, rest in instructions() if word == "RUN" and "pip install" in rest]
    assert len(runs) == 1, "the image installs the project with exactly one pip command"
    return runs[0]


def copied_sources() -> list[str]:
    sources = []
    for word, rest in instructions():
        if word != "COPY" or rest.startswith("--from"):
            continue
        *srcs, _dest = shlex.split(rest)
        sources += [s.rstrip("/") for s in srcs]
    return sources


def test_install_line_is_the_readme_setup_command():
    image, make = image_install(), makefile_install()
    assert image[:4] == ["python", "-m", "pip", "install"]
    make_flags, _, make_extras = pip_install(make)
    image_flags, _, image_extras = pip_install(image)
    assert "-e" in make_flags and "-e" not in image_flags, "an image installs a copy, not an editable tree"
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert image_extras <= make_extras <= declared
    assert "dev" not in image_extras and "torch" not in image_extras, "test and in-job extras stay out"


def test_copies_exist_and_cover_the_distribution():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    sources = copied_sources()
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    needed = {"pyproject.toml", pyproject["project"]["readme"]} | set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert needed <= set(sources), f"not copied: {needed - set(sources)}"


def test_wheel_builds_from_exactly_the_copied_files(tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    for src in copied_sources():
        if src.startswith("docs/"):
            continue  # the runtime stage's documentation, not part of the build stage's install
        path = REPO / src
        if path.is_dir():
            shutil.copytree(path, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (context / src).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, context / src)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(context)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("foreshock-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for package in packages:
        assert package.replace(".", "/") + "/__init__.py" in names, f"{package} is missing from the image"
    for module in ("foreshock/cli.py", "foreshock/config.py"):
        assert module in names
    for command in ("collectors/command.py", "service/command.py"):
        if (REPO / command).exists():
            assert "foreshock/" + command in names, command
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "foreshock = foreshock.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_runtime_stage_is_non_root_and_matches_the_manifests():
    runtime = stages()[-1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users, "the runtime stage sets a USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0), "a numeric non-root uid"
    entrypoint = [rest for word, rest in runtime if word == "ENTRYPOINT"]
    assert entrypoint == ['["foreshock"]']
    kube = REPO / "deploy" / "kubernetes"
    sharded = REPO / "deploy" / "kubernetes-sharded"
    exposed = {int(p) for word, rest in runtime if word == "EXPOSE" for p in rest.split()}
    # the single control plane's and the sharded one's (shards, coordinators) run the image's user
    for path in (kube / "serve-statefulset.yaml", sharded / "shard-statefulset.yaml",
                 sharded / "coordinator-deployment.yaml"):
        workload = yaml.safe_load(path.read_text())
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid), path.name
        served = {p["containerPort"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert served <= exposed, path.name
    ports = set()
    for name in ("serve-statefulset.yaml", "collector-daemonset.yaml"):
        doc = yaml.safe_load((kube / name).read_text())
        ports |= {p["containerPort"] for c in doc["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert exposed == ports


def test_build_context_leaves_out_local_state():
    ignore = (CONTAINERFILE.parent / "Containerfile.dockerignore").read_text().split()
    for pattern in (".venv", ".git", "build", "**/__pycache__", "*.egg-info"):
        assert pattern in ignore, pattern
