"""Configuration precedence, once for every command: flag > environment > file > default.

Settings are named once (``database_url``); the environment variable is that
name upper-cased behind ``KICKASS_`` (``KICKASS_DATABASE_URL``) and the file
key is the name itself, in a TOML file given by ``--config`` or
``KICKASS_CONFIG``. Only the standard library is used, so the volunteer
client can share this module.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

from kickass_core.errors import KickassError

# TOML is in the standard library from Python 3.11 (tomllib). Core also runs on
# 3.9 and 3.10 (the volunteer's one-file client, which needs no configuration
# file): there the same parser is used if the tomli package is installed, and
# a configuration file is otherwise a clear error (load_file).
_toml: ModuleType | None
if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - Python 3.9/3.10
    try:
        import tomli as _toml
    except ImportError:
        _toml = None

ENV_PREFIX = "KICKASS_"
ENV_CONFIG = "KICKASS_CONFIG"

T = TypeVar("T")


def env_name(setting: str, prefix: str = ENV_PREFIX) -> str:
    return prefix + setting.upper()


def load_file(path: str | Path | None) -> dict[str, Any]:
    """The settings of a TOML file (``None``: the file named by KICKASS_CONFIG, if any)."""
    if path is None:
        path = os.environ.get(ENV_CONFIG)
        if not path:
            return {}
    p = Path(path)
    if _toml is None:
        raise KickassError(
            f"cannot read configuration file {p}: this Python "
            f"({sys.version_info[0]}.{sys.version_info[1]}) has no TOML parser",
            hint=f"use Python 3.11 or newer, install tomli, or unset {ENV_CONFIG} and pass "
            "the settings as flags or KICKASS_* environment variables",
        )
    try:
        with p.open("rb") as f:
            data: dict[str, Any] = _toml.load(f)
    except FileNotFoundError as exc:
        raise KickassError(
            f"configuration file {p} not found", hint=f"check {ENV_CONFIG} or --config"
        ) from exc
    except (OSError, _toml.TOMLDecodeError) as exc:
        raise KickassError(f"cannot read configuration file {p}: {exc}") from exc
    # One table per command is allowed ([server], [agent]); flat keys serve all.
    return data


def resolve(
    setting: str,
    flag: T | None,
    *,
    default: T | None = None,
    file: Mapping[str, Any] | None = None,
    section: str | None = None,
    parse: Callable[[str], T] | None = None,
    environ: Mapping[str, str] | None = None,
    prefix: str = ENV_PREFIX,
) -> T | None:
    """The value of ``setting``: the flag if given, else the environment, else the file.

    ``parse`` turns an environment string (or a file value) into the setting's
    type; a value it rejects is a KickassError naming where it came from.
    """
    if flag is not None:
        return flag
    env = os.environ if environ is None else environ
    name = env_name(setting, prefix)
    raw = env.get(name)
    if raw not in (None, ""):
        return _parse(raw, parse, f"environment variable {name}")
    if file:
        scoped = file.get(section, {}) if section else {}
        if isinstance(scoped, Mapping) and setting in scoped:
            return _parse(
                scoped[setting], parse, f"[{section}] {setting} in the configuration file"
            )
        if setting in file and not isinstance(file[setting], Mapping):
            return _parse(file[setting], parse, f"{setting} in the configuration file")
    return default


def _parse(value: Any, parse: Callable[[str], T] | None, where: str) -> T:
    if parse is None:
        # Without a parser the raw value is taken as the setting's type.
        return cast(T, value)
    try:
        return parse(value)
    except (TypeError, ValueError) as exc:
        raise KickassError(f"bad value {value!r} for {where}: {exc}") from exc


def read_secret(file: str | Path | None, env: str, what: str, hint: str) -> str | None:
    """A secret (API key, agent secret, runner token) from ``file``, else ``$env``.

    Secrets never come from flags (they would show in `ps`) and are never
    printed; ``None`` when neither is set, so the caller says what is missing.
    """
    if file:
        try:
            value = Path(file).read_text().strip()
        except OSError as exc:
            raise KickassError(
                f"cannot read the {what} file {file}: {exc.strerror}", hint=hint
            ) from None
        if not value:
            raise KickassError(f"the {what} file {file} is empty", hint=hint)
        return value
    return os.environ.get(env, "").strip() or None
