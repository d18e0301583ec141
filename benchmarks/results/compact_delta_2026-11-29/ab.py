"""A/B of the served proxy (engine_overhead.py's null server, --device-ms 5, lookahead on, greedy, 128 tokens):
(--mode greedy | top_p; greedy by default) each round runs every checkout in turn, each on its own server, the 4-round figure then the steady one.

    .venv/bin/python ab.py OLD_CHECKOUT NEW_CHECKOUT --rounds 4 --levels 64 256

A checkout is a directory with the tree (``git worktree add DIR COMMIT``); its null server runs from it."""
import argparse, subprocess, sys, json, statistics
p = argparse.ArgumentParser(); p.add_argument("roots", nargs="+"); p.add_argument("--rounds", type=int, default=2)
p.add_argument("--ka", action="store_true"); p.add_argument("--mode", default="greedy"); p.add_argument("--levels", type=int, nargs="+", default=[256])
a = p.parse_args()
res = {r: [] for r in a.roots}
for k in range(a.rounds):
    for root in a.roots:
        out = subprocess.run([sys.executable, "-c", f"""
import sys, json; sys.path.insert(0, '{root}/benchmarks'); sys.path.insert(0, '{root}')
import engine_overhead as eo
MODE = '{a.mode}'
args = eo.argparse.Namespace(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device='numpy', set=[], levels={a.levels},
    prompt_len=150, tokens=128, client_procs=2, min_tokens=131072, rounds=0, keep_alive={a.ka}, modes=[MODE])
proc, port = eo.start_null_server(args, 256, ['--device-ms', '5', '--set=lookahead=on'])
try:
    r = {{}}
    for b in {a.levels}:
        s = eo.server_us_per_token(port, proc.pid, b, MODE, args)
        st = eo.steady_tok_s(s, port, proc.pid, b, MODE, args)
        r[b] = dict(whole=s['tok_s'] / (1000*b/5), steady=st / (1000*b/5), loop=s.get('event_loop', 0), core=s.get('engine_core', 0), clients=s['clients'])
    print('RESULT', json.dumps(r))
finally:
    proc.terminate(); proc.wait()
"""], capture_output=True, text=True, cwd=root)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
        if not line: print(out.stderr[-3000:]); continue
        r = json.loads(line[0][7:]); res[root].append(r)
        print(k, root, {b: {kk: round(v, 3) for kk, v in x.items()} for b, x in r.items()}, flush=True)
for root, rs in res.items():
    for b in map(str, a.levels):
        print(root, b, "median whole %.3f steady %.3f loop %.1f core %.1f" % tuple(statistics.median(r[b][k] for r in rs) for k in ("whole", "steady", "loop", "core")))
