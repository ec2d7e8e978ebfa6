"""A kernel's shared-memory layout, described once: Python reads its size (to validate a spec and to
launch), and the rendered kernel gets its offsets as constants and checks its own use against
them with static_asserts.

    layout = SmemLayout([Region("q", 16384), Region("kv", 32768)])
    layout.size        # 49152: the dynamic shared memory a block asks for
    layout.cuda()      # constexpr int SMEM_Q = 0; constexpr int SMEM_Q_BYTES = 16384; ...
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """A named piece of shared memory; `align` is the byte boundary it starts on."""

    name: str
    bytes: int
    align: int = 16


class SmemLayout:
    """Regions laid out one after another; overlays start at 0 and reuse the space of the regions
    once those are no longer needed (output staging at the end of a kernel). Dynamic shared memory
    is only 16-byte aligned: when a region needs more (TMA's swizzled tiles: 1024), the kernel
    rounds its base up to `align` (SMEM_ALIGN) and the size includes that slack."""

    def __init__(self, regions: list[Region], overlays: list[Region] = ()):
        self.regions, self.overlays = list(regions), list(overlays)
        self.offsets: dict[str, int] = {}
        offset = 0
        for region in self.regions:
            offset += -offset % region.align
            self.offsets[region.name] = offset
            offset += region.bytes
        for overlay in self.overlays:
            self.offsets[overlay.name] = 0
        self.size = max([offset] + [o.bytes for o in self.overlays])
        if self.align > 16:
            self.size += self.align

    @property
    def align(self) -> int:
        """The boundary the whole block of shared memory must start on."""
        return max([16] + [r.align for r in self.regions + self.overlays])

    def cuda(self) -> str:
        """Each region's offset and size as constexprs, and the total."""
        lines = []
        for region in self.regions + self.overlays:
            name = f"SMEM_{region.name.upper()}"
            lines.append(f"constexpr int {name} = {self.offsets[region.name]}, {name}_BYTES = {region.bytes};")
        if self.align > 16:
            lines.append(f"constexpr int SMEM_ALIGN = {self.align};  // the kernel rounds its base up to this")
        lines.append(f"constexpr int SMEM_BYTES = {self.size};")
        return "\n".join(lines)
