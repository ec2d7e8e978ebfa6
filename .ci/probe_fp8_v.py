"""GPU time of the FP8 forward's V preparation (ops.fp8_values: (B, H_kv, keys, d_v) e4m3 to
(B, H_kv, d_v, keys) with each 16 keys in FP8_KEY_ORDER) against other ways to write the same bytes
in PyTorch, and against a plain transposing copy (the floor of a PyTorch transpose) and a plain
copy (the memory floor), at the bench's shapes (16k tokens, d = 128: 16 heads; d = 256: 8).
Each candidate's output is checked equal to fp8_values'.  Usage: python3 .ci/probe_fp8_v.py"""

import torch

from flashgen import bench, ops


def gathered_then_transposed(v):
    """The key order within each 16 first, on rows of d_v contiguous bytes, then one transposing copy."""
    batch, kv_heads, keys, head_dim_v = v.shape
    bytes_ = v.view(torch.uint8)
    if keys % 16:
        bytes_ = torch.nn.functional.pad(bytes_, (0, 0, 0, 16 - keys % 16))
    grouped = bytes_.reshape(batch, kv_heads, -1, 16, head_dim_v).index_select(3, ops._key_order(v.device))
    return grouped.permute(0, 1, 4, 2, 3).reshape(batch, kv_heads, head_dim_v, -1).contiguous().view(v.dtype)


def main():
    for head_dim in (128, 256):
        _, k, v = bench._inputs(16384, head_dim)
        v = v.to(torch.float8_e4m3fn)
        want = ops.fp8_values(v)
        got = gathered_then_transposed(v)
        same = torch.equal(want.view(torch.uint8), got.view(torch.uint8))
        times = {
            "fp8_values (index_select on the transposed view)": bench.time_ms(lambda: ops.fp8_values(v)),
            "gather rows, then one transposing copy": bench.time_ms(lambda: gathered_then_transposed(v)),
            "transposing copy alone": bench.time_ms(lambda: v.view(torch.uint8).transpose(2, 3).contiguous()),
            "plain copy (memory floor)": bench.time_ms(lambda: v.view(torch.uint8).clone()),
        }
        print(f"d = {head_dim}, V {tuple(v.shape)} ({v.numel() / 2**20:.0f} MiB); the second equal to the first: {same}")
        for name, ms in times.items():
            print(f"  {name}: {ms * 1000:.1f} us")


if __name__ == "__main__":
    main()
