//! `tokenpath serve --upstream URL` in front of a real CPU engine — another `tokenpath serve`
//! on the default model — as separate processes: the answer through the gateway is the engine's
//! own, the engine's stages come back marked as the engine's, a field the engine refuses is the
//! engine's 400, and the gateway, which reads only the model file's tokenizer metadata, stays a
//! fraction of the engine's memory.

#![allow(clippy::unwrap_used)]

mod support;

use serde_json::{json, Value};
use support::{default_model, http, serve, vm_hwm_kib};

/// Regression: the gateway learned the upstream's context from `/v1/models` without the
/// upstream's key, so in front of an engine started with an API key it would not start unless
/// told `--max-model-len`.
#[test]
fn the_gateway_learns_the_context_of_an_upstream_that_wants_a_key() {
    let Some(model) = default_model() else { return };
    let engine = serve(&model, &["--api-keys", "ops:sk-upstream-test"]);
    let url = format!("http://127.0.0.1:{}", engine.port);
    let (status, _) = http(engine.port, "GET", "/v1/models", "");
    assert_eq!(status, 401, "the engine wants its key");
    let gateway = serve(&model, &["--upstream", &url, "--upstream-api-key", "sk-upstream-test"]);
    let (status, models) = http(gateway.port, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{models}");
    let n_ctx = serde_json::from_str::<Value>(&models).unwrap()["data"][0]["max_model_len"].as_u64().unwrap();
    assert!(n_ctx >= 2048, "{models}");
}

#[test]
fn the_gateway_in_front_of_a_running_engine_serves_its_answers() {
    let Some(model) = default_model() else { return };
    // No prefix cache: the second ask of the same prompt must run the same chunks as the first
    // (a cached prefix makes the last prefill chunk shorter, and SmolLM2's greedy answer to this
    // prompt differs between a 5-row and a 37-row last chunk).
    let engine = serve(&model, &["--no-prefix-cache"]);
    let url = format!("http://127.0.0.1:{}", engine.port);
    let gateway = serve(&model, &["--upstream", &url]);
    let name = model.file_stem().unwrap().to_string_lossy().into_owned();
    let body =
        json!({"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0})
        .to_string();
    let (s1, direct) = http(engine.port, "POST", "/v1/chat/completions", &body);
    let (s2, through) = http(gateway.port, "POST", "/v1/chat/completions", &body);
    assert_eq!((s1, s2), (200, 200), "{direct}\n{through}");
    let (direct, through): (Value, Value) =
        (serde_json::from_str(&direct).unwrap(), serde_json::from_str(&through).unwrap());
    assert_eq!(through["choices"][0]["message"]["content"], direct["choices"][0]["message"]["content"]);
    assert_eq!(through["usage"]["prompt_tokens"], direct["usage"]["prompt_tokens"]);
    assert_eq!(through["usage"]["completion_tokens"], direct["usage"]["completion_tokens"]);
    let timing = &through["timing"];
    for stage in ["queue", "prefill", "decode"] {
        assert_eq!(timing["sources"][stage], "engine", "{timing}");
    }
    assert!(
        timing["stages_ms"].get("gateway").is_some() && timing["sources"].get("gateway").is_none(),
        "{timing}"
    );
    // Forwarded, not judged here: tokenpath's strict API refuses a field it does not know, and
    // that refusal is what the client gets.
    let extra = json!({"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "min_tokens": 1})
    .to_string();
    let (status, refusal) = http(gateway.port, "POST", "/v1/chat/completions", &extra);
    assert_eq!(status, 400, "{refusal}");
    assert!(refusal.contains("min_tokens"), "{refusal}");
    // The upstream's limits were learned from its /v1/models: a prompt past the context is ours
    // to refuse, before it is sent.
    let (_, models) = http(gateway.port, "GET", "/v1/models", "");
    let n_ctx = serde_json::from_str::<Value>(&models).unwrap()["data"][0]["max_model_len"].as_u64().unwrap();
    assert!(n_ctx >= 2048, "{models}");
    let (status, _) = http(gateway.port, "GET", "/ready", "");
    assert_eq!(status, 200);
    let (engine_kib, gateway_kib) = (vm_hwm_kib(engine.child.id()), vm_hwm_kib(gateway.child.id()));
    let model_kib = std::fs::metadata(&model).unwrap().len() / 1024;
    eprintln!("peak RSS: engine {engine_kib} KiB, gateway {gateway_kib} KiB, model file {model_kib} KiB");
    assert!(gateway_kib < engine_kib.saturating_sub(model_kib / 2), "the gateway holds no weights");
    drop(gateway);
    // The same engine listed in a cluster file as a `tokenpath` upstream (tiered gateways): the
    // same answer, the engine's stages. A key variable the file names but nobody set is an
    // error at start, not an unauthenticated upstream.
    let dir = std::env::temp_dir().join(format!("tokenpath-upstream-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cluster.toml");
    std::fs::write(
        &file,
        format!(
            "[[upstream]]\nurl = \"{url}\"\nkind = \"tokenpath\"\napi_key_env = \"TP_TEST_UPSTREAM_KEY\"\n"
        ),
    )
    .unwrap();
    let missing = std::process::Command::new(env!("CARGO_BIN_EXE_tokenpath"))
        .args(["serve", "--port", "0", "--model"])
        .arg(&model)
        .arg("--cluster")
        .arg(&file)
        .env_remove("TP_TEST_UPSTREAM_KEY")
        .output()
        .unwrap();
    assert!(!missing.status.success());
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("TP_TEST_UPSTREAM_KEY, which is not set"), "{err}");
    std::fs::write(&file, format!("[[upstream]]\nurl = \"{url}\"\nkind = \"tokenpath\"\n")).unwrap();
    let tiered = serve(&model, &["--cluster", file.to_str().unwrap()]);
    let (status, answer) = http(tiered.port, "POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], direct["choices"][0]["message"]["content"]);
    assert_eq!(answer["timing"]["sources"]["prefill"], "engine", "{}", answer["timing"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
