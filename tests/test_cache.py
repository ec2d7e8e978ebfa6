"""The disk cache: build once, commit atomically, rebuild damaged entries, refuse unsafe directories,
and compile once when several processes ask for the same kernel at the same time."""

import hashlib
import json
import logging
import multiprocessing
import os
import stat

import pytest

import flashgen
import flashgen.cache
from flashgen.cache import CUBIN, META, SOURCE, KernelCache
from flashgen.spec import KernelSpec

SPEC = KernelSpec(head_dim=32, block_m=64, num_warps=4)


@pytest.fixture
def compiles(monkeypatch):
    """Count calls to the compiler the cache uses (the real one still runs)."""
    calls = []
    real = flashgen.cache.compile_source

    def counting(spec, source, source_path=None):
        calls.append(spec)
        return real(spec, source, source_path)

    monkeypatch.setattr(flashgen.cache, "compile_source", counting)
    return calls


@pytest.fixture
def root(tmp_path):
    return tmp_path / "c"


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_builds_once(root, compiles):
    cache = KernelCache(root)
    first = cache.get(SPEC)
    assert len(compiles) == 1
    assert cache.get(SPEC) is first  # the in-process dict
    again = KernelCache(root).get(SPEC)  # a new process would start here: from disk
    assert len(compiles) == 1
    assert again is not first and again.cubin == first.cubin and again.key == first.key


def test_entry_layout_and_modes(root):
    artifact = KernelCache(root).get(SPEC)
    entry = artifact.path
    assert entry.parent == root / flashgen.__version__ / SPEC.arch
    assert entry.name.startswith(SPEC.name + "-")
    assert {SOURCE, CUBIN, META} <= {p.name for p in entry.iterdir()}
    assert (entry / CUBIN).read_bytes() == artifact.cubin
    meta = json.loads((entry / META).read_text())
    assert meta["key"] == artifact.key and meta["cubin_sha256"] == hashlib.sha256(artifact.cubin).hexdigest()
    for directory in (root, root / flashgen.__version__, entry.parent, entry):
        assert mode(directory) == 0o700, directory
    assert not [name for _, _, files in os.walk(root) for name in files if name.endswith(".tmp")]


def test_failed_build_leaves_no_entry(root, monkeypatch):
    real = flashgen.cache.compile_source

    def broken(spec, source, source_path=None):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(flashgen.cache, "compile_source", broken)
    cache = KernelCache(root)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get(SPEC)
    (entry,) = [p for p in (root / flashgen.__version__ / SPEC.arch).iterdir() if p.is_dir()]
    assert (entry / SOURCE).exists()  # saved for debugging, but
    assert not (entry / META).exists()  # no commit marker: not an entry
    assert cache.entries() == []

    monkeypatch.setattr(flashgen.cache, "compile_source", real)
    artifact = cache.get(SPEC)
    assert artifact.path == entry and (entry / META).exists()
    assert [e["name"] for e in cache.entries()] == [SPEC.name]


def truncate_cubin(entry):
    data = (entry / CUBIN).read_bytes()
    (entry / CUBIN).write_bytes(data[: len(data) // 2])


def garble_meta(entry):
    (entry / META).write_text("{not json")


def delete_cubin(entry):
    (entry / CUBIN).unlink()


def flip_cubin_byte(entry):
    data = bytearray((entry / CUBIN).read_bytes())
    data[-1] ^= 0xFF
    (entry / CUBIN).write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate_cubin, garble_meta, delete_cubin, flip_cubin_byte])
def test_damaged_entry_is_logged_and_rebuilt(root, compiles, caplog, damage):
    original = KernelCache(root).get(SPEC)
    damage(original.path)
    compiles.clear()
    with caplog.at_level(logging.WARNING, logger="flashgen.cache"):
        rebuilt = KernelCache(root).get(SPEC)
    assert len(compiles) == 1
    assert any("damaged" in r.getMessage() and str(original.path) in r.getMessage() for r in caplog.records)
    assert rebuilt.cubin == original.cubin
    assert (original.path / CUBIN).read_bytes() == original.cubin  # repaired on disk
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashgen.cache"):
        KernelCache(root).get(SPEC)
    assert len(compiles) == 1 and not caplog.records  # the repaired entry loads cleanly


@pytest.mark.parametrize("unsafe", [0o777, 0o770, 0o702], ids=oct)
def test_directory_writable_by_others_is_refused(root, unsafe):
    root.mkdir()
    root.chmod(unsafe)
    with pytest.raises(flashgen.CacheError, match="writable by other users"):
        KernelCache(root).get(SPEC)


def test_path_that_is_a_file_is_refused(root):
    root.write_text("")
    with pytest.raises(flashgen.CacheError, match="not a directory"):
        KernelCache(root).get(SPEC)


def compile_worker(root, log_path, out_path, barrier):
    """One of several processes asking for SPEC at once (top level: spawn imports it)."""
    import flashgen.cache

    real = flashgen.cache.compile_source

    def logged(spec, source, source_path=None):
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()}\n")
        return real(spec, source, source_path)

    flashgen.cache.compile_source = logged
    barrier.wait(timeout=120)
    artifact = flashgen.cache.KernelCache(root).get(SPEC)
    with open(out_path, "w") as out:
        out.write(hashlib.sha256(artifact.cubin).hexdigest())


def test_concurrent_processes_compile_once(root, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    workers = 4
    barrier = ctx.Barrier(workers)
    log_path = tmp_path / "compiles.log"
    outs = [tmp_path / f"sha{i}" for i in range(workers)]
    procs = [ctx.Process(target=compile_worker, args=(root, log_path, out, barrier)) for out in outs]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    assert [proc.exitcode for proc in procs] == [0] * workers
    assert len(log_path.read_text().splitlines()) == 1
    digests = {out.read_text() for out in outs}
    assert len(digests) == 1
    assert digests == {hashlib.sha256(KernelCache(root).get(SPEC).cubin).hexdigest()}


def test_entries_and_clear(root):
    cache = KernelCache(root)
    assert cache.entries() == [] and cache.clear() == 0  # no root yet
    artifact = cache.get(SPEC)
    (entry,) = cache.entries()
    assert entry["name"] == SPEC.name and entry["path"] == str(artifact.path) and entry["bytes"] > len(artifact.cubin)
    assert cache.clear() == 1
    assert cache.entries() == [] and not artifact.path.exists()


def test_clear_leaves_other_files_alone(root):
    cache = KernelCache(root)
    cache.get(SPEC)
    (root / "notes").mkdir()
    (root / "notes" / "keep.txt").write_text("mine")
    (root / flashgen.__version__ / "README").write_text("mine too")
    assert cache.clear() == 1
    assert cache.entries() == []
    assert (root / "notes" / "keep.txt").read_text() == "mine"
    assert (root / flashgen.__version__ / "README").read_text() == "mine too"
    assert not (root / flashgen.__version__ / SPEC.arch).exists()
