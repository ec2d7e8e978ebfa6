"""Instruction counts in the SASS of the kernels the tables pick for a few problems (GPU machine:
cuobjdump): the Hopper instructions that make a kernel what it claims, no local memory, and the
highest register the code names (under setmaxnreg 240 a consumer may go up to R239).

    PYTHONPATH=. python3 .ci/sass.py
"""

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from flashgen import tuning
from flashgen.compile import compile_source
from flashgen.render import render

OPCODES = ("HGMMA", "HMMA", "UTMALDG", "UTMASTG", "UBLKCP", "UBLKRED", "UTMAREDG", "USETMAXREG", "LDGSTS", "LDL", "STL")

specs = [tuning.forward_spec(d, "bf16", True, "sm_90a", 4096) for d in (64, 128)]
specs += [s for d in (64, 128, 192, 256) for s in tuning.backward_specs(d, "bf16", True, "sm_90a", False)]
specs += [tuning.decode_spec(128, "bf16", "sm_90a", paged, 4) for paged in (False, True)]
specs.append(tuning.merge_spec("merge", 128, "bf16", "sm_90a"))
with tempfile.TemporaryDirectory() as tmp:
    for spec in specs:
        path = Path(tmp) / f"{spec.name}.cubin"
        path.write_bytes(compile_source(spec, render(spec)).cubin)
        sass = subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True, check=True).stdout
        found = Counter(m.group(1) for m in re.finditer(r"\b([A-Z][A-Z0-9]+)[.\s]", sass) if m.group(1) in OPCODES)
        registers = 1 + max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1)  # the highest one named
        print(spec.name, " ".join(f"{op} {found[op]}" for op in OPCODES if found[op]) or "-", f"R0-R{registers - 1}", flush=True)
