//! HTTP upstreams: engines the gateway fronts instead of running them — vLLM, SGLang,
//! TensorRT-LLM, Dynamo's frontend, llama.cpp's server, another tokenpath gateway — one or
//! many, colocated or prefill/decode-disaggregated in each engine's own protocol.
//!
//! [`UpstreamPool`] is a [`Backend`]: the gateway admits a request exactly as for its own
//! engine (API key, tenant limits charged from its own tokenization, validation of the fields it
//! acts on), the pool picks where it goes ([`pool`]: health, load from each upstream's own
//! `/metrics`, the gateway's prefix index with the balance bound, outlier ejection, a retry on
//! another upstream only before the client got a byte), and the request runs in its kind's
//! sequence ([`legs`]): one call for `openai` and `tokenpath`; for `vllm-pd` a prefill leg whose
//! `kv_transfer_params` go verbatim to the decode leg; for `sglang-pd` both legs at once,
//! joined by a bootstrap room; for `trtllm-pd` a `context_only` leg, then `generation_only`.
//! The client's body goes on whole — unknown fields included, `model` rewritten to the
//! upstream's name, `stream_options.include_usage` forced on a stream so output tokens are
//! charged as they arrive (and `continuous_usage_stats` on a vLLM decode leg, so a chunk of
//! several tokens is charged exactly) — and the answer comes back as the engine sent it, with our model
//! name, our `timing` on the last chunk ([`relay`]) and, in PD, the prefill leg's cached tokens.
//!
//! The client's credentials never reach an upstream; the upstream's own key (if any) is sent
//! instead. Every wait on an upstream is bounded: connecting, the first byte of the response,
//! and silence between chunks.

mod chunk;
mod discover;
mod endpoint;
mod legs;
mod load;
mod pool;
mod relay;

pub use crate::route::BALANCE_THRESHOLD;
pub use discover::DNS_INTERVAL;
pub use endpoint::max_model_len;
pub use pool::{Added, UpstreamPool, UpstreamView, EJECTION, EJECT_AFTER, MAX_UPSTREAMS};

use std::time::Duration;
use tokenpath_protocol::backend::ModelInfo;
use tokenpath_protocol::cluster::{peer_message, WorkerRole};
use tokenpath_protocol::ProtocolError;

/// How long connecting to an upstream and getting its response headers may take.
pub const DEFAULT_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a streaming upstream may stay silent between chunks.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest non-streamed response body taken from an upstream.
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// Longest upstream URL accepted.
pub const MAX_URL_LEN: usize = 300;

/// Which protocol an upstream speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpstreamKind {
    /// Any OpenAI-compatible server, one call per request.
    OpenAi,
    /// Another tokenpath gateway (tiered gateways): OpenAI calls, readiness from `/ready`, its
    /// `timing` absorbed stage by stage.
    Tokenpath,
    /// vLLM with a KV connector (NIXL): prefill leg, then decode leg with its transfer params.
    VllmPd,
    /// SGLang in PD mode: both legs at once with one bootstrap room.
    SglangPd,
    /// `trtllm-serve` context and generation servers: `disaggregated_params`.
    TrtllmPd,
}

impl UpstreamKind {
    /// The name in flags, files and the admin API.
    pub fn name(self) -> &'static str {
        match self {
            Self::OpenAi => "openai",
            Self::Tokenpath => "tokenpath",
            Self::VllmPd => "vllm-pd",
            Self::SglangPd => "sglang-pd",
            Self::TrtllmPd => "trtllm-pd",
        }
    }

    /// Whether its upstreams run one half of a request (role prefill or decode).
    pub fn disaggregated(self) -> bool {
        matches!(self, Self::VllmPd | Self::SglangPd | Self::TrtllmPd)
    }
}

impl std::fmt::Display for UpstreamKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for UpstreamKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Self::OpenAi, Self::Tokenpath, Self::VllmPd, Self::SglangPd, Self::TrtllmPd]
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown upstream kind {s:?}: expected openai, tokenpath, vllm-pd, sglang-pd or trtllm-pd"
                )
            })
    }
}

/// One upstream server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamSpec {
    /// Base URL (`http://10.0.0.5:8000`); the endpoint paths are appended.
    pub url: String,
    /// The protocol it speaks.
    pub kind: UpstreamKind,
    /// Its part: `both` for `openai`/`tokenpath`, `prefill` or `decode` for the PD kinds.
    pub role: WorkerRole,
    /// The model name it serves; `None`: the client's is sent as is.
    pub model: Option<String>,
    /// SGLang prefill servers: the bootstrap port (`None`: the engine's default, sent as null).
    pub bootstrap_port: Option<u16>,
    /// Sent as `Authorization: Bearer` (never the client's key); `None`: the pool's.
    pub api_key: Option<String>,
    /// The shared KV pool it reads, as the operator names it (vLLM servers on one LMCache
    /// server, tokenpath servers on one `--kv-pool` directory): what was routed to one member
    /// of a pool counts, at half weight, for every other member of it.
    pub kv_pool: Option<String>,
}

impl UpstreamSpec {
    /// A colocated OpenAI upstream at `url`.
    pub fn openai(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            kind: UpstreamKind::OpenAi,
            role: WorkerRole::Both,
            model: None,
            bootstrap_port: None,
            api_key: None,
            kv_pool: None,
        }
    }

    /// An upstream as an operator writes it (a cluster file's `[[upstream]]` table, the body of
    /// `POST /admin/upstreams`): kind `openai` when absent, role `both` when absent for a
    /// colocated kind (a PD kind needs one); then [`Self::validated`].
    pub fn from_parts(
        url: String,
        kind: Option<&str>,
        role: Option<&str>,
        model: Option<String>,
        bootstrap_port: Option<u16>,
        api_key: Option<String>,
    ) -> Result<Self, ProtocolError> {
        let kind: UpstreamKind =
            kind.unwrap_or("openai").parse().map_err(|m: String| ProtocolError::invalid("kind", m))?;
        let role = match role {
            Some(r) => r.parse::<WorkerRole>()?,
            None if kind.disaggregated() => {
                return Err(ProtocolError::invalid(
                    "role",
                    format!("a {kind} upstream needs role \"prefill\" or \"decode\""),
                ))
            }
            None => WorkerRole::Both,
        };
        Self { url, kind, role, model, bootstrap_port, api_key, kv_pool: None }.validated()
    }

    /// The same upstream on the shared KV pool `name` (see [`Self::kv_pool`]), checked.
    pub fn on_kv_pool(mut self, name: Option<String>) -> Result<Self, ProtocolError> {
        self.kv_pool = name;
        self.validated()
    }

    /// Checks the URL (http or https, bounded, no credentials or query), the role against the
    /// kind, and that only an SGLang prefill server has a bootstrap port; the URL comes back
    /// without a trailing `/`.
    pub fn validated(mut self) -> Result<Self, ProtocolError> {
        let bad = |param: &str, message: String| ProtocolError::InvalidRequest {
            param: Some(param.into()),
            message,
        };
        self.url = self.url.trim_end_matches('/').to_owned();
        let parsed = reqwest::Url::parse(&self.url)
            .map_err(|e| bad("url", format!("{:?}: {e}", peer_message(&self.url))))?;
        if self.url.len() > MAX_URL_LEN
            || !matches!(parsed.scheme(), "http" | "https")
            || parsed.host_str().is_none()
            || !parsed.username().is_empty()
            || parsed.password().is_some()
            || parsed.query().is_some()
            || parsed.fragment().is_some()
        {
            return Err(bad(
                "url",
                format!(
                    "an upstream URL is http:// or https://, a host and an optional port and path, at most {MAX_URL_LEN} bytes, not {:?}",
                    peer_message(&self.url)
                ),
            ));
        }
        let role_ok = match self.kind {
            UpstreamKind::OpenAi | UpstreamKind::Tokenpath => self.role == WorkerRole::Both,
            _ => self.role != WorkerRole::Both,
        };
        if !role_ok {
            let want = if self.kind.disaggregated() { "prefill or decode" } else { "both" };
            return Err(bad("role", format!("a {} upstream has role {want}, not {}", self.kind, self.role)));
        }
        if self.bootstrap_port.is_some()
            && !(self.kind == UpstreamKind::SglangPd && self.role == WorkerRole::Prefill)
        {
            return Err(bad(
                "bootstrap_port",
                "only an sglang-pd prefill upstream has a bootstrap port".into(),
            ));
        }
        if self.model.as_ref().is_some_and(|m| m.is_empty() || m.len() > 256) {
            return Err(bad("model", "an upstream model name is 1 to 256 bytes".into()));
        }
        if self
            .kv_pool
            .as_ref()
            .is_some_and(|p| p.is_empty() || p.len() > 128 || !p.bytes().all(|b| b.is_ascii_graphic()))
        {
            return Err(bad("kv_pool", "a KV pool name is 1 to 128 printable ASCII bytes, no spaces".into()));
        }
        Ok(self)
    }

    /// The host part of its URL (SGLang's `bootstrap_host`).
    pub(crate) fn host(&self) -> String {
        reqwest::Url::parse(&self.url)
            .ok()
            .and_then(|u| u.host_str().map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned()))
            .unwrap_or_default()
    }
}

/// What every upstream of a pool shares.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// The name clients use (ours), written into every chunk and body passed back.
    pub served_model_name: String,
    /// Sent as `Authorization: Bearer` to upstreams that have no key of their own.
    pub api_key: Option<String>,
    /// The model's limits (context length; token ids are the upstream's to check).
    pub model_info: ModelInfo,
    /// Connect + response headers (each leg).
    pub first_byte_timeout: Duration,
    /// Silence between chunks.
    pub idle_timeout: Duration,
}

/// The upstream could not be reached or did not answer in time.
fn unreachable(url: &str, e: &reqwest::Error) -> ProtocolError {
    let what = if e.is_timeout() { "timed out" } else { "unreachable" };
    ProtocolError::Unavailable { message: format!("upstream {url} {what}: {e}") }
}

/// The error for an upstream's non-2xx answer: the client's fault (4xx but auth) keeps the
/// upstream's words (cut and cleaned); a full upstream is overloaded; the rest is ours.
fn refusal(url: &str, status: u16, body: &str) -> ProtocolError {
    let said = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(|m| m.as_str().map(str::to_owned)))
        .unwrap_or_else(|| body.to_owned());
    let said = peer_message(&said);
    match status {
        429 | 503 => ProtocolError::Overloaded { max: 0 },
        401 | 403 => ProtocolError::Unavailable {
            message: format!("upstream {url} refused our credentials ({status}): {said}"),
        },
        400..=499 => ProtocolError::InvalidRequest {
            param: None,
            message: format!("The upstream engine refused the request: {said}"),
        },
        _ => ProtocolError::Unavailable { message: format!("upstream {url} answered {status}: {said}") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_refusals_map_to_the_clients_or_ours() {
        let body =
            r#"{"error":{"message":"max_tokens is too large\u001b[31m","type":"invalid_request_error"}}"#;
        match refusal("u", 400, body) {
            ProtocolError::InvalidRequest { message, .. } => {
                assert!(
                    message.contains("max_tokens is too large") && !message.contains('\u{1b}'),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(refusal("u", 429, ""), ProtocolError::Overloaded { .. }));
        assert!(matches!(refusal("u", 503, ""), ProtocolError::Overloaded { .. }));
        assert!(matches!(refusal("u", 401, ""), ProtocolError::Unavailable { .. }));
        assert!(matches!(refusal("u", 500, "boom"), ProtocolError::Unavailable { .. }));
    }

    #[test]
    fn kinds_parse_by_name_and_specs_check_role_url_and_port() {
        for k in ["openai", "tokenpath", "vllm-pd", "sglang-pd", "trtllm-pd"] {
            assert_eq!(k.parse::<UpstreamKind>().unwrap().name(), k);
        }
        assert!("vllm".parse::<UpstreamKind>().is_err());
        let ok = UpstreamSpec::openai("http://127.0.0.1:8000/").validated().unwrap();
        assert_eq!(ok.url, "http://127.0.0.1:8000");
        for url in [
            "ftp://x",
            "http://u:p@h:1",
            "http://h:1/?a=b",
            "nonsense",
            &format!("http://{}", "a".repeat(400)),
        ] {
            assert!(UpstreamSpec::openai(url).validated().is_err(), "{url}");
        }
        let pd = |kind, role, port| UpstreamSpec {
            kind,
            role,
            bootstrap_port: port,
            ..UpstreamSpec::openai("http://[::1]:30000")
        };
        assert!(pd(UpstreamKind::VllmPd, WorkerRole::Both, None).validated().is_err());
        assert!(pd(UpstreamKind::OpenAi, WorkerRole::Prefill, None).validated().is_err());
        assert!(pd(UpstreamKind::VllmPd, WorkerRole::Prefill, Some(8998)).validated().is_err());
        assert!(pd(UpstreamKind::SglangPd, WorkerRole::Decode, Some(8998)).validated().is_err());
        let s = pd(UpstreamKind::SglangPd, WorkerRole::Prefill, Some(8998)).validated().unwrap();
        assert_eq!(s.host(), "::1");
    }
}
