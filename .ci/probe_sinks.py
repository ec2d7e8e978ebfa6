"""GPU probe of a sink's gradient: whether the backward leaves o, lse, dO, q, k, v as the forward gave them
(bitwise), how the gradient compares with the formula over the saved o and lse, and where its error
against the fp32 oracle comes from (the output rounded to bf16, or the lse). d = 64, 128; T = 1000;
full and causal; both backward modes; with and without a sink.

    PYTHONPATH=. python3 .ci/probe_sinks.py
"""

import torch, flashgen
from flashgen import reference
SINK = [2.0, -1.0, 0.5, 4.0, -3.0, 1.0, 0.0, 6.0]
def where(a, b):
    bad = (a != b)
    if a.dtype.is_floating_point: bad &= ~(a.isnan() & b.isnan())
    n = int(bad.sum())
    return "ok" if n == 0 else f"CHANGED {n} first {tuple(int(i) for i in bad.nonzero()[0])} last {tuple(int(i) for i in bad.nonzero()[-1])}"
for d in (64, 128):
  for causal in (False, True):
   for det in (False, True):
    for with_sink in (True, False):
      gen = torch.Generator(device="cuda").manual_seed(d + 1000)
      q = torch.randn(2, 8, 1000, d, device="cuda", dtype=torch.bfloat16, generator=gen)
      k, v = (torch.randn(2, 2, 1000, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
      d_o = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
      sink = torch.tensor(SINK, device="cuda") if with_sink else None
      leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if with_sink else [])
      o, lse = flashgen.attention(*leaves[:3], causal=causal, learnable_sink=leaves[3] if with_sink else None,
                                  deterministic=det, return_lse=True)
      o0, lse0, d_o0 = o.detach().clone(), lse.detach().clone(), d_o.clone()
      o.backward(d_o)
      torch.cuda.synchronize()
      msg = {n: where(a, b) for n, a, b in (("o", o.detach(), o0), ("lse", lse.detach(), lse0), ("d_o", d_o, d_o0),
              ("q", leaves[0].detach(), q), ("k", leaves[1].detach(), k), ("v", leaves[2].detach(), v))}
      line = f"d={d} causal={causal} det={det} sink={with_sink}: " + " ".join(f"{n}:{m}" for n, m in msg.items())
      if with_sink:
          delta = (d_o.float() * o0.float()).sum(-1)
          manual = -(torch.exp(sink[None, :, None] - lse0) * delta).sum((0, 2))
          line += f" | sink grad vs from-saved max {(leaves[3].grad - manual).abs().max().item():.2e}"
          eo, else_ = reference.naive_attention(q, k, v, causal=causal, learnable_sink=sink, return_lse=True)
          line += f" | o err {(o0.float()-eo.float()).abs().max().item():.2e} lse err {(lse0-else_).abs().max().item():.2e}"
          s_ = sink.clone().requires_grad_()
          eo2 = reference.naive_attention(q, k, v, causal=causal, learnable_sink=s_)
          eo2.backward(d_o.float()); exact = s_.grad
          f = lambda o_, l_: -(torch.exp(sink[None, :, None] - l_) * (d_o.float() * o_.float()).sum(-1)).sum((0, 2))  # noqa: E731
          line += (f" | vs exact: ours {(leaves[3].grad - exact).abs().max().item():.2e}, formula(exact O fp32) {(f(eo, else_) - exact).abs().max().item():.2e},"
                   f" formula(exact O bf16) {(f(eo.bfloat16(), else_) - exact).abs().max().item():.2e}, formula(our O, exact lse) {(f(o0, else_) - exact).abs().max().item():.2e}")
      print(line, flush=True)
