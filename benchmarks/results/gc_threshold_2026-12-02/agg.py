import sys, collections
f = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
self_c = collections.Counter(); incl = collections.Counter(); total = 0
for line in open(f):
    stack, _, cnt = line.rstrip().rpartition(' ')
    cnt = int(cnt); frames = stack.split(';')
    # only main thread? keep all
    total += cnt
    self_c[frames[-1]] += cnt
    for fr in set(frames): incl[fr] += cnt
print('total', total)
print('--- self')
for k, v in self_c.most_common(n): print(f'{100*v/total:5.1f}% {k[:150]}')
print('--- inclusive')
for k, v in incl.most_common(n): print(f'{100*v/total:5.1f}% {k[:150]}')
