import json, statistics as st, sys
from collections import defaultdict
tags = sys.argv[1:]
rows = defaultdict(lambda: defaultdict(list))
for t in tags:
    d = json.load(open(f'vs_llama_server_{t}.json'))
    side = 'main' if 'main' in t else 'base'
    for p in d['points']:
        assert p['failed'] == 0
        rows[(p['workload'], p['clients'])][(side, p['server'])].append(p['tok_s'])
print("| workload | clients | cllm tok/s base: median (n) | main: median (n) | main/base | llama-server in base runs / in main runs |")
print("|---|---|---|---|---|---|")
for k in sorted(rows):
    r = rows[k]
    b, m = r[('base','cllm')], r[('main','cllm')]
    lb, lm = r[('base','llama-server')], r[('main','llama-server')]
    print(f"| {k[0]} | {k[1]} | {st.median(b):.1f} ({len(b)}) | {st.median(m):.1f} ({len(m)}) | {st.median(m)/st.median(b):.3f} | {st.median(lb):.1f} / {st.median(lm):.1f} |")
