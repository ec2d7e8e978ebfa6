"""The on-disk kernel cache: one directory per compiled kernel, written so that no reader ever sees
half an entry and N processes asking for one spec compile it once.

Layout: $FLASHGEN_CACHE_DIR (default ~/.cache/flashgen) / <flashgen version> / <arch> /
<spec name>-<key prefix> / {kernel.cu, kernel.cubin, meta.json}, and <flashgen version> / templates /
(the compiled Jinja templates, so that a fresh process renders without compiling them). Every file
is written to a temporary name and renamed into place; meta.json, holding the cubin's checksum, is
written last and is the commit marker. Loading checks the checksum, so a truncated or corrupted
entry is a miss (logged and rebuilt), never a crash. A cubin found in the cache is code that will
run, so the cache directory must belong to the user and be writable by nobody else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import filelock

from . import __version__
from .compile import Resources, compile_options, compile_source, jit_disabled, no_jit_error, nvrtc_version
from .render import render
from .spec import ARCHS, KernelSpec

log = logging.getLogger("flashgen.cache")

SOURCE, CUBIN, META = "kernel.cu", "kernel.cubin", "meta.json"
TEMPLATES = "templates"  # <version>/templates: the compiled Jinja templates (render's bytecode_dir)


class CacheError(RuntimeError):
    """The cache directory cannot be used safely."""


@dataclass(frozen=True)
class Artifact:
    """A compiled kernel: the cubin and what is known about it."""

    spec: KernelSpec
    key: str
    cubin: bytes = field(repr=False)
    resources: Resources
    meta: dict = field(repr=False)
    path: Path | None = None  # the entry directory or meta file it was read from


def cache_root() -> Path:
    return Path(os.environ.get("FLASHGEN_CACHE_DIR") or Path.home() / ".cache" / "flashgen")


def content_key(spec: KernelSpec, source: str) -> str:
    """sha256 over everything that decides the cubin's bytes."""
    parts = [
        spec.canonical(),
        source,
        f"nvrtc={nvrtc_version()}",
        f"arch={spec.arch}",
        "options=" + " ".join(compile_options(spec)),
        f"flashgen={__version__}",
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cubin_matches(cubin: bytes, meta: dict) -> bool:
    """Is this the cubin the metadata describes (not truncated, not altered)?"""
    return len(cubin) == meta["cubin_bytes"] and sha256(cubin) == meta["cubin_sha256"]


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, flush it to disk, rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def writing(root: Path):
    """A file-system error while creating or writing under the cache names the cache directory,
    the variable that chooses it, and why (not a bare `[Errno 13] ...`)."""
    try:
        yield
    except OSError as error:
        where = f" ({error.filename})" if error.filename and Path(error.filename) != Path(root) else ""
        why = (None if root.exists() else _uncreatable(root)) or f"{error.strerror or error}{where}"
        raise _unwritable(root, why) from error


def _unwritable(root: Path, why: str) -> CacheError:
    return CacheError(f"cannot write into the flashgen cache directory {root}: {why}. "
                      f"Set FLASHGEN_CACHE_DIR to a directory you can write.")


def _uncreatable(root: Path) -> str | None:
    """Why the missing directory `root` could not be created (None: it could)."""
    above = next(parent for parent in root.absolute().parents if parent.exists())
    if not above.is_dir():
        return f"{above} is not a directory"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"{above} is not writable"
    return None


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) mode 0700, and refuse one that others could write into."""
    missing = []
    for parent in [path, *path.parents]:
        if parent.exists():
            break
        missing.append(parent)
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
    check_private(path)
    return path


def check_private(path: Path) -> None:
    """Refuse a cache directory that is not a directory, not the user's, or writable by others."""
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(
            f"flashgen cache directory {path} exists and is not a directory. "
            f"Set FLASHGEN_CACHE_DIR to a directory (or remove the file)."
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise CacheError(
            f"flashgen cache directory {path} belongs to uid {info.st_uid}, not to you "
            f"(uid {os.getuid()}): a cubin found there is code that will run. "
            "Set FLASHGEN_CACHE_DIR to a directory of your own."
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"flashgen cache directory {path} is writable by other users "
            f"(mode {stat.S_IMODE(info.st_mode):#o}): a cubin found there is code that will run. "
            f"Run `chmod 700 {path}` or set FLASHGEN_CACHE_DIR to a private directory."
        )


class KernelCache:
    """Disk cache of compiled kernels. The in-process memo of loaded kernels (flashgen.kernels)
    stands in front of it, so a warm call never reaches here."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else cache_root()

    def __repr__(self) -> str:
        return f"KernelCache({str(self.root)!r})"

    def get(self, spec: KernelSpec, *, ahead_of_time: bool = False) -> Artifact:
        """The compiled kernel for `spec`: from disk, or built now (once, under a lock). With
        FLASHGEN_NO_JIT set only `ahead_of_time` builds compile; others raise NoJitError."""
        source = render(spec, self._templates_dir())
        try:
            key = content_key(spec, source)  # names the NVRTC release
        except RuntimeError as error:  # no NVRTC here: with FLASHGEN_NO_JIT, a kernel that was not prebuilt
            if jit_disabled() and not ahead_of_time:
                raise no_jit_error(spec) from error
            raise
        entry_name = f"{spec.name}-{key[:16]}"
        if jit_disabled() and not ahead_of_time and not (self.root / __version__ / spec.arch / entry_name / META).exists():
            raise no_jit_error(spec)  # before anything is created on disk
        with writing(self.root):
            parent = private_dir(private_dir(private_dir(self.root) / __version__) / spec.arch)
        entry = parent / entry_name
        artifact = self.load(entry, spec, key)
        if artifact is None:
            lock_path = parent / f"{entry.name}.lock"
            lock = filelock.FileLock(str(lock_path), mode=0o600)
            with writing(self.root):
                lock.acquire()
            try:
                artifact = self.load(entry, spec, key)  # someone may have built it while we waited
                if artifact is None:
                    artifact = self._build(entry, spec, key, source, ahead_of_time)
            finally:
                # Removed while still held, so that no .lock stays behind. A process still waiting on
                # the removed file, like one that locks a new file of that name, then finds the entry
                # built (after a failed build two may build at once, which the atomic writes allow).
                lock_path.unlink(missing_ok=True)
                lock.release()
        return artifact

    def _templates_dir(self) -> Path | None:
        """Where the compiled templates are kept; None with FLASHGEN_NO_JIT while it does not exist
        (nothing is created on disk then)."""
        if jit_disabled() and not (self.root / __version__ / TEMPLATES).is_dir():
            return None
        with writing(self.root):
            return private_dir(private_dir(private_dir(self.root) / __version__) / TEMPLATES)

    @staticmethod
    def load(entry: Path, spec: KernelSpec, key: str) -> Artifact | None:
        """The entry if it is complete and intact; None (logged if damaged) otherwise. Never raises."""
        meta_path = entry / META
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            if not isinstance(meta, dict):
                raise ValueError(f"meta.json holds a {type(meta).__name__}, not an object")
            cubin = (entry / CUBIN).read_bytes()
            problem = None
            if meta.get("key") != key:
                problem = "key mismatch"
            elif not cubin_matches(cubin, meta):
                problem = f"cubin checksum mismatch ({len(cubin)} bytes, expected {meta['cubin_bytes']})"
            if problem is None:
                return Artifact(spec, key, cubin, Resources(**meta["resources"]), meta, entry)
        except (OSError, ValueError, KeyError, TypeError) as error:
            problem = f"{type(error).__name__}: {error}"
        log.warning("flashgen cache entry %s is damaged (%s); rebuilding it", entry, problem)
        return None

    def _build(self, entry: Path, spec: KernelSpec, key: str, source: str, ahead_of_time: bool) -> Artifact:
        with writing(self.root):
            private_dir(entry)
            (entry / META).unlink(missing_ok=True)  # the entry is incomplete until meta.json returns
            write_atomic(entry / SOURCE, source.encode())  # saved first: compile errors point at it
        started = time.perf_counter()
        binary = compile_source(spec, source, entry / SOURCE, ahead_of_time=ahead_of_time)
        meta = {
            "name": spec.name,
            "ident": spec.ident,
            "spec": json.loads(spec.canonical()),
            "key": key,
            "cubin_bytes": len(binary.cubin),
            "cubin_sha256": sha256(binary.cubin),
            "resources": binary.resources.to_dict(),
            "smem_dynamic": spec.smem_bytes,
            "nvrtc": nvrtc_version(),
            "options": list(binary.options),
            "flashgen": __version__,
            "compile_seconds": round(time.perf_counter() - started, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with writing(self.root):
            write_atomic(entry / CUBIN, binary.cubin)
            write_atomic(entry / META, json.dumps(meta, indent=2).encode())  # last: the commit marker
        log.info("compiled %s in %.2fs", spec.name, meta["compile_seconds"])
        return Artifact(spec, key, binary.cubin, binary.resources, meta, entry)

    # ---- inspection --------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the cache directory exists (False: nothing was compiled into it yet). Raises
        CacheError where it could not be used: a file, someone else's or writable by others, or
        (missing) under a path where it cannot be created."""
        if not self.root.exists():
            why = _uncreatable(self.root)
            if why:
                raise _unwritable(self.root, why)
            return False
        check_private(self.root)
        return True

    def entries(self) -> list[dict]:
        """Complete entries under the root (any version and arch), with their size; CacheError
        for a root that could not be used (see exists)."""
        found = []
        if not self.exists():
            return found
        for meta_path in sorted(self.root.glob(f"*/*/*/{META}")):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(meta, dict):
                continue
            size = sum(f.stat().st_size for f in meta_path.parent.iterdir() if f.is_file())
            found.append({**meta, "path": str(meta_path.parent), "bytes": size})
        return found

    def clear(self) -> int:
        """Delete every entry; returns how many complete entries there were. Only the
        <version>/<arch> and <version>/templates folders flashgen writes are removed, never anything
        else under the root (nor anything in a root that could not be used: CacheError)."""
        count = len(self.entries())
        if self.exists():
            for arch_dir in sorted(self.root.glob("*/*")):
                version_dir = arch_dir.parent
                ours = arch_dir.name in ARCHS or arch_dir.name == TEMPLATES
                if ours and arch_dir.is_dir() and not (arch_dir.is_symlink() or version_dir.is_symlink()):
                    shutil.rmtree(arch_dir)
                    if not any(version_dir.iterdir()):
                        version_dir.rmdir()
        return count


_default: KernelCache | None = None


def default_cache() -> KernelCache:
    """The process-wide cache at cache_root() (re-read if FLASHGEN_CACHE_DIR changes)."""
    global _default
    if _default is None or _default.root != cache_root():
        _default = KernelCache()
    return _default
