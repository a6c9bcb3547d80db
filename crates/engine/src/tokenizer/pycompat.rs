//! Python-isms for chat templates: the `str`/`dict` methods and the `tojson` filter that HF
//! chat templates assume, as `ChatTemplate` installs them into minijinja.
//!
//! Templates are written against Python Jinja2 as HF `apply_chat_template` configures it, so
//! they call Python methods on values (`content.strip()`, `m.get('k', d)`, `tool.items()`) and
//! expect HF's `tojson`, which is `json.dumps(x, ensure_ascii=False)`: `", "`/`": "`
//! separators, keys in insertion order, no HTML escaping (Jinja2's and minijinja's built-in
//! `tojson` escape `<>&'` and compact the output, which would change prompts). Kept apart from
//! `chat.rs` so the rendering API stays small and readable.

use std::cell::Cell;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

/// Bytes the methods below may read and write in one render. Fuel counts instructions, so
/// without this a template could call `big.count('a')` or `big.replace('', big)` a million
/// times within its fuel and pin a core for minutes or build gigabytes.
pub(crate) const WORK_BUDGET: usize = 256 << 20;

thread_local! {
    static WORK: Cell<usize> = const { Cell::new(0) };
}

/// Starts a render's budget (one render runs on one thread).
pub(crate) fn reset_work_budget() {
    WORK.with(|w| w.set(0));
}

fn charge(bytes: usize) -> Result<(), Error> {
    WORK.with(|w| {
        let used = w.get().saturating_add(bytes);
        w.set(used);
        if used > WORK_BUDGET {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("the template's string methods went over their budget of {WORK_BUDGET} bytes"),
            ))
        } else {
            Ok(())
        }
    })
}

/// Length of `s.replace(from, to)` without building it (Python: "" matches between chars too).
fn replaced_len(s: &str, from: &str, to: &str) -> usize {
    let n = if from.is_empty() { s.chars().count() + 1 } else { s.matches(from).count() };
    (s.len() - n.saturating_mul(from.len()).min(s.len())).saturating_add(n.saturating_mul(to.len()))
}

fn str_arg(args: &[Value], i: usize) -> Result<Option<&str>, Error> {
    match args.get(i) {
        None => Ok(None),
        Some(v) if v.is_none() || v.is_undefined() => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "expected a string argument")),
    }
}

/// Python methods on strings and dicts that HF templates call.
pub(crate) fn python_method(
    _state: &State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let arg_bytes: usize = args.iter().filter_map(Value::as_str).map(str::len).sum();
        charge(s.len().saturating_add(arg_bytes))?;
        // Only string-argument methods read this; startswith/endswith/join take other types.
        let chars =
            if matches!(method, "startswith" | "endswith" | "join") { None } else { str_arg(args, 0)? };
        let strip_set = |c: char| chars.map_or(c.is_whitespace(), |set| set.contains(c));
        return Ok(match method {
            "strip" => Value::from(s.trim_matches(strip_set)),
            "lstrip" => Value::from(s.trim_start_matches(strip_set)),
            "rstrip" => Value::from(s.trim_end_matches(strip_set)),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "title" => Value::from(title(s)),
            "capitalize" => {
                let mut cs = s.chars();
                Value::from(
                    cs.next()
                        .map(|f| f.to_uppercase().chain(cs.flat_map(char::to_lowercase)).collect::<String>())
                        .unwrap_or_default(),
                )
            }
            "startswith" => Value::from(prefix_args(args)?.iter().any(|p| s.starts_with(p.as_str()))),
            "endswith" => Value::from(prefix_args(args)?.iter().any(|p| s.ends_with(p.as_str()))),
            "replace" => {
                let (Some(from), Some(to)) = (str_arg(args, 0)?, str_arg(args, 1)?) else {
                    return Err(Error::new(ErrorKind::MissingArgument, "replace(old, new)"));
                };
                charge(replaced_len(s, from, to))?;
                Value::from(s.replace(from, to))
            }
            "split" => {
                let parts: Vec<Value> = match chars {
                    None => s.split_whitespace().map(Value::from).collect(),
                    Some("") => return Err(Error::new(ErrorKind::InvalidOperation, "empty separator")),
                    Some(sep) => s.split(sep).map(Value::from).collect(),
                };
                Value::from(parts)
            }
            "find" => {
                Value::from(chars.and_then(|n| s.find(n)).map_or(-1, |b| s[..b].chars().count() as i64))
            }
            "count" => Value::from(chars.map_or(0, |n| {
                if n.is_empty() {
                    s.chars().count() + 1
                } else {
                    s.matches(n).count()
                }
            })),
            "isdigit" => Value::from(!s.is_empty() && s.chars().all(|c| c.is_ascii_digit())),
            "join" => {
                let items =
                    args.first().ok_or_else(|| Error::new(ErrorKind::MissingArgument, "join(iterable)"))?;
                let mut parts = Vec::new();
                for v in items.try_iter()? {
                    let text = v.to_string();
                    charge(text.len().saturating_add(s.len()))?;
                    parts.push(text);
                }
                Value::from(parts.join(s))
            }
            "format" => return Err(Error::new(ErrorKind::UnknownMethod, "str.format is not supported")),
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => {
                let mut items = Vec::new();
                for k in value.try_iter()? {
                    let v = value.get_item(&k)?;
                    items.push(Value::from(vec![k, v]));
                }
                Ok(Value::from(items))
            }
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => {
                let vals: Result<Vec<_>, _> = value.try_iter()?.map(|k| value.get_item(&k)).collect();
                Ok(Value::from(vals?))
            }
            "get" => {
                let key = args.first().ok_or_else(|| Error::new(ErrorKind::MissingArgument, "get(key)"))?;
                let v = value.get_item(key)?;
                Ok(if v.is_undefined() { args.get(1).cloned().unwrap_or(Value::from(())) } else { v })
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        };
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

/// `startswith`/`endswith` accept a string or a tuple (list) of strings.
fn prefix_args(args: &[Value]) -> Result<Vec<String>, Error> {
    let first = args.first().ok_or_else(|| Error::new(ErrorKind::MissingArgument, "expected a prefix"))?;
    if let Some(s) = first.as_str() {
        return Ok(vec![s.to_string()]);
    }
    Ok(first.try_iter()?.map(|v| v.as_str().unwrap_or_default().to_string()).collect())
}

fn title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_cased = c.is_alphabetic();
    }
    out
}

/// Widest field a printf-style `format` may ask for (`%5000000000d` would allocate petabytes:
/// found by the chat_template fuzz target, an abort in-process).
pub(crate) const MAX_FORMAT_WIDTH: u64 = 4096;

/// The `format` filter (`"%s: %d"|format(a, b)`), refusing widths and precisions past
/// [`MAX_FORMAT_WIDTH`] before minijinja's own implementation allocates them.
pub(crate) fn format(spec: &str, args: minijinja::value::Rest<Value>) -> Result<Value, Error> {
    let mut digits: u64 = 0;
    let mut in_spec = false;
    for c in spec.chars() {
        match c {
            '%' => {
                in_spec = !in_spec;
                digits = 0;
            }
            '0'..='9' if in_spec => {
                digits = digits.saturating_mul(10).saturating_add(u64::from(c as u8 - b'0'));
                if digits > MAX_FORMAT_WIDTH {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("a format width or precision over {MAX_FORMAT_WIDTH}"),
                    ));
                }
            }
            '.' | '-' | '+' | ' ' | '#' | '(' | ')' if in_spec => digits = 0,
            c if in_spec && c.is_ascii_alphabetic() => in_spec = false,
            _ => {}
        }
    }
    charge(spec.len())?;
    minijinja::format_filter(minijinja::FormatStyle::Printf, spec, &args).map(Value::from)
}

/// HF's `tojson`: `json.dumps(value, ensure_ascii=False, indent=None, sort_keys=False)`;
/// accepts the `indent`, `ensure_ascii` and `sort_keys` keyword arguments.
pub(crate) fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let opts = JsonOpts {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    py_json(&json, &opts, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn py_json(v: &serde_json::Value, o: &JsonOpts, level: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = o.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if o.indent.is_some() { "," } else { ", " };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) => out.push_str(&py_float(f)),
            None => out.push_str(&n.to_string()),
        },
        J::String(s) => py_str(s, o.ensure_ascii, out),
        J::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(item, o, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        J::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &J)> = map.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_str(k, o.ensure_ascii, out);
                out.push_str(": ");
                py_json(val, o, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

/// Python's `repr(float)` as `json.dumps` prints it.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust: "1e20" / "1.5e-5"; Python: "1e+20" / "1.5e-05".
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
        return format!("{mant}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

fn py_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenpath_protocol::{PromptMessage, Role};

    fn dumps(v: serde_json::Value, indent: Option<usize>) -> String {
        let mut out = String::new();
        py_json(&v, &JsonOpts { indent, ensure_ascii: false, sort_keys: false }, 0, &mut out);
        out
    }

    #[test]
    fn replaced_len_matches_replace() {
        for (s, from, to) in
            [("banana", "an", "AN!"), ("", "", "x"), ("héé", "", "--"), ("aaa", "aa", ""), ("ab", "zz", "q")]
        {
            let want = if from.is_empty() {
                // Python semantics: `to` between every char and at both ends.
                let mut out = to.to_string();
                for c in s.chars() {
                    out.push(c);
                    out.push_str(to);
                }
                out.len()
            } else {
                s.replace(from, to).len()
            };
            assert_eq!(replaced_len(s, from, to), want, "{s:?}.replace({from:?}, {to:?})");
        }
    }

    #[test]
    fn string_methods_stop_at_the_work_budget() {
        // Regression (chat_template fuzzing, T3/T4): `a.replace("", a)` five times builds
        // gigabytes and `big.count(..)` in a loop runs for minutes, both inside the fuel.
        let t = super::super::ChatTemplate::new(
            "{% set a = messages[0].content %}{% for i in range(100000) %}{{ a.count('x') }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let big = "x".repeat(1 << 20);
        let e = t.render(&[PromptMessage::new(Role::User, big)], false).unwrap_err();
        assert!(e.to_string().contains("budget"), "{e}");
        let t = super::super::ChatTemplate::new(
            "{% set a = messages[0].content %}{% set a = a.replace('', a) %}{% set a = a.replace('', a) %}{% set a = a.replace('', a) %}{{ a|length }}",
            "",
            "",
        )
        .unwrap();
        let e = t.render(&[PromptMessage::new(Role::User, "y".repeat(100))], false).unwrap_err();
        assert!(e.to_string().contains("budget"), "{e}");
    }

    /// Regression (chat_template fuzz, 2026-12-02): `'%5544455555555555d'|format(1)` asked for a
    /// petabyte allocation and aborted the process.
    #[test]
    fn format_refuses_huge_widths_and_still_formats() {
        let t = |src: &str| super::super::ChatTemplate::new(src, "", "").unwrap().render(&[], false);
        let e = t("{{ '%5544455555555555d'|format(1) }}").unwrap_err();
        assert!(e.to_string().contains("format width"), "{e}");
        assert!(t("{{ '%.99999s'|format('a') }}").is_err());
        assert_eq!(t("{{ '%s=%03d'|format('n', 7) }}").unwrap(), "n=007");
    }

    #[test]
    fn matches_python_json_dumps() {
        let v = serde_json::json!({"b": [1, 2.5, 1e20, 1.0, null], "a": "é<&>\n\"", "e": {}, "f": []});
        assert_eq!(
            dumps(v.clone(), None),
            r#"{"b": [1, 2.5, 1e+20, 1.0, null], "a": "é<&>\n\"", "e": {}, "f": []}"#
        );
        assert_eq!(dumps(serde_json::json!({"k": [1]}), Some(2)), "{\n  \"k\": [\n    1\n  ]\n}");
        assert_eq!(py_float(1.5e-5), "1.5e-05");
    }
}
