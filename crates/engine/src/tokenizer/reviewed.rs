//! Chat templates that were read and found bounded, so they render in-process.
//!
//! The sandbox (`sandbox.rs`) exists because a template is code from a model file. A template
//! whose exact bytes a person has read is not unknown code: when it only loops over `messages`
//! and concatenates their fields (no recursion, no loop over a computed range, no string
//! repetition), a render's time and memory are linear in the request, which the HTTP body limit
//! already bounds, and minijinja's fuel still applies. Those templates skip the round trip to
//! a child process (about 0.1–0.2 ms per request on the gateway's core, see
//! `docs/upstreams.md`). A template is recognised by the BLAKE3 digest of its source, so one
//! changed byte sends it back to the sandbox. Operators add the digests of templates they have
//! reviewed with `--trust-template` (the log prints each template's digest at start).

/// A template source that was read and found bounded.
#[derive(Debug, Clone, Copy)]
pub struct Reviewed {
    /// Which models ship it.
    pub name: &'static str,
    /// BLAKE3 of the template source, lowercase hex.
    pub digest: &'static str,
}

/// Reviewed here. Each entry: one `for message in messages` loop, field concatenation, an
/// optional generation prompt — nothing whose cost grows faster than the messages.
pub const REVIEWED: &[Reviewed] = &[Reviewed {
    name: "SmolLM2-*-Instruct (ChatML with a default system turn)",
    digest: "2ff3b438de276e44f744a575e323cd7c32a47e72d91baf30d965df0c307af35b",
}];

/// The digest `--trust-template` takes for `source`.
pub fn template_digest(source: &str) -> String {
    blake3::hash(source.as_bytes()).to_hex().to_string()
}

/// The name a reviewed template is known by, or `"operator-trusted"` when only `trusted`
/// (the operator's digests) holds it; `None` renders in the sandbox.
pub(crate) fn trusted_name<'a>(digest: &str, trusted: &'a [String]) -> Option<&'a str> {
    if let Some(r) = REVIEWED.iter().find(|r| r.digest == digest) {
        return Some(r.name);
    }
    trusted.iter().any(|d| d.eq_ignore_ascii_case(digest)).then_some("operator-trusted")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source of SmolLM2-135M-Instruct's `tokenizer.chat_template`, as its GGUF holds it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn the_default_models_template_is_reviewed_and_one_changed_byte_is_not() {
        let digest = template_digest(SMOLLM2);
        assert_eq!(digest.len(), 64);
        assert!(trusted_name(&digest, &[]).is_some(), "digest {digest}");
        let changed = SMOLLM2.replacen("helpful", "helpfull", 1);
        assert!(trusted_name(&template_digest(&changed), &[]).is_none());
    }

    #[test]
    fn an_operator_digest_is_trusted_in_either_case() {
        let src = "{{ messages[0]['content'] }}";
        let digest = template_digest(src);
        assert!(trusted_name(&digest, &[]).is_none());
        assert_eq!(trusted_name(&digest, &[digest.to_uppercase()]), Some("operator-trusted"));
    }
}
