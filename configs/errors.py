"""The one error type a bad config raises: its message names the key path and the reason."""

import importlib.util
import sys


class ConfigError(ValueError):
    """A bad config value. ``str(err)`` is one line: ``<key.path>: <reason>``."""

    def __init__(self, key: str, reason: str):
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}" if key else reason)


class MissingExtra(ConfigError, ImportError):
    """An optional dependency is not installed: a ConfigError (one line, exit 2 from the command
    lines) and an ImportError (what library callers expect)."""


def require_extra(module: str, extra: str, key: str) -> None:
    """``MissingExtra`` naming ``key`` (the flag or config key that needs it) and the pip extra
    that installs ``module``, unless it can be imported. Looks the module up without importing it
    (transformers takes seconds), so a command can check before any work."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package or an import hook that refuses it
        found = False
    if not found:
        raise MissingExtra(key, f"needs {module}: pip install 'moezoo[{extra}]'")


def check(cond: bool, key: str, reason: str) -> None:
    """Raise ``ConfigError(key, reason)`` unless ``cond``."""
    if not cond:
        raise ConfigError(key, reason)


def check_choice(value, choices, key: str) -> None:
    check(
        value in choices,
        key,
        f"unknown value {value!r}; expected one of {', '.join(map(str, choices))}",
    )


def choice_list(text: str, choices, key: str) -> list[str]:
    """A command-line comma list whose every item is one of ``choices`` (``"fwd,fwdbwd"`` ->
    ``["fwd", "fwdbwd"]``); ConfigError naming ``key`` for an unknown item or an empty list."""
    items = [x for x in text.split(",") if x]
    check(bool(items), key, f"empty; expected some of {', '.join(map(str, choices))}")
    for x in items:
        check_choice(x, choices, key)
    return items


def int_list(text: str, key: str, allow_empty: bool = False) -> list[int]:
    """A command-line comma list of positive integers (``"1024,2048"``); ConfigError naming ``key``
    otherwise."""
    items = [x for x in text.split(",") if x]
    check(allow_empty or bool(items), key, "empty; expected positive integers, e.g. 16384,65536")
    for x in items:
        check(x.isdigit() and int(x) > 0, key, f"{x!r} is not a positive integer")
    return [int(x) for x in items]


def check_positive(obj, key_prefix: str, *names: str) -> None:
    """Every named attribute of ``obj`` (when not None) must be > 0."""
    for n in names:
        v = getattr(obj, n)
        if v is not None:
            check(v > 0, f"{key_prefix}.{n}", f"must be > 0, got {v}")


def exit_code(main, *args, **kwargs) -> int:
    """Run a command-line entry point: its return code, or 2 after printing a ConfigError as one
    line ``error: <key.path>: <reason>`` on stderr (the user's mistake, not a traceback)."""
    try:
        return main(*args, **kwargs) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
