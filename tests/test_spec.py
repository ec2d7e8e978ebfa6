"""KernelSpec: validation names the bad field and value; name and content key cover every field."""

import dataclasses
import re

import pytest

from flashgen.cache import content_key
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError

BAD = [
    # (fields, text the error must contain)
    (dict(head_dim=100), "head_dim=100"),
    (dict(head_dim=0), "head_dim=0"),
    (dict(head_dim=264), "head_dim=264"),
    (dict(head_dim=64, dtype="fp32"), "dtype='fp32'"),
    (dict(head_dim=64, block_m=96), "block_m=96 with num_warps=4"),  # 24 rows per warp
    (dict(head_dim=64, block_m=256), "block_m=256 with num_warps=4"),  # 64 rows per warp
    (dict(head_dim=64, block_n=40), "block_n=40"),
    (dict(head_dim=64, block_n=272), "block_n=272"),
    (dict(head_dim=64, num_warps=3), "num_warps=3"),
    (dict(head_dim=64, num_stages=5), "num_stages=5"),
    (dict(head_dim=64, arch="sm_70"), "arch='sm_70'"),
    (dict(head_dim=64, kind="bwd"), "kind='bwd'"),
    (dict(head_dim=64, causal=1), "causal=1"),
    (dict(head_dim=64.0), "head_dim=64.0: must be an int"),
    (dict(head_dim=True), "head_dim=True: must be an int"),
    (dict(head_dim=64, block_n="64"), "block_n='64': must be an int"),
    (
        dict(head_dim=128, block_m=128, block_n=128, num_warps=4),
        "block_m=128, block_n=128, head_dim=128, num_warps=4: each thread would hold 256",
    ),
    (
        dict(head_dim=256, block_m=128, block_n=128, num_warps=8, num_stages=3, arch="sm_86"),
        "block_m=128, block_n=128, num_stages=3, head_dim=256: needs 473088 bytes",
    ),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[m for _, m in BAD])
def test_bad_field_raises_spec_error_naming_it(fields, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        KernelSpec(**fields)


def test_smem_limit_is_per_arch():
    fields = dict(head_dim=256, block_m=128, block_n=128, num_warps=8, num_stages=3)
    with pytest.raises(SpecError, match="on sm_86"):
        KernelSpec(**fields, arch="sm_86")
    with pytest.raises(SpecError, match="on sm_90a"):  # 473088 > 227 KiB as well
        KernelSpec(**fields, arch="sm_90a")
    assert KernelSpec(**{**fields, "num_stages": 2, "block_n": 64}, arch="sm_90a").smem_bytes <= 227 * 1024


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)


def test_name():
    spec = KernelSpec(64, block_m=128, block_n=64, causal=True)
    assert spec.name == "fwd_d64_m128_n64_bf16_causal_w4_s2_sm90a"
    assert spec.name.isidentifier()


@pytest.mark.parametrize(
    "spec",
    [
        KernelSpec(64),
        KernelSpec(64, block_m=128, block_n=64, causal=True),
        KernelSpec(40, block_m=64, block_n=32, dtype="fp16", num_stages=3, arch="sm_80"),
        KernelSpec(256, block_m=64, block_n=32, arch="sm_86"),  # exactly the 99 KiB limit
        KernelSpec(8, block_m=16, block_n=16, num_warps=1, causal=True, arch="sm_90"),
    ],
    ids=lambda spec: spec.name,
)
def test_from_name_round_trips(spec):
    assert KernelSpec.from_name(spec.name) == spec
    assert KernelSpec.from_json(spec.canonical()) == spec


@pytest.mark.parametrize("name", ["", "fwd_d64", "fwd_d64_m128_n64_fp32_full_w4_s2_sm90a", "x" + KernelSpec(64).name])
def test_from_name_rejects_malformed(name):
    with pytest.raises(SpecError):
        KernelSpec.from_name(name)


BASE = KernelSpec(64, block_m=128, block_n=64, dtype="bf16", causal=False, num_warps=4, num_stages=2, arch="sm_90a")
ALTERNATIVE = {
    "head_dim": 128,
    "block_m": 64,
    "block_n": 32,
    "dtype": "fp16",
    "causal": True,
    "num_warps": 8,  # 128 rows / 8 warps = 16 rows per warp
    "num_stages": 3,
    "arch": "sm_80",
    # "kind": only "fwd" exists, so there is no valid alternative to change it to.
}


def key(spec):
    return content_key(spec, render(spec))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KernelSpec)])
def test_every_field_changes_name_and_key(field):
    if field == "kind":
        pytest.skip("kind has a single valid value ('fwd')")
    changed = BASE.replace(**{field: ALTERNATIVE[field]})
    assert getattr(changed, field) != getattr(BASE, field)
    assert changed.name != BASE.name
    assert key(changed) != key(BASE)


def test_alternatives_cover_every_field_but_kind():
    assert set(ALTERNATIVE) == {f.name for f in dataclasses.fields(KernelSpec)} - {"kind"}


def test_key_is_stable():
    assert key(BASE) == key(BASE)
    assert key(BASE) == key(KernelSpec.from_name(BASE.name))
    assert re.fullmatch(r"[0-9a-f]{64}", key(BASE))
