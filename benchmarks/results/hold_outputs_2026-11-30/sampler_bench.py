"""CPU µs of one 256-row sampling step of the torch sampler on the proxy logits (one torch thread), by mode."""
import torch, time, numpy as np
torch.set_num_threads(1)
from cllm.bench.null_backend import NullBackend
from cllm.sampling.torch_sampler import sample_on_device
from cllm.sampling.sampler import SamplingRow
import cllm
b = NullBackend(device="torch", device_ms=0)
for mode in [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=1), dict(temperature=1.0, seed=1), dict(temperature=0.7, top_k=40, seed=1)]:
    p = cllm.SamplingParams(max_tokens=100, ignore_eos=True, **mode)
    rows = [SamplingRow(p, np.random.default_rng(i), [1]*150, [], frozenset([0])) for i in range(256)]
    lg = b._rows(256).clone()
    for _ in range(20): sample_on_device(lg.clone(), rows).results()
    t=time.process_time()
    for _ in range(200): sample_on_device(lg.clone(), rows).results()
    print(mode, round((time.process_time()-t)/200*1e6), "us cpu per 256-row step")
