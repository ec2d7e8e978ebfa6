"""SASS of the Hopper kernels (cuobjdump and nvdisasm from NVIDIA's wheels, test dependencies):
what ptxas made of the schedules the templates ask for. ptxas hoists a warpgroup MMA wait to the
top of its basic block, so work written between an MMA's issue and its wait can land behind the
wait, off the tensor cores' time; these tests read where the multi-function unit's instructions
(the exponentials, softcap's tanh) ended up."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashgen import tuning
from flashgen.compile import compile_source
from flashgen.render import render
from flashgen.spec import KernelSpec
from sweeps import group, sweep

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import rules  # noqa: E402


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        found = found or next((str(p) for p in sorted(Path(root).glob("*/bin/cuobjdump"))), None)
    return found


CUOBJDUMP = _cuobjdump()
pytestmark = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def sass(spec: KernelSpec, tmp_path) -> list[str]:
    """The kernel's instructions in order, predicates dropped."""
    path = tmp_path / f"{spec.name}.cubin"
    path.write_bytes(compile_source(spec, render(spec)).cubin)
    env = {**os.environ, "PATH": f"{Path(CUOBJDUMP).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # where nvdisasm is
    text = subprocess.run([CUOBJDUMP, "-sass", str(path)], capture_output=True, text=True, check=True, env=env).stdout
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][^;]*);", text)


def between_waits(instructions: list[str]) -> list[tuple[list[str], list[str]]]:
    """For each wait that leaves one MMA group in flight (the score product's wait, the other product
    still running): the instructions up to the next wait, and those from there to the next MMA."""
    found = []
    for i, op in enumerate(instructions):
        if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"):
            end = next(j for j in range(i + 1, len(instructions)) if instructions[j].startswith("WARPGROUP.DEPBAR"))
            after = next((j for j in range(end, len(instructions)) if instructions[j].startswith("HGMMA")), len(instructions))
            found.append((instructions[i + 1:end], instructions[end:after]))
    return found


def mufu(ops: list[str], function: str) -> int:
    return sum(op.startswith(f"MUFU.{function}") for op in ops)


BACKWARD = [spec for spec in tuning.shipped_specs("sm_90a") if spec.kind.startswith("bwd_sm90") and spec.block_n == 128]
BACKWARD += [tuning.backward_specs(d, "bf16", c, "sm_90a", False, variant=("softcap",))[0] for d, c in ((64, True), (128, False))]
# mask rules at d = 64 (at d = 96 and 128 their test ahead of the wait made bwd_sm90_kv spill): one
# that reads a tensor (documents) and one that does not (prefix-LM)
_DOCUMENTS = rules.documents(torch.zeros(2, 300, dtype=torch.int32)).source
BACKWARD += [spec for source, c in ((_DOCUMENTS, True), (rules.prefix_lm(64).source, False)) for det in (False, True)
             for spec in tuning.backward_specs(64, "bf16", c, "sm_90a", det, variant=(("mask_mod", source),))
             if spec.kind.startswith("bwd_sm90")]


@pytest.mark.parametrize("spec", sweep(BACKWARD, by=lambda spec: (*group(spec), "softcap" in spec.variants, bool(spec.mask_mod))))
def test_the_hopper_backward_computes_p_under_dp(spec, tmp_path):
    """Every exponential of a step's P^T (block_m / 2 a thread) runs between the S^T wait and the dP^T
    wait; with softcap, every tanh too."""
    waits = between_waits(sass(spec, tmp_path))
    steps = [(under, after) for under, after in waits if mufu(under + after, "EX2") + mufu(under + after, "TANH")]
    per_thread = spec.block_m // 2
    assert steps, "no wait for S^T alone"  # (the other such waits are dQ's pipeline)
    for under, after in steps:
        assert (mufu(under, "EX2"), mufu(after, "EX2")) == (per_thread, 0)
        assert (mufu(under, "TANH"), mufu(after, "TANH")) == ((per_thread, 0) if "softcap" in spec.variants else (0, 0))


FORWARD = [tuning.forward_spec(d, "bf16", c, "sm_90a", 4096, variant=v) for d in (64, 128) for c in (False, True)
           for v in ((), ("softcap",))]


@pytest.mark.parametrize("spec", FORWARD, ids=lambda spec: spec.name)
def test_the_hopper_forward_runs_its_softmax_under_pv(spec, tmp_path):
    """Every exponential (and tanh) of a key tile's softmax runs between the QK^T wait and the P V
    wait (the conditional K release holds the wait back)."""
    steps = between_waits(sass(spec, tmp_path))
    assert steps
    for under, after in steps:
        assert mufu(under, "EX2") >= spec.block_n // 2 and mufu(after, "EX2") == mufu(after, "TANH") == 0


SUMMING = [spec for spec in BACKWARD if spec.kind == "bwd_sm90_kvq"]  # the kernels that add up dQ


@pytest.mark.parametrize("spec", SUMMING, ids=lambda spec: spec.name)
def test_the_hopper_backward_stages_dq_under_dk(spec, tmp_path):
    """A step issues dV, dQ, then dK: once dV and dQ have landed, the dQ tile's staging (8 n8 tiles,
    two 8-byte stores each) and its TMA reduction run while dK is still computed."""
    instructions = sass(spec, tmp_path)
    staged = [under for under, _ in between_waits(instructions) if any(op.startswith("STS.64") for op in under)]
    assert len(staged) == 1, "no wait that leaves dK in flight before the dQ staging"
    assert sum(op.startswith("STS.64") for op in staged[0]) == 16
    assert any(op.startswith("UTMACMDFLUSH") for op in staged[0])  # the reduction is issued there too


RULES = [(rules.documents(torch.zeros(2, 300, dtype=torch.int32)).source, True), (rules.prefix_lm(64).source, False)]
RULE_SPECS = [tuning.forward_spec(64, "bf16", causal, "sm_90a", 4096, variant=(("mask_mod", source),)) for source, causal in RULES]
RULE_SPECS += [tuning.backward_specs(64, "bf16", causal, "sm_90a", False, variant=(("mask_mod", source),))[0] for source, causal in RULES]


@pytest.mark.parametrize("spec", RULE_SPECS, ids=lambda spec: spec.name)
def test_a_mask_rule_is_tested_without_a_branch_per_element(spec, tmp_path):
    """The rule is evaluated at clamped positions whether or not the mask already hides the element
    (`|`, not `||`), so a partial tile's test has no branch per element and the loads of a rule that
    reads a tensor are shared by the elements of a row or a key. A branch per element would leave
    at least one divergence region (BSSY) per element of a thread's tile."""
    elements = (spec.block_n if spec.kind == "fwd_sm90" else spec.block_m) // 2
    assert sum(op.startswith("BSSY") for op in sass(spec, tmp_path)) < elements


@pytest.mark.parametrize("spec", FORWARD, ids=lambda spec: spec.name)
def test_the_hopper_forward_reads_q_from_registers_where_it_fits(spec, tmp_path):
    """Two consumer warpgroups (d = 128) hold their rows of Q in registers: every QK^T takes its A
    operand from registers (so it reads only K from shared memory), and Q is read into them once a
    tile, one ldmatrix.x4 per k16 step of the head dim. Three consumers (d = 64's 192 x 128) have
    no room and read Q from shared memory."""
    instructions = sass(spec, tmp_path)
    products = [op for op in instructions if op.startswith("HGMMA")]
    # S = Q K^T has K-major operands, O += P V a transposed B (tnspB); A from registers is named R<n>
    scores = [op for op in products if "tnspB" not in op]
    in_registers = spec.family.q_in_registers(spec)
    assert in_registers == (spec.block_m == 128)
    steps = spec.family.head_dim_pad(spec) // 16
    assert scores and all(bool(re.match(r"HGMMA\S+ R\d+, R\d+, gdesc", op)) == in_registers for op in scores)
    assert sum(op.startswith("LDSM.16.M88.4") for op in instructions) == (steps if in_registers else 0)


# The trio layout (block_n = 96) as the tables run it at d = 192 / d_v = 128, and its dQ-less kind.
TRIO = [tuning.backward_specs(192, "bf16", causal, "sm_90a", False, head_dim_v=128)[0] for causal in (False, True)]
TRIO += [TRIO[1].replace(kind="bwd_sm90_kv")]


@pytest.mark.parametrize("spec", TRIO, ids=lambda spec: spec.name)
def test_the_trio_backward_computes_p_under_dp_and_issues_its_mmas_back_to_back(spec, tmp_path):
    """Each step's 16 exponentials a thread (64 queries x 32 keys) run between the S wait and the dP
    wait; with dQ, its staging (16 eight-byte stores) and TMA reduction run while dK^T is computed;
    and the S product's 12 MMAs follow each other with about 4 instructions between them (their
    descriptors one add from a base built once, in uniform registers; rebuilt each time, 13)."""
    assert spec.family.trio(spec)
    instructions = sass(spec, tmp_path)
    waits = between_waits(instructions)
    steps = [(under, after) for under, after in waits if mufu(under + after, "EX2")]
    assert steps and all((mufu(under, "EX2"), mufu(after, "EX2")) == (16, 0) for under, after in steps)
    staged = [under for under, _ in waits if any(op.startswith("STS.64") for op in under)]
    if spec.kind == "bwd_sm90_kvq":
        assert len(staged) == 1 and sum(op.startswith("STS.64") for op in staged[0]) == 16
        assert any(op.startswith("UTMACMDFLUSH") for op in staged[0])
    else:
        assert not staged
    mmas = [i for i, op in enumerate(instructions) if op.startswith("HGMMA.64x32x16")]
    score = mmas[:12]  # S: 12 k-steps of d = 192, the step's first MMAs
    gaps = [b - a - 1 for a, b in zip(score, score[1:])]
    assert sum(gaps) <= 6 * len(gaps), gaps
