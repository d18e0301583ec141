# _weights (temperature, max, exp over 256 x 1,024 floats) on the null table, cache hot and after reading 32 MB
# (cold): the whole batch at once (orig) against blocks of rows within L2 (numpy or torch ops).
import time, torch, numpy as np
torch.set_num_threads(1)
from cllm.bench.null_backend import NullBackend
b = NullBackend(slots=256, vocab_size=1024, device="torch")
L = b._rows(256); T = torch.full((256,), 0.8)
junk = np.ones(8 << 20, np.float32)
def orig(l, t):
    s = l / t[:, None]; s -= s.amax(dim=1, keepdim=True); np.exp(s.numpy(), out=s.numpy()); return s
def blocked_np(l, t, bv=65536):
    x, tt = l.numpy(), t.numpy()[:, None]; out = np.empty(x.shape, np.float32); blk = max(1, bv // x.shape[1])
    for s in range(0, len(x), blk):
        o = out[s:s+blk]; np.divide(x[s:s+blk], tt[s:s+blk], out=o); o -= o.max(axis=1, keepdims=True); np.exp(o, out=o)
    return out
def blocked_torch(l, t, bv=65536):
    out = torch.empty_like(l); blk = max(1, bv // l.shape[1]); tt = t[:, None]
    for s in range(0, len(l), blk):
        o = out[s:s+blk]; torch.div(l[s:s+blk], tt[s:s+blk], out=o); o -= o.amax(dim=1, keepdim=True); np.exp(o.numpy(), out=o.numpy())
    return out
def run(f, cold, n=300, **k):
    tot = 0
    for _ in range(n):
        if cold: junk.sum()
        t = time.perf_counter(); f(L, T, **k); tot += time.perf_counter() - t
    return 1e6 * tot / n
for f in (orig, blocked_np, blocked_torch):
    print(f.__name__, 'hot %.0f cold %.0f' % (run(f, 0), run(f, 1)))
print('blocked_torch 128K', 'hot %.0f cold %.0f' % (run(blocked_torch, 0, bv=131072), run(blocked_torch, 1, bv=131072)))
print('blocked_torch 32K', 'hot %.0f cold %.0f' % (run(blocked_torch, 0, bv=32768), run(blocked_torch, 1, bv=32768)))
a = orig(L, T).numpy(); print('same', np.array_equal(a, blocked_np(L, T)), np.array_equal(a, blocked_torch(L, T).numpy()))
