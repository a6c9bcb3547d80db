#!/usr/bin/env python3
"""scripts/validate-sim's table: each cell's simulated metrics against the real run's.

    sim_table.py OUT_DIR CELL...           (reads CELL.real*.json and CELL.sim.json from OUT_DIR)
    sim_table.py --sweep OUT_DIR CONFIG...  (the ranking of configurations by goodput)

Signed error = (sim - real) / real, in %. With several real runs of a cell (CELL.real.json,
CELL.real2.json, ...) "real" is their mean and the runs' own spread (the largest distance of one
run from the mean, %) is printed next to the error: an error inside it is noise as much as
model. The decision counters (prompt, cached and output
tokens per request) are compared request by request: they come from the same scheduler code, so
a difference where the arrival order is the same is a bug; under load the order of arrivals at
the worker can differ with the timing, so it is reported, not judged, there.
"""
import glob
import json
import sys

METRICS = [
    ("TTFT mean", "summary", "ttft_ms", "mean"),
    ("TTFT p50", "summary", "ttft_ms", "p50"),
    ("TTFT p99", "summary", "ttft_ms", "p99"),
    ("TPOT mean", "summary", "tpot_ms", "mean"),
    ("TPOT p99", "summary", "tpot_ms", "p99"),
    ("E2E mean", "summary", "e2e_ms", "mean"),
    ("E2E p99", "summary", "e2e_ms", "p99"),
    ("chunk gap p50", "summary", "chunk_gap_ms", "p50"),
    ("chunk gap p99", "summary", "chunk_gap_ms", "p99"),
    ("prefill p99", "stages", "prefill_ms", "p99"),
    ("queue p99", "stages", "queue_ms", "p99"),
    ("kv_transfer p50", "stages", "kv_transfer_ms", "p50"),
    ("kv_transfer p99", "stages", "kv_transfer_ms", "p99"),
]


def get(doc, block, key, stat):
    v = doc.get(block, {}).get(key)
    return None if v is None else v.get(stat)


def usage(r, k):
    return (r.get("usage") or {}).get(k) or 0


def reals(out_dir, cell):
    paths = [f"{out_dir}/{cell}.real.json"] + sorted(
        p for p in glob.glob(f"{out_dir}/{cell}.real*.json") if not p.endswith(".real.json"))
    return [json.load(open(p)) for p in paths]


def kendall_tau_b(a, b):
    """Kendall's tau-b of two equally long score lists (ties counted as such)."""
    conc = disc = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


def sweep(out_dir, configs):
    def goodput(doc):
        return (doc.get("goodput") or {}).get("goodput_rps") or 0.0

    def e2e(doc):
        return get(doc, "summary", "e2e_ms", "mean") or 0.0

    real = [reals(out_dir, c)[0] for c in configs]
    sim = [json.load(open(f"{out_dir}/{c}.sim.json")) for c in configs]
    rg, sg = [goodput(d) for d in real], [goodput(d) for d in sim]
    # Goodput first; at equal goodput the lower mean E2E ranks higher.
    rkey = [(g, -e2e(d)) for g, d in zip(rg, real)]
    skey = [(g, -e2e(d)) for g, d in zip(sg, sim)]
    print("sweep: goodput (req/s meeting the SLO) and mean E2E, real vs simulated")
    print(f"{'config':<18}{'real goodput':>14}{'sim goodput':>13}{'real E2E ms':>13}{'sim E2E ms':>12}")
    for c, r, s_, a, b in zip(configs, rg, sg, real, sim):
        print(f"{c:<18}{r:>14.3f}{s_:>13.3f}{e2e(a):>13.0f}{e2e(b):>12.0f}")
    rank = lambda keys: sorted(range(len(keys)), key=lambda i: keys[i], reverse=True)
    rr, sr = rank(rkey), rank(skey)
    pos = lambda order: [order.index(i) for i in range(len(order))]
    tau_g = kendall_tau_b(rg, sg)
    tau_k = kendall_tau_b([-p for p in pos(rr)], [-p for p in pos(sr)])
    best_real, pick = rr[0], sr[0]
    shortfall = 100.0 * (rg[best_real] - rg[pick]) / rg[best_real] if rg[best_real] else 0.0
    print(f"Kendall tau-b: {tau_k:+.2f} on the ranking (goodput, then E2E), {tau_g:+.2f} on goodput alone (ties kept)")
    print(f"real best {configs[best_real]}; the simulator picks {configs[pick]}, whose real goodput is "
          f"{shortfall:.1f}% below the best's")


def main():
    if sys.argv[1] == "--sweep":
        return sweep(sys.argv[2], sys.argv[3:])
    out_dir, cells = sys.argv[1], sys.argv[2:]
    rows = {}
    spread = {}
    runs = {}
    counters = {}
    for cell in cells:
        docs = reals(out_dir, cell)
        runs[cell] = len(docs)
        real = docs[0]
        sim = json.load(open(f"{out_dir}/{cell}.sim.json"))
        errs = {}
        spr = {}
        for name, block, key, stat in METRICS:
            vals = [get(d, block, key, stat) for d in docs]
            b = get(sim, block, key, stat)
            if any(v is None for v in vals) or b is None or not all(vals):
                errs[name] = spr[name] = None
                continue
            a = sum(vals) / len(vals)
            errs[name] = 100.0 * (b - a) / a
            spr[name] = max(100.0 * abs(v - a) / a for v in vals) if len(vals) > 1 else None
        rows[cell] = errs
        spread[cell] = spr
        rr, sr = real["requests"], sim["requests"]
        same = {k: sum(1 for x, y in zip(rr, sr) if usage(x, k) == usage(y, k)) for k in
                ("prompt_tokens", "cached_tokens", "completion_tokens")}
        cached = (sum(usage(x, "cached_tokens") for x in rr), sum(usage(y, "cached_tokens") for y in sr))
        ok = (sum(1 for x in rr if x["outcome"]["status"] == "ok"), sum(1 for y in sr if y["outcome"]["status"] == "ok"))
        counters[cell] = (len(rr), same, cached, ok)

    width = max(len(c) for c in cells + ["worst"]) + 2
    repeated = any(n > 1 for n in runs.values())
    width = max(width, 16) if repeated else width
    print("signed error of the simulation, % ((sim - real) / real); '-' where the stage is absent")
    if repeated:
        print("real = the mean of " + ", ".join(f"{c} {runs[c]}" for c in cells)
              + " runs; [±s] = the real runs' own spread (largest distance of one run from their mean)")
    print(f"{'metric':<18}" + "".join(f"{c:>{width}}" for c in cells) + f"{'worst':>{width}}")

    def cell_text(c, name):
        v = rows[c][name]
        if v is None:
            return "-"
        s_ = spread[c].get(name)
        return f"{v:+.1f}" + (f" [±{s_:.0f}]" if s_ is not None else "")

    for name, *_ in METRICS:
        vals = [rows[c][name] for c in cells]
        if all(v is None for v in vals):
            continue
        worst = max((v for v in vals if v is not None), key=abs)
        print(f"{name:<18}" + "".join(f"{cell_text(c, name):>{width}}" for c in cells)
              + f"{worst:>+{width}.1f}")
    if repeated:
        inside = sum(1 for c in cells for n, *_ in METRICS
                     if rows[c][n] is not None and spread[c].get(n) is not None and abs(rows[c][n]) <= spread[c][n])
        total = sum(1 for c in cells for n, *_ in METRICS if rows[c][n] is not None and spread[c].get(n) is not None)
        print(f"errors inside the real runs' own spread: {inside} of {total}")
    print()
    print("decisions (first real run): requests whose prompt / cached / output tokens equal the real run's; total cached tokens real → sim; completed real / sim")
    for c in cells:
        n, same, cached, ok = counters[c]
        print(f"  {c:<16} n={n:<4} prompt {same['prompt_tokens']}/{n}  cached {same['cached_tokens']}/{n}  "
              f"output {same['completion_tokens']}/{n}  cached tokens {cached[0]} → {cached[1]}  completed {ok[0]}/{ok[1]}")


if __name__ == "__main__":
    main()
