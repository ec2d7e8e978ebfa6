"""Which KernelSpec to run for a problem: small tables measured on the H200 (see BENCHMARKS.md).

Each entry lists tile shapes best first; the first one that is a valid spec for the target (shared
memory differs between sm_80, sm_86 and sm_90) wins. On sm_90a the forward is the Hopper family
(TMA, wgmma, warp specialization); elsewhere, and for short queries, the mma.sync family.
"""

from __future__ import annotations

from .spec import KernelSpec, SpecError, check_head_dim

# (largest head_dim, causal) -> [(block_m, block_n, num_warps, num_stages), ...] best first
FORWARD_TABLE = {
    (64, False): [(128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
    (64, True): [(128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
    (128, False): [(128, 32, 4, 2), (64, 64, 4, 2)],
    (128, True): [(128, 64, 4, 2), (64, 64, 4, 2)],
    (256, False): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (256, True): [(64, 64, 4, 2), (64, 32, 4, 2)],
}
# Ampere and Ada (sm_8x) hold fewer registers' worth of these tiles before ptxas spills.
FORWARD_TABLE_SM8X = {**FORWARD_TABLE, (128, True): [(64, 64, 4, 2)]}
SHORT_QUERY = 64  # at or below this many query rows, 64-row blocks waste less work

# sm_90a forward (kind fwd_sm90): largest (padded) head_dim -> [(block_m, block_n, num_stages)].
# Measured on the H200 for d = 64, 128 and 256 (BENCHMARKS.md); d <= 192 is not tuned yet.
HOPPER_FORWARD_TABLE = {
    64: [(192, 128, 2)],
    128: [(128, 128, 2)],
    192: [(128, 96, 2)],
    256: [(128, 80, 2)],
}


def query_bucket(seqlen_q: int) -> bool:
    """The forward table's bucket of a query length: whether it counts as short. Everything that
    keeps a choice per problem keys it by this."""
    return seqlen_q <= SHORT_QUERY

# Backward: which kernels run. Up to head_dim 128 one key-major kernel keeps dK and dV in registers
# together; above, dV and dK take separate passes so that each fits.
BACKWARD_KINDS = {
    (128, False): ["bwd_kvq"],
    (128, True): ["bwd_kv", "bwd_q"],
    (256, False): ["bwd_v", "bwd_kq"],
    (256, True): ["bwd_v", "bwd_k", "bwd_q"],
}  # (head-dim bound, deterministic) -> kinds, key-major first
# (key- or query-major, head-dim bound, causal) -> [(block_m, block_n, num_warps, num_stages), ...]
BACKWARD_TABLE = {
    ("key", 64, False): [(128, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2)],
    ("key", 64, True): [(128, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 2)],
    ("key", 128, False): [(64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 2)],
    ("key", 128, True): [(64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 2)],
    ("key", 256, False): [(32, 64, 4, 2), (16, 64, 4, 2)],
    ("key", 256, True): [(32, 64, 4, 2), (16, 64, 4, 2)],
    ("query", 64, False): [(128, 64, 4, 2), (64, 64, 4, 2)],
    ("query", 64, True): [(128, 64, 4, 2), (64, 64, 4, 2)],
    ("query", 128, False): [(64, 64, 4, 2), (64, 32, 4, 2)],
    ("query", 128, True): [(64, 64, 4, 2), (64, 32, 4, 2)],
    ("query", 256, False): [(64, 32, 4, 2), (32, 32, 2, 2)],
    ("query", 256, True): [(64, 32, 4, 2), (32, 32, 2, 2)],
}

# Before sm_90 the key-major kernels run on mma.sync, whose 128 x 128 causal d = 64 tile spills.
BACKWARD_TABLE_SM8X = {**BACKWARD_TABLE, ("key", 64, True): BACKWARD_TABLE[("key", 64, True)][1:]}


def _bound(head_dim: int) -> int:
    # head_dim > 256 falls in the last row, so KernelSpec rejects it with a SpecError
    return next((b for b in (64, 128, 256) if head_dim <= b), 256)


def _first_valid(candidates, kind, head_dim, dtype, causal, arch, fields=("block_m", "block_n", "num_warps", "num_stages")) -> KernelSpec:
    check_head_dim(head_dim)  # a bad head dim is the problem, not the tiles
    error = None
    for values in candidates:
        try:
            return KernelSpec(head_dim=head_dim, dtype=dtype, causal=causal, arch=arch, kind=kind, **dict(zip(fields, values)))
        except SpecError as rejected:
            error = rejected
    raise SpecError(f"no {kind} tile shape fits head_dim={head_dim} on {arch}: {error}")


def forward_spec(head_dim: int, dtype: str, causal: bool, arch: str, seqlen_q: int) -> KernelSpec:
    """The forward kernel for a problem: the Hopper family on sm_90a, unless the query is short."""
    if arch == "sm_90a" and not query_bucket(seqlen_q):
        return tuned_spec("fwd_sm90", head_dim, dtype, causal, arch)
    return mma_forward_spec(head_dim, dtype, causal, arch, seqlen_q)


def mma_forward_spec(head_dim: int, dtype: str, causal: bool, arch: str, seqlen_q: int) -> KernelSpec:
    table = FORWARD_TABLE_SM8X if arch.startswith("sm_8") else FORWARD_TABLE
    candidates = table[(_bound(head_dim), causal)]
    if query_bucket(seqlen_q):
        candidates = [c for c in candidates if c[0] == 64] + candidates
    return _first_valid(candidates, "fwd", head_dim, dtype, causal, arch)


def tuned_spec(kind: str | None, head_dim: int, dtype: str, causal: bool, arch: str) -> KernelSpec:
    """The table's spec of a kind; kind None is the forward the tables pick for long sequences."""
    if kind is None:
        return forward_spec(head_dim, dtype, causal, arch, seqlen_q=4096)
    if kind == "fwd":
        return mma_forward_spec(head_dim, dtype, causal, arch, seqlen_q=4096)
    if kind == "fwd_sm90":
        bound = next((b for b in HOPPER_FORWARD_TABLE if head_dim <= b), 256)
        return _first_valid(HOPPER_FORWARD_TABLE[bound], kind, head_dim, dtype, causal, arch, ("block_m", "block_n", "num_stages"))
    if kind == "bwd_prep":
        return backward_prep(head_dim, dtype, arch)
    table = BACKWARD_TABLE_SM8X if arch.startswith("sm_8") else BACKWARD_TABLE
    major = "query" if kind == "bwd_q" else "key"
    return _first_valid(table[(major, _bound(head_dim), causal)], kind, head_dim, dtype, causal, arch)


def backward_specs(head_dim: int, dtype: str, causal: bool, arch: str, deterministic: bool) -> list[KernelSpec]:
    """The backward kernels to run after the prep, in order."""
    kinds = BACKWARD_KINDS[(128 if head_dim <= 128 else 256, deterministic)]
    return [tuned_spec(kind, head_dim, dtype, causal, arch) for kind in kinds]


TEST_HEAD_DIMS = (32, 40, 64, 80, 96, 128, 192, 256)


def backward_prep(head_dim: int, dtype: str, arch: str) -> KernelSpec:
    return KernelSpec(head_dim=head_dim, dtype=dtype, arch=arch, kind="bwd_prep")


def shipped_specs(arch: str, head_dims=TEST_HEAD_DIMS) -> list[KernelSpec]:
    """Every spec the tables pick on `arch` for these head dims, both dtypes and masks: forward,
    and backward (with its prep) in both modes."""
    specs = []
    for head_dim in head_dims:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                picked = [forward_spec(head_dim, dtype, causal, arch, t) for t in (SHORT_QUERY, SHORT_QUERY + 1)]
                picked.append(backward_prep(head_dim, dtype, arch))
                for deterministic in (False, True):
                    picked += backward_specs(head_dim, dtype, causal, arch, deterministic)
                specs += [spec for spec in dict.fromkeys(picked) if spec not in specs]
    return specs
