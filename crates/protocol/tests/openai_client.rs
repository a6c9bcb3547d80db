//! Requests exactly as the official `openai` Python client (v1) serializes them — its
//! `json.dumps` spacing, `null` for parameters passed as `None`, every parameter of
//! `chat.completions.create` and `completions.create` — must parse and validate; every rejection
//! must name its parameter. Kept apart from the modules because it is the compatibility contract.

use serde_json::json;
use tokenpath_protocol::*;

fn chat(body: &str) -> Result<GenerationRequest, ProtocolError> {
    parse_chat_request(body.as_bytes())?.validate(&Limits::default())
}

fn completion(body: &str) -> Result<GenerationRequest, ProtocolError> {
    parse_completion_request(body.as_bytes())?.validate(&Limits::default())
}

fn param(r: Result<GenerationRequest, ProtocolError>) -> String {
    match r {
        Err(ProtocolError::InvalidRequest { param, .. }) => param.unwrap_or_default(),
        other => panic!("expected an invalid request, got {other:?}"),
    }
}

/// Every parameter of `client.chat.completions.create` (openai-python 1.x/2.x), as `null`.
const CHAT_PARAMS: &[&str] = &[
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
];

const COMPLETION_PARAMS: &[&str] = &[
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
];

#[test]
fn chat_as_the_python_client_sends_it() {
    let body = r#"{"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], "model": "smollm2"}"#;
    let r = chat(body).unwrap();
    assert_eq!(r.model, "smollm2");
    assert_eq!(r.params, GenerationParams::default());
    let Prompt::Chat(m) = &r.prompt else { panic!() };
    assert_eq!(m[1], PromptMessage { role: Role::User, content: "Hi".into(), name: None });

    let streaming = r#"{"messages": [{"role": "user", "content": "Hi"}], "model": "smollm2", "max_completion_tokens": 64, "seed": 7, "stream": true, "stream_options": {"include_usage": true}, "temperature": 0.0, "ignore_eos": true}"#;
    let p = chat(streaming).unwrap().params;
    assert!(p.stream && p.include_usage && p.ignore_eos);
    assert_eq!((p.max_tokens, p.temperature, p.seed), (Some(64), 0.0, Some(7)));
}

#[test]
fn every_chat_parameter_of_the_client_is_accepted_as_null() {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    for p in CHAT_PARAMS {
        body[p] = serde_json::Value::Null;
    }
    let r = chat(&body.to_string()).unwrap();
    assert_eq!(r.params, GenerationParams::default());
}

#[test]
fn every_chat_parameter_is_accepted_with_a_no_op_value() {
    let body = json!({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ops"}],
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {}, "logprobs": false,
        "top_logprobs": 0, "max_tokens": 10, "metadata": {"k": "v"}, "modalities": ["text"], "n": 1,
        "parallel_tool_calls": true, "prompt_cache_key": "k", "response_format": {"type": "text"},
        "safety_identifier": "s", "seed": -3, "service_tier": "auto", "stop": ["\n"], "store": false,
        "stream": true, "stream_options": {"include_usage": false, "include_obfuscation": false},
        "temperature": 2, "tool_choice": "none", "tools": [], "top_p": 0.9, "user": "u-1",
    });
    let r = chat(&body.to_string()).unwrap();
    let Prompt::Chat(m) = &r.prompt else { panic!() };
    assert_eq!(m[0].content, "a\nb");
    assert_eq!(m[0].role, Role::Developer);
    assert_eq!(m[0].name.as_deref(), Some("ops"));
    assert_eq!(r.user.as_deref(), Some("u-1"));
    assert_eq!(r.params.stop, ["\n"]);
    assert_eq!(r.params.max_tokens, Some(10));
}

#[test]
fn replayed_assistant_message_from_model_dump_is_accepted() {
    // `response.choices[0].message.model_dump()` sent back as history.
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "Hi"},
        {"content": "Hello!", "refusal": null, "role": "assistant", "annotations": [], "audio": null,
         "function_call": null, "tool_calls": null},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "And?"}]});
    let r = chat(&body.to_string()).unwrap();
    let Prompt::Chat(m) = r.prompt else { panic!() };
    assert_eq!(
        m.iter().map(|m| m.role).collect::<Vec<_>>(),
        [Role::User, Role::Assistant, Role::Tool, Role::User]
    );
}

#[test]
fn completions_as_the_python_client_sends_them() {
    let r = completion(r#"{"model": "smollm2", "prompt": "Once upon a time"}"#).unwrap();
    assert_eq!(r.prompt, Prompt::Text("Once upon a time".into()));
    assert_eq!(r.params.max_tokens, Some(COMPLETIONS_DEFAULT_MAX_TOKENS));
    let s = r#"{"model": "smollm2", "prompt": [1, 2, 3], "max_tokens": 128, "stream": true, "stream_options": {"include_usage": true}, "temperature": 0, "ignore_eos": true}"#;
    let r = completion(s).unwrap();
    assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
    assert!(r.params.stream && r.params.include_usage);
    assert_eq!(
        completion(r#"{"model": "m", "prompt": ["one"]}"#).unwrap().prompt,
        Prompt::Text("one".into())
    );
    assert_eq!(
        completion(r#"{"model": "m", "prompt": [[5, 6]]}"#).unwrap().prompt,
        Prompt::Tokens(vec![5, 6])
    );

    let mut body = json!({"model": "m", "prompt": "x"});
    for p in COMPLETION_PARAMS {
        body[p] = serde_json::Value::Null;
    }
    completion(&body.to_string()).unwrap();
    let noop = json!({"model": "m", "prompt": "x", "best_of": 1, "echo": false, "suffix": "", "n": 1,
        "logit_bias": {}, "stop": "END", "seed": 1, "user": "u", "frequency_penalty": 0, "presence_penalty": 0, "top_p": 1});
    assert_eq!(completion(&noop.to_string()).unwrap().params.stop, ["END"]);
}

#[test]
fn unknown_fields_are_rejected_like_openai() {
    let e = chat(r#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_token": 5}"#)
        .unwrap_err();
    assert!(e.to_string().starts_with("Unrecognized request argument supplied: max_token"), "{e}");
    assert_eq!(param(Err(e)), "max_token");
    let e = chat(r#"{"model": "m", "messages": [{"role": "user", "content": "x", "extra": 1}]}"#);
    assert_eq!(param(e), "extra");
    assert_eq!(param(completion(r#"{"model": "m", "prompt": "x", "top_k": 5}"#)), "top_k");
    assert_eq!(
        param(chat(r#"{"model": "m", "messages": [], "stream_options": {"continuous_usage_stats": true}}"#)),
        "continuous_usage_stats"
    );
}

#[test]
fn malformed_bodies_are_invalid_requests_with_position() {
    for (body, needle) in [
        ("{", "line 1"),
        ("not json", "could not parse"),
        (r#"{"model": "m", "messages": "hi"}"#, "invalid type"),
        (r#"{"model": "m", "messages": [{"role": "robot", "content": "x"}]}"#, "unknown variant `robot`"),
        (r#"{"model": "m", "messages": [], "temperature": "hot"}"#, "column"),
        (
            r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
            "Missing required parameter: 'text'",
        ),
    ] {
        let e = parse_chat_request(body.as_bytes()).unwrap_err();
        assert!(matches!(e, ProtocolError::InvalidRequest { .. }), "{body}");
        assert!(e.to_string().contains(needle), "{body}: {e}");
    }
    assert_eq!(param(chat(r#"{"messages": []}"#)), "model");
    let e = parse_completion_request(br#"{"model": "m", "prompt": [1, "a"]}"#).unwrap_err();
    assert!(e.to_string().contains("must not mix"), "{e}");
    assert!(parse_completion_request(br#"{"model": "m", "prompt": [1.5]}"#).is_err());
    assert!(parse_completion_request(br#"{"model": "m", "prompt": {}}"#).is_err());
}

#[test]
fn every_chat_validation_error_names_its_param() {
    let base = || json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (json!({"model": ""}), "model"),
        (json!({"messages": []}), "messages"),
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"temperature": -1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"n": 2}), "n"),
        (json!({"n": 0}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": -5}), "max_tokens"),
        (json!({"max_completion_tokens": 100000}), "max_completion_tokens"),
        (json!({"max_tokens": 10, "max_completion_tokens": 20}), "max_tokens"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (json!({"stop": ""}), "stop[0]"),
        (json!({"stream_options": {"include_usage": true}}), "stream_options"),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (json!({"logit_bias": {"50256": -100}}), "logit_bias"),
        (json!({"response_format": {"type": "json_object"}}), "response_format"),
        (json!({"tools": [{"type": "function", "function": {"name": "f"}}]}), "tools"),
        (json!({"tool_choice": "auto"}), "tool_choice"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"function_call": "auto"}), "function_call"),
        (json!({"modalities": ["text", "audio"]}), "modalities"),
        (json!({"audio": {"voice": "alloy", "format": "wav"}}), "audio"),
        (json!({"prediction": {"type": "content", "content": "x"}}), "prediction"),
        (json!({"reasoning_effort": "low"}), "reasoning_effort"),
        (json!({"verbosity": "low"}), "verbosity"),
        (json!({"web_search_options": {}}), "web_search_options"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
            "messages[0].content[0].type",
        ),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
        (
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}]}),
            "messages[1].tool_calls",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": "a", "refusal": "no"}]}),
            "messages[0].refusal",
        ),
    ];
    for (patch, want) in cases {
        let mut body = base();
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = chat(&body.to_string());
        let dbg = format!("{r:?}");
        assert_eq!(param(r), want, "{body} -> {dbg}");
    }
}

#[test]
fn every_completion_validation_error_names_its_param() {
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (json!({"prompt": null}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": [[1], [2]]}), "prompt"),
        (json!({"prompt": [1, -2]}), "prompt[1]"),
        (json!({"prompt": [1, 4294967296u64]}), "prompt[1]"),
        (json!({"echo": true}), "echo"),
        (json!({"logprobs": 1}), "logprobs"),
        (json!({"suffix": "end"}), "suffix"),
        (json!({"best_of": 2}), "best_of"),
        (json!({"best_of": 0}), "best_of"),
        (json!({"n": 3}), "n"),
        (json!({"logit_bias": {"1": 2}}), "logit_bias"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"temperature": 9}), "temperature"),
        (json!({"stop": ["x", ""]}), "stop[1]"),
    ];
    for (patch, want) in cases {
        let mut body = json!({"model": "m", "prompt": "hello"});
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = completion(&body.to_string());
        let dbg = format!("{r:?}");
        assert_eq!(param(r), want, "{body} -> {dbg}");
    }
}

#[test]
fn unsupported_features_say_not_supported() {
    let e = chat(r#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true}"#)
        .unwrap_err();
    assert_eq!(e.to_string(), "Invalid 'logprobs': logprobs are not supported by this server.");
    let e = completion(r#"{"model": "m", "prompt": "x", "echo": true}"#).unwrap_err();
    assert!(e.to_string().contains("not supported"), "{e}");
    let api = e.api_error();
    assert_eq!(api.kind, ErrorKind::InvalidRequest);
    assert_eq!(api.body.error.param.as_deref(), Some("echo"));
}

#[test]
fn max_tokens_cap_is_configurable() {
    let body = br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 300}"#;
    let req = parse_chat_request(body).unwrap();
    assert!(req.validate(&Limits { max_tokens_cap: 256 }).is_err());
    assert_eq!(req.validate(&Limits { max_tokens_cap: 300 }).unwrap().params.max_tokens, Some(300));
}

#[test]
fn requests_round_trip_through_serde() {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        "stop": ["a"], "stream": true, "stream_options": {"include_usage": true}, "temperature": 0.5});
    let req = parse_chat_request(body.to_string().as_bytes()).unwrap();
    let again = parse_chat_request(serde_json::to_string(&req).unwrap().as_bytes()).unwrap();
    assert_eq!(again, req);
    let creq = parse_completion_request(br#"{"model": "m", "prompt": [[1, 2]], "stop": "x"}"#).unwrap();
    let again = parse_completion_request(serde_json::to_string(&creq).unwrap().as_bytes()).unwrap();
    assert_eq!(again, creq);
}

/// What SGLang's gateway and vllm-router forward (their recorded bodies' extra fields): accepted
/// at those values, so tokenpath serves behind them; a value that would change the output is
/// refused by name.
#[test]
fn the_routers_extra_fields_are_accepted_at_their_defaults() {
    let extra = r#""no_stop_trim": false, "ignore_eos": false, "continue_final_message": false,
        "skip_special_tokens": true, "separate_reasoning": true, "stream_reasoning": true,
        "return_hidden_states": false, "include_reasoning": true, "logprobs": false"#;
    let chat_body = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "max_completion_tokens": 3, {extra}}}"#
    );
    chat(&chat_body).unwrap();
    let completion_body =
        format!(r#"{{"model": "m", "prompt": "hi", {}}}"#, extra.replace(r#", "logprobs": false"#, ""));
    completion(&completion_body).unwrap();
    for (field, value) in [
        ("no_stop_trim", "true"),
        ("continue_final_message", "true"),
        ("skip_special_tokens", "false"),
        ("return_hidden_states", "true"),
    ] {
        let body = format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}"#
        );
        assert_eq!(param(chat(&body)), field);
        let body = format!(r#"{{"model": "m", "prompt": "hi", "{field}": {value}}}"#);
        assert_eq!(param(completion(&body)), field);
    }
}
