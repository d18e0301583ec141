"""Does the model's confidence in its recent tokens tell a copy's n-gram match from a chat's?"""
import sys, math, json, statistics
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
from speculative import prompt_sets
import cllm
from cllm.speculative.ngram import NgramIndex
llm = cllm.LLM(backend="llama_cpp", speculative="off")
sets = prompt_sets()
rows = []
for name in ["copy", "chat", "code", "long"]:
    for prompt in sets[name]:
        out = llm.chat([[{"role": "user", "content": prompt}]], cllm.SamplingParams(max_tokens=192, temperature=0, logprobs=0))[0]
        o = out.outputs[0]
        ids = list(o.token_ids)
        lps = [lp.logprob for lp in o.logprobs]
        probs = [math.exp(x) for x in lps]
        ptoks = list(out.prompt_token_ids)
        idx = NgramIndex(2, 4)
        for L in range(1, len(ids) - 1):
            d = idx.propose(ptoks, 12, ids[:L])
            if not d:
                continue
            acc = 0
            while acc < len(d) and L + acc < len(ids) and ids[L + acc] == d[acc]:
                acc += 1
            recent = probs[max(0, L - 4):L]
            rows.append(dict(set=name, L=L, n=idx.matched, acc=acc, first=acc > 0, conf=min(recent), mean=sum(recent) / len(recent), next_p=probs[L]))
json.dump(rows, open("/tmp/s15/conf.json", "w"))
for name in ["copy", "chat", "code", "long"]:
    for lo, hi in [(0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 0.99), (0.99, 1.01)]:
        r = [x for x in rows if x["set"] == name and lo <= x["conf"] < hi]
        if r:
            print(f"{name:5s} min-conf of last 4 in [{lo:.2f},{hi:.2f}): {len(r):4d} matches, first token right {sum(x['first'] for x in r)/len(r):.2f}, mean accepted of 12 {statistics.fmean(x['acc'] for x in r):.1f}")
