"""The table of scripts/bench-gateway: added latency per gateway, mode and streaming, from the
runs' JSON (tokenpath bench --out), and our ratios to the best Rust router and to LiteLLM.

Added latency at a rate: the run's p50/p99 through the gateway minus the same repeat's direct
p50/p99 at that rate (TTFT from send when streamed, E2E when not); the median over the repeats,
with their range. A rate is sustained when, in the median repeat, nothing failed, the client
sent and completed >= 95% of the offered rate, and the added p99 is < 5 ms.
"""
import argparse
import json
import os
import sys

BOUND_MS = 5.0
MODES = ("plain", "vllm-pd", "sglang-pd")


def load(out_dir):
    runs = {}
    for f in sorted(os.listdir(out_dir)):
        if not f.endswith(".json") or f == "warmup.json":
            continue
        stem = f[: -len(".json")]
        try:
            tag, kind, rate, rep = stem.rsplit("-", 3)
            rate, rep = float(rate), int(rep.lstrip("r"))
        except ValueError:
            continue
        mode = next((m for m in MODES if tag.endswith("-" + m)), None)
        if mode is None or kind not in ("s", "n"):
            continue
        name = tag[: -len(mode) - 1]
        with open(os.path.join(out_dir, f)) as fh:
            runs.setdefault((name, mode, kind == "s", rate), {})[rep] = json.load(fh)["summary"]
    return runs


def metric(summary, stream):
    return summary["ttft_ms" if stream else "e2e_ms"]


def added_once(via, direct, stream, rate):
    a, d = metric(via, stream), metric(direct, stream)
    if not a or not d:
        return None
    ok = (
        via["failed"] == 0
        and via["completed"] > 0
        and via["achieved_send_rps"] >= 0.95 * rate
        and via["requests_per_s"] >= 0.95 * rate
    )
    return {"p50": a["p50"] - d["p50"], "p99": a["p99"] - d["p99"], "ok": ok, "failed": via["failed"]}


def added(runs, name, mode, stream, rate):
    """The median repeat (by added p99) and the range of added p99 over the repeats."""
    via, direct = runs.get((name, mode, stream, rate), {}), runs.get(("direct", mode, stream, rate), {})
    each = [added_once(via[k], direct[k], stream, rate) for k in sorted(via) if k in direct]
    each = [e for e in each if e is not None]
    if not each:
        return None
    each.sort(key=lambda e: e["p99"])
    # The lower middle for an even count: one noisy repeat of two does not decide the point.
    mid = dict(each[(len(each) - 1) // 2])
    mid["range"] = (each[0]["p99"], each[-1]["p99"], len(each))
    return mid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--sweep", required=True)
    args = ap.parse_args()
    sweep = sorted(float(r) for r in args.sweep.split(","))
    runs = load(args.out_dir)
    names = sorted({k[0] for k in runs if k[0] != "direct"}, key=lambda n: (n != "tokenpath", n))
    rows, best = [], {}
    print(f"added latency (ms) at {args.rate:g} req/s, and the highest rate with added p99 < {BOUND_MS:g} ms")
    print(f"{'gateway':<15}{'mode':<11}{'stream':<8}{'added p50':>10}{'added p99':>10}  {'p99 range':<22}{'max rate':>8}")
    for mode in MODES:
        for stream in (True, False):
            for name in names:
                a = added(runs, name, mode, stream, args.rate)
                if a is None:
                    continue
                top = 0.0
                for r in sweep:
                    s = added(runs, name, mode, stream, r)
                    if s is None or not (s["ok"] and s["p99"] < BOUND_MS):
                        break
                    top = r
                rows.append((name, mode, stream, a, top))
                best[(name, mode, stream)] = (a, top)
                flag = "" if a["ok"] else "  (failed or fell behind)"
                print(
                    f"{name:<15}{mode:<11}{'yes' if stream else 'no':<8}{a['p50']:>10.2f}{a['p99']:>10.2f}"
                    f"  {'%.2f..%.2f (n=%d)' % a['range']:<22}{top:>8g}{flag}"
                )
    print()
    # Ratios: theirs / ours (> 1: we add less). A floor of 0.01 ms keeps a near-zero from dividing.
    for mode in MODES:
        for stream in (True, False):
            ours = best.get(("tokenpath", mode, stream))
            if ours is None:
                continue
            o99 = max(ours[0]["p99"], 0.01)
            rust = [best[k] for k in best if k[1:] == (mode, stream) and k[0] in ("vllm-router", "sglang-router")]
            parts = []
            if rust:
                b = min(rust, key=lambda x: x[0]["p99"])
                parts.append(f"best Rust router's added p99 / ours = {max(b[0]['p99'], 0.01) / o99:.2f}")
                parts.append(f"max rate ours / best Rust router's = {ours[1] / max(max(x[1] for x in rust), 1):.2f}")
            ll = best.get(("litellm", mode, stream))
            if ll is not None:
                parts.append(f"LiteLLM's added p99 / ours = {max(ll[0]['p99'], 0.01) / o99:.1f}")
            if parts:
                print(f"{mode}, {'streamed' if stream else 'not streamed'}: " + "; ".join(parts))
    if not rows:
        print("no runs found", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
