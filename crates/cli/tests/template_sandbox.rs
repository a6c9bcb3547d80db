//! A model's chat template is untrusted code (security review T1–T4, found by fuzzing the
//! chat_template target): through the real binary, a template that recurses without end, builds
//! gigabytes, runs for minutes or leaks renders in a sandbox child, so each such request gets a
//! 400 naming the template, the server's own memory stays flat, and the next request is served.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use support::{http, vm_hwm_kib};
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec, TINY_CHAT_TEMPLATE};

/// Misbehaves when the last message says how; otherwise the tiny model's ChatML.
fn hostile_template() -> String {
    let cases = [
        // T2/T1: a namespace holding itself, printed (unbounded recursion; a leaking cycle).
        ("cycle", "{% set ns = namespace() %}{% set ns.x = ns %}{{ ns }}"),
        // T3: a string doubled 40 times (a terabyte) inside the fuel.
        ("double", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"),
        // T4: 100,000 allocations of 4 MB (not constant, so not folded at compile time): minutes
        // of work inside the fuel.
        ("slow", "{% for i in range(100000) %}{% if (c * 1000000) in 'b' %}{% endif %}{% endfor %}"),
        ("raise", "{{ raise_exception('refused by the template') }}"),
    ];
    let mut t = String::from("{% set c = messages[-1].content %}");
    for (i, (word, body)) in cases.iter().enumerate() {
        t.push_str(if i == 0 { "{% if " } else { "{% elif " });
        t.push_str(&format!("c == '{word}' %}}{body}"));
    }
    t.push_str("{% else %}");
    t.push_str(TINY_CHAT_TEMPLATE);
    t.push_str("{% endif %}");
    t
}

fn chat(port: u16, content: &str) -> (u16, String) {
    let body = serde_json::json!({
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "ignore_eos": true
    });
    http(port, "POST", "/v1/chat/completions", &body.to_string())
}

#[test]
fn hostile_chat_templates_fail_one_request_each_and_the_server_carries_on() {
    let dir = std::env::temp_dir().join(format!("tp-template-sandbox-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("hostile.gguf");
    let spec = TinySpec { chat_template: hostile_template(), ..TinySpec::default() };
    std::fs::write(&model, tiny_model_bytes(&spec).unwrap()).unwrap();
    let served = support::serve(
        &model,
        &["--served-model-name", "tiny", "--kv-tokens", "1024", "--template-timeout-s", "2"],
    );
    let port = served.port;
    let (status, body) = chat(port, "hello");
    assert_eq!(status, 200, "{body}");
    let before = vm_hwm_kib(served.child.id());

    for (word, says) in [
        ("cycle", "stopped"),
        ("double", "stopped"),
        ("slow", "longer than 2.0 s"),
        ("raise", "refused by the template"),
        ("cycle", "stopped"),
    ] {
        let (status, body) = chat(port, word);
        assert_eq!(status, 400, "{word}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("chat template") && msg.contains(says), "{word}: {msg}");
        let (status, body) = chat(port, "hello again");
        assert_eq!(status, 200, "after {word}: {body}");
    }
    // The renders that blew up did so in children: the server's own peak barely moved.
    let after = vm_hwm_kib(served.child.id());
    assert!(after < before + 200 * 1024, "server peak RSS grew from {before} KiB to {after} KiB");
    served.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
