# py-spy of the API process under 1-token streamed requests (per-request cost dominant): python req_prof.py TREE TAG
import sys, json, subprocess
root = sys.argv[1]; tag = sys.argv[2]
sys.path.insert(0, root + '/benchmarks'); sys.path.insert(0, root)
import engine_overhead as eo
def ns(**kw):
    d = dict(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device='numpy', set=[], levels=[64],
    prompt_len=150, tokens=1, client_procs=2, min_tokens=1, rounds=200, keep_alive=False, modes=['greedy']); d.update(kw)
    return eo.argparse.Namespace(**d)
proc, port = eo.start_null_server(ns(), 256, ['--device-ms', '5', '--set=lookahead=on'])
try:
    eo.server_us_per_token(port, proc.pid, 64, 'greedy', ns(rounds=20))
    spy = subprocess.Popen([root + '/.venv/bin/py-spy', 'record', '--nonblocking', '-r', '250', '-d', '8', '-f', 'raw', '-o', f'/tmp/p/{tag}_req.txt', '--pid', str(proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s = eo.server_us_per_token(port, proc.pid, 64, 'greedy', ns())
    spy.wait()
    print('RESULT', json.dumps(dict(req_s=s['tok_s'], loop_us_per_req=s.get('event_loop', 0), core=s.get('engine_core', 0), clients=s['clients'])))
finally:
    proc.terminate(); proc.wait()
