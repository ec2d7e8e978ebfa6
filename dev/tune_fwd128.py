import torch
from flashgen import bench
for T in (2048, 4096):
    for causal in (False, True):
        rows = bench.tune_forward(128, causal, T, candidates=[(128,64,4,2),(128,32,4,2),(128,32,4,3),(64,64,4,2),(64,32,4,2),(64,64,4,3),(128,64,8,2)])
        print(f"tune fwd d=128 causal={causal} T={T}: " + ", ".join(f"{r['spec'].replace('_bf16','').replace('_sm90a','')}={r['tflops']:.0f}" for r in rows))
print("host overhead us", bench.host_overhead_us())
print("compile/load", bench.compile_and_load_times())
