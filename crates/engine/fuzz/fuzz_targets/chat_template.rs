//! Fuzz target: a fuzzer-chosen chat template (the GGUF's `tokenizer.chat_template`, which
//! comes with an untrusted model file) compiled and rendered over a few messages, as the
//! gateway does for every chat request. `ChatTemplate::new` must refuse a broken template with
//! an error and `render` must return or fail, never panic, never hang (libFuzzer's -timeout
//! reports a render that does not end) and never allocate without bound (-rss_limit_mb).
//! This is the in-process path (fuel and the string-method budget only). Two findings are
//! minijinja's and cannot be bounded in-process — unbounded recursion through a namespace
//! that holds itself, and `s ~ s` doubling — which is why the binary renders in a sandbox
//! child (`tokenizer/sandbox.rs`, tested in `cli/tests/template_sandbox.rs`): crashes of
//! those two classes are known, anything else is a bug.
//! Input: `template \0 content \0 content ...` (up to four message contents; without a NUL the
//! whole input is the template and the messages are fixed).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_engine::tokenizer::{ChatTemplate, PromptMessage, Role};

const ROLES: [Role; 4] = [Role::System, Role::User, Role::Assistant, Role::User];

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or_default();
    let Ok(t) = ChatTemplate::new(source, "<s>", "</s>") else { return };
    let mut messages: Vec<PromptMessage> =
        parts.take(ROLES.len()).zip(ROLES).map(|(c, r)| PromptMessage::new(r, c)).collect();
    if messages.is_empty() {
        messages = vec![PromptMessage::new(Role::System, "Be brief."), PromptMessage::new(Role::User, "Hi there")];
    }
    let _ = t.render(&messages, data.len() % 2 == 0);
});
