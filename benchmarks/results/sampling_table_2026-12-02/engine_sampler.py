"""The in-process engine over the asynchronous simulated device (engine_overhead.proxy_engine_step: 256 rows,
--device-ms 5, lookahead on, torch on one thread as in the null server's core), with the torch sampler's
parts timed inside it:

    python engine_sampler.py TREE top_p|greedy [STEPS] [--dummy-math]

prints the engine's host ms per step and the wall µs per call of the sampler and its parts. --dummy-math adds
the sampler's temperature/softmax math over 256 x 1,024 floats (without a draw) to every sampling call: run
with greedy, it shows what that math alone costs the host in the engine.
"""
import collections, sys, time
root = sys.argv[1]
sys.path.insert(0, root); sys.path.insert(0, root + '/benchmarks')
import numpy as np
import torch
torch.set_num_threads(1)
import engine_overhead as eo
from cllm.bench import null_backend as nb
from cllm.sampling import torch_sampler as ts

mode, steps = sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 200
spent, calls = collections.Counter(), collections.Counter()


def timed(owner, name):
    if not hasattr(owner, name):
        return
    f = getattr(owner, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
            calls[name] += 1
    setattr(owner, name, g)


for name in ("sample_on_device", "_draw", "_weights", "_truncated_draw", "_results", "argmax_rows"):
    timed(ts, name)
for name in ("settings", "uniforms"):
    timed(getattr(ts, "SamplingTable", object), name)
if "--dummy-math" in sys.argv:
    plain = nb.NullBackend.sample

    def sample(self, logits, rows):
        s = logits / 0.8
        s -= s.amax(dim=1, keepdim=True)
        np.exp(s.numpy(), out=s.numpy())
        s.sum(dim=1), s.amax(dim=1)
        return plain(self, logits, rows)
    nb.NullBackend.sample = sample
args = eo.argparse.Namespace(device_ms=5.0, token_us=0.0, vocab=1024, prompt_len=150, steps=steps, repeats=3)
r = eo.proxy_engine_step(256, mode, "on", args)
print(mode, "dummy-math" if "--dummy-math" in sys.argv else "", f"host {r['host_ms']:.3f} ms/step",
      " ".join(f"{k} {1e6 * v / calls[k]:.0f} µs" for k, v in spent.items()))
