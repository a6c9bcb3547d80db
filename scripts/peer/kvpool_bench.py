#!/usr/bin/env python3
"""The KV pool's benchmark (scripts/bench-kvpool runs it): the Mooncake conversation trace replayed
against `tokenpath serve` without the pool, with its RAM tier, and with RAM + SSD, at the same
offered rate; next to an ideal prefix-LRU of the same capacity computed from the same requests.
Then the time to load a 4,096-token prefix from each tier, measured on the server's timeline.

Mapping: each Mooncake `hash_id` (a 512-token block there) becomes one 16-token KV block of
fixed synthetic token ids here (equal ids, equal tokens), so a shared run of ids is a shared
prefix; each prompt ends with one token of its own (the last token is always computed), so
every mapped block can be reused. Time is scaled so the first --requests requests arrive at
--rate per second. Output is capped at --max-tokens (`ignore_eos`).

Definitions (printed with the table): hit fraction = Σ cached_tokens / Σ prompt block tokens over
every request (the server's own `usage.prompt_tokens_details.cached_tokens`); the ideal is a
prefix LRU of C blocks (a request hits its longest run of held blocks from the first; then
every block of it is touched), with C the pool's largest tier (RAM slots, or SSD slots) — the
tiers are inclusive, so that is what the pool can hold. TTFT from the client's clock (first
chunk with text).
"""

import argparse
import collections
import hashlib
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

BS = 16
BLOCK_BYTES = 368_640  # one 16-token block of the default model's KV (f16, 30 layers × 3 KV heads × 64 × 2)
VOCAB_LO, VOCAB_SPAN = 1000, 40000


def block_tokens(h):
    """Sixteen token ids fixed by `h` alone (no two ids share a block: a keyed hash, not a
    modulus that would repeat)."""
    d = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=2 * BS, person=b"tokenpath-kvp").digest()
    return [VOCAB_LO + int.from_bytes(d[2 * j:2 * j + 2], "little") % VOCAB_SPAN for j in range(BS)]


def load_trace(path, n):
    reqs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            e = json.loads(line)
            reqs.append((e["timestamp"], e["hash_ids"], e["output_length"]))
    return reqs


def ideal_hits(reqs, capacity):
    cache = collections.OrderedDict()
    hit = total = 0
    for _, ids, _ in reqs:
        run = 0
        for h in ids:
            if h in cache:
                run += 1
            else:
                break
        hit += run
        total += len(ids)
        for h in ids:
            cache[h] = True
            cache.move_to_end(h)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hit / total if total else 0.0


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


class Server:
    def __init__(self, binary, model, port, extra, log_path):
        self.port = port
        self.log = open(log_path, "w")
        args = [binary, "serve", "--model", model, "--port", str(port), "--served-model-name", "m"] + extra
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "info"})
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"tokenpath serve exited early; see {log_path}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/ready")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"tokenpath serve did not become ready; see {log_path}")

    def metrics(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", "/metrics")
        return c.getresponse().read().decode()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def complete(port, prompt, max_tokens):
    """One streamed completion: (ttft_s, cached_tokens, timing, ok)."""
    body = json.dumps({
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    })
    t0 = time.perf_counter()
    ttft, cached, timing = None, 0, {}
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return None, 0, {}, False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if ttft is None and any(ch.get("text") for ch in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            if chunk.get("timing"):
                timing = chunk["timing"]
        return ttft, cached, timing, ttft is not None
    except (OSError, ValueError):
        return None, 0, {}, False


def replay(port, reqs, rate, max_tokens):
    t_first, t_last = reqs[0][0], reqs[-1][0]
    span = max(1e-9, t_last - t_first)
    wall = len(reqs) / rate
    results = [None] * len(reqs)

    def one(i, prompt, out):
        results[i] = complete(port, prompt, out)

    threads = []
    start = time.perf_counter()
    for i, (ts, ids, out) in enumerate(reqs):
        due = start + (ts - t_first) / span * wall
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        prompt = [t for h in ids for t in block_tokens(h)] + [VOCAB_LO + VOCAB_SPAN + (i % 5000)]
        th = threading.Thread(target=one, args=(i, prompt, min(out, max_tokens)), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return results


def summarize(name, reqs, results, ideal):
    ok = [r for r in results if r and r[3]]
    block_tokens_all = [len(ids) * BS for _, ids, _ in reqs]
    cached = [r[1] if r else 0 for r in results]
    hit = sum(cached) / sum(block_tokens_all)
    half = len(reqs) // 2
    h1 = sum(cached[:half]) / max(1, sum(block_tokens_all[:half]))
    h2 = sum(cached[half:]) / max(1, sum(block_tokens_all[half:]))
    ttfts = [r[0] * 1000 for r in ok]
    tiers = collections.Counter()
    loads = []
    for r in ok:
        t = r[2]
        for k in ("cached_tokens_host", "cached_tokens_ssd", "cached_tokens_remote"):
            tiers[k] += t.get(k, 0)
        if "kv_load" in t.get("stages_ms", {}):
            loads.append(t["stages_ms"]["kv_load"])
    return {
        "config": name, "requests": len(reqs), "ok": len(ok), "hit_fraction": hit, "ideal_hit_fraction": ideal,
        "vs_ideal": (hit / ideal) if ideal else None, "hit_first_half": h1, "hit_second_half": h2,
        "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99),
        "tokens_from_host": tiers["cached_tokens_host"], "tokens_from_ssd": tiers["cached_tokens_ssd"],
        "kv_load_p50_ms": pct(loads, 50), "kv_load_p99_ms": pct(loads, 99),
    }


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return None


def tier_load_times(binary, model, base_port, out_dir):
    """A 4,096-token prefix computed by one server, then loaded by a second server on the same
    pool (host-RAM tier), then — both stopped — by a third (SSD tier). The loading servers first
    serve a 4,096-token prompt of their own, so the load lands in arena pages already touched
    (a fresh arena is mapped lazily: its first use pays a page fault per 4 KiB, reported apart)."""
    pool = os.path.join(out_dir, "pool-load")
    shutil.rmtree(pool, ignore_errors=True)
    # 512 blocks (the least a full 8K context allows): two 257-block warm-ups touch them all.
    flags = ["--kv-tokens", "8192", "--kv-pool", pool, "--kv-pool-ram", "1GiB", "--kv-pool-ssd", "1GiB"]
    prompts = [[t for h in range(base, base + 256) for t in block_tokens(h)] + [VOCAB_LO] for base in
               (10_000_000, 11_000_000, 12_000_000)]
    warm = [t for h in range(20_000_000, 20_000_256) for t in block_tokens(h)] + [VOCAB_LO]
    warm2 = [t for h in range(30_000_000, 30_000_256) for t in block_tokens(h)] + [VOCAB_LO]

    def load_ms(t):
        return t.get("stages_ms", {}).get("kv_load")

    x = Server(binary, model, base_port, flags, os.path.join(out_dir, "load-x.log"))
    y = None
    try:
        for prompt in prompts:
            _, c0, _, ok = complete(x.port, prompt, 1)
            assert ok and c0 == 0, "the first computation"
        y = Server(binary, model, base_port + 1, flags, os.path.join(out_dir, "load-y.log"))
        for w in (warm, warm2):
            _, cw, _, ok = complete(y.port, w, 1)
            assert ok and cw == 0, "the warm-up is computed"
        host = []
        for prompt in prompts:
            _, c1, t1, ok = complete(y.port, prompt, 1)
            assert ok, "host-tier request failed"
            host.append((c1, t1.get("cached_tokens_host", 0), load_ms(t1)))
        time.sleep(1.0)  # the owner writes the blocks down to SSD when idle
    finally:
        if y:
            y.stop()
        x.stop()
    z = Server(binary, model, base_port + 2, flags, os.path.join(out_dir, "load-z.log"))
    try:
        # Cold first: the SSD tier's blocks into a fresh arena.
        _, cc, tc, ok = complete(z.port, warm, 1)
        assert ok, "SSD-tier (cold arena) request failed"
        _, _, _, ok = complete(z.port, warm2, 1)
        ssd = []
        for prompt in prompts:
            _, c2, t2, ok = complete(z.port, prompt, 1)
            assert ok, "SSD-tier request failed"
            ssd.append((c2, t2.get("cached_tokens_ssd", 0), load_ms(t2)))
    finally:
        z.stop()
    return {
        "prefix_tokens": 4096,
        "host": {"from_host": [h[1] for h in host], "kv_load_ms": [h[2] for h in host],
                 "median_ms": statistics.median(h[2] or float("nan") for h in host)},
        "ssd": {"from_ssd": [h[1] for h in ssd], "kv_load_ms": [h[2] for h in ssd],
                "median_ms": statistics.median(h[2] or float("nan") for h in ssd)},
        "ssd_cold_arena": {"cached": cc, "from_ssd": tc.get("cached_tokens_ssd", 0), "kv_load_ms": load_ms(tc)},
    }


def bench_workloads(a):
    """The bench's own workloads (`tokenpath bench --workload ...`, chat requests through the
    model's template) against the same three configurations at one offered rate each, and
    against an arena too large to evict anything in the run: no cache of any capacity hits more
    than that, so it bounds the ideal LRU from above (a ratio against it understates the pool's)."""
    rows = []
    for spec in a.bench_workload:
        workload, rate, n, *topology = spec.split("@")
        topology = topology[0].split() if topology else []
        configs = [
            ("no pool (arena only)", ["--kv-tokens", str(a.kv_tokens)]),
            ("pool: RAM", ["--kv-tokens", str(a.kv_tokens), "--kv-pool-ram", a.ram, "--kv-pool-ssd", "0"]),
            ("pool: RAM + SSD", ["--kv-tokens", str(a.kv_tokens), "--kv-pool-ram", a.ram, "--kv-pool-ssd", a.ssd]),
            ("unbounded arena (bound)", ["--kv-tokens", str(a.bound_kv_tokens)]),
        ]
        for i, (name, flags) in enumerate(configs):
            pool = os.path.join(a.out_dir, f"wl-pool-{i}")
            shutil.rmtree(pool, ignore_errors=True)
            extra = flags + (["--kv-pool", pool] if "--kv-pool-ram" in flags else []) + topology
            tag = workload.split(":")[0] + ("-" + "".join(topology).replace("-", "") if topology else "")
            print(f"[bench-kvpool] {workload} at {rate}/s, {n} requests: {name}", file=sys.stderr)
            srv = Server(a.binary, a.model, a.port + 20 + i, extra, os.path.join(a.out_dir, f"wl-{tag}-{i}.log"))
            out = os.path.join(a.out_dir, f"wl-{tag}-{i}.json")
            try:
                subprocess.run([a.binary, "bench", "--url", f"http://127.0.0.1:{srv.port}", "--model", "m",
                                "--workload", workload, "--rate", rate, "--num-requests", n, "--seed", "11",
                                "--tokenizer", a.model, "--ignore-eos", "--no-progress", "--out", out],
                               check=True, stdout=subprocess.DEVNULL, stderr=open(out + ".log", "w"))
                time.sleep(0.5)
                m = srv.metrics()
            finally:
                srv.stop()
            with open(out) as f:
                doc = json.load(f)
            recs = doc["requests"]
            prompt = sum((r.get("usage") or {}).get("prompt_tokens", 0) for r in recs)
            cached = sum((r.get("usage") or {}).get("cached_tokens") or 0 for r in recs)
            timing = [r.get("server") or {} for r in recs]
            rows.append({
                "workload": workload + (" [" + " ".join(topology) + "]" if topology else ""), "rate": float(rate), "config": name, "requests": len(recs),
                "ok": sum(1 for r in recs if r.get("outcome") == "ok"),
                "hit_fraction": cached / prompt if prompt else 0.0,
                "ttft_p50_ms": doc["summary"]["ttft_ms"]["p50"], "ttft_p99_ms": doc["summary"]["ttft_ms"]["p99"],
                "tokens_from_host": sum(t.get("cached_tokens_host", 0) for t in timing),
                "tokens_from_ssd": sum(t.get("cached_tokens_ssd", 0) for t in timing),
                "leases_open_at_end": metric(m, "tokenpath_kv_pool_leases"),
            })
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--ram", default="256MiB")
    ap.add_argument("--ssd", default="4GiB")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-workloads", action="store_true")
    ap.add_argument("--skip-pool-replay", action="store_true")
    ap.add_argument("--pool-replay", help="the pool_replay example binary")
    ap.add_argument("--bound-kv-tokens", type=int, default=65536)
    ap.add_argument("--bench-workload", action="append",
                    help="WORKLOAD@RATE@REQUESTS[@SERVE FLAGS] of `tokenpath bench` (repeatable)")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    size = lambda s: int(s[:-3]) << {"KiB": 10, "MiB": 20, "GiB": 30}[s[-3:]]
    ram_slots = size(a.ram) // (((BLOCK_BYTES + 4095) // 4096) * 4096)
    ssd_slots = (size(a.ssd) - 4096) // (4096 + ((BLOCK_BYTES + 4095) // 4096) * 4096)
    arena_blocks = a.kv_tokens // BS
    reqs = load_trace(a.trace, a.requests)
    configs = [
        ("no pool (arena only)", [], arena_blocks),
        ("pool: RAM", ["--kv-pool-ram", a.ram, "--kv-pool-ssd", "0"], ram_slots),
        ("pool: RAM + SSD", ["--kv-pool-ram", a.ram, "--kv-pool-ssd", a.ssd], max(ram_slots, ssd_slots)),
    ]
    rows = []
    if not a.skip_replay:
        for i, (name, flags, cap) in enumerate(configs):
            pool = os.path.join(a.out_dir, f"pool-{i}")
            shutil.rmtree(pool, ignore_errors=True)
            extra = ["--kv-tokens", str(a.kv_tokens)] + (["--kv-pool", pool] + flags if flags else [])
            print(f"[bench-kvpool] {name}: {len(reqs)} requests at {a.rate}/s", file=sys.stderr)
            s = Server(a.binary, a.model, a.port + i, extra, os.path.join(a.out_dir, f"serve-{i}.log"))
            try:
                results = replay(s.port, reqs, a.rate, a.max_tokens)
                time.sleep(0.5)
                m = s.metrics()
            finally:
                s.stop()
            row = summarize(name, reqs, results, ideal_hits(reqs, cap))
            row["capacity_blocks"] = cap
            row["leases_open_at_end"] = metric(m, "tokenpath_kv_pool_leases")
            row["pinned_at_end"] = metric(m, "tokenpath_kv_pool_pinned_blocks")
            rows.append(row)
    a.bench_workload = a.bench_workload or [
        "shared-prefix:48:512:16-64:4-8@1.5@90",
        "multi-turn:5:192-320:8-16@0.3@60",
    ]
    wl = [] if a.skip_workloads else bench_workloads(a)
    loads = tier_load_times(a.binary, a.model, a.port + 10, a.out_dir)
    whole = None
    if a.pool_replay and not a.skip_pool_replay:
        # The whole trace, no model: RAM and SSD slots as in the runs above, blocks scaled down
        # to 16 KiB (what is measured here is the pool's bookkeeping, not its memcpy).
        print(f"[bench-kvpool] the whole trace through the pool ({ram_slots} RAM / {ssd_slots} SSD slots)", file=sys.stderr)
        out = subprocess.run([a.pool_replay, a.trace, os.path.join(a.out_dir, "pool-replay"), str(ram_slots),
                              str(ssd_slots), "16384", "2"], check=True, capture_output=True, text=True)
        whole = json.loads(out.stdout.strip().splitlines()[-1])
    report = {"replay": rows, "workloads": wl, "tier_load": loads, "whole_trace": whole, "kernel_note": "see serve-*.log for the kernels this CPU ran"}
    with open(os.path.join(a.out_dir, "kvpool.json"), "w") as f:
        json.dump(report, f, indent=2)
    print_table(report, a)


def print_table(r, a):
    if r["replay"]:
        print_replay(r, a)
    print_rest(r)


def print_replay(r, a):
    print(f"\nKV pool on the Mooncake conversation trace: first {a.requests} requests at {a.rate} req/s, "
          f"hash_id -> one 16-token block, arena --kv-tokens {a.kv_tokens}, RAM {a.ram}, SSD {a.ssd}, max_tokens {a.max_tokens}")
    hdr = f"{'config':24} {'hit':>7} {'ideal':>7} {'vs ideal':>8} {'1st/2nd half':>13} {'TTFT p50':>9} {'p99':>9} {'host tok':>9} {'ssd tok':>8} {'leases':>6}"
    print(hdr)
    base = None
    for row in r["replay"]:
        vs = f"{row['vs_ideal']:.2f}" if row["vs_ideal"] is not None else "-"
        print(f"{row['config']:24} {row['hit_fraction']:7.3f} {row['ideal_hit_fraction']:7.3f} {vs:>8} "
              f"{row['hit_first_half']:6.3f}/{row['hit_second_half']:.3f} {row['ttft_p50_ms']:8.0f}ms {row['ttft_p99_ms']:8.0f}ms "
              f"{row['tokens_from_host']:9d} {row['tokens_from_ssd']:8d} {row['leases_open_at_end'] if row['leases_open_at_end'] is not None else '-':>6}")
        base = base or row
    for row in r["replay"][1:]:
        print(f"  {row['config']} / no pool: TTFT p50 {row['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x, "
              f"p99 {row['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x")


def print_rest(r):
    if r["workloads"]:
        print("\nThe bench's workloads (chat requests, `tokenpath bench --seed 11`), hit fraction = "
              "Σ usage.cached_tokens / Σ usage.prompt_tokens; bound = an arena that evicts nothing in the run")
        print(f"{'workload':52} {'config':24} {'hit':>6} {'vs bound':>8} {'TTFT p50':>9} {'p99':>9} {'host tok':>9} {'ssd tok':>8} {'leases':>6}")
        for w in dict.fromkeys(x["workload"] for x in r["workloads"]):
            rows = [x for x in r["workloads"] if x["workload"] == w]
            bound = rows[-1]["hit_fraction"]
            for x in rows:
                vs = f"{x['hit_fraction'] / bound:.2f}" if bound else "-"
                lo = x["leases_open_at_end"]
                print(f"{w + ' @' + str(x['rate']):52} {x['config']:24} {x['hit_fraction']:6.3f} {vs:>8} "
                      f"{x['ttft_p50_ms']:8.0f}ms {x['ttft_p99_ms']:8.0f}ms {x['tokens_from_host']:9d} "
                      f"{x['tokens_from_ssd']:8d} {lo if lo is not None else '-':>6}")
            for x in rows[1:3]:
                print(f"  {x['config']} / no pool: TTFT p50 {x['ttft_p50_ms'] / rows[0]['ttft_p50_ms']:.2f}x, "
                      f"p99 {x['ttft_p99_ms'] / rows[0]['ttft_p99_ms']:.2f}x")
    w = r.get("whole_trace")
    if w:
        print(f"\nThe whole trace ({w['requests']} requests, {w['trace_seconds']:.0f} s of arrivals) straight through the pool, "
              f"no model, {w['clients']} clients: {w['replay_seconds']:.1f} s ({w['trace_seconds'] / w['replay_seconds']:.0f}x compressed); "
              f"{w['ram_slots']} RAM / {w['ssd_slots']} SSD slots of {w['block_bytes']} bytes")
        print(f"  hit fraction {w['hit_fraction']:.3f}, ideal LRU {w['ideal_hit_fraction']:.3f} "
              f"({w['hit_fraction'] / max(1e-9, w['ideal_hit_fraction']):.2f}); per tenth pool/ideal: "
              + " ".join(f"{d['pool']:.3f}/{d['ideal']:.3f}" for d in w["deciles"]))
        print(f"  at the end: leases open {w['leases_open']}, pinned {w['pinned']}, failed loads {w['failed_loads']}")
    t = r["tier_load"]
    ms = lambda v: ", ".join(f"{x:.1f}" for x in v)
    print(f"4,096-token prefix (three of them) loaded from host RAM: tokens {t['host']['from_host']}, kv_load {ms(t['host']['kv_load_ms'])} ms, "
          f"median {t['host']['median_ms']:.1f} ms (target <= 20)")
    print(f"  from SSD: tokens {t['ssd']['from_ssd']}, kv_load {ms(t['ssd']['kv_load_ms'])} ms, median {t['ssd']['median_ms']:.1f} ms (target <= 100); "
          f"from SSD into a fresh (never touched) arena: {t['ssd_cold_arena']['from_ssd']} tokens in {t['ssd_cold_arena']['kv_load_ms']} ms")


if __name__ == "__main__":
    main()
