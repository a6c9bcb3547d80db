//! The cluster file (`tokenpath serve --cluster cluster.toml`): what the gateway serves through.
//! `[[worker]]` tables list tokenpath workers; `[[upstream]]` tables list engines that run
//! elsewhere (vLLM, SGLang, TensorRT-LLM, llama.cpp, any OpenAI server, another tokenpath), each
//! a static address or a DNS name re-resolved as pods come and go. One file serves one model
//! through one kind of backend: workers and upstreams are not mixed (the gateway's routing and
//! its stage timeline differ between them), and the file says so rather than guessing.
//!
//! Parsed here, in the library, so every rule (unknown keys, role per kind, one tokenizer,
//! secrets from the environment and never from the file) is tested without a process.

use anyhow::Context as _;
use std::path::{Path, PathBuf};
use tokenpath_gateway::upstream::UpstreamSpec;
use tokenpath_protocol::cluster::WorkerRole;

/// What a cluster file lists.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ClusterPlan {
    /// Tokenpath workers: address and role.
    pub workers: Vec<(String, WorkerRole)>,
    /// Upstream engines.
    pub upstreams: Vec<UpstreamEntry>,
    /// The tokenizer the upstreams' tables name (all the same file), if any.
    pub tokenizer: Option<PathBuf>,
}

/// One `[[upstream]]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamEntry {
    /// The server (for `discover`, the template every resolved address is made from).
    pub spec: UpstreamSpec,
    /// The URL's host is a DNS name resolved again every
    /// [`tokenpath_gateway::upstream::DNS_INTERVAL`], one member per address (a Kubernetes
    /// headless Service).
    pub discover: bool,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    worker: Vec<FileWorker>,
    #[serde(default)]
    upstream: Vec<FileUpstream>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileWorker {
    addr: String,
    role: String,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileUpstream {
    url: String,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    tokenizer: Option<PathBuf>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    /// The shared KV pool it reads (upstreams naming the same one share prefix affinity).
    #[serde(default)]
    kv_pool: Option<String>,
    /// The environment variable holding its API key (a key is never written in the file).
    #[serde(default)]
    api_key_env: Option<String>,
    #[serde(default)]
    discover: bool,
}

/// Reads and checks a cluster file; `env` looks up the variables `api_key_env` names.
pub fn load(path: &Path, env: impl Fn(&str) -> Option<String>) -> anyhow::Result<ClusterPlan> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text, env).with_context(|| format!("in {}", path.display()))
}

/// [`load`] on the file's text. Relative tokenizer paths are taken as written.
pub fn parse(text: &str, env: impl Fn(&str) -> Option<String>) -> anyhow::Result<ClusterPlan> {
    let file: File = toml::from_str(text).context("parsing the cluster file")?;
    anyhow::ensure!(
        file.worker.is_empty() || file.upstream.is_empty(),
        "it lists both [[worker]] and [[upstream]] tables: one gateway serves through tokenpath \
         workers or through upstream engines, not both"
    );
    let mut plan = ClusterPlan::default();
    for (i, w) in file.worker.into_iter().enumerate() {
        let role = w.role.parse::<WorkerRole>().map_err(|e| anyhow::anyhow!("worker {}: {e}", i + 1))?;
        plan.workers.push((w.addr, role));
    }
    for (i, u) in file.upstream.into_iter().enumerate() {
        let n = i + 1;
        let entry = upstream(u, &env, &mut plan.tokenizer).with_context(|| format!("upstream {n}"))?;
        anyhow::ensure!(
            !plan.upstreams.iter().any(|e| e.spec.url == entry.spec.url),
            "upstream {n}: {} is listed twice",
            entry.spec.url
        );
        plan.upstreams.push(entry);
    }
    if let Some(first) = plan.upstreams.first() {
        let kind = first.spec.kind;
        anyhow::ensure!(
            plan.upstreams.iter().all(|e| e.spec.kind.disaggregated() == kind.disaggregated()),
            "it mixes colocated and prefill/decode upstream kinds: list one or the other"
        );
        if kind.disaggregated() {
            for role in [WorkerRole::Prefill, WorkerRole::Decode] {
                anyhow::ensure!(
                    plan.upstreams.iter().any(|e| e.spec.role == role),
                    "its {kind} upstreams have no {role} server"
                );
            }
        }
    }
    Ok(plan)
}

fn upstream(
    u: FileUpstream,
    env: &impl Fn(&str) -> Option<String>,
    tokenizer: &mut Option<PathBuf>,
) -> anyhow::Result<UpstreamEntry> {
    let api_key = match &u.api_key_env {
        Some(var) => Some(
            env(var)
                .filter(|k| !k.is_empty())
                .with_context(|| format!("api_key_env names {var}, which is not set"))?,
        ),
        None => None,
    };
    if let Some(t) = u.tokenizer {
        match tokenizer {
            Some(seen) if *seen != t => anyhow::bail!(
                "tokenizer {} differs from {}: one gateway serves one model",
                t.display(),
                seen.display()
            ),
            _ => *tokenizer = Some(t),
        }
    }
    let spec = UpstreamSpec::from_parts(
        u.url,
        u.kind.as_deref(),
        u.role.as_deref(),
        u.model,
        u.bootstrap_port,
        api_key,
    )?
    .on_kv_pool(u.kv_pool)?;
    Ok(UpstreamEntry { spec, discover: u.discover })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokenpath_gateway::upstream::UpstreamKind;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn workers_parse_as_before() {
        let plan = parse("[[worker]]\naddr = \"127.0.0.1:9000\"\nrole = \"prefill\"\n", no_env).unwrap();
        assert_eq!(plan.workers, vec![("127.0.0.1:9000".into(), WorkerRole::Prefill)]);
        assert!(plan.upstreams.is_empty());
    }

    #[test]
    fn a_pd_pair_with_every_field() {
        let text = r#"
            [[upstream]]
            url = "http://10.0.0.5:30000/"
            kind = "sglang-pd"
            role = "prefill"
            model = "qwen"
            tokenizer = "/models/tokenizer.json"
            bootstrap_port = 8998
            api_key_env = "SGL_KEY"
            kv_pool = "rack-1"

            [[upstream]]
            url = "http://decode.svc:30001"
            kind = "sglang-pd"
            role = "decode"
            discover = true
        "#;
        let plan = parse(text, |v| (v == "SGL_KEY").then(|| "k1".to_owned())).unwrap();
        let [p, d] = &plan.upstreams[..] else { panic!("{plan:?}") };
        assert_eq!(p.spec.url, "http://10.0.0.5:30000", "trailing slash dropped");
        assert_eq!((p.spec.kind, p.spec.role), (UpstreamKind::SglangPd, WorkerRole::Prefill));
        assert_eq!(p.spec.bootstrap_port, Some(8998));
        assert_eq!(p.spec.api_key.as_deref(), Some("k1"));
        assert_eq!(p.spec.model.as_deref(), Some("qwen"));
        assert!(!p.discover && d.discover);
        assert_eq!((p.spec.kv_pool.as_deref(), d.spec.kv_pool.as_deref()), (Some("rack-1"), None));
        assert_eq!(d.spec.api_key, None);
        assert_eq!(plan.tokenizer.as_deref(), Some(Path::new("/models/tokenizer.json")));
    }

    /// The annotated example the docs point to parses (its key set from a fake environment).
    #[test]
    fn the_deploy_example_parses() {
        let text = include_str!("../../../deploy/cluster.example.toml");
        let plan = parse(text, |v| (v == "VLLM_API_KEY").then(|| "k".to_owned())).unwrap();
        assert_eq!(plan.upstreams.len(), 2);
        assert!(plan.upstreams[1].discover);
    }

    #[test]
    fn defaults_are_a_colocated_openai_server() {
        let plan = parse("[[upstream]]\nurl = \"http://127.0.0.1:8080\"\n", no_env).unwrap();
        assert_eq!(plan.upstreams[0].spec, UpstreamSpec::openai("http://127.0.0.1:8080"));
    }

    /// Each mistake is refused with its reason, never half-applied.
    #[test]
    fn mistakes_are_named() {
        let cases = [
            ("[[upstream]]\nurl = \"http://a:1\"\nkid = \"openai\"\n", "kid"),
            ("[[upstream]]\nurl = \"http://a:1\"\nkind = \"tgi\"\n", "unknown upstream kind"),
            ("[[upstream]]\nurl = \"http://a:1\"\nkind = \"vllm-pd\"\n", "needs role"),
            (
                "[[upstream]]\nurl = \"http://a:1\"\nkind = \"vllm-pd\"\nrole = \"prefill\"\n",
                "no decode server",
            ),
            ("[[upstream]]\nurl = \"http://a:1\"\napi_key_env = \"NOPE\"\n", "NOPE, which is not set"),
            ("[[upstream]]\nurl = \"ftp://a:1\"\n", "http:// or https://"),
            ("[[upstream]]\nurl = \"http://a:1\"\n[[upstream]]\nurl = \"http://a:1/\"\n", "listed twice"),
            (
                "[[upstream]]\nurl = \"http://a:1\"\n[[worker]]\naddr = \"127.0.0.1:9\"\nrole = \"both\"\n",
                "not both",
            ),
            (
                "[[upstream]]\nurl = \"http://a:1\"\ntokenizer = \"x.json\"\n\
                 [[upstream]]\nurl = \"http://b:1\"\ntokenizer = \"y.json\"\n",
                "one model",
            ),
            (
                "[[upstream]]\nurl = \"http://a:1\"\n[[upstream]]\nurl = \"http://b:1\"\n\
                 kind = \"trtllm-pd\"\nrole = \"decode\"\n",
                "mixes",
            ),
            ("[[upstream]]\nurl = \"http://a:1\"\nrole = \"prefill\"\n", "role"),
        ];
        for (text, why) in cases {
            let err = format!("{:#}", parse(text, no_env).unwrap_err());
            assert!(err.contains(why), "{text:?}: {err}");
        }
    }
}
