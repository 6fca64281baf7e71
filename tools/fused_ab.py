#!/usr/bin/env python3
"""One line per rope-bench JSON of tools/fused_ab.sh: each fused row's graph time per launch in
us and its share of the same run's copy of its own bytes (d: decode, p: prefill; nr = norm +
rope, rc = rope + cache, nr+c = norm + rope + cache, nrfp8 = with FP8 q and cache, unf = the
unfused bound; P = programmatic dependent launch)."""
import json
import sys

SHORT = {
    "norm + rope": "nr",
    "rope + cache": "rc",
    "norm + rope + cache": "nr+c",
    "norm + rope + FP8 q, cache": "nrfp8",
    "unfused: rope + copies": "unf",
}

for path in sys.argv[1:]:
    rows = json.load(open(path))["fused"]
    by = {(r["shape"], r["variant"]): r for r in rows}
    out = []
    for r in rows:
        variant = r["variant"]
        if r["own_copy"] is None and not variant.startswith("unfused"):
            continue
        pdl = variant.endswith(", PDL")
        base = variant[: -len(", PDL")] if pdl else variant
        name = SHORT.get(base, base) + ("P" if pdl else "")
        # The unfused rows' share is over the copy of q, k and v (their lower bound's bytes).
        copy = by.get((r["shape"], r["own_copy"] or "copy of q, k, v"))
        share = copy["graph_us"] / r["graph_us"] * 100 if copy else float("nan")
        out.append(f'{r["shape"][0]}:{name}={r["graph_us"]:.2f}({share:.1f}%)')
    print(path.split("/")[-1].removesuffix(".json"), " ".join(out))
