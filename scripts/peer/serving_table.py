"""The table of scripts/bench-serving: per server and concurrency, output tok/s, TTFT p50/p99 and
TPOT p50/p99 from the closed-loop runs' JSON (tokenpath bench --out), the highest rate meeting the
SLO from the --find-max-rate run, then tokenpath's ratios to each peer (throughput and max rate:
ours / theirs, higher is better; TTFT and TPOT p50: theirs / ours, higher is better) and the
issue's shape checks (TTFT p99 <= 2x p50 at the highest concurrency).
"""
import argparse
import json
import os
import re

SERVERS = ("tokenpath", "llama-server", "vllm")


def quantile(v, f):
    """Quantile `f` of `v` with linear interpolation between closest ranks (the bench's own)."""
    v = sorted(v)
    rank = f * (len(v) - 1)
    lo, hi = int(rank), min(int(rank) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def ttfts(doc):
    """(TTFT ms, prompt tokens) of every completed request, in the order they were sent."""
    out = []
    for r in sorted(doc.get("requests", []), key=lambda r: r["t_send"]):
        first = next((e["at_ns"] for e in r.get("events", []) if e.get("tokens", 0) > 0), None)
        if (r.get("outcome") or {}).get("status") == "ok" and first is not None:
            prompt = (r.get("usage") or {}).get("prompt_tokens") or r.get("prompt_tokens_hint") or 0
            out.append(((first - r["t_send"]) / 1e6, prompt))
    return out


def steady_ttft(doc, conc):
    """TTFT p50 and p99 (ms) of the requests sent after the first `conc` (the closed loop's first
    wave, sent all at once: its k-th request waits for k - 1 prefills under any scheduler)."""
    t = [ms for ms, _ in ttfts(doc)[conc:]]
    if not t:
        return None, None
    return quantile(t, 0.5), quantile(t, 0.99)


def first_wave_floor(doc, conc, prefill_tok_s):
    """The lowest TTFT p99 (ms) any scheduler could give this run on an engine that prefills at
    `prefill_tok_s`: the first wave's `conc` prompts arrive at once, so the k-th answered waits
    for at least the k shortest prompts' prefill; every later request keeps its measured TTFT."""
    t = ttfts(doc)
    if len(t) <= conc or not prefill_tok_s:
        return None
    wave, done = [], 0
    for prompt in sorted(p for _, p in t[:conc]):
        done += prompt
        wave.append(done / prefill_tok_s * 1000.0)
    return quantile(wave + [ms for ms, _ in t[conc:]], 0.99)


def prompt_prefill_ms(doc, conc, prefill_tok_s):
    """One first-wave prompt's prefill (ms, their mean) at `prefill_tok_s`: the unit both the
    first wave's floor and a steady-state TTFT are made of."""
    t = ttfts(doc)
    if len(t) < conc or not prefill_tok_s:
        return None
    return sum(p for _, p in t[:conc]) / conc / prefill_tok_s * 1000.0


def load(out_dir):
    closed, rates = {}, {}
    for f in sorted(os.listdir(out_dir)):
        m = re.fullmatch(r"(.+)-(c(\d+)|maxrate)\.json", f)
        if not m:
            continue
        with open(os.path.join(out_dir, f)) as fh:
            doc = json.load(fh)
        if m.group(2) == "maxrate":
            rates[m.group(1)] = doc.get("find_max_rate", {})
        else:
            summary = dict(doc["summary"])
            summary["steady_ttft"] = steady_ttft(doc, int(m.group(3)))
            summary["doc"] = doc
            closed[(m.group(1), int(m.group(3)))] = summary
    return closed, rates


def pct(s, key, q):
    v = s.get(key) or {}
    return v.get(q)


def engine_figures(out_dir, name="engine.json"):
    """Our engine's figures (name -> tok/s) from the same run's bench-engine JSON, if any."""
    path = os.path.join(out_dir, name)
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return {k: v.get("ours") for k, v in json.load(fh).items() if isinstance(v, dict)}


def step_rounds(out_dir):
    """(served TPOT p50 ms, engine step ms) of every alternating c=1 round, in order."""
    rounds = []
    for r in range(1, 1000):
        served_path = os.path.join(out_dir, f"tokenpath-step{r}.json")
        if not os.path.exists(served_path):
            break
        with open(served_path) as fh:
            served = pct(json.load(fh)["summary"], "tpot_ms", "p50")
        e = engine_figures(out_dir, f"engine-step{r}.json").get("decode_b1_ctx512")
        if served and e:
            rounds.append((served, 1000.0 / e))
    return rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--kernels", default="?")
    ap.add_argument("--vllm-dtype", default="?")
    a = ap.parse_args()
    closed, rates = load(a.out_dir)
    servers = [s for s in SERVERS if any(k[0] == s for k in closed) or s in rates]
    concs = sorted({c for (_, c) in closed})
    fmt = lambda v, p=1: "-" if v is None else f"{v:,.{p}f}"
    print(f"tokenpath kernels: {a.kernels}; vllm dtype: {a.vllm_dtype}")
    print(f"{'server':<14}{'conc':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
          f"{'TPOT p99':>10}{'failed':>8}{'TTFT p50/p99 after the first wave':>36}")
    for s in servers:
        for c in concs:
            r = closed.get((s, c))
            if not r:
                continue
            print(f"{s:<14}{c:>5}{fmt(r.get('output_tokens_per_s')):>11}"
                  f"{fmt(pct(r, 'ttft_ms', 'p50'), 0):>10}{fmt(pct(r, 'ttft_ms', 'p99'), 0):>10}"
                  f"{fmt(pct(r, 'tpot_ms', 'p50')):>10}{fmt(pct(r, 'tpot_ms', 'p99')):>10}{r.get('failed', 0):>8}"
                  f"{fmt(r['steady_ttft'][0], 0):>26} / {fmt(r['steady_ttft'][1], 0)}")
    if rates:
        print()
        for s in servers:
            r = rates.get(s)
            if r is None:
                continue
            probes = ", ".join(f"{p['rate']:.3g}:{p['attainment']:.2f}" for p in r.get("probes", []))
            print(f"{s:<14} max rate at {r.get('slo')} ({r.get('target_attainment')}): "
                  f"{fmt(r.get('max_rate'), 3)} req/s (first failing {fmt(r.get('first_failing_rate'), 3)}; "
                  f"probes rate:attainment {probes})")
    ours = "tokenpath"
    print()
    for peer in (s for s in servers if s != ours):
        parts = []
        for c in concs:
            o, p = closed.get((ours, c)), closed.get((peer, c))
            if not o or not p:
                continue
            ratio = lambda x, y: "-" if not x or not y else f"{x / y:.2f}"
            parts.append(
                f"c={c}: tok/s {ratio(o.get('output_tokens_per_s'), p.get('output_tokens_per_s'))}x, "
                f"TTFT p50 {ratio(pct(p, 'ttft_ms', 'p50'), pct(o, 'ttft_ms', 'p50'))}x, "
                f"TPOT p50 {ratio(pct(p, 'tpot_ms', 'p50'), pct(o, 'tpot_ms', 'p50'))}x")
        mo, mp = (rates.get(ours) or {}).get("max_rate"), (rates.get(peer) or {}).get("max_rate")
        if mo and mp:
            parts.append(f"max rate {mo / mp:.2f}x")
        if parts:
            print(f"tokenpath vs {peer}: " + "; ".join(parts))
    engine = engine_figures(a.out_dir)
    one = closed.get((ours, 1))
    rounds = step_rounds(a.out_dir)
    if rounds:
        # The alternating rounds are the measure; a single served run against one engine run
        # minutes later is printed only when there are none (this VM moves by a fifth meanwhile).
        ratios = sorted(s / e for s, e in rounds)
        each = ", ".join(f"{s:.2f}/{e:.2f}" for s, e in rounds)
        print(f"tokenpath c=1 step in {len(rounds)} alternating rounds (served TPOT p50 / engine step, ms): "
              f"{each}; ratio median {quantile(ratios, 0.5):.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f}, "
              f"target <= 1.2)")
    elif one and pct(one, "tpot_ms", "p50"):
        e = engine.get("decode_b1_ctx512")
        steps_file = os.path.join(a.out_dir, "engine.steps")
        steps = 32
        if os.path.exists(steps_file):
            with open(steps_file) as fh:
                steps = int(fh.read())
        if e:
            step = 1000.0 / e
            served = pct(one, "tpot_ms", "p50")
            print(f"tokenpath decode step at c=1: served TPOT p50 {served:.1f} ms, engine alone {step:.1f} ms "
                  f"from 512 to {512 + steps} tokens of context: {served / step:.2f}x (target <= 1.2)")
    if concs:
        top = closed.get((ours, concs[-1]))
        if top and pct(top, "ttft_ms", "p50"):
            shape = pct(top, "ttft_ms", "p99") / pct(top, "ttft_ms", "p50")
            print(f"tokenpath TTFT p99 / p50 at c={concs[-1]}: {shape:.2f} (target <= 2)")
            p50, p99 = top["steady_ttft"]
            if p50:
                print(f"  after the first wave (the {concs[-1]} requests sent at once): {p99 / p50:.2f}")
            prefill = engine.get("prefill_512")
            floor = first_wave_floor(top["doc"], concs[-1], prefill)
            if floor:
                whole = pct(top, "ttft_ms", "p50")
                verdict = "out of reach of any scheduler" if floor > 2 * whole else "reachable"
                print(f"  the first wave's floor: p99 >= {floor:,.0f} ms over this run (its k-th answer needs k "
                      f"prompts prefilled at the engine's {prefill:,.0f} tok/s) against 2 x p50 = {2 * whole:,.0f} ms: "
                      f"{verdict}; measured {pct(top, 'ttft_ms', 'p99'):,.0f} ms, "
                      f"{pct(top, 'ttft_ms', 'p99') / floor:.2f}x the floor")
                one = prompt_prefill_ms(top["doc"], concs[-1], prefill)
                if one:
                    print(f"  p50 is {whole / one:.1f} prompts' prefill ({one:,.0f} ms each) and the first wave's last "
                          f"answer waits for {concs[-1]}: p99 <= 2 x p50 needs p50 >= {concs[-1] / 2:.0f} prompts' "
                          f"prefill, a queue; a faster prefill shortens both alike")

if __name__ == "__main__":
    main()
