//! Chat templates: render the GGUF `tokenizer.chat_template` (HF Jinja) with minijinja.
//!
//! Model chat templates are written for Python's Jinja2 as HF `apply_chat_template` runs it:
//! `trim_blocks` + `lstrip_blocks`, a `raise_exception` function, `bos_token`/`eos_token`
//! variables, and Python string/dict methods called on values (`content.strip()`,
//! `msg.get('x')`, `d.items()`) and HF's `tojson` (Python `json.dumps`, keys in insertion
//! order, no HTML escaping). minijinja is Jinja2-compatible but has neither, so `pycompat.rs`
//! supplies them (rather than pulling in minijinja-contrib). The template is compiled once;
//! broken templates fail at `new` with `TemplateSyntax`, runtime failures (including
//! `raise_exception`) with `TemplateRender`. When the binary installed a sandbox
//! (`sandbox.rs`), renders run in child processes, because a template is untrusted code — except the
//! templates `reviewed.rs` recognises by digest.

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

use super::pycompat::{self, python_method, tojson};
use super::reviewed;
use super::sandbox::{self, Init, Sandbox};
use super::TokenizerError;
use tokenpath_protocol::PromptMessage;

const NAME: &str = "chat_template";

/// Most template instructions one render may run (minijinja's fuel).
pub const TEMPLATE_FUEL: u64 = 2_000_000;

/// A compiled chat template plus the BOS/EOS texts it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where renders run when the process installed a sandbox and the template is not
    /// a reviewed one.
    sandbox: Option<Sandbox>,
    /// BLAKE3 of the source (what `--trust-template` takes).
    digest: String,
    /// The reviewed template's render written out in Rust (`reviewed.rs`), used instead of
    /// the interpreter.
    native: Option<reviewed::Native>,
}

impl ChatTemplate {
    /// Compiles `source` (the `tokenizer.chat_template` value). `bos_token`/`eos_token` are
    /// the texts of the BOS/EOS tokens ("" when the vocabulary has none). With a sandbox
    /// installed, renders will run in its children.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TokenizerError> {
        let init = Init { source: source.into(), bos_token: bos_token.into(), eos_token: eos_token.into() };
        let mut t = Self::in_process(&init)?;
        if let Some(program) = sandbox::installed() {
            match reviewed::trusted_name(&t.digest, &program.trusted) {
                Some(name) => tracing::info!("chat template {} ({name}) renders in-process", t.digest),
                None => {
                    tracing::info!(
                        "chat template {} renders in a sandbox (--trust-template {0} renders it in-process)",
                        t.digest
                    );
                    t.sandbox = Some(Sandbox::new(program, init));
                }
            }
        }
        Ok(t)
    }

    /// BLAKE3 of the template source, lowercase hex.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Whether renders run in sandbox children (an installed sandbox and a template that is
    /// neither reviewed nor trusted by the operator).
    pub fn sandboxed(&self) -> bool {
        self.sandbox.is_some()
    }

    /// Compiles for rendering in this process (what a sandbox child does).
    pub(crate) fn in_process(init: &Init) -> Result<Self, TokenizerError> {
        let Init { source, bos_token, eos_token } = init;
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_unknown_method_callback(python_method);
        env.add_filter("tojson", tojson);
        env.add_filter("format", pycompat::format);
        // A render is a few instructions per message; a template with nested loops over
        // `range(100000)` runs out instead of pinning a core (the error names the fuel).
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TokenizerError::TemplateSyntax(describe(&e)))?;
        let digest = reviewed::template_digest(source);
        let native = reviewed::native(&digest);
        Ok(Self {
            env,
            bos_token: bos_token.clone(),
            eos_token: eos_token.clone(),
            sandbox: None,
            digest,
            native,
        })
    }

    /// `source` rendered by the interpreter always, even when it has a native render (what
    /// the native renders are tested against).
    #[cfg(test)]
    pub(crate) fn interpreted(source: &str, bos_token: &str, eos_token: &str) -> Self {
        let init = Init { source: source.into(), bos_token: bos_token.into(), eos_token: eos_token.into() };
        Self { native: None, ..Self::in_process(&init).expect("the template compiles") }
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends the opening of
    /// the assistant turn.
    pub fn render(
        &self,
        messages: &[PromptMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        if let Some(render) = self.native {
            let mut out =
                String::with_capacity(messages.iter().map(|m| m.content.len() + 32).sum::<usize>() + 128);
            render(messages, add_generation_prompt, &mut out);
            return Ok(out);
        }
        if self.sandbox.is_none() {
            // In-process: the messages go to the template as they are, not through a JSON tree
            // and its copy (what `render_json` needs for the sandbox's wire).
            #[derive(serde::Serialize)]
            struct Message<'a> {
                role: &'a str,
                content: &'a str,
            }
            let msgs: Vec<Message<'_>> =
                messages.iter().map(|m| Message { role: m.role.as_str(), content: &m.content }).collect();
            return self.render_value(Value::from_serialize(&msgs), add_generation_prompt, None);
        }
        let msgs: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role.as_str(), "content": m.content}))
            .collect();
        self.render_json(&serde_json::Value::Array(msgs), add_generation_prompt, &serde_json::Map::new())
    }

    /// Renders arbitrary JSON messages (e.g. with `tool_calls`), with extra top-level
    /// variables (`tools`, `date_string`, ...).
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        match &self.sandbox {
            Some(sandbox) => sandbox.render(messages, add_generation_prompt, extra),
            None => self.render_here(messages, add_generation_prompt, extra),
        }
    }

    /// Renders in this thread, under fuel and the `pycompat` work budget.
    pub(crate) fn render_here(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        self.render_value(Value::from_serialize(messages), add_generation_prompt, Some(extra))
    }

    /// Renders `messages` (already a template value) with the extra top-level variables.
    fn render_value(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TokenizerError> {
        pycompat::reset_work_budget();
        let fixed = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        // The fixed variables win over an extra one of the same name, as they always have.
        let ctx = match extra {
            Some(extra) if !extra.is_empty() => {
                minijinja::context! { ..fixed, ..Value::from_serialize(extra) }
            }
            _ => fixed,
        };
        let tmpl = self.env.get_template(NAME).map_err(|e| TokenizerError::TemplateRender(describe(&e)))?;
        tmpl.render(ctx).map_err(|e| TokenizerError::TemplateRender(describe(&e)))
    }
}

fn describe(e: &Error) -> String {
    match (e.line(), e.detail()) {
        (Some(line), Some(d)) => format!("{} (line {line}): {d}", e.kind()),
        (Some(line), None) => format!("{e} (line {line})"),
        _ => e.to_string(),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {msg}")))
}

/// `strftime_now(fmt)` as HF passes it (Llama 3.x templates), in UTC; supports
/// `%d %m %Y %y %b %B %H %M %S %j %%`.
fn strftime_now(fmt: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(&fmt, secs)
}

pub(crate) fn strftime(fmt: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (unix_secs / 86_400) as i64;
    let sod = unix_secs % 86_400;
    // Civil-from-days (H. Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('H') => out.push_str(&format!("{:02}", sod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", sod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", sod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_protocol::Role;

    const CHATML: &str = r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders() {
        let t = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").expect("compiles");
        let out = t.render(&[PromptMessage::new(Role::User, "hi")], true).expect("renders");
        assert_eq!(out, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let src = "{% for m in messages %}{% if m.role not in ['user'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}[{{ m.content.strip() }}|{{ m.content.split()|length }}|{{ m.get('x', 'd') }}|{{ m.content.startswith((' a', 'q')) }}]{% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        assert_eq!(
            t.render(&[PromptMessage::new(Role::User, " a b ")], false).expect("renders"),
            "[a b|2|d|True]"
        );
        let err = t.render(&[PromptMessage::new(Role::Tool, "x")], false).expect_err("raises");
        assert!(matches!(err, TokenizerError::TemplateRender(ref m) if m.contains("bad role tool")), "{err}");
    }

    #[test]
    fn broken_template_is_a_typed_error() {
        assert!(matches!(
            ChatTemplate::new("{% for x in %}", "", ""),
            Err(TokenizerError::TemplateSyntax(_))
        ));
    }

    #[test]
    fn strftime_formats() {
        // 2024-02-29 13:05:09 UTC
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %j %B %%", 1_709_211_909),
            "29 Feb 2024 13:05:09 060 February %"
        );
    }
}
