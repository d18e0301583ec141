# py-spy of the API process and the engine core at 256 streams: python pyspy_256.py TREE TAG [greedy|top_p]; then agg.py /tmp/p/TAG_api.txt
import sys, json, subprocess, time, os, argparse
root = sys.argv[1]; tag = sys.argv[2]; mode = sys.argv[3] if len(sys.argv) > 3 else 'greedy'
sys.path.insert(0, root + '/benchmarks'); sys.path.insert(0, root)
import engine_overhead as eo
from pathlib import Path
args = eo.argparse.Namespace(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device='numpy', set=[], levels=[256],
    prompt_len=150, tokens=128, client_procs=2, min_tokens=1, rounds=10, keep_alive=False, modes=[mode])
proc, port = eo.start_null_server(args, 256, ['--device-ms', '5', '--set=lookahead=on'])
try:
    eo.server_us_per_token(port, proc.pid, 256, mode, eo.argparse.Namespace(**{**vars(args), 'rounds': 2}))
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    spies = [subprocess.Popen(['/work/main/.venv/bin/py-spy', 'record', '--nonblocking', '-r', '250', '-d', '8', '-f', 'raw', '-o', f'/tmp/p/{tag}_{name}.txt', '--pid', str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in (('api', proc.pid), ('core', max((int(k) for k in kids), key=lambda k: sum(int(x) for x in open(f'/proc/{k}/stat').read().rsplit(')',1)[1].split()[11:13]))))]
    s = eo.server_us_per_token(port, proc.pid, 256, mode, args)
    for sp in spies: sp.wait()
    print('RESULT', json.dumps(dict(ratio=s['tok_s'] / (1000*256/5), loop=s.get('event_loop', 0), core=s.get('engine_core', 0), clients=s['clients'])))
finally:
    proc.terminate(); proc.wait()
