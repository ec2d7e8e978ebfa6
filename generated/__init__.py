"""Ahead-of-time flashgen kernels (see README.md): `from <this package> import <kernel name>`,
then `<kernel name>.attention(q, k, v)`; or `kernels()` for all of them, by name."""

from pathlib import Path as _Path


def kernels() -> dict:
    """Every forward kernel in this folder (each loads its backward kernels), by name."""
    import flashgen

    return flashgen.load(_Path(__file__).parent)
