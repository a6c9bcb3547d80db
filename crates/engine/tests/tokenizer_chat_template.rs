//! The default model's own chat template, rendered with minijinja, against Python Jinja2
//! (the renderer HF and llama-cpp-python use): `fixtures/chat_template_expected.json`.

mod support;

use serde_json::Value;
use tokenpath_engine::tokenizer::{PromptMessage, Role};

#[test]
fn default_model_template_matches_jinja2() {
    let Some(l) = support::load_default() else { return };
    let t = support::template_of(&l);
    let raw = std::fs::read_to_string(support::fixture("chat_template_expected.json")).expect("fixture");
    let cases: Vec<Value> = serde_json::from_str(&raw).expect("json");
    for c in &cases {
        let msgs: Vec<PromptMessage> = c["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| {
                PromptMessage::new(
                    serde_json::from_value::<Role>(m["role"].clone()).expect("role"),
                    m["content"].as_str().expect("content"),
                )
            })
            .collect();
        let agp = c["add_generation_prompt"].as_bool().expect("agp");
        let got = t.render(&msgs, agp).expect("render");
        assert_eq!(got, c["expected"].as_str().expect("expected"), "case {c}");
    }
}

#[test]
fn rendered_prompt_tokenizes_with_control_tokens() {
    let Some(l) = support::load_default() else { return };
    let t = support::template_of(&l);
    let prompt = t.render(&[PromptMessage::new(Role::User, "hi")], true).expect("render");
    let ids = l.tok.encode(&prompt, true, true).expect("encode");
    let im_start = l.tok.token_id("<|im_start|>").expect("im_start");
    assert_eq!(ids.iter().filter(|&&i| i == im_start).count(), prompt.matches("<|im_start|>").count());
}

/// Third-party templates rendered by Python Jinja2 configured like HF `apply_chat_template`
/// (`CHAT_TEMPLATE_DIFF=expected.json`, made by a local script; the templates themselves are
/// not committed). Errors must be errors on both sides, with the same `raise_exception` text.
#[test]
fn differential_from_env() {
    let Some(path) = std::env::var_os("CHAT_TEMPLATE_DIFF") else { return };
    let cases: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).expect("file")).expect("json");
    let mut bad = 0;
    for c in &cases {
        let src = std::fs::read_to_string(c["template"].as_str().expect("template")).expect("template file");
        let t = tokenpath_engine::tokenizer::ChatTemplate::new(&src, "<s>", "</s>").expect("compiles");
        let mut extra = c["context"].as_object().expect("context").clone();
        let messages = extra.remove("messages").expect("messages");
        let got = t.render_json(&messages, c["add_generation_prompt"].as_bool().expect("agp"), &extra);
        let ok = match (&got, c.get("ok").and_then(Value::as_str), c.get("error").and_then(Value::as_str)) {
            (Ok(g), Some(want), _) => g == want,
            (Err(e), None, Some(want)) => e.to_string().contains(want),
            _ => false,
        };
        if !ok {
            bad += 1;
            eprintln!(
                "MISMATCH {} agp={}\n  jinja2: {:?}\n  ours:   {:?}",
                c["template"],
                c["add_generation_prompt"],
                c.get("ok").or(c.get("error")),
                got
            );
        }
    }
    eprintln!("chat template differential: {}/{} identical", cases.len() - bad, cases.len());
    assert_eq!(bad, 0);
}
