//! Building the tokenizer and chat template from GGUF metadata: the one place that knows which
//! `tokenizer.*` keys exist and which are optional, so the engine, the tests and the parity tools
//! all read a model file the same way.

use super::{ChatTemplate, Tokenizer};
use crate::error::Result;
use crate::gguf::GgufIndex;

/// The tokenizer described by `tokenizer.ggml.*`.
pub fn tokenizer_from_gguf(g: &GgufIndex) -> Result<Tokenizer> {
    Tokenizer::check_model(g.get_str("tokenizer.ggml.model")?)?;
    let opt_u32 = |k: &str| if g.contains(k) { g.get_u32(k).map(Some) } else { Ok(None) };
    let opt_bool = |k: &str| if g.contains(k) { g.get_bool(k).map(Some) } else { Ok(None) };
    let types_key = "tokenizer.ggml.token_type";
    let merges_key = "tokenizer.ggml.merges";
    let pre_key = "tokenizer.ggml.pre";
    Ok(Tokenizer::from_gguf_parts(
        g.get_str_array("tokenizer.ggml.tokens")?.to_vec(),
        if g.contains(types_key) { g.get_i32_array(types_key)?.into_owned() } else { Vec::new() },
        if g.contains(merges_key) { g.get_str_array(merges_key)?.to_vec() } else { Vec::new() },
        if g.contains(pre_key) { Some(g.get_str(pre_key)?) } else { None },
        opt_u32("tokenizer.ggml.bos_token_id")?,
        opt_u32("tokenizer.ggml.eos_token_id")?,
        opt_bool("tokenizer.ggml.add_bos_token")?,
        opt_bool("tokenizer.ggml.add_eos_token")?,
    )?)
}

/// The chat template in `tokenizer.chat_template`, if the file has one.
pub fn chat_template_from_gguf(g: &GgufIndex, tok: &Tokenizer) -> Result<Option<ChatTemplate>> {
    let key = "tokenizer.chat_template";
    if !g.contains(key) {
        return Ok(None);
    }
    let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i).ok()).unwrap_or("").to_owned();
    Ok(Some(ChatTemplate::new(g.get_str(key)?, &text_of(tok.bos()), &text_of(tok.eos()))?))
}
