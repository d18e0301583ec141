# The torch sampler alone, 256 rows (top-p 0.95 at 0.8, or GREEDY=1), two rows replaced per call (as requests of
# 128 tokens are at 256 streams): min and median CPU ms per call over 7 x 200 calls. PYTHONPATH=TREE python sampler_churn.py
# the whole torch sampler on 256 top-p rows, rows renewed every 128 calls (as requests of 128 tokens are)
import time, torch, numpy as np, sys, statistics
torch.set_num_threads(1)
from cllm.bench.null_backend import NullBackend
from cllm.sampling.params import SamplingParams
from cllm.sampling.sampler import SamplingRow
from cllm.sampling.torch_sampler import sample_on_device
b = NullBackend(slots=256, vocab_size=1024, device="torch")
import os
p = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=100000) if not os.environ.get("GREEDY") else SamplingParams(temperature=0.0, max_tokens=100000)
logits = b._rows(256)
rows = [SamplingRow(p, i, [], [], frozenset({0})) for i in range(256)]
n = 0
def step():
    global n
    n += 1
    rows[n % 256] = SamplingRow(p, n, [], [], frozenset({0})); rows[(n + 128) % 256] = SamplingRow(p, -n - 1 & 0xffff, [], [], frozenset({0}))
    sample_on_device(logits.clone(), rows).results()
for _ in range(300): step()
ts = []
for _ in range(7):
    t = time.thread_time()
    for _ in range(200): step()
    ts.append(1000 * (time.thread_time() - t) / 200)
print("per call ms", round(min(ts), 4), round(statistics.median(ts), 4))
