"""The soak's driver (scripts/soak): standard library only."""
import argparse, http.client, json, os, random, re, signal, subprocess, sys, threading, time

def rss_kb(pids):
    total = 0
    for p in pids:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total

def children(parent):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out

def request(port, rnd, results):
    stream = rnd.random() < 0.6
    cancel = stream and rnd.random() < 0.2
    body = json.dumps({"model": "smollm2", "prompt": "soak " + " ".join(str(rnd.randrange(1000)) for _ in range(rnd.randrange(4, 64))),
                       "max_tokens": rnd.randrange(1, 16), "stream": stream, "temperature": 0.7, "seed": rnd.randrange(1 << 30)})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            data = r.read()
            ok = b'"error"' in data
            results.append(f"error_json_{r.status}" if ok else f"bad_{r.status}")
            if r.status == 503:
                time.sleep(0.2)  # a worker is restarting: a client would back off too
            return
        if cancel:
            r.read(64)  # a piece of the stream, then the client goes away
            results.append("cancelled")
            return
        data = r.read()
        if stream and b"[DONE]" not in data:
            results.append("stream_cut")
        elif b'"error"' in data:
            results.append("error_in_stream")
        else:
            results.append("ok")
    except Exception as e:  # a hang (timeout) or a reset
        results.append("exception:" + type(e).__name__)
    finally:
        c.close()

def main():
    a = argparse.ArgumentParser()
    a.add_argument("--bin"); a.add_argument("--model"); a.add_argument("--out")
    a.add_argument("--requests", type=int); a.add_argument("--concurrency", type=int)
    args = a.parse_args()
    served = subprocess.Popen([args.bin, "serve", "--port", "0", "--model", args.model, "--served-model-name", "smollm2",
                               "--prefill", "1", "--decode", "1"], stderr=subprocess.PIPE, text=True)
    port = None
    for line in served.stderr:
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            port = int(m.group(1)); break
    if port is None:
        sys.exit("serve did not start")
    threading.Thread(target=lambda: [None for _ in served.stderr], daemon=True).start()
    results, samples, lock = [], [], threading.Lock()
    todo = iter(range(args.requests))
    def worker(seed):
        rnd = random.Random(seed)
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            request(port, rnd, results)
    t0 = time.time()
    stop = threading.Event()
    def sampler():
        while not stop.is_set():
            samples.append((time.time() - t0, rss_kb([served.pid] + children(served.pid))))
            stop.wait(5)
    threading.Thread(target=sampler, daemon=True).start()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(args.concurrency)]
    for t in threads: t.start()
    killed = 0
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        done = len(results)
        if killed < 2 and done >= (killed + 1) * args.requests // 3:
            kids = children(served.pid)
            if kids:
                os.kill(random.choice(kids), signal.SIGKILL); killed += 1
                print(f"killed a worker at {done} requests", file=sys.stderr)
    for t in threads: t.join()
    stop.set()
    # Every worker back at zero KV blocks (polls refresh every 500 ms).
    leaks, deadline = None, time.time() + 60
    while time.time() < deadline:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/admin/workers", headers={"host": "localhost"})
        ws = json.loads(c.getresponse().read())["workers"]; c.close()
        leaks = [w for w in ws if not w["up"] or (w["stats"] or {}).get("kv_blocks_used", 1) != 0]
        if not leaks: break
        time.sleep(0.5)
    served.send_signal(signal.SIGTERM); served.wait(timeout=120)
    counts = {}
    for r in results: counts[r] = counts.get(r, 0) + 1
    wall = time.time() - t0
    first = [kb for t, kb in samples if t <= 60] or [0]
    last = [kb for t, kb in samples if t >= wall - 60] or [0]
    f, l = sum(first) / len(first), sum(last) / len(last)
    report = {"requests": len(results), "outcomes": counts, "workers_killed": killed, "wall_s": round(wall, 1),
              "rss_first_minute_mb": round(f / 1024, 1), "rss_last_minute_mb": round(l / 1024, 1),
              "rss_change": round((l - f) / f, 3) if f else None, "leaking_workers": leaks}
    json.dump(report, open(args.out, "w"), indent=2)
    print(json.dumps(report, indent=2))
    bad = {k: v for k, v in counts.items() if k not in ("ok", "cancelled", "error_in_stream") and not k.startswith("error_json_")}
    fail = []
    if bad: fail.append(f"unclean outcomes {bad}")
    if leaks: fail.append(f"KV blocks still in use / workers down: {leaks}")
    if f and abs(l - f) / f > 0.10 and wall > 180: fail.append(f"resident memory moved {100 * (l - f) / f:.1f}%")
    if fail:
        sys.exit("soak failed: " + "; ".join(fail))
    print("soak passed", file=sys.stderr)

main()
