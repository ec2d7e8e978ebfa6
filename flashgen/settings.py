"""The environment variables flashgen reads, checked in one place: what each one means on this
machine, or the error that says what is wrong with it (`flashgen doctor`, `python -m flashgen.check`).

Each variable is parsed where it is used (cache.cache_root, compile.jit_disabled, tuning.table);
this module only asks those readers, so a rule lives once.
"""

from __future__ import annotations

import os


class SettingError(ValueError):
    """An environment variable (FLASHGEN_*) holds a value flashgen cannot use; the message names
    the variable, its value and what is wrong."""


def _cache() -> str:
    from .cache import default_cache

    store = default_cache()
    if not store.exists():  # (checked for safety and creatability on the way)
        return f"the kernel cache, {store.root}; it does not exist yet (the first compile creates it)"
    return f"the kernel cache, {store.root}, holding {len(store.entries())} kernel(s)"


def _no_jit() -> str:
    from .compile import jit_disabled

    return "nothing compiles on first use (only `flashgen build` and `show --resources` do)" if jit_disabled() \
        else "kernels compile on first use"


def _tuning_table() -> str:
    from . import tuning

    return f"the tuning table {tuning.table_path()}, {len(tuning.table()['entries'])} entries"


VARIABLES = {"FLASHGEN_CACHE_DIR": _cache, "FLASHGEN_NO_JIT": _no_jit, "FLASHGEN_TUNING_TABLE": _tuning_table}


def environment() -> list[tuple[str, str | Exception]]:
    """Each variable flashgen reads, as `NAME=value` (or `NAME unset`), with what it means here or
    the error (a SettingError, or a CacheError for the cache directory) its value gives."""
    from .cache import CacheError

    rows = []
    for name, meaning in VARIABLES.items():
        value = os.environ.get(name)
        shown = f"{name}={value!r}" if value is not None else f"{name} unset"
        try:
            rows.append((shown, meaning()))
        except (SettingError, CacheError) as error:
            rows.append((shown, error))
    return rows


def problems() -> list[Exception]:
    """The errors of the variables that are set wrong (none: all usable)."""
    return [found for _, found in environment() if isinstance(found, Exception)]
