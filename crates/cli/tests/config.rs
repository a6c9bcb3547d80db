//! The command line's own surface through the real binary: `--config FILE` and `--print-config`
//! (a server started from a file serves with the file's settings; a flag and an environment
//! variable each override the file; an unknown key is an error that names it; the annotated
//! example in `deploy/` is a valid file), `--version` (which kernels this CPU gets) and shell
//! completions.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use std::process::Command;
use support::http;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};

fn tiny_model(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("tp-config-{name}-{}.gguf", std::process::id()));
    std::fs::write(&p, tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    p
}

fn file(name: &str, text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("tp-config-{name}-{}.toml", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

fn print_config(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenpath"));
    cmd.args(args).arg("--print-config").env_remove("TOKENPATH_CONFIG").env_remove("TOKENPATH_MAX_BATCH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_server_started_from_a_file_serves_with_its_settings() {
    let model = tiny_model("serve");
    let f = file("serve", "served-model-name = \"from-file\"\nkv_tokens = 1024\nmax-batch = 4\n");
    let mut s = support::serve(&model, &["--config", f.to_str().unwrap()]);
    let (status, body) = http(s.port, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"from-file\""), "{body}");
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    let _ = std::fs::remove_file(model);
    let _ = std::fs::remove_file(f);
}

#[test]
fn flags_and_environment_override_the_file_and_unknown_keys_are_named() {
    let model = tiny_model("print");
    let m = model.to_str().unwrap();
    let f = file("print", "kv-tokens = 1024\nmax-batch = 4\nprefill-chunk = 128\n");
    let fp = f.to_str().unwrap();
    let (ok, out, err) = print_config(
        &["serve", "--config", fp, "--model", m, "--kv-tokens", "2048"],
        &[("TOKENPATH_MAX_BATCH", "16"), ("TOKENPATH_CLUSTER_SECRET", "hunter2")],
    );
    assert!(ok, "{err}");
    for want in ["kv-tokens = 2048  # flag", "max-batch = 16  # environment", "prefill-chunk = 128  # file"] {
        assert!(out.contains(want), "{want}: {out}");
    }
    assert!(
        out.contains("# cluster-secret = <redacted>  # environment") && !out.contains("hunter2"),
        "{out}"
    );
    // What it printed is a valid file.
    let again = file("again", &out);
    let (ok, out2, err) = print_config(&["serve", "--config", again.to_str().unwrap(), "--model", m], &[]);
    assert!(ok && out2.contains("max-batch = 16  # file"), "{err}{out2}");

    let bad = file("bad", "kv-tokens = 1024\nprefil-chunk = 128\n");
    let (ok, _, err) = print_config(&["serve", "--config", bad.to_str().unwrap(), "--model", m], &[]);
    assert!(!ok && err.contains("unknown key `prefil-chunk`"), "{err}");
    for p in [model, f, again, bad] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn the_annotated_example_is_a_valid_file() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/tokenpath.example.toml");
    let model = tiny_model("example");
    let (ok, out, err) =
        print_config(&["serve", "--config", example, "--model", model.to_str().unwrap()], &[]);
    assert!(ok, "{err}");
    assert!(
        out.contains("port = 8000  # file") && out.contains("served-model-name = \"smollm2\"  # file"),
        "{out}"
    );
    let _ = std::fs::remove_file(model);
}

#[test]
fn version_says_which_kernels_this_cpu_runs() {
    let run = |cap: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenpath"));
        cmd.arg("--version").env_remove("TOKENPATH_KERNEL");
        if let Some(c) = cap {
            cmd.env("TOKENPATH_KERNEL", c);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let best = tokenpath_engine::quant::Kernel::best().name();
    let text = run(None);
    assert!(text.starts_with(concat!("tokenpath ", env!("CARGO_PKG_VERSION"))), "{text}");
    assert!(text.contains("this CPU runs scalar"), "{text}");
    if std::env::var_os("TOKENPATH_KERNEL").is_none() {
        assert!(text.contains(&format!("kernels: {best} ")), "{text}");
    }
    assert!(run(Some("scalar")).contains("kernels: scalar "), "the cap shows");
}

#[test]
fn completions_cover_every_command_and_the_config_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenpath")).args(["completions", "bash"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for word in ["serve", "bench", "worker", "kv-pool", "--kv-pool-ram", "--config", "--print-config"] {
        assert!(text.contains(word), "{word} missing from the bash completions");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_tokenpath")).args(["completions", "tcsh"]).output().unwrap();
    assert!(!bad.status.success());
}
