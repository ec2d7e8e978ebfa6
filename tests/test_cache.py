"""The disk cache: build once, commit atomically, rebuild damaged entries, refuse unsafe directories,
and compile once when several processes ask for the same kernel at the same time."""

import hashlib
import json
import logging
import multiprocessing
import os
import stat

import pytest
from jinja2.bccache import bc_magic

import flashgen
import flashgen.cache
from flashgen.cache import CUBIN, META, SOURCE, TEMPLATES, KernelCache
from flashgen.spec import KernelSpec

SPEC = KernelSpec(head_dim=32, block_m=64, num_warps=4)


@pytest.fixture
def compiles(monkeypatch):
    """Count calls to the compiler the cache uses (the real one still runs)."""
    calls = []
    real = flashgen.cache.compile_source

    def counting(spec, source, source_path=None, **options):
        calls.append(spec)
        return real(spec, source, source_path, **options)

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
    again = KernelCache(root).get(SPEC)  # a new process would start here: from disk
    assert len(compiles) == 1
    assert again is not first and again.cubin == first.cubin and again.key == first.key


def test_one_memo_of_loaded_kernels_stands_in_front_of_the_cache(root, monkeypatch):
    from flashgen import kernels

    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    monkeypatch.setattr(kernels, "_loaded", {})
    reads = []
    real = KernelCache.get
    monkeypatch.setattr(KernelCache, "get", lambda self, spec, **kw: reads.append(spec) or real(self, spec, **kw))
    kernel = kernels.get(SPEC)
    assert kernels.get(SPEC) is kernel and reads == [SPEC]  # the second call never reaches the cache


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


@pytest.mark.parametrize("keep", [lambda size: size // 2, lambda size: len(bc_magic) + 1], ids=["code cut", "checksum cut"])
def test_compiled_templates_are_kept_and_a_damaged_one_is_a_miss(root, monkeypatch, keep):
    """A fresh process finds its kernel by rendering it: from the compiled templates kept in the
    cache (milliseconds), not by compiling them again (tens of milliseconds). A damaged file (cut in
    its compiled code, or in the pickled checksum after Jinja's header) is compiled again."""
    import jinja2

    from flashgen import render

    key = KernelCache(root).get(SPEC).key
    templates = root / flashgen.__version__ / TEMPLATES
    files = sorted(templates.iterdir())
    assert files and mode(templates) == 0o700
    compiled = []
    real = jinja2.Environment.compile
    monkeypatch.setattr(jinja2.Environment, "compile", lambda self, *a, **kw: compiled.append(a) or real(self, *a, **kw))
    render._environment.cache_clear()  # as in a fresh process
    assert KernelCache(root).get(SPEC).key == key and compiled == []
    for path in files:  # damaged: a miss, recompiled and written again whole
        path.write_bytes(path.read_bytes()[: keep(path.stat().st_size)])
    render._environment.cache_clear()
    assert KernelCache(root).get(SPEC).key == key and compiled
    render._environment.cache_clear()
    compiled.clear()
    assert KernelCache(root).get(SPEC).key == key and compiled == []


def test_failed_build_leaves_no_entry(root, monkeypatch):
    real = flashgen.cache.compile_source

    def broken(spec, source, source_path=None, **options):
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


def meta_not_an_object(entry):
    (entry / META).write_text("null")


@pytest.mark.parametrize("damage", [truncate_cubin, garble_meta, delete_cubin, flip_cubin_byte, meta_not_an_object])
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

    def logged(spec, source, source_path=None, **options):
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
    assert not (root / flashgen.__version__ / TEMPLATES).exists()


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_no_jit_refuses_to_compile_and_writes_nothing(root, compiles, monkeypatch, value):
    monkeypatch.setenv("FLASHGEN_NO_JIT", value)
    with pytest.raises(flashgen.NoJitError, match=f"{SPEC.name} is not prebuilt and FLASHGEN_NO_JIT is set"):
        KernelCache(root).get(SPEC)
    assert compiles == [] and not root.exists()
    KernelCache(root).get(SPEC, ahead_of_time=True)  # `flashgen build` compiles: that is its job
    assert compiles == [SPEC]
    assert KernelCache(root).get(SPEC).cubin  # a kernel already compiled loads: nothing compiles


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_no_jit_off_values_compile(root, compiles, monkeypatch, value):
    monkeypatch.setenv("FLASHGEN_NO_JIT", value)
    KernelCache(root).get(SPEC)
    assert compiles == [SPEC]


def test_no_jit_with_a_value_it_does_not_know_is_an_error(root, monkeypatch):
    monkeypatch.setenv("FLASHGEN_NO_JIT", "maybe")
    with pytest.raises(ValueError, match="FLASHGEN_NO_JIT='maybe': must be"):
        KernelCache(root).get(SPEC)


def test_no_jit_without_a_compiler_names_the_kernel_that_is_missing(root, monkeypatch):
    """A deployment with FLASHGEN_NO_JIT may have no NVRTC at all: a kernel that was not prebuilt is
    still a NoJitError naming it, not an install hint."""
    from flashgen import compile as compiler

    def no_nvrtc():
        raise RuntimeError("flashgen compiles kernels with CuPy's NVRTC: pip install cupy-cuda13x nvidia-cuda-nvrtc")

    monkeypatch.setattr(flashgen.cache, "content_key", lambda spec, source: compiler._nvrtc() and "")
    monkeypatch.setattr(compiler, "_nvrtc", no_nvrtc)
    monkeypatch.setenv("FLASHGEN_NO_JIT", "1")
    with pytest.raises(flashgen.NoJitError, match=f"{SPEC.name} is not prebuilt"):
        KernelCache(root).get(SPEC)
    monkeypatch.setenv("FLASHGEN_NO_JIT", "0")
    with pytest.raises(RuntimeError, match="pip install"):
        KernelCache(root).get(SPEC)


def test_no_jit_covers_the_compiler_itself(monkeypatch):
    from flashgen.compile import compile_ptx, compile_source
    from flashgen.render import render

    monkeypatch.setenv("FLASHGEN_NO_JIT", "1")
    for compile_ in (compile_source, compile_ptx):
        with pytest.raises(flashgen.NoJitError):
            compile_(SPEC, render(SPEC))


def test_repr_of_an_artifact_leaves_out_the_cubin(root):
    artifact = KernelCache(root).get(SPEC)
    text = repr(artifact)
    assert SPEC.name in text and len(text) < 1000 and "cubin" not in text


def test_cubins_are_whole_elf_files(root):
    """NVRTC's bytes, all of them: the section and program headers end inside the file (CuPy's
    getCUBIN drops the last byte, which the driver tolerates but cuobjdump does not)."""
    import struct

    cubin = KernelCache(root).get(SPEC).cubin
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    assert len(cubin) >= max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def test_a_compile_error_crosses_a_process_boundary_whole(tmp_path):
    """A parallel build's worker raises it in another process: pickled with all four fields (its
    __init__ takes them; the default pickling carried only the message and failed to rebuild it)."""
    import pickle

    from flashgen.compile import CompileError

    error = pickle.loads(pickle.dumps(CompileError("fwd_x", "line 3: error", ["-arch=sm_90a"], tmp_path / "x.cu")))
    assert (error.spec_name, error.log, error.options, error.source_path) == ("fwd_x", "line 3: error", ["-arch=sm_90a"],
                                                                              tmp_path / "x.cu")
    assert "NVRTC failed to compile fwd_x" in str(error)


@pytest.fixture
def fake_compile(monkeypatch):
    """The compiler replaced by one that returns a stand-in cubin at once (the point is the files)."""
    from flashgen.compile import Binary, Resources

    def fake(spec, source, source_path=None, **options):
        return Binary(b"\x7fELF stand-in", Resources(32, 0, 0, 0, 0), "", ())

    monkeypatch.setattr(flashgen.cache, "compile_source", fake)


def test_a_compile_leaves_no_lock_file_behind(root, fake_compile):
    """The lock that makes N processes compile a spec once used to stay as a zero-byte .lock per entry."""
    artifact = KernelCache(root).get(SPEC)
    assert artifact.cubin == b"\x7fELF stand-in"
    left = [os.path.join(folder, name) for folder, _, files in os.walk(root) for name in files if name.endswith(".lock")]
    assert left == []


def test_a_cache_path_under_a_file_names_the_cache_directory_and_the_variable(tmp_path):
    (tmp_path / "file").write_text("")
    cache = KernelCache(tmp_path / "file" / "cache")
    message = f"cannot write into the flashgen cache directory {cache.root}: {tmp_path / 'file'} is not a directory. " \
              f"Set FLASHGEN_CACHE_DIR to a directory you can write."
    with pytest.raises(flashgen.CacheError) as raised:
        cache.get(SPEC)
    assert str(raised.value) == message  # (it was a bare "[Errno 20] Not a directory: ...")
    with pytest.raises(flashgen.CacheError) as raised:
        cache.entries()  # inspecting it says the same, and creates nothing
    assert str(raised.value) == message


def test_a_write_refused_in_the_cache_names_the_cache_directory_and_the_variable(root, fake_compile, monkeypatch):
    """What an unwritable cache gives, whoever runs the test (root may write anywhere)."""
    import errno

    def refused(path, data):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(flashgen.cache, "write_atomic", refused)
    with pytest.raises(flashgen.CacheError, match=f"cannot write into the flashgen cache directory {root}: Permission denied "
                                                  f"\\({root}/.*/kernel.cu\\). Set FLASHGEN_CACHE_DIR to a directory you can write."):
        KernelCache(root).get(SPEC)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory of mode 0500")
def test_an_unwritable_cache_names_the_cache_directory_and_the_variable(root):
    root.mkdir(mode=0o500)
    with pytest.raises(flashgen.CacheError, match=f"cannot write into the flashgen cache directory {root}: Permission denied"):
        KernelCache(root).get(SPEC)


def test_inspecting_refuses_what_using_refuses(root, tmp_path):
    """entries() and clear() took a file, or a directory others can write, as an empty cache."""
    assert KernelCache(root).exists() is False and not root.exists()
    root.write_text("")
    for inspect in (KernelCache(root).exists, KernelCache(root).entries, KernelCache(root).clear):
        with pytest.raises(flashgen.CacheError, match=f"flashgen cache directory {root} exists and is not a directory. "
                                                      "Set FLASHGEN_CACHE_DIR"):
            inspect()
    shared = tmp_path / "shared"
    (shared / flashgen.__version__ / SPEC.arch).mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(flashgen.CacheError, match="is writable by other users"):
        KernelCache(shared).clear()
    assert (shared / flashgen.__version__ / SPEC.arch).is_dir()  # nothing deleted there
