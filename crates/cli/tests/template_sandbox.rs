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

/// The command lines of `pid`'s children that are template-sandbox children.
fn sandbox_children(pid: u32) -> usize {
    let mut n = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let kids = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for kid in kids.split_whitespace() {
            let cmd = std::fs::read(format!("/proc/{kid}/cmdline")).unwrap_or_default();
            n += usize::from(String::from_utf8_lossy(&cmd).contains("__render-template"));
        }
    }
    n
}

#[test]
fn a_template_the_operator_trusts_by_digest_renders_in_process_and_a_malformed_digest_is_refused() {
    let dir = std::env::temp_dir().join(format!("tp-template-trust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    std::fs::write(&model, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    let digest = tokenpath_engine::tokenizer::reviewed::template_digest(TINY_CHAT_TEMPLATE);
    let args = ["--served-model-name", "tiny", "--kv-tokens", "1024"];

    // Not reviewed: the first render starts a sandbox child, and the log says how to trust it.
    let mut sandboxed = support::serve(&model, &args);
    assert_eq!(chat(sandboxed.port, "hello").0, 200);
    assert_eq!(sandbox_children(sandboxed.child.id()), 1);
    sandboxed.stop_ref();
    assert!(sandboxed.logs().contains(&format!("--trust-template {digest}")));

    // Trusted: the same answer, no child.
    let mut with = args.to_vec();
    with.extend(["--trust-template", &digest]);
    let mut trusted = support::serve(&model, &with);
    let (status, body) = chat(trusted.port, "hello");
    assert_eq!(status, 200, "{body}");
    assert_eq!(sandbox_children(trusted.child.id()), 0);
    trusted.stop_ref();
    assert!(trusted.logs().contains("(operator-trusted) renders in-process"));

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["serve", "--trust-template", "abc", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a BLAKE3 digest"));
    let _ = std::fs::remove_dir_all(&dir);
}
