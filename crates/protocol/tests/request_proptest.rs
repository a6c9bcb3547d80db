//! Property tests for request parsing, mirroring the `chat_request` fuzz target on structured
//! input: bodies built from the real parameter names with values of random JSON shape must parse
//! and validate without panicking, fail only with a typed `InvalidRequest`, and an accepted
//! request must survive a serialize/parse round trip unchanged.

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use tokenpath_protocol::{parse_chat_request, parse_completion_request, Limits, ProtocolError};

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-10i64..300).prop_map(Value::from),
        (-3.0f64..3.0).prop_map(Value::from),
        "[a-z ]{0,6}".prop_map(Value::from),
        Just(json!("text")),
        Just(json!({"type": "text", "text": "hi"})),
        Just(json!({"role": "user", "content": "hi"})),
        Just(json!({"include_usage": true})),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

const KEYS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "echo",
    "suffix",
    "best_of",
    "ignore_eos",
    "metadata",
    "store",
    "modalities",
    "bogus",
];

fn body() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec((proptest::sample::select(KEYS), value()), 0..8).prop_map(|kv| {
        let mut obj = Map::new();
        obj.insert("model".into(), json!("m"));
        obj.insert("messages".into(), json!([{"role": "user", "content": "x"}]));
        obj.insert("prompt".into(), json!("x"));
        for (k, v) in kv {
            obj.insert(k.to_owned(), v);
        }
        serde_json::to_vec(&Value::Object(obj)).unwrap_or_default()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn random_bodies_parse_validate_and_round_trip(body in body()) {
        let limits = Limits::default();
        match parse_chat_request(&body) {
            Ok(req) => {
                let again = parse_chat_request(&serde_json::to_vec(&req).unwrap()).unwrap();
                prop_assert_eq!(&again, &req);
                if let Err(e) = req.validate(&limits) {
                    let is_invalid = matches!(e, ProtocolError::InvalidRequest { .. });
                    prop_assert!(is_invalid);
                }
            }
            Err(e) => prop_assert!(matches!(e, ProtocolError::InvalidRequest { .. }), "{}", e),
        }
        // `messages` is an unknown field for completions, so strip it to reach validation too.
        let mut v: Value = serde_json::from_slice(&body).unwrap();
        v.as_object_mut().unwrap().remove("messages");
        match parse_completion_request(&serde_json::to_vec(&v).unwrap()) {
            Ok(req) => {
                let again = parse_completion_request(&serde_json::to_vec(&req).unwrap()).unwrap();
                prop_assert_eq!(&again, &req);
                let _ = req.validate(&limits);
            }
            Err(e) => prop_assert!(matches!(e, ProtocolError::InvalidRequest { .. }), "{}", e),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_chat_request(&bytes).map(|r| r.validate(&Limits::default()));
        let _ = parse_completion_request(&bytes).map(|r| r.validate(&Limits::default()));
    }
}

/// Regression (found by the `chat_request` / `completion_request` fuzz targets): a number past
/// the f32 range became infinity, which re-serialized as `null` (so an accepted request did not
/// round-trip). Now it is refused as the out-of-range number it is.
#[test]
fn numbers_past_the_f32_range_are_refused_not_made_infinite() {
    use tokenpath_protocol::{parse_chat_request, parse_completion_request, ProtocolError};
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":-1e39}"#;
    assert!(matches!(parse_chat_request(chat), Err(ProtocolError::InvalidRequest { .. })));
    for field in ["temperature", "top_p", "presence_penalty", "frequency_penalty"] {
        let body = format!(r#"{{"model":"m","prompt":"x","{field}":1e39}}"#);
        assert!(
            matches!(parse_completion_request(body.as_bytes()), Err(ProtocolError::InvalidRequest { .. })),
            "{field}"
        );
        let ok = format!(r#"{{"model":"m","prompt":"x","{field}":0.5}}"#);
        assert!(parse_completion_request(ok.as_bytes()).is_ok(), "{field}");
    }
}
