#!/usr/bin/env python3
"""scripts/validate-sim's table: each cell's simulated metrics against the real run's.

    sim_table.py OUT_DIR CELL...   (reads CELL.real.json and CELL.sim.json from OUT_DIR)

Signed error = (sim - real) / real, in %. The decision counters (prompt, cached and output
tokens per request) are compared request by request: they come from the same scheduler code, so
a difference where the arrival order is the same is a bug; under load the order of arrivals at
the worker can differ with the timing, so it is reported, not judged, there.
"""
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


def main():
    out_dir, cells = sys.argv[1], sys.argv[2:]
    rows = {}
    counters = {}
    for cell in cells:
        real = json.load(open(f"{out_dir}/{cell}.real.json"))
        sim = json.load(open(f"{out_dir}/{cell}.sim.json"))
        errs = {}
        for name, block, key, stat in METRICS:
            a, b = get(real, block, key, stat), get(sim, block, key, stat)
            if a is None or b is None or a == 0:
                errs[name] = None
            else:
                errs[name] = 100.0 * (b - a) / a
        rows[cell] = errs
        rr, sr = real["requests"], sim["requests"]
        same = {k: sum(1 for x, y in zip(rr, sr) if usage(x, k) == usage(y, k)) for k in
                ("prompt_tokens", "cached_tokens", "completion_tokens")}
        cached = (sum(usage(x, "cached_tokens") for x in rr), sum(usage(y, "cached_tokens") for y in sr))
        ok = (sum(1 for x in rr if x["outcome"]["status"] == "ok"), sum(1 for y in sr if y["outcome"]["status"] == "ok"))
        counters[cell] = (len(rr), same, cached, ok)

    width = max(len(c) for c in cells + ["worst"]) + 2
    print("signed error of the simulation, % ((sim - real) / real); '-' where the stage is absent")
    print(f"{'metric':<18}" + "".join(f"{c:>{width}}" for c in cells) + f"{'worst':>{width}}")
    for name, *_ in METRICS:
        vals = [rows[c][name] for c in cells]
        if all(v is None for v in vals):
            continue
        worst = max((v for v in vals if v is not None), key=abs)
        print(f"{name:<18}" + "".join(f"{'-' if v is None else f'{v:+.1f}':>{width}}" for v in vals)
              + f"{worst:>+{width}.1f}")
    print()
    print("decisions: requests whose prompt / cached / output tokens equal the real run's; total cached tokens real → sim; completed real / sim")
    for c in cells:
        n, same, cached, ok = counters[c]
        print(f"  {c:<16} n={n:<4} prompt {same['prompt_tokens']}/{n}  cached {same['cached_tokens']}/{n}  "
              f"output {same['completion_tokens']}/{n}  cached tokens {cached[0]} → {cached[1]}  completed {ok[0]}/{ok[1]}")


if __name__ == "__main__":
    main()
