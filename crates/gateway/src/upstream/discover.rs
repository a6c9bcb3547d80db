//! Discovery by DNS name: what a Kubernetes headless Service gives — one name, one address per
//! ready pod. The name is resolved every [`DNS_INTERVAL`]; each address is a member of the pool
//! (its URL carries the address, so each pod is routed, probed and ejected on its own), members
//! whose address left the answer are removed, and a failed lookup changes nothing (a DNS blip
//! must not empty the pool).

use super::pool::{Source, UpstreamPool};
use super::UpstreamSpec;
use std::time::Duration;
use tokenpath_protocol::ProtocolError;

/// How often a discovered name is resolved again.
pub const DNS_INTERVAL: Duration = Duration::from_secs(10);
/// Most addresses taken from one answer.
const MAX_ADDRESSES: usize = 64;

impl UpstreamPool {
    /// Resolves `template.url`'s host every `every` (from now, on the current runtime, for as
    /// long as the pool lives) and keeps one member per address, each like `template`.
    pub fn discover(&self, template: UpstreamSpec, every: Duration) -> Result<(), ProtocolError> {
        let template = template.validated()?;
        let url = reqwest::Url::parse(&template.url)
            .map_err(|e| ProtocolError::invalid("url", format!("{}: {e}", template.url)))?;
        let host = template.host();
        let port = url.port_or_known_default().unwrap_or(80);
        let name = format!("{host}:{port}");
        let weak = std::sync::Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let pool = UpstreamPool { inner };
                match tokio::time::timeout(Duration::from_secs(5), tokio::net::lookup_host(name.as_str()))
                    .await
                {
                    Ok(Ok(addrs)) => {
                        let mut specs: Vec<UpstreamSpec> = Vec::new();
                        for addr in addrs.take(MAX_ADDRESSES) {
                            let mut u = url.clone();
                            if u.set_ip_host(addr.ip()).is_err() {
                                continue;
                            }
                            let spec = UpstreamSpec { url: u.to_string(), ..template.clone() };
                            if let Ok(spec) = spec.validated() {
                                if !specs.contains(&spec) {
                                    specs.push(spec);
                                }
                            }
                        }
                        pool.sync(Source::Dns(name.clone()), specs);
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(name = %name, "resolving an upstream name failed (members kept): {e}")
                    }
                    Err(_) => {
                        tracing::warn!(name = %name, "resolving an upstream name timed out (members kept)")
                    }
                }
                drop(pool);
                tokio::time::sleep(every).await;
            }
        });
        Ok(())
    }
}
