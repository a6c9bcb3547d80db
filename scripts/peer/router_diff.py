"""Compares what our gateway and an engine's own router sent to the same mock PD pair
(scripts/check-router-diff): each requirement of the engine's sequence, checked on every
request of both, side by side; fields one adds and the other does not are listed. Exits 1 when
our legs miss a requirement."""
import json
import os
import sys

CLIENT_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is PD?"}]
MOCK_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "mock-prefill",
               "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}


def legs(d):
    def read(name):
        with open(os.path.join(d, name)) as f:
            return [json.loads(l) for l in f if l.strip()]
    return list(zip(read("prefill.jsonl"), read("decode.jsonl")))


def max_tokens(b):
    return b.get("max_tokens", b.get("max_completion_tokens"))


def vllm_checks(p, d, streamed):
    pb, db = p["body"], d["body"]
    return {
        "prefill: kv_transfer_params.do_remote_decode": (pb.get("kv_transfer_params") or {}).get("do_remote_decode") is True,
        "prefill: not streamed": pb.get("stream") in (False, None),
        "prefill: one token": max_tokens(pb) == 1,
        "prefill: the client's messages": pb.get("messages") == CLIENT_MESSAGES,
        "decode: the prefill's kv_transfer_params verbatim": db.get("kv_transfer_params") == MOCK_PARAMS,
        "decode: the client's max_tokens": max_tokens(db) == 3,
        "decode: the client's stream flag": bool(db.get("stream")) == streamed,
        "decode: the client's messages": db.get("messages") == CLIENT_MESSAGES,
        "one X-Request-Id on both legs": p["request_id"] is not None and p["request_id"] == d["request_id"],
    }


def sglang_checks(p, d, streamed):
    pb, db = p["body"], d["body"]
    room = pb.get("bootstrap_room")
    return {
        "the same body to both legs": pb == db,
        "bootstrap_host: the prefill server's": pb.get("bootstrap_host") == "127.0.0.1",
        "bootstrap_port: the prefill server's": pb.get("bootstrap_port") == 8998,
        "bootstrap_room: an integer < 2^63": isinstance(room, int) and 0 <= room < 2**63,
        "the client's max_tokens": max_tokens(db) == 3,
        "the client's stream flag": bool(db.get("stream")) == streamed,
        "the client's messages": db.get("messages") == CLIENT_MESSAGES,
    }


def main():
    out = sys.argv[1]
    failed = False
    for family, checks, router in (("vllm", vllm_checks, "vllm-router"), ("sglang", sglang_checks, "sglang-router")):
        ours, theirs = legs(os.path.join(out, family, "tokenpath")), legs(os.path.join(out, family, router))
        if len(ours) != 2 or len(theirs) != 2:
            print(f"{family}: expected 2 requests on each leg, got {len(ours)} (ours) and {len(theirs)} ({router})")
            failed = True
            continue
        print(f"== {family} PD: tokenpath vs {router} ==")
        print(f"{'requirement':<52}{'request':<12}{'tokenpath':<11}{router}")
        for i, streamed in enumerate((True, False)):
            a, b = checks(*ours[i], streamed), checks(*theirs[i], streamed)
            for k in a:
                mark = lambda ok: "yes" if ok else "NO"
                print(f"{k:<52}{'streamed' if streamed else 'whole':<12}{mark(a[k]):<11}{mark(b[k])}")
                failed |= not a[k]
        for leg, n in (("prefill", 0), ("decode", 1)):
            ka, kb = set(ours[0][n]["body"]), set(theirs[0][n]["body"])
            if ka - kb:
                print(f"{leg} fields only tokenpath sends: {', '.join(sorted(ka - kb))}")
            if kb - ka:
                print(f"{leg} fields only {router} sends: {', '.join(sorted(kb - ka))}")
        print()
    if failed:
        print("tokenpath's legs miss a requirement (NO above)")
        sys.exit(1)
    print("tokenpath's legs meet every requirement")


if __name__ == "__main__":
    main()
