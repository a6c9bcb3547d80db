"""The AIPerf side of scripts/check-peer-bench: its offline tokenizer, and the comparison.

    python aiperf_compare.py tokenizer MODEL.gguf HF_HOME REPO_ID
        Writes the GGUF's own tokenizer (vocabulary, merges, special tokens, chat template) as a
        Hugging Face tokenizer into a hub-cache snapshot HF_HOME/hub/models--ORG--NAME/, so
        `aiperf --tokenizer REPO_ID` loads it with HF_HUB_OFFLINE=1. (AIPerf 0.13.0 in offline mode
        treats every --tokenizer as a hub repo id, a local directory too; a cache snapshot is the
        offline form it accepts.) Prints the snapshot directory.

    python aiperf_compare.py compare --aiperf DIR --ours RUN.json [--aiperf DIR --ours RUN.json ...]
                                     [--side-aiperf DIR --side-ours RUN.json]
                                     --bin TOKENPATH --tokenizer DIR --output-tokens N [--json OUT]
        Prints both tools' numbers mapped to our definitions and checks them (exit 1 on a failed
        check): one pair per round of the sequential phase, and the side-by-side phase. Uses
        `TOKENPATH report --json` for our definitions on AIPerf's records, and the tokenizer
        directory for AIPerf's default (re-tokenized) output counts. Definitions and every
        disagreement: docs/metrics.md, "Checked against AIPerf".

transformers' own GGUF tokenizer reader imports torch (it also reads weights), which this venv
does not have; the metadata is read with the `gguf` package instead and handed to transformers'
converter (`convert_gguf_tokenizer`), so the tokenizer is the one `AutoTokenizer.from_pretrained(
dir, gguf_file=...)` would build, plus one fix: llama.cpp's `smollm` pre-tokenizer splits digits
one by one (as SmolLM2's own tokenizer.json does), which that converter leaves out.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

BOUND = 0.02  # cross-tool: p50s where the definitions agree
SAME_DATA_BOUND = 0.001  # same records, both definitions: floating point only


# --- tokenizer -------------------------------------------------------------------------------


def write_tokenizer(gguf_path: str, hf_home: str, repo_id: str) -> str:
    import hashlib

    from gguf import GGUFReader
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    tok = {n: meta[f"tokenizer.{k}"] for k, n in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if f"tokenizer.{k}" in meta}
    cfg = {n: meta[f"tokenizer.{k}"] for k, n in GGUF_TOKENIZER_MAPPING["tokenizer_config"].items() if f"tokenizer.{k}" in meta}
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tok)
    if tok.get("pre_tokenizer_type") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unk_token_id", "pad_token": "pad_token_id"}
    special = {name: tok["tokens"][tok[key]] for name, key in ids.items() if tok.get(key) is not None}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=cfg.get("chat_template"),
        add_bos_token=bool(cfg.get("add_bos_token", False)),
        add_eos_token=bool(cfg.get("add_eos_token", False)),
        **special,
    )
    h = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    commit = h.hexdigest()[:40]  # a hub revision is 40 hex digits; this one names the GGUF file
    org, name = repo_id.split("/")
    repo = os.path.join(hf_home, "hub", f"models--{org}--{name}")
    snapshot = os.path.join(repo, "snapshots", commit)
    tmp = snapshot + ".tmp"
    fast.save_pretrained(tmp)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    if os.path.isdir(snapshot):
        import shutil

        shutil.rmtree(snapshot)
    os.replace(tmp, snapshot)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    return snapshot


# --- statistics (the same as both tools': linear interpolation between closest ranks) ---------


def pct(values, q):
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return None
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (k - lo) * (v[hi] - v[lo])


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


# --- AIPerf's files -----------------------------------------------------------------------------


def jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chunk_text(data: str):
    """(content text, usage, finish_reason, timing) of one SSE data payload, as AIPerf's chat
    parser reads it (only `choices[0].delta.content` / reasoning counts as content)."""
    if data.strip() == "[DONE]":
        return "", None, None, None
    try:
        obj = json.loads(data)
    except ValueError:
        return "", None, None, None
    text, finish = "", None
    choices = obj.get("choices") or []
    if choices:
        delta = choices[0].get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
        finish = choices[0].get("finish_reason")
    return text, obj.get("usage"), finish, obj.get("timing")


class AiperfRun:
    def __init__(self, d: str):
        self.dir = d
        self.summary = json.load(open(os.path.join(d, "profile_export_aiperf.json"), encoding="utf-8"))
        self.records = jsonl(os.path.join(d, "profile_export.jsonl"))
        self.raw = jsonl(os.path.join(d, "profile_export_raw.jsonl"))

    def metric(self, tag):
        """Per-record values of one metric (lists flattened), ms or tokens as exported."""
        out = []
        for r in self.records:
            m = (r.get("metrics") or {}).get(tag)
            if m is None:
                continue
            v = m["value"]
            out.extend(v if isinstance(v, list) else [v])
        return out

    def as_tokenpath_records(self):
        """AIPerf's raw records as our ClientRecord JSON (ns on AIPerf's perf clock): every SSE
        message an event, carrying one token when it has content text (our server sends one token
        per event; the final usage says how many in all), `t_send` = AIPerf's request start."""
        out, texts = [], []
        self.timing = []  # the server's `timing` of each record (None when it sent none)
        for i, r in enumerate(self.raw):
            t0 = r["start_perf_ns"]
            events, usage, finish, timing, text = [], None, None, None, []
            last = t0
            for resp in r.get("responses") or []:
                last = resp["perf_ns"]
                for p in resp.get("packets") or []:
                    if p.get("name") != "data":
                        continue
                    t, u, fr, tm = chunk_text(p.get("value", ""))
                    events.append({"at_ns": resp["perf_ns"], "tokens": 1 if t else 0})
                    text.append(t)
                    usage = u or usage
                    finish = fr or finish
                    timing = tm or timing
            ok = r.get("status") == 200 and not r.get("error")
            rec = {
                "id": i,
                "t_sched": t0,
                "t_send": t0,
                "streamed": True,
                "events": events,
                "t_done": last,
                "outcome": {"status": "ok", "finish_reason": finish} if ok else {"status": "failed", "kind": "aiperf", "message": str(r.get("error"))},
            }
            if usage:
                rec["usage"] = {"prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0)}
            out.append(rec)
            texts.append("".join(text))
            self.timing.append(timing)
        return out, texts


# --- ours ---------------------------------------------------------------------------------------


def tokenpath_report(bin_path, records):
    """`tokenpath report --json` on records: our definitions, computed by our code."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        path = f.name
    try:
        out = subprocess.run([bin_path, "report", path, "--json"], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return json.loads(out)


def stat(summary_block, key, q):
    s = summary_block.get(key)
    return None if s is None else s.get(q)


# --- the comparison -----------------------------------------------------------------------------

DOC = "docs/metrics.md#checked-against-aiperf"
# (our name, our summary key, AIPerf tag, the server's own measurement of the same interval)
ROWS = [
    ("TTFT", "ttft_ms", "time_to_first_token", "ttft"),
    ("TPOT", "tpot_ms", "inter_token_latency", "decode_per_token"),
    ("chunk gap", "chunk_gap_ms", "inter_chunk_latency", None),
    ("E2E", "e2e_ms", "request_latency", "e2e"),
]


def fmt(v, digits=1):
    return "-" if v is None else f"{v:,.{digits}f}"


def fmt_ratio(r):
    return "-" if r is None else f"{r:.3f}"


def server_clock(timings, n_out):
    """The server's own measurements (its `timing`), per request: TTFT, decode per token, E2E."""
    return {
        "ttft": [t["ttft_ms"] for t in timings if t.get("ttft_ms") is not None],
        "decode_per_token": [t["stages_ms"]["decode"] / (n_out - 1) for t in timings if "decode" in (t.get("stages_ms") or {})],
        "e2e": [t["e2e_ms"] for t in timings if t.get("e2e_ms") is not None],
    }


def offsets(recs, timings):
    """Per request, what the client saw minus what the server measured, ms: TTFT and E2E."""
    tt, ee = [], []
    for r, t in zip(recs, timings):
        tok = [e["at_ns"] for e in r["events"] if e["tokens"] > 0]
        if not tok or t is None:
            continue
        tt.append((tok[0] - r["t_send"]) / 1e6 - t["ttft_ms"])
        ee.append((tok[-1] - r["t_send"]) / 1e6 - t["e2e_ms"])
    return tt, ee


def zero_gap_share(recs):
    gaps = []
    for r in recs:
        tok = [e["at_ns"] for e in r["events"] if e["tokens"] > 0]
        gaps.extend(b - a for a, b in zip(tok, tok[1:]))
    return None if not gaps else sum(1 for g in gaps if g < 100_000) / len(gaps)


def verdict(adj, raw):
    if adj is None:
        return None, "MISSING"
    if abs(adj - 1) <= BOUND:
        tail = f"; raw p50s within {BOUND:.0%} too" if raw is not None and abs(raw - 1) <= BOUND else ""
        return True, f"agree (server-adjusted p50 within {BOUND:.0%}{tail})"
    return False, f"DISAGREE (server-adjusted p50 off by {abs(adj - 1):.1%} > {BOUND:.0%})"


def main_compare(a):
    if len(a.aiperf) != len(a.ours):
        sys.exit("compare: give as many --aiperf as --ours")
    ap_runs = [AiperfRun(d) for d in a.aiperf]
    our_runs = [json.load(open(p, encoding="utf-8")) for p in a.ours]
    pooled = len(ap_runs) > 1
    n_out = a.output_tokens
    problems, notes = [], []

    # -- sanity: the same workload, every request complete, exact lengths --
    our_recs = [r for run in our_runs for r in run["requests"]]
    our_ok = [r for r in our_recs if r["outcome"]["status"] == "ok"]
    ap_conv, ap_texts, ap_timing = [], [], []
    for run in ap_runs:
        recs, texts = run.as_tokenpath_records()
        ap_conv.extend(recs)
        ap_texts.extend(texts)
        ap_timing.extend(run.timing)
    ap_ok = [r for r in ap_conv if r["outcome"]["status"] == "ok"]
    ap_ok_timing = [t for r, t in zip(ap_conv, ap_timing) if r["outcome"]["status"] == "ok"]
    if len(our_ok) != len(our_recs):
        problems.append(f"tokenpath bench: {len(our_recs) - len(our_ok)} of {len(our_recs)} requests failed")
    errors = [run.summary.get("error_summary") for run in ap_runs if run.summary.get("error_summary")]
    if len(ap_ok) != len(ap_conv) or errors:
        problems.append(f"AIPerf: {len(ap_conv) - len(ap_ok)} of {len(ap_conv)} requests failed: {errors}")
    for name, recs in (("tokenpath bench", our_ok), ("AIPerf", ap_ok)):
        outs = sorted({(r.get("usage") or {}).get("completion_tokens") for r in recs})
        if outs != [n_out]:
            problems.append(f"{name}: usage.completion_tokens {outs}, expected all {n_out} (ignore_eos)")
    our_prompt = sorted({(r.get("usage") or {}).get("prompt_tokens") for r in our_ok})
    ap_prompt = sorted({(r.get("usage") or {}).get("prompt_tokens") for r in ap_ok})
    if our_prompt != ap_prompt:
        problems.append(f"not the same workload: the server counted prompts of {our_prompt} tokens from tokenpath bench, {ap_prompt} from AIPerf")

    # -- each tool's own numbers (several rounds: the same statistics over all their records) --
    if pooled:
        ours = tokenpath_report(a.bin, our_recs)["summary"]
        ours_tput = sum(r["summary"]["output_tokens_per_s"] * r["summary"]["window_s"] for r in our_runs) / sum(r["summary"]["window_s"] for r in our_runs)
    else:
        ours = our_runs[0]["summary"]
        ours_tput = ours["output_tokens_per_s"]

    def ap_value(tag, q):
        if not pooled:
            return (ap_runs[0].summary.get(tag) or {}).get(q)
        return pct([v for run in ap_runs for v in run.metric(tag)], int(q[1:]))

    ap_tput = sum(run.summary["total_osl"]["avg"] for run in ap_runs) / sum(run.summary["benchmark_duration"]["avg"] for run in ap_runs)

    our_timing = [r.get("server") for r in our_ok]
    srv_ours = server_clock([t for t in our_timing if t], n_out)
    srv_ap = server_clock([t for t in ap_ok_timing if t], n_out)

    print()
    print(f"check-peer-bench: tokenpath bench ({len(our_ok)} requests) vs AIPerf {ap_runs[0].summary.get('aiperf_version')} "
          f"({len(ap_ok)} requests), {len(ap_runs)} round(s) each, one `tokenpath serve`")
    print(f"  server-counted prompt tokens: {our_prompt} (ours) / {ap_prompt} (AIPerf); output tokens: {n_out} each (ignore_eos)")
    print(f"  'server' = the server's own clock (the `timing` on every response) for the same interval in each tool's run;")
    print(f"  'adjusted' = ratio / server: what is left for the tools once the server's own speed in each run is taken out")
    print()
    head = (f"{'ours = AIPerf':<38}{'ours p50':>10}{'AIPerf p50':>12}{'ratio':>8}{'server':>8}{'adjusted':>10}"
            f"{'ours p99':>10}{'AIPerf p99':>12}  verdict")
    print(head)
    print("-" * (len(head) + 40))
    table = []
    for name, key, tag, srv in ROWS:
        o50, o99 = stat(ours, key, "p50"), stat(ours, key, "p99")
        p50, p99 = ap_value(tag, "p50"), ap_value(tag, "p99")
        raw = ratio(o50, p50)
        sr = ratio(pct(srv_ours[srv], 50), pct(srv_ap[srv], 50)) if srv else None
        if srv:
            adj = None if raw is None or sr is None else raw / sr
            ok, v = verdict(adj, raw)
            if ok is not True:
                problems.append(f"{name} p50: ours {fmt(o50, 3)} ms, AIPerf {fmt(p50, 3)} ms, server ratio {fmt_ratio(sr)}: {v}")
        else:
            adj = None
            v = f"no server clock for it: gated side by side below ({DOC}-chunk-gap)"
        table.append({"metric": name, "aiperf": tag, "ours_p50": o50, "aiperf_p50": p50, "ratio": raw, "server_ratio": sr,
                      "adjusted": adj, "ours_p99": o99, "aiperf_p99": p99, "verdict": v})
        print(f"{name + ' = ' + tag + ' (ms)':<38}{fmt(o50):>10}{fmt(p50):>12}{fmt_ratio(raw):>8}{fmt_ratio(sr):>8}{fmt_ratio(adj):>10}"
              f"{fmt(o99):>10}{fmt(p99):>12}  {v}")
    # Output tok/s: a closed loop's rate is concurrency / mean cycle, so the server's speed enters
    # through its mean E2E.
    raw = ratio(ours_tput, ap_tput)
    mo, ma = (sum(x) / len(x) if x else None for x in (srv_ours["e2e"], srv_ap["e2e"]))
    sr = ratio(ma, mo)
    adj = None if raw is None or sr is None else raw / sr
    ok, v = verdict(adj, raw)
    v += f"; windows differ by definition: {DOC}-output-toks"
    if ok is not True:
        problems.append(f"output tok/s: ours {fmt(ours_tput, 2)}, AIPerf {fmt(ap_tput, 2)}, server ratio {fmt_ratio(sr)}: {v}")
    table.append({"metric": "output tok/s", "aiperf": "output_token_throughput", "ours": ours_tput, "aiperf_value": ap_tput,
                  "ratio": raw, "server_ratio": sr, "adjusted": adj, "verdict": v})
    print(f"{'output tok/s = output_token_throughput':<38}{fmt(ours_tput):>10}{fmt(ap_tput):>12}{fmt_ratio(raw):>8}{fmt_ratio(sr):>8}"
          f"{fmt_ratio(adj):>10}{'':>10}{'':>12}  {v}")

    # AIPerf as most people run it: output tokens counted by re-tokenizing the text.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    retok = [len(tok.encode(t, add_special_tokens=False)) for t in ap_texts]
    default_itl = []
    for rec, n in zip(ap_conv, retok):
        times = [e["at_ns"] for e in rec["events"] if e["tokens"] > 0]
        if rec["outcome"]["status"] == "ok" and times and n >= 2:
            default_itl.append((times[-1] - times[0]) / (n - 1) / 1e6)
    mism = sum(1 for n in retok if n != n_out)
    d50, d99 = pct(default_itl, 50), pct(default_itl, 99)
    p50 = ap_value("inter_token_latency", "p50")
    off = sorted({n for n in retok if n != n_out and n > 1})
    dev = [(n_out - 1) / (n - 1) - 1 for n in off]
    span = f": {off[0]}-{off[-1]} tokens, their ITL {min(dev):+.1%} to {max(dev):+.1%}" if off else ""
    v = f"differs by definition: {DOC}-itl ({mism}/{len(retok)} outputs re-tokenize to != {n_out} tokens{span})"
    table.append({"metric": "AIPerf ITL, default token count", "aiperf_p50": d50, "aiperf_p99": d99, "vs_server_count_p50": ratio(d50, p50), "verdict": v})
    print(f"{'  AIPerf ITL, text re-tokenized (ms)':<38}{'':>10}{fmt(d50):>12}{'':>8}{'':>8}{'':>10}{'':>10}{fmt(d99):>12}  {v}")
    our_retok = [r.get("retokenized_output") for r in our_ok if r.get("retokenized_output") is not None]
    if our_retok:
        notes.append(f"re-tokenized outputs that differ from usage ({n_out}): tokenpath bench's {sum(1 for n in our_retok if n != n_out)}/{len(our_retok)}, "
                     f"AIPerf's {mism}/{len(retok)} (AIPerf's ITL with them: p50 {fmt(d50, 2)} ms against {fmt(p50, 2)} ms with usage)")

    # -- the same records under both definitions: no run-to-run noise left --
    same = tokenpath_report(a.bin, ap_conv)["summary"]
    print()
    print(f"Same records, both definitions: `tokenpath report` on AIPerf's raw records ({len(ap_ok)} requests) against AIPerf's own values")
    head2 = f"{'ours = AIPerf':<38}{'ours p50':>12}{'AIPerf p50':>12}{'ratio':>8}{'ours p99':>12}{'AIPerf p99':>12}  verdict"
    print(head2)
    print("-" * (len(head2) + 40))
    same_rows = []
    for name, key, tag, _ in ROWS:
        vals = [v for run in ap_runs for v in run.metric(tag)]
        a50, a99 = pct(vals, 50), pct(vals, 99)
        o50, o99 = stat(same, key, "p50"), stat(same, key, "p99")
        rr = [ratio(o50, a50), ratio(o99, a99)]
        if None in rr:
            v = "MISSING"
            problems.append(f"same records, {name}: missing values")
        elif max(abs(x - 1) for x in rr) <= SAME_DATA_BOUND:
            v = f"identical (p50 and p99 within {SAME_DATA_BOUND:.1%})"
        else:
            v = f"DIFFERENT ({max(abs(x - 1) for x in rr):.2%} > {SAME_DATA_BOUND:.1%})"
            problems.append(f"same records, {name}: ours {o50}/{o99}, AIPerf {a50}/{a99}")
        same_rows.append({"metric": name, "ours_p50": o50, "aiperf_p50": a50, "ours_p99": o99, "aiperf_p99": a99, "verdict": v})
        print(f"{name + ' = ' + tag + ' (ms)':<38}{fmt(o50, 3):>12}{fmt(a50, 3):>12}{fmt_ratio(rr[0]):>8}{fmt(o99, 3):>12}{fmt(a99, 3):>12}  {v}")
    if not pooled:
        st, rt = same["output_tokens_per_s"], ratio(same["output_tokens_per_s"], ap_tput)
        v = f"differs by definition: {DOC}-output-toks (our window ends at [DONE], AIPerf's at the last token)"
        print(f"{'output tok/s = output_token_throughput':<38}{fmt(st, 3):>12}{fmt(ap_tput, 3):>12}{fmt_ratio(rt):>8}{'':>12}{'':>12}  {v}")
        same_rows.append({"metric": "output tok/s", "ours": st, "aiperf_value": ap_tput, "ratio": rt, "verdict": v})

    # -- how each tool sees the server: its measurement on top of the server's own clock --
    print()
    print("Each tool against the server's own clock, per request (client minus server, ms; TPOT / server decode per token):")
    fid = {}
    for label, recs, timings in (("tokenpath bench", our_ok, our_timing), ("AIPerf", ap_ok, ap_ok_timing)):
        tt, ee = offsets(recs, timings)
        tp = [((r_t[-1] - r_t[0]) / 1e6 / (n_out - 1)) / (t["stages_ms"]["decode"] / (n_out - 1))
              for r_t, t in ((([e["at_ns"] for e in r["events"] if e["tokens"] > 0]), t) for r, t in zip(recs, timings)) if t and len(r_t) > 1]
        z = zero_gap_share(recs)
        fid[label] = {"ttft_offset_ms_p50": pct(tt, 50), "ttft_offset_ms_p99": pct(tt, 99), "e2e_offset_ms_p50": pct(ee, 50),
                      "tpot_over_server_p50": pct(tp, 50), "zero_chunk_gaps": z}
        print(f"  {label:<16} TTFT +{fmt(pct(tt, 50), 2)} (p99 +{fmt(pct(tt, 99), 2)})   E2E +{fmt(pct(ee, 50), 2)}   "
              f"TPOT x{fmt(pct(tp, 50), 4)}   chunk gaps under 0.1 ms: {'-' if z is None else f'{z:.2%}'}")
    print(f"  server's own p50s during ours / AIPerf's run: TTFT {fmt(pct(srv_ours['ttft'], 50))} / {fmt(pct(srv_ap['ttft'], 50))} ms, "
          f"decode per token {fmt(pct(srv_ours['decode_per_token'], 50), 2)} / {fmt(pct(srv_ap['decode_per_token'], 50), 2)} ms, "
          f"E2E {fmt(pct(srv_ours['e2e'], 50))} / {fmt(pct(srv_ap['e2e'], 50))} ms")
    side_rows = side_by_side(a, problems) if a.side_aiperf and a.side_ours else []
    for n in notes:
        print(f"note: {n}")

    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"cross_tool": table, "same_records": same_rows, "against_server_clock": fid, "side_by_side": side_rows,
                       "problems": problems,
                       "notes": notes, "bound": BOUND, "same_records_bound": SAME_DATA_BOUND}, f, indent=2)
    if problems:
        print("FAILED:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"OK: the same records give the same numbers under both definitions; across the two runs the p50s agree "
          f"within {BOUND:.0%} once the server's own speed in each run is taken out"
          + (f", and the chunk gaps of the same batch steps within {BOUND:.0%}" if side_rows else ""))
    return 0


def side_by_side(a, problems):
    """Both tools at once, concurrency 1 each: one stream of each in the same batch steps. AIPerf
    started first and sent a few requests more; the ends, where only one tool streamed, are
    dropped: AIPerf's first request and those past our count, our last one."""
    run = AiperfRun(a.side_aiperf)
    mine = json.load(open(a.side_ours, encoding="utf-8"))["requests"]
    mine = sorted((r for r in mine if r["outcome"]["status"] == "ok"), key=lambda r: r["t_send"])[:-1]
    theirs = sorted(run.records, key=lambda r: r["metadata"]["request_start_ns"])[1 : len(mine) + 1]
    ours = tokenpath_report(a.bin, mine)["summary"]

    def values(tag):
        out = []
        for r in theirs:
            m = (r.get("metrics") or {}).get(tag)
            if m is not None:
                out.extend(m["value"] if isinstance(m["value"], list) else [m["value"]])
        return out

    print()
    print(f"Side by side: both tools at the same time, concurrency 1 each ({len(mine)} of ours, {len(theirs)} of AIPerf's "
          f"requests while both streamed): the same batch steps, timed by both")
    head = f"{'ours = AIPerf':<38}{'ours p50':>10}{'AIPerf p50':>12}{'ratio':>8}{'ours p99':>10}{'AIPerf p99':>12}  verdict"
    print(head)
    print("-" * (len(head) + 40))
    rows = []
    for name, key, tag, _ in ROWS:
        vals = values(tag)
        o50, o99, p50, p99 = stat(ours, key, "p50"), stat(ours, key, "p99"), pct(vals, 50), pct(vals, 99)
        r = ratio(o50, p50)
        if key == "chunk_gap_ms":
            ok, v = (r is not None and abs(r - 1) <= BOUND), ""
            v = f"agree (p50 within {BOUND:.0%})" if ok else f"DISAGREE ({'-' if r is None else f'{abs(r - 1):.1%}'} > {BOUND:.0%})"
            if not ok:
                problems.append(f"side by side, chunk gap p50: ours {fmt(o50, 3)} ms, AIPerf {fmt(p50, 3)} ms")
        else:
            v = f"not gated here: each stream's own prefill lands on the other (phase): {DOC}-side-by-side"
        rows.append({"metric": name, "ours_p50": o50, "aiperf_p50": p50, "ratio": r, "ours_p99": o99, "aiperf_p99": p99, "verdict": v})
        print(f"{name + ' = ' + tag + ' (ms)':<38}{fmt(o50):>10}{fmt(p50):>12}{fmt_ratio(r):>8}{fmt(o99):>10}{fmt(p99):>12}  {v}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("gguf")
    t.add_argument("hf_home")
    t.add_argument("repo_id")
    c = sub.add_parser("compare")
    c.add_argument("--aiperf", action="append", required=True)
    c.add_argument("--ours", action="append", required=True)
    c.add_argument("--bin", required=True)
    c.add_argument("--tokenizer", required=True)
    c.add_argument("--output-tokens", type=int, required=True)
    c.add_argument("--side-aiperf")
    c.add_argument("--side-ours")
    c.add_argument("--json")
    a = ap.parse_args()
    if a.cmd == "tokenizer":
        print(write_tokenizer(a.gguf, a.hf_home, a.repo_id))
        return 0
    return main_compare(a)


if __name__ == "__main__":
    sys.exit(main())
