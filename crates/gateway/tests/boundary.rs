//! The gateway's boundary (ARCHITECTURE invariant 7): the library serves any `Backend` and
//! tokenizes with any `PromptTokenizer`, and links neither the engine nor the worker crate, so a
//! gateway in front of remote workers or HTTP upstreams never loads a model's weights.

#[test]
fn the_gateway_library_depends_on_neither_the_engine_nor_the_worker() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let doc: toml::Table = manifest.parse().unwrap();
    let deps = doc["dependencies"].as_table().expect("[dependencies]");
    for forbidden in ["tokenpath-engine", "tokenpath-worker"] {
        assert!(!deps.contains_key(forbidden), "the gateway library depends on {forbidden}");
    }
    // And what it does depend on of ours does not bring them in.
    for ours in deps.keys().filter(|k| k.starts_with("tokenpath-")) {
        let dir = ours.trim_start_matches("tokenpath-");
        let path = format!("{}/../{dir}/Cargo.toml", env!("CARGO_MANIFEST_DIR"));
        let theirs: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
        let their_deps = theirs.get("dependencies").and_then(|d| d.as_table()).cloned().unwrap_or_default();
        for forbidden in ["tokenpath-engine", "tokenpath-worker"] {
            assert!(
                !their_deps.contains_key(forbidden),
                "{ours} (a gateway dependency) depends on {forbidden}"
            );
        }
    }
}

/// Invariant 9: outside the gateway, HTTP statuses are chosen only by the two servers with
/// another contract — the OTLP receiver (OTLP's specification) and the mock engine.
#[test]
fn http_status_codes_are_chosen_in_one_place_per_http_contract() {
    let crates = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let allowed = ["gateway/src/", "otlp/src/server.rs", "otlp/src/grpc.rs", "bench/src/mock/mod.rs"];
    let mut offenders = Vec::new();
    let mut stack = vec![crates.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let rel = path.strip_prefix(crates).unwrap().to_string_lossy().replace('\\', "/");
            if path.is_dir() {
                // Tests and fuzz targets may answer however their fake servers need.
                if !["target", "tests", "fuzz"].contains(&entry.file_name().to_string_lossy().as_ref()) {
                    stack.push(path);
                }
            } else if rel.ends_with(".rs") && !allowed.iter().any(|a| rel.starts_with(a)) {
                let src = std::fs::read_to_string(&path).unwrap();
                if src.contains("StatusCode::") {
                    offenders.push(rel);
                }
            }
        }
    }
    assert!(offenders.is_empty(), "HTTP statuses chosen outside their one place: {offenders:?}");
}
