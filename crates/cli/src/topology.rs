//! Process topology for `tokenpath serve`: where the workers are (started here as child
//! processes, or listed in a cluster file) and which cores each may use.
//!
//! Children are owned by a [`Children`] guard that kills and reaps them when dropped — on a clean
//! exit, on an error, and on Ctrl-C (the gateway returns, the guard drops) — so a serve never
//! leaves orphaned workers holding cores and memory.

use anyhow::Context as _;
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::Duration;
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_worker::Role;

/// The environment variable the cluster secret travels in (never the command line, which every
/// user of the machine can read in /proc).
pub const CLUSTER_SECRET_ENV: &str = "TOKENPATH_CLUSTER_SECRET";

/// The secret gateway and workers share.
#[derive(Debug, clap::Args)]
pub struct SecretArgs {
    /// The cluster secret every connection between gateway and workers proves (challenge-
    /// response, at least 16 characters). `serve --prefill/--decode` generates one for its
    /// children when none is set. Prefer the environment variable.
    #[arg(long = "cluster-secret", env = CLUSTER_SECRET_ENV, hide_env_values = true, value_name = "SECRET")]
    pub cluster_secret: Option<crate::secret::Secret>,
}

impl SecretArgs {
    /// The configured secret, or none.
    pub fn secret(&self) -> anyhow::Result<Option<(String, ClusterSecret)>> {
        self.cluster_secret
            .as_ref()
            .map(|s| Ok((s.expose().to_owned(), ClusterSecret::new(s.expose()).map_err(anyhow::Error::msg)?)))
            .transpose()
    }
}

/// A set of CPU cores: `0`, `0,1`, `0-3`, `0,2-3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(Vec<usize>);

impl CpuList {
    /// How many cores.
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

impl FromStr for CpuList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut cpus = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let parse = |x: &str| {
                x.trim().parse::<usize>().map_err(|_| format!("{part:?} is not a core number or range"))
            };
            let (a, b) = (parse(a)?, parse(b)?);
            if a > b || b >= 1024 {
                return Err(format!("{part:?} is not a valid core range"));
            }
            cpus.extend(a..=b);
        }
        cpus.sort_unstable();
        cpus.dedup();
        if cpus.is_empty() {
            return Err("an empty core list".into());
        }
        Ok(Self(cpus))
    }
}

impl std::fmt::Display for CpuList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s: Vec<String> = self.0.iter().map(usize::to_string).collect();
        f.write_str(&s.join(","))
    }
}

/// Restricts this process to `cpus`. Call before starting threads: they inherit the mask.
pub fn pin_to_cpus(cpus: &CpuList) -> anyhow::Result<()> {
    // SAFETY: `cpu_set_t` is plain data; zeroed is a valid empty set, CPU_SET only writes bits
    // inside it (indices are < 1024 = CPU_SETSIZE, checked when parsing), and
    // sched_setaffinity reads exactly `size_of::<cpu_set_t>()` bytes from the pointer.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in &cpus.0 {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        anyhow::bail!("cannot pin to cores {cpus}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// One worker of a cluster file.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileWorker {
    addr: String,
    role: String,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(default)]
    worker: Vec<FileWorker>,
}

/// Reads a `cluster.toml`: `[[worker]]` tables with `addr` and `role`.
pub fn load_cluster_file(path: &Path) -> anyhow::Result<Vec<(String, Role)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: ClusterFile = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    file.worker
        .into_iter()
        .enumerate()
        .map(|(i, w)| {
            let role =
                w.role.parse::<Role>().with_context(|| format!("worker {} in {}", i + 1, path.display()))?;
            Ok((w.addr, role))
        })
        .collect()
}

/// Worker processes started by this one; killed and reaped on drop.
#[derive(Debug, Default)]
pub struct Children(Vec<(String, Child)>);

impl Children {
    /// Starts `tokenpath worker --role ROLE --listen 127.0.0.1:0 …extra` with the cluster
    /// `secret` in its environment, and returns its address.
    pub fn spawn(
        &mut self,
        name: &str,
        role: Role,
        cpus: Option<&CpuList>,
        extra: &[String],
        secret: &str,
    ) -> anyhow::Result<String> {
        let exe = std::env::current_exe().context("finding the tokenpath executable")?;
        let mut cmd = Command::new(exe);
        if secret.is_empty() {
            // No secret (loopback only): the child runs without one too.
            cmd.env_remove(CLUSTER_SECRET_ENV);
        } else {
            cmd.env(CLUSTER_SECRET_ENV, secret);
        }
        cmd.args(["worker", "--role", &role.to_string(), "--listen", "127.0.0.1:0", "--id", name]);
        if let Some(c) = cpus {
            cmd.args(["--cpus", &c.to_string()]);
        }
        cmd.args(extra).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().with_context(|| format!("starting worker {name}"))?;
        let stdout = child.stdout.take().context("worker stdout")?;
        self.0.push((name.to_owned(), child));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next();
            let _ = tx.send(first);
            // Keep draining so the child never blocks on a full pipe.
            for _ in lines {}
        });
        let line = rx
            .recv_timeout(Duration::from_secs(300))
            .map_err(|_| anyhow::anyhow!("worker {name} did not start in time"))?
            .with_context(|| format!("worker {name} exited before listening"))?
            .with_context(|| format!("reading worker {name}'s address"))?;
        let addr = line
            .strip_prefix("tokenpath worker listening on ")
            .with_context(|| format!("worker {name} said {line:?} instead of its address"))?
            .trim()
            .to_owned();
        Ok(addr)
    }

    /// Names of children that have exited.
    pub fn exited(&mut self) -> Vec<String> {
        self.0
            .iter_mut()
            .filter_map(|(n, c)| matches!(c.try_wait(), Ok(Some(_))).then(|| n.clone()))
            .collect()
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (name, child) in &mut self.0 {
            if let Ok(None) = child.try_wait() {
                tracing::debug!(worker = %name, "stopping worker");
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_reject_nonsense() {
        assert_eq!("0".parse::<CpuList>().unwrap_or_else(|e| panic!("{e}")).to_string(), "0");
        assert_eq!("3,0-1".parse::<CpuList>().unwrap_or_else(|e| panic!("{e}")).to_string(), "0,1,3");
        for bad in ["", "a", "2-1", "5000", "1-"] {
            assert!(bad.parse::<CpuList>().is_err(), "{bad}");
        }
    }
}
