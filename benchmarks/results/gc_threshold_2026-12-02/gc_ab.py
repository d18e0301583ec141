import sys, json, subprocess, time, os, statistics
# The gc_ab.py runs of gc_ab_1.log / gc_ab_2.log ran the tree at ROOT (a143563, in a worktree) through gc_server.py, which
# sets GC_TH in the API process and, being __mp_main__ there too, in the engine core; edit ROOT to rerun.
root = ROOT = '/tmp/w/base'
sys.path.insert(0, root + '/benchmarks'); sys.path.insert(0, root)
import engine_overhead as eo
ths = sys.argv[1].split('/'); pairs = int(sys.argv[2]); mode = sys.argv[3] if len(sys.argv) > 3 else 'greedy'
args = eo.argparse.Namespace(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device='numpy', set=[], levels=[256],
    prompt_len=150, tokens=128, client_procs=2, min_tokens=1, rounds=8, keep_alive=False, modes=[mode])
res = {t: [] for t in ths}
for k in range(pairs):
    for th in (ths if k % 2 == 0 else ths[::-1]):
        port = eo._free_port()
        proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gc_server.py'), '--port', str(port), '--slots', '256', '--vocab', '1024', '--device', 'torch', '--device-ms', '5', '--set=lookahead=on'], cwd=root, env={**os.environ, 'GC_TH': th}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    import socket
                    with socket.create_connection(('127.0.0.1', port), timeout=1) as s:
                        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        if b' 200 ' in s.recv(1024): break
                except OSError: pass
                time.sleep(0.3)
            eo.server_us_per_token(port, proc.pid, 256, mode, eo.argparse.Namespace(**{**vars(args), 'rounds': 2}))
            s = eo.server_us_per_token(port, proc.pid, 256, mode, args)
            r = dict(ratio=s['tok_s']/(1000*256/5), loop=s.get('event_loop', 0), core=s.get('engine_core', 0), ttft90=s['ttft_p90_ms'])
            res[th].append(r); print(k, th, {a: round(b, 3) for a, b in r.items()}, flush=True)
        finally:
            proc.terminate(); proc.wait()
for th, rs in res.items():
    print(th, 'median', {a: round(statistics.median(r[a] for r in rs), 3) for a in rs[0]})
