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
    (dict(head_dim=64, kind="fwd_sm90", block_n=128, exp2_fma=9), "exp2_fma=9: must be in [0, 8]"),
    (dict(head_dim=64, kind="fwd_sm90", block_n=128, exp2_fma=0.5), "exp2_fma=0.5: must be an int"),
    (dict(head_dim=64, exp2_fma=2), "exp2_fma=2: a fwd kernel does not use exp2_fma"),
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
    spec = KernelSpec(head_dim=64, block_m=128, block_n=64, causal=True)
    assert spec.name == "fwd_d64_m128_n64_bf16_causal_w4_s2_sm90a"
    assert spec.name.isidentifier()


@pytest.mark.parametrize(
    "spec",
    [
        KernelSpec(head_dim=64),
        KernelSpec(head_dim=64, block_m=128, block_n=64, causal=True),
        KernelSpec(head_dim=40, block_m=64, block_n=32, dtype="fp16", num_stages=3, arch="sm_80"),
        KernelSpec(head_dim=256, block_m=64, block_n=32, arch="sm_86"),  # exactly the 99 KiB limit
        KernelSpec(head_dim=8, block_m=16, block_n=16, num_warps=1, causal=True, arch="sm_90"),
        KernelSpec(head_dim=96, kind="bwd_prep", dtype="fp16"),
    ],
    ids=lambda spec: spec.name,
)
def test_canonical_round_trips(spec):
    assert KernelSpec.from_json(spec.canonical()) == spec


def test_fields_are_keywords():
    with pytest.raises(TypeError):
        KernelSpec(64)  # noqa: the DSL grows fields: a position would shift meaning


def test_a_family_names_only_the_fields_it_uses_and_refuses_the_others():
    prep = KernelSpec(head_dim=64, kind="bwd_prep")
    assert prep.name == "bwd_prep_d64_bf16_sm90a"
    with pytest.raises(SpecError, match=r"causal=True: a bwd_prep kernel does not use causal \(leave it at its default, False\)"):
        KernelSpec(head_dim=64, kind="bwd_prep", causal=True)
    with pytest.raises(SpecError, match="block_m=64: a bwd_prep kernel does not use block_m"):
        KernelSpec(head_dim=64, kind="bwd_prep", block_m=64)


def test_ident_is_the_name_and_a_hash_of_everything():
    spec = KernelSpec(head_dim=64, causal=True)
    name, digest = spec.ident.rsplit("-", 1)
    assert name == spec.name and re.fullmatch(r"[0-9a-f]{12}", digest)
    assert spec.ident == KernelSpec.from_json(spec.canonical()).ident
    assert KernelSpec(head_dim=64).ident != spec.ident


BASE = KernelSpec(head_dim=64, block_m=128, block_n=64, dtype="bf16", causal=False, num_warps=4, num_stages=2, arch="sm_90a")
ALTERNATIVE = {
    "head_dim": 128,
    "block_m": 64,
    "block_n": 32,
    "dtype": "fp16",
    "causal": True,
    "num_warps": 8,  # 128 rows / 8 warps = 16 rows per warp
    "num_stages": 3,
    "arch": "sm_80",
    "kind": "bwd_q",
    "persistent": True,
    "exp2_fma": 3,
    "varlen": True,
    "head_dim_v": 32,
    "paged": True,
    "variants": ("window",),
    "score_mod": '{"cuda":"score * 2.f","grad":"2.f","tensors":[]}',
    "mask_mod": '{"cuda":"q_idx >= kv_idx","per_batch":false,"per_head":false,"tensors":[]}',
    "rotary": "halves",
    "out_dtype": "fp16",
    "kv_dtype": "e4m3",
}
# Fields the mma.sync forward does not use change a spec of a family that does.
_HOPPER = KernelSpec(head_dim=64, block_m=128, block_n=128, kind="fwd_sm90")
_DECODE = KernelSpec(head_dim=64, block_m=16, block_n=64, kind="decode", num_stages=3)
_PACKED_HOPPER = KernelSpec(head_dim=64, block_m=128, block_n=128, kind="fwd_sm90", varlen=True)
_FP8 = KernelSpec(head_dim=64, block_m=128, block_n=128, kind="fwd_sm90", dtype="e4m3", out_dtype="bf16")
BASE_FOR = {"persistent": _HOPPER, "exp2_fma": _HOPPER, "rotary": _DECODE, "paged": _PACKED_HOPPER, "out_dtype": _FP8,
            "kv_dtype": _DECODE}


def key(spec):
    return content_key(spec, render(spec))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KernelSpec)])
def test_every_field_changes_name_and_key(field):
    base = BASE_FOR.get(field, BASE)
    changed = base.replace(**{field: ALTERNATIVE[field]})
    assert getattr(changed, field) != getattr(base, field)
    assert changed.name != base.name
    assert key(changed) != key(base)


def test_alternatives_cover_every_field():
    assert set(ALTERNATIVE) == {f.name for f in dataclasses.fields(KernelSpec)}


def test_key_is_stable():
    assert key(BASE) == key(BASE)
    assert key(BASE) == key(KernelSpec.from_json(BASE.canonical()))
    assert re.fullmatch(r"[0-9a-f]{64}", key(BASE))


def test_a_key_major_backward_needs_a_thread_per_two_query_rows():
    """Its query tile's statistics are loaded one thread per two rows (a static_assert in the
    template): refused here by name, not by NVRTC."""
    with pytest.raises(SpecError, match="block_m=128 with num_warps=1: .* block_m must be at most 64"):
        KernelSpec(kind="bwd_kv", head_dim=16, block_m=128, block_n=16, num_warps=1, arch="sm_80")
    assert KernelSpec(kind="bwd_kv", head_dim=16, block_m=64, block_n=16, num_warps=1, arch="sm_80").block_m == 64


def test_variants_are_named_each_once_in_the_registry_order():
    spec = KernelSpec(head_dim=64, variants=["alibi", "window"])  # (a list, as JSON reads it)
    assert spec.variants == ("window", "alibi") and spec == KernelSpec(head_dim=64, variants=("window", "alibi"))
    assert KernelSpec.from_json(spec.canonical()) == spec and spec.name.endswith("_window_alibi")
    with pytest.raises(SpecError, match="'sinkhole' is not one of window, softcap, alibi"):
        KernelSpec(head_dim=64, variants=("sinkhole",))
    with pytest.raises(SpecError, match="must be a tuple of variant names"):
        KernelSpec(head_dim=64, variants="window")
    with pytest.raises(SpecError, match="a bwd_prep kernel does not build window"):
        KernelSpec(head_dim=64, kind="bwd_prep", variants=("window",))
