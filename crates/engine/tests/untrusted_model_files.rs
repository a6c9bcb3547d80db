//! A model file is untrusted input above its parser too (security review L2): a context length
//! that would size a KV cache of terabytes is refused at load, and a chat template that loops
//! without end runs out of fuel instead of pinning the gateway.

use tokenpath_engine::model::Model;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::tokenizer::{ChatTemplate, PromptMessage, Role};

#[test]
fn an_absurd_context_length_is_refused_at_load() {
    let bytes =
        tiny_model_bytes(&TinySpec { n_ctx: u32::MAX as usize, ..TinySpec::default() }).expect("tiny model");
    let e = Model::from_bytes(bytes).expect_err("refused");
    assert!(e.to_string().contains("context_length"), "{e}");
    let ok = tiny_model_bytes(&TinySpec { n_ctx: 1 << 20, ..TinySpec::default() }).expect("tiny model");
    assert!(Model::from_bytes(ok).is_ok(), "the largest allowed context loads");
}

#[test]
fn a_template_that_never_ends_runs_out_of_fuel() {
    let src = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
    let t = ChatTemplate::new(src, "<s>", "</s>").expect("compiles");
    let e = t.render(&[PromptMessage::new(Role::User, "hi")], true).expect_err("out of fuel");
    assert!(e.to_string().to_lowercase().contains("fuel"), "{e}");
    // An ordinary template with many messages has fuel to spare.
    let chatml = tokenpath_engine::tiny::TINY_CHAT_TEMPLATE;
    let t = ChatTemplate::new(chatml, "<s>", "</s>").expect("compiles");
    let many: Vec<PromptMessage> =
        (0..2000).map(|i| PromptMessage::new(Role::User, format!("message {i}"))).collect();
    assert!(t.render(&many, true).is_ok());
}
