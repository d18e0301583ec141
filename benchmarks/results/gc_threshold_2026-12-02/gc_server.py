"""A null server with GC statistics per generation (written to /tmp/gc_PID.txt, by the API process and the engine core);
GC_TH="g0,g1,g2" sets the thresholds in both before anything is imported."""
import gc, sys, time, collections, os
stats = collections.defaultdict(lambda: [0, 0.0, 0.0]); t0 = [0.0]; last = [0.0]
def _write():
    with open(f'/tmp/gc_{os.getpid()}.txt', 'w') as f:
        f.write(f"GC_TH={os.environ.get('GC_TH')} thresholds {gc.get_threshold()} frozen {gc.get_freeze_count()}\n")
        for g, (n, tot, mx) in sorted(stats.items()): f.write(f"gen{g}: {n} collections, {tot*1000:.0f} ms total, max {mx*1000:.1f} ms\n")
def cb(phase, info):
    if phase == 'start': t0[0] = time.perf_counter()
    else:
        now = time.perf_counter(); d = now - t0[0]; s = stats[info['generation']]; s[0] += 1; s[1] += d; s[2] = max(s[2], d)
        if now - last[0] > 1.0: last[0] = now; _write()
gc.callbacks.append(cb)
th = os.environ.get('GC_TH')
if th: gc.set_threshold(*map(int, th.split(',')))
if __name__ == '__main__':
    sys.argv = ['null_server'] + sys.argv[1:]
    from cllm.bench import null_server
    try:
        null_server.main()
    finally:
        _write()
