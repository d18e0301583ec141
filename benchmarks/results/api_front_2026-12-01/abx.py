"""A/B of two checkouts on the served proxy, in pairs that alternate which goes first: each run a fresh null
server (--device-ms 5, lookahead on), 2 warm rounds, then --rounds measured (--b streams, greedy, 128 tokens);
paired medians. (ab.py in ../compact_delta_2026-11-29/ runs the 4-round and steady figures instead.)

    .venv/bin/python abx.py OLD_CHECKOUT NEW_CHECKOUT --pairs 6 [--b 256] [--rounds 8]
"""
import argparse, subprocess, sys, json, statistics
p = argparse.ArgumentParser(); p.add_argument("roots", nargs="+"); p.add_argument("--pairs", type=int, default=6)
p.add_argument("--rounds", type=int, default=8); p.add_argument("--b", type=int, default=256); p.add_argument("--mode", default="greedy")
a = p.parse_args()
res = {r: [] for r in a.roots}
for k in range(a.pairs):
    for root in (a.roots if k % 2 == 0 else a.roots[::-1]):
        code = f"""
import sys, json; sys.path.insert(0, '{root}/benchmarks'); sys.path.insert(0, '{root}')
import engine_overhead as eo
args = eo.argparse.Namespace(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device='numpy', set=[], levels=[{a.b}],
    prompt_len=150, tokens=128, client_procs=2, min_tokens=1, rounds={a.rounds}, keep_alive=False, modes=['{a.mode}'])
proc, port = eo.start_null_server(args, 256, ['--device-ms', '5', '--set=lookahead=on'])
try:
    eo.server_us_per_token(port, proc.pid, {a.b}, '{a.mode}', eo.argparse.Namespace(**{{**vars(args), 'rounds': 2}}))
    s = eo.server_us_per_token(port, proc.pid, {a.b}, '{a.mode}', args)
    print('RESULT', json.dumps(dict(ratio=s['tok_s'] / (1000*{a.b}/5), loop=s.get('event_loop', 0), core=s.get('engine_core', 0), clients=s['clients'], ttft=s['ttft_p50_ms'])))
finally:
    proc.terminate(); proc.wait()
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
        if not line: print(out.stderr[-2000:]); continue
        r = json.loads(line[0][7:]); res[root].append(r)
        print(k, root, {kk: round(v, 3) for kk, v in r.items()}, flush=True)
for root, rs in res.items():
    print(root, "median", {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]})
if len(a.roots) == 2:
    A, B = res[a.roots[0]], res[a.roots[1]]
    d = [b["ratio"] - x["ratio"] for x, b in zip(A, B)]
    print("paired ratio diff (B - A): median %.3f, B better in %d of %d" % (statistics.median(d), sum(x > 0 for x in d), len(d)))
