//! Small serde building blocks shared by the request and response types: "string or array"
//! fields (OpenAI's `stop`, message `content`, completion `prompt`) and the mapping of serde_json
//! errors to [`ProtocolError::InvalidRequest`].
//!
//! The polymorphic fields get hand-written visitors rather than `#[serde(untagged)]`: an untagged
//! enum reports every mismatch as "data did not match any variant", which tells a client nothing,
//! while a visitor keeps serde_json's own message and its line/column.

use crate::ProtocolError;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use std::fmt;

/// Deserializes a JSON string or an array of JSON strings as a `Vec<String>`.
pub(crate) fn string_or_strings<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string or an array of strings")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(vec![v.to_owned()])
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok(vec![v])
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = seq.next_element::<String>()? {
                out.push(s);
            }
            Ok(out)
        }
    }
    d.deserialize_any(V)
}

/// [`string_or_strings`] for an optional field; `null` is `None`.
pub(crate) fn opt_string_or_strings<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<String>>, D::Error> {
    // `"stop": null` reaches a `deserialize_with` function too, so it handles null itself.
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<Vec<String>>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("null, a string or an array of strings")
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            string_or_strings(d).map(Some)
        }
    }
    d.deserialize_option(V)
}

/// An optional number that must fit an `f32` as a finite value: `1e39` would become infinity
/// (and re-serialize as `null`), so it is refused as the out-of-range number it is.
pub(crate) fn opt_finite_f32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
    let v: Option<f64> = serde::Deserialize::deserialize(d)?;
    v.map(check_f32::<D::Error>).transpose()
}

/// [`opt_finite_f32`] for a number that must be there (the worker protocol's sampling fields).
pub(crate) fn finite_f32<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    check_f32(serde::Deserialize::deserialize(d)?)
}

fn check_f32<E: de::Error>(x: f64) -> Result<f32, E> {
    if x.is_finite() && x.abs() <= f64::from(f32::MAX) {
        Ok(x as f32)
    } else {
        Err(E::custom(format!("{x} is not a finite 32-bit number")))
    }
}

/// Deserializes an optional error `code`: OpenAI sends a string, older vLLM an integer (the HTTP
/// status). Both become a string so a bench can report either.
pub(crate) fn lenient_code<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let v = <serde_json::Value as serde::Deserialize>::deserialize(d)?;
    Ok(match v {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) => Some(s),
        other => Some(other.to_string()),
    })
}

/// Maps a serde_json error from parsing a request body to an OpenAI-style invalid request.
///
/// Unknown fields (`deny_unknown_fields`) and missing fields are reworded to OpenAI's messages
/// ("Unrecognized request argument supplied: foo", "Missing required parameter: 'model'") with the
/// field as `param`; everything else keeps serde_json's message with its line and column.
pub(crate) fn request_json_error(e: &serde_json::Error) -> ProtocolError {
    let text = e.to_string();
    let at =
        if e.line() > 0 { format!(" (line {}, column {})", e.line(), e.column()) } else { String::new() };
    if let Some(name) = backticked_after(&text, "unknown field `") {
        return ProtocolError::InvalidRequest {
            param: Some(name.to_owned()),
            message: format!("Unrecognized request argument supplied: {name}{at}"),
        };
    }
    if let Some(name) = backticked_after(&text, "missing field `") {
        return ProtocolError::InvalidRequest {
            param: Some(name.to_owned()),
            message: format!("Missing required parameter: '{name}'{at}"),
        };
    }
    let message = match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            format!("We could not parse the JSON body of your request: {text}")
        }
        _ => format!("Invalid request body: {text}"),
    };
    ProtocolError::InvalidRequest { param: None, message }
}

/// `foo` from "<prefix>foo`..." when `text` starts with `prefix`.
fn backticked_after<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = text.strip_prefix(prefix)?;
    rest.find('`').map(|end| &rest[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct S {
        #[serde(default, deserialize_with = "opt_strings")]
        stop: Option<Vec<String>>,
        #[allow(dead_code)]
        model: String,
    }

    fn opt_strings<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
        string_or_strings(d).map(Some)
    }

    #[test]
    fn string_or_array() {
        let s: S = serde_json::from_str(r#"{"model":"m","stop":"x"}"#).unwrap();
        assert_eq!(s.stop, Some(vec!["x".to_owned()]));
        let s: S = serde_json::from_str(r#"{"model":"m","stop":["a","b"]}"#).unwrap();
        assert_eq!(s.stop, Some(vec!["a".to_owned(), "b".to_owned()]));
        let e = serde_json::from_str::<S>(r#"{"model":"m","stop":[1]}"#).unwrap_err();
        assert!(e.to_string().contains("expected a string"), "{e}");
    }

    #[test]
    fn unknown_and_missing_fields_use_openai_wording() {
        let e = serde_json::from_str::<S>(r#"{"model":"m","foo":1}"#).unwrap_err();
        let ProtocolError::InvalidRequest { param, message } = request_json_error(&e) else {
            panic!("wrong variant")
        };
        assert_eq!(param.as_deref(), Some("foo"));
        assert!(message.starts_with("Unrecognized request argument supplied: foo (line 1"), "{message}");
        let e = serde_json::from_str::<S>(r#"{}"#).unwrap_err();
        let ProtocolError::InvalidRequest { param, message } = request_json_error(&e) else {
            panic!("wrong variant")
        };
        assert_eq!(param.as_deref(), Some("model"));
        assert!(message.starts_with("Missing required parameter: 'model'"), "{message}");
        let e = serde_json::from_str::<S>(r#"{"model": "#).unwrap_err();
        assert!(request_json_error(&e).to_string().contains("could not parse the JSON"));
    }
}
