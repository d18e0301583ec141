import sys, json
root = sys.argv[1]; mode='greedy'
sys.path.insert(0, root + '/benchmarks'); sys.path.insert(0, root)
import engine_overhead as eo
def ns(**kw):
    d = dict(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device='numpy', set=[], levels=[256],
    prompt_len=150, tokens=128, client_procs=2, min_tokens=1, rounds=8, keep_alive=False, modes=[mode]); d.update(kw)
    return eo.argparse.Namespace(**d)
proc, port = eo.start_null_server(ns(), 256, ['--device-ms', '5', '--set=lookahead=on'])
try:
    eo.server_us_per_token(port, proc.pid, 256, mode, ns(rounds=2))
    for T, R in ((128, 6), (16, 24), (128, 6), (16, 24)):
        s = eo.server_us_per_token(port, proc.pid, 256, mode, ns(tokens=T, rounds=R))
        print(T, json.dumps({k: round(v, 2) for k, v in s.items() if k in ('event_loop','engine_core','clients','tok_s','tokens')}), 'loop per req ms', round(s['event_loop']*T/1000, 3), flush=True)
finally:
    proc.terminate(); proc.wait()
