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
