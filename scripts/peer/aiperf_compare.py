"""The AIPerf side of scripts/check-peer-bench: its offline tokenizer, and the comparison.

    python aiperf_compare.py tokenizer MODEL.gguf HF_HOME REPO_ID
        Writes the GGUF's own tokenizer (vocabulary, merges, special tokens, chat template) as a
        Hugging Face tokenizer into a hub-cache snapshot HF_HOME/hub/models--ORG--NAME/, so
        `aiperf --tokenizer REPO_ID` loads it with HF_HUB_OFFLINE=1. (AIPerf 0.13.0 in offline mode
        treats every --tokenizer as a hub repo id, a local directory too; a cache snapshot is the
        offline form it accepts.) Prints the snapshot directory.

    python aiperf_compare.py compare --aiperf DIR --ours RUN.json [--aiperf DIR --ours RUN.json ...]
                                     --bin TOKENPATH --tokenizer DIR --output-tokens N [--json OUT]
        Prints both tools' numbers mapped to our definitions and checks them (exit 1 on a failed
        check). Definitions and every disagreement: docs/metrics.md, "Checked against AIPerf".

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
        self.server = []
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
            if ok and timing:
                self.server.append(timing)
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

ROWS = [
    # (our name, our summary key, AIPerf tag, anchor in docs/metrics.md, same definition?)
    ("TTFT", "ttft_ms", "time_to_first_token", "ttft", True),
    ("TPOT", "tpot_ms", "inter_token_latency", "tpot", True),
    ("chunk gap", "chunk_gap_ms", "inter_chunk_latency", "chunk-gap", True),
    ("E2E", "e2e_ms", "request_latency", "e2e", True),
]
DOC = "docs/metrics.md#checked-against-aiperf"


def fmt(v, digits=1):
    return "-" if v is None else f"{v:,.{digits}f}"


def fmt_ratio(r):
    return "-" if r is None else f"{r:.3f}"


def main_compare(a):
    if len(a.aiperf) != len(a.ours):
        sys.exit("compare: give as many --aiperf as --ours")
    ap_runs = [AiperfRun(d) for d in a.aiperf]
    our_runs = [json.load(open(p, encoding="utf-8")) for p in a.ours]
    pooled = len(ap_runs) > 1
    problems, notes = [], []

    # -- sanity: the same workload, every request complete, exact lengths --
    our_recs = [r for run in our_runs for r in run["requests"]]
    our_ok = [r for r in our_recs if r["outcome"]["status"] == "ok"]
    ap_conv, ap_texts = [], []
    for run in ap_runs:
        recs, texts = run.as_tokenpath_records()
        ap_conv.extend(recs)
        ap_texts.extend(texts)
    ap_ok = [r for r in ap_conv if r["outcome"]["status"] == "ok"]
    if len(our_ok) != len(our_recs):
        problems.append(f"tokenpath bench: {len(our_recs) - len(our_ok)} of {len(our_recs)} requests failed")
    if len(ap_ok) != len(ap_conv) or any(run.summary.get("error_summary") for run in ap_runs):
        problems.append(f"AIPerf: {len(ap_conv) - len(ap_ok)} of {len(ap_conv)} requests failed: "
                        f"{[run.summary.get('error_summary') for run in ap_runs]}")
    for name, recs in (("tokenpath bench", our_ok), ("AIPerf", ap_ok)):
        outs = sorted({(r.get("usage") or {}).get("completion_tokens") for r in recs})
        if outs != [a.output_tokens]:
            problems.append(f"{name}: usage.completion_tokens {outs}, expected all {a.output_tokens} (ignore_eos)")
    our_prompt = sorted({(r.get("usage") or {}).get("prompt_tokens") for r in our_ok})
    ap_prompt = sorted({(r.get("usage") or {}).get("prompt_tokens") for r in ap_ok})
    if our_prompt != ap_prompt:
        problems.append(f"not the same workload: the server counted prompts of {our_prompt} tokens from tokenpath bench, {ap_prompt} from AIPerf")

    # -- each tool's own numbers (pooled over rounds: the same statistics on all records) --
    if pooled:
        ours = tokenpath_report(a.bin, our_recs)["summary"]
        ours_tput = sum(r["summary"]["output_tokens_per_s"] * r["summary"]["window_s"] for r in our_runs) / sum(
            r["summary"]["window_s"] for r in our_runs
        )
    else:
        ours = our_runs[0]["summary"]
        ours_tput = ours["output_tokens_per_s"]

    def ap_value(tag, q):
        if not pooled:
            return (ap_runs[0].summary.get(tag) or {}).get(q)
        return pct([v for run in ap_runs for v in run.metric(tag)], int(q[1:]))

    ap_tput = sum(run.summary["total_osl"]["avg"] for run in ap_runs) / sum(run.summary["benchmark_duration"]["avg"] for run in ap_runs)

    n_ours, n_ap = len(our_ok), len(ap_ok)
    print()
    print(f"check-peer-bench: tokenpath bench ({n_ours} requests) vs AIPerf {ap_runs[0].summary.get('aiperf_version')} "
          f"({n_ap} requests), {len(ap_runs)} round(s), same `tokenpath serve`")
    print(f"  server-counted prompt tokens: {our_prompt} (ours) / {ap_prompt} (AIPerf); output tokens: {a.output_tokens} each")
    print()
    head = f"{'metric (ours = AIPerf)':<44}{'ours p50':>10}{'AIPerf p50':>12}{'ratio':>8}{'ours p99':>10}{'AIPerf p99':>12}  verdict"
    print(head)
    print("-" * (len(head) + 30))
    table = []
    for name, key, tag, anchor, same in ROWS:
        o50, o99 = stat(ours, key, "p50"), stat(ours, key, "p99")
        p50, p99 = ap_value(tag, "p50"), ap_value(tag, "p99")
        r50 = ratio(o50, p50)
        if r50 is None:
            verdict = "MISSING"
            problems.append(f"{name}: a p50 is missing (ours {o50}, AIPerf {p50})")
        elif abs(r50 - 1) <= BOUND:
            verdict = f"agree (p50 within {BOUND:.0%})"
        else:
            verdict = f"DISAGREE (p50 off by {abs(r50 - 1):.1%} > {BOUND:.0%})"
            problems.append(f"{name} p50: ours {o50:.3f} ms, AIPerf {p50:.3f} ms ({r50:.3f}x)")
        table.append({"metric": name, "aiperf": tag, "ours_p50": o50, "aiperf_p50": p50, "ours_p99": o99, "aiperf_p99": p99, "verdict": verdict})
        print(f"{name + ' = ' + tag + ' (ms)':<44}{fmt(o50):>10}{fmt(p50):>12}{fmt_ratio(r50):>8}{fmt(o99):>10}{fmt(p99):>12}  {verdict}")
    r = ratio(ours_tput, ap_tput)
    if r is not None and abs(r - 1) <= BOUND:
        verdict = f"agree (within {BOUND:.0%}; windows differ by definition: {DOC}-output-toks)"
    else:
        verdict = f"DISAGREE ({'-' if r is None else f'{abs(r - 1):.1%}'} > {BOUND:.0%})"
        problems.append(f"output tok/s: ours {ours_tput}, AIPerf {ap_tput}")
    table.append({"metric": "output tok/s", "aiperf": "output_token_throughput", "ours": ours_tput, "aiperf_value": ap_tput, "verdict": verdict})
    print(f"{'output tok/s = output_token_throughput':<44}{fmt(ours_tput):>10}{fmt(ap_tput):>12}{fmt_ratio(r):>8}{'':>10}{'':>12}  {verdict}")

    # AIPerf as most people run it: output tokens counted by re-tokenizing the text.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    retok = [len(tok.encode(t, add_special_tokens=False)) for t in ap_texts]
    default_itl = []
    for rec, n in zip(ap_conv, retok):
        tokens = [e["at_ns"] for e in rec["events"] if e["tokens"] > 0]
        if rec["outcome"]["status"] != "ok" or len(tokens) < 1 or n < 2:
            continue
        default_itl.append((tokens[-1] - tokens[0]) / (n - 1) / 1e6)
    mism = sum(1 for n in retok if n != a.output_tokens)
    d50, d99 = pct(default_itl, 50), pct(default_itl, 99)
    o50, o99 = stat(ours, "tpot_ms", "p50"), stat(ours, "tpot_ms", "p99")
    verdict = f"differs by definition: see {DOC}-itl ({mism}/{len(retok)} texts re-tokenize to != {a.output_tokens})"
    table.append({"metric": "TPOT vs AIPerf default ITL", "ours_p50": o50, "aiperf_p50": d50, "ours_p99": o99, "aiperf_p99": d99, "verdict": verdict})
    print(f"{'TPOT = ITL w/o --use-server-token-count (ms)':<44}{fmt(o50):>10}{fmt(d50):>12}{fmt_ratio(ratio(o50, d50)):>8}{fmt(o99):>10}{fmt(d99):>12}  {verdict}")
    our_retok = [r.get("retokenized_output") for r in our_ok if r.get("retokenized_output") is not None]
    if our_retok:
        notes.append(f"re-tokenized outputs: tokenpath bench's {sum(1 for n in our_retok if n != a.output_tokens)}/{len(our_retok)} "
                     f"and AIPerf's {mism}/{len(retok)} differ from usage ({a.output_tokens})")

    # -- the same records under both definitions: no run-to-run noise left --
    same = tokenpath_report(a.bin, ap_conv)["summary"]
    print()
    print(f"Same records, both definitions: `tokenpath report` on AIPerf's raw records ({n_ap} requests) vs AIPerf's own values")
    print(head.replace("ours", "ours").replace("metric (ours = AIPerf)", "metric (ours on AIPerf's records)"))
    print("-" * (len(head) + 30))
    same_rows = []
    for name, key, tag, anchor, _ in ROWS:
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
        print(f"{name + ' = ' + tag + ' (ms)':<44}{fmt(o50, 3):>10}{fmt(a50, 3):>12}{fmt_ratio(rr[0]):>8}{fmt(o99, 3):>10}{fmt(a99, 3):>12}  {v}")
    same_tput = same["output_tokens_per_s"] if not pooled else None
    if same_tput is not None:
        rt = ratio(same_tput, ap_tput)
        v = f"differs by definition: see {DOC}-output-toks (window ends at [DONE], not at the last token)"
        print(f"{'output tok/s = output_token_throughput':<44}{fmt(same_tput, 3):>10}{fmt(ap_tput, 3):>12}{fmt_ratio(rt):>8}{'':>10}{'':>12}  {v}")
        same_rows.append({"metric": "output tok/s", "ours": same_tput, "aiperf_value": ap_tput, "verdict": v})

    # -- how fast the server itself was in each run (its own clock, the `timing` it sends) --
    def server_clock(timings):
        ttft = [t.get("ttft_ms") for t in timings]
        per_tok = [t["stages_ms"]["decode"] / (a.output_tokens - 1) for t in timings if "decode" in (t.get("stages_ms") or {})]
        return pct(ttft, 50), pct(per_tok, 50)

    s_ours = server_clock([r["server"] for r in our_ok if r.get("server")])
    s_ap = server_clock([t for run in ap_runs for t in run.server])
    print()
    print("The server's own clock (the `timing` it sent on each response), in each tool's run:")
    server_rows = []
    for label, i, client in (("server TTFT p50 (ms)", 0, ("ttft_ms", "time_to_first_token")),
                             ("server decode per token p50 (ms)", 1, ("tpot_ms", "inter_token_latency"))):
        o, p = s_ours[i], s_ap[i]
        co, cp = stat(ours, client[0], "p50"), ap_value(client[1], "p50")
        print(f"  {label:<36} during ours {fmt(o, 2):>9}   during AIPerf's {fmt(p, 2):>9}   ratio {fmt_ratio(ratio(o, p))}"
              f"   (client - server: ours {fmt(None if co is None or o is None else co - o, 2)}, AIPerf {fmt(None if cp is None or p is None else cp - p, 2)})")
        server_rows.append({"metric": label, "during_ours": o, "during_aiperf": p})
    sr = ratio(s_ours[1], s_ap[1])
    if sr is not None and abs(sr - 1) > BOUND:
        notes.append(f"the server itself decoded {abs(sr - 1):.1%} {'faster' if sr < 1 else 'slower'} during our run than during "
                     f"AIPerf's: a client-side difference of that size is the server's, not a tool's (see {DOC}-noise)")
    for n in notes:
        print(f"note: {n}")

    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"cross_tool": table, "same_records": same_rows, "server_clock": server_rows, "problems": problems,
                       "notes": notes, "bound": BOUND, "same_data_bound": SAME_DATA_BOUND}, f, indent=2)
    if problems:
        print("FAILED:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"OK: where the definitions agree, the p50s agree within {BOUND:.0%} across the two tools, and exactly on the same records")
    return 0


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
    c.add_argument("--json")
    a = ap.parse_args()
    if a.cmd == "tokenizer":
        print(write_tokenizer(a.gguf, a.hf_home, a.repo_id))
        return 0
    return main_compare(a)


if __name__ == "__main__":
    sys.exit(main())
