"""One configuration format for every command: a TOML file, then FORESHOCK_* environment variables, then flags.

Precedence, lowest first: the command's defaults, the `[section]` table of the TOML file (`--config FILE`
or FORESHOCK_CONFIG), environment variables named FORESHOCK_<SECTION>_<KEY> (upper case; for example
FORESHOCK_COLLECT_INTERVAL=5), and command-line flags that were given. Values from the environment are
parsed by the type of the default (bool, int, float, list as comma-separated, str). A bad value is an
error that names the key and where it came from; nothing is half-applied.

Each command declares its settings once, beside its DEFAULTS: a CHECKS mapping of key -> Check (at_least,
above, between) that resolve() applies to the final value. Floats are finite everywhere (NaN and inf are
refused whatever the key). The `[section]`s a config file may hold are the commands' names, and the
FORESHOCK_* variables a process may carry are FORESHOCK_<COMMAND>_<KEY>, FORESHOCK_CONFIG and
OTHER_VARIABLES (read by the in-job migrator, the predictor and the tests): anything else is an error that
names it (check_file, check_environment), since a misspelt name would otherwise be silently ignored.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_PREFIX = "FORESHOCK_"

# FORESHOCK_* variables that are no command's setting: where each is read.
OTHER_VARIABLES = {
    "FORESHOCK_CONFIG": "the config file (foreshock/config.py)",
    **{f"FORESHOCK_{name}": "the in-job migrator (migrator/config.py)" for name in (
        "SERVICE", "JOB_ID", "RANK", "WORLD_SIZE", "NODE", "ROLE", "TOKEN", "TLS_CA", "STORE", "HOST_STORE",
        "SPARE_NODES", "FALLBACK", "CHECKPOINT_DIR", "RPC_TIMEOUT_S", "TRANSFER_TIMEOUT_S", "STANDBY_POLL_S",
        "REPORT_INTERVAL_S", "STEP_REPORT_INTERVAL_S", "SPARE_HEARTBEAT_S", "MIGRATOR_FAULT")},
    **{f"FORESHOCK_EXAMPLE_{name}": "the migrator's torchrun example (migrator/torchrun_example.py)"
       for name in ("OUT", "STEPS", "STEP_SLEEP")},
    "FORESHOCK_PREDICT_THREADS": "the predictor's kernels (predictor/features.py, predictor/registry.py)",
    "FORESHOCK_FEATURE_WORKERS": "the predictor's offline features (predictor/offline.py)",
    "FORESHOCK_SHARED": "tests and benchmarks: the shared fixtures folder",
    "FORESHOCK_UPDATE_GOLDEN": "tests: rewrite the golden files",
}


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and its origin."""


def parse_listen(spec: str) -> tuple[str, int]:
    """A listen address, "127.0.0.1:9464" / ":9464" (every interface) / "[::1]:9464" -> (addr, port).

    Raises ValueError saying what is wrong with it (the caller prefixes the setting's name)."""
    host, sep, port = spec.rpartition(":")
    if not sep:
        raise ValueError(f"{spec!r}: not HOST:PORT (for example 127.0.0.1:7443, [::1]:7443, 0.0.0.0:7443)")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{spec!r}: port {port!r} is not a number from 0 to 65535")
    return (host.strip("[]") or "0.0.0.0"), int(port)


@dataclass(frozen=True)
class Check:
    """A setting's allowed values: `ok(value)` is true for those, `allowed` says which in words."""

    ok: Callable[[Any], bool]
    allowed: str


def at_least(low: float) -> Check:
    return Check(lambda v: v >= low, f"must be >= {low:g}")


def above(low: float) -> Check:
    return Check(lambda v: v > low, f"must be > {low:g}")


def between(low: float, high: float) -> Check:
    return Check(lambda v: low <= v <= high, f"must be in [{low:g}, {high:g}]")


def check_file(file_data: Mapping[str, Any], sections, origin: str = "the config file") -> None:
    """Refuse a `[section]` that is no command's (a misspelt one would be ignored)."""
    unknown = sorted(set(file_data) - set(sections))
    if unknown:
        raise ConfigError(f"[{unknown[0]}] in {origin}: unknown section (known: {', '.join(sorted(sections))})")


def check_environment(sections, env: Mapping[str, str] | None = None) -> None:
    """Refuse a FORESHOCK_* variable that is neither a command's setting nor in OTHER_VARIABLES."""
    env = os.environ if env is None else env
    prefixes = tuple(f"{ENV_PREFIX}{section.upper()}_" for section in sections)
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in OTHER_VARIABLES and not name.startswith(prefixes):
            raise ConfigError(f"environment variable {name}: unknown (settings are "
                              f"FORESHOCK_<COMMAND>_<KEY> for the commands {', '.join(sorted(sections))}, "
                              f"or one of {', '.join(sorted(OTHER_VARIABLES))})")


def load_file(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        path = os.environ.get(ENV_PREFIX + "CONFIG")
    if not path:
        return {}
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _coerce(key: str, origin: str, raw: Any, default: Any) -> Any:
    if default is None or raw is None:
        return raw
    try:
        if isinstance(default, bool):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"expected a boolean, got {raw!r}")
        if isinstance(default, int) and not isinstance(raw, bool):
            return int(raw)
        if isinstance(default, float):
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError(f"expected a finite number, got {raw!r}")
            return value
        if isinstance(default, (list, tuple)):
            if isinstance(raw, str):
                return [part.strip() for part in raw.split(",") if part.strip()]
            if isinstance(raw, (list, tuple)):
                return list(raw)
            raise ValueError(f"expected a list, got {raw!r}")
        if isinstance(default, str):
            if not isinstance(raw, str):
                raise ValueError(f"expected a string, got {raw!r}")
            return raw
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key} from {origin}: {exc}") from None
    return raw


def resolve(section: str, defaults: Mapping[str, Any], *, file_data: Mapping[str, Any] | None = None,
            flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
            checks: Mapping[str, Check] | None = None) -> dict[str, Any]:
    """The settings of one command: defaults < TOML [section] < FORESHOCK_SECTION_KEY < flags, each
    value then held to its Check in `checks`."""
    env = os.environ if env is None else env
    result = dict(defaults)
    origins = dict.fromkeys(defaults, "the default")
    table = (file_data or {}).get(section, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{section}] in the config file must be a table")
    for key, value in table.items():
        if key not in defaults:
            raise ConfigError(f"[{section}] {key}: unknown setting (known: {', '.join(sorted(defaults))})")
        result[key] = _coerce(f"[{section}] {key}", "the config file", value, defaults[key])
        origins[key] = "the config file"
    prefix = f"{ENV_PREFIX}{section.upper()}_"
    for name, value in env.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix):].lower()
        if key not in defaults:
            raise ConfigError(f"environment variable {name}: unknown setting of [{section}] "
                              f"(known: {', '.join(sorted(defaults))})")
        result[key] = _coerce(key, f"environment variable {name}", value, defaults[key])
        origins[key] = f"environment variable {name}"
    for key, value in (flags or {}).items():
        if value is not None and key in defaults:
            origins[key] = f"flag --{key.replace('_', '-')}"
            result[key] = _coerce(key, origins[key], value, defaults[key])
    for key, check in (checks or {}).items():
        if key not in defaults:
            raise KeyError(f"check for {key!r}, which is no setting of [{section}]")
        if not check.ok(result[key]):
            raise ConfigError(f"{key} from {origins[key]}: {check.allowed}, got {result[key]!r}")
    return result
