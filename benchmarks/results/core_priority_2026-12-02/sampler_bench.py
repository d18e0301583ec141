import time, torch, numpy as np, cProfile, pstats, sys
torch.set_num_threads(1)
from cllm.bench.null_backend import NullBackend
from cllm.sampling.params import SamplingParams
from cllm.sampling.sampler import SamplingRow
from cllm.sampling.torch_sampler import sample_on_device
b = NullBackend(slots=256, vocab_size=1024, device="torch")
import os
p = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=100000) if not os.environ.get("GREEDY") else SamplingParams(temperature=0.0, max_tokens=100000)
rows = [SamplingRow(p, i, [], [], frozenset({0})) for i in range(256)]
logits = b._rows(256)
for _ in range(50): sample_on_device(logits.clone(), rows).results()
N = 300
t = time.perf_counter()
for _ in range(N): sample_on_device(logits.clone(), rows).results()
print("per call ms", 1000 * (time.perf_counter() - t) / N)
if len(sys.argv) > 1:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(N): sample_on_device(logits.clone(), rows).results()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
