"""Ahead-of-time flashgen kernels (see README.md). `load()` registers every kernel in this folder
with flashgen, so that flashgen.attention and the other functions run them with no compiler, and
returns the forward kernels by name; `from <this package> import <kernel name>` imports one of them
(`<kernel name>.attention(q, k, v)`)."""

from pathlib import Path as _Path


def load() -> dict:
    """flashgen.load(this folder), wherever it is installed."""
    import flashgen

    return flashgen.load(_Path(__file__).parent)
