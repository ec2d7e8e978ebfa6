"""Which KernelSpec to run for a problem: a small table measured on the H200 (see BENCHMARKS.md).

Each entry lists tile shapes best first; the first one that is a valid spec for the target (shared
memory differs between sm_80, sm_86 and sm_90) wins.
"""

from __future__ import annotations

from .spec import KernelSpec, SpecError

# (largest head_dim, causal) -> [(block_m, block_n, num_warps, num_stages), ...] best first
FORWARD_TABLE = {
    (64, False): [(128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
    (64, True): [(128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
    (128, False): [(128, 32, 4, 2), (64, 64, 4, 2)],
    (128, True): [(128, 64, 4, 2), (64, 64, 4, 2)],
    (256, False): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (256, True): [(64, 64, 4, 2), (64, 32, 4, 2)],
}
SHORT_QUERY = 64  # at or below this many query rows, 64-row blocks waste less work


def forward_spec(head_dim: int, dtype: str, causal: bool, arch: str, seqlen_q: int) -> KernelSpec:
    # head_dim > 256 uses the last row, so KernelSpec rejects it with a SpecError, not StopIteration
    bound = next((b for b in (64, 128, 256) if head_dim <= b), 256)
    candidates = FORWARD_TABLE[(bound, causal)]
    if seqlen_q <= SHORT_QUERY:
        candidates = [c for c in candidates if c[0] == 64] + candidates
    error = None
    for block_m, block_n, num_warps, num_stages in candidates:
        try:
            return KernelSpec(
                head_dim=head_dim, block_m=block_m, block_n=block_n, dtype=dtype, causal=causal,
                num_warps=num_warps, num_stages=num_stages, arch=arch,
            )
        except SpecError as rejected:
            error = rejected
    raise SpecError(f"no forward tile shape fits head_dim={head_dim} on {arch}: {error}")


TEST_HEAD_DIMS = (32, 40, 64, 80, 96, 128, 192, 256)


def shipped_forward_specs(arch: str, head_dims=TEST_HEAD_DIMS) -> list[KernelSpec]:
    """Every spec the table picks on `arch` for these head dims, both dtypes and masks."""
    specs = []
    for head_dim in head_dims:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                for seqlen_q in (SHORT_QUERY, SHORT_QUERY + 1):
                    spec = forward_spec(head_dim, dtype, causal, arch, seqlen_q)
                    if spec not in specs:
                        specs.append(spec)
    return specs
