"""Medians of the per-round speculation ratios (ngram / off, one stream, per-request pairs) in this folder."""
import glob, json, statistics
from pathlib import Path

here = Path(__file__).parent
for prefix, sets in (("cc", ("copy", "chat")), ("cl", ("code", "long"))):
    for build in ("orig", "patched"):
        files = sorted(glob.glob(str(here / f"{prefix}_{build}_*[0-9].json")), key=lambda f: int(f.rsplit("_", 1)[1][:-5]))
        if not files:
            continue
        for name in sets:
            ratios = [json.load(open(f))["ratios"][name]["vs_cllm_off"] for f in files]
            print(f"{build:8s} {name:5s} rounds {len(ratios):2d}  median {statistics.median(ratios):.3f}  "
                  f"below 0.97: {sum(r < 0.97 for r in ratios)}  by round: {' '.join(f'{r:.2f}' for r in ratios)}")
