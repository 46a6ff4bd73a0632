"""One configuration format for every command: a TOML file, then FORESHOCK_* environment variables, then flags.

Precedence, lowest first: the command's defaults, the `[section]` table of the TOML file (`--config FILE`
or FORESHOCK_CONFIG), environment variables named FORESHOCK_<SECTION>_<KEY> (upper case; for example
FORESHOCK_COLLECT_INTERVAL=5), and command-line flags that were given. Values from the environment are
parsed by the type of the default (bool, int, float, list as comma-separated, str). A bad value is an
error that names the key and where it came from; nothing is half-applied.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "FORESHOCK_"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and its origin."""


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
            return float(raw)
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
            flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings of one command: defaults < TOML [section] < FORESHOCK_SECTION_KEY < flags."""
    env = os.environ if env is None else env
    result = dict(defaults)
    table = (file_data or {}).get(section, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{section}] in the config file must be a table")
    for key, value in table.items():
        if key not in defaults:
            raise ConfigError(f"[{section}] {key}: unknown setting (known: {', '.join(sorted(defaults))})")
        result[key] = _coerce(f"[{section}] {key}", "the config file", value, defaults[key])
    prefix = f"{ENV_PREFIX}{section.upper()}_"
    for name, value in env.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix):].lower()
        if key in defaults:
            result[key] = _coerce(key, f"environment variable {name}", value, defaults[key])
    for key, value in (flags or {}).items():
        if value is not None and key in defaults:
            result[key] = _coerce(key, f"flag --{key.replace('_', '-')}", value, defaults[key])
    return result
