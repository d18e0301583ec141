# _fill of the current tree against 6447c27's, interleaved in one process: 256 decode rows (64-block tables, positions 600-912),
# the CUDA mask layout; asserts both mirrors end equal
# (first: git show 6447c27:cllm/backends/torch/cuda_graphs.py > /tmp/old_cuda_graphs.py; run from /work/main)
import sys, time, types, statistics, importlib.util
import numpy as np, torch
sys.path.insert(0, '/work/main/benchmarks'); sys.path.insert(0, '/work/main')
from cllm.backends.torch import cuda_graphs as new
spec = importlib.util.spec_from_file_location("old_cuda_graphs", "/tmp/old_cuda_graphs.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_cuda_graphs"] = old; spec.loader.exec_module(old)
from cllm.backends.torch.attention import SeqChunk
torch.set_num_threads(1)
class Shape: block_size = 16; num_kv_heads = 2; num_blocks = 256 * 64; seq_blocks = 64; head_dim = 8
class Cache:
    shape = Shape(); head_major = False
    class k: device = torch.device('cuda')  # decode_mask_arrays' CUDA layout (no dense lookup)
from cllm.backends.torch.kv_cache import PagedKVCache
Cache.write_rows = PagedKVCache.write_rows
B, bs = 256, 16
tables = [list(range(i * 64, i * 64 + 64)) for i in range(B)]
def make(mod):
    g = mod.DecodeGraphs.__new__(mod.DecodeGraphs)
    g._cache = Cache(); g._scratch = 0
    if mod is new: g._next_slot = Cache().write_rows(np.ones(1, dtype=np.int64)) - Cache().write_rows(np.zeros(1, dtype=np.int64))
    first = {**g._arrays(np.zeros(B, dtype=np.int64), [SeqChunk(r, 1, 0, (0,)) for r in range(B)])}
    host = {k: v.copy() for k, v in first.items()}
    inputs = types.SimpleNamespace(writable=lambda: host, upload=lambda: None, host=host)
    bucket = mod._Bucket(inputs, None, None)
    return g, bucket
res = {'old': [], 'new': []}
gs = {'old': make(old), 'new': make(new)}
start = 600
for step in range(300):
    chunks = [SeqChunk(r, 1, start + step + (r % 7), tables[r]) for r in range(B)]
    ids = np.arange(B, dtype=np.int64)
    for name in (('old', 'new') if step % 2 else ('new', 'old')):
        g, b = gs[name]
        t = time.perf_counter(); g._fill(b, ids, chunks); res[name].append(time.perf_counter() - t)
hn, ho = gs['new'][1].inputs.host, gs['old'][1].inputs.host
assert all(np.array_equal(hn[k], ho[k]) for k in ho), 'mirrors differ'
for name, v in res.items():
    v = v[20:]
    print(name, 'median %.1f µs, p10 %.1f' % (1e6 * statistics.median(v), 1e6 * sorted(v)[len(v) // 10]))
