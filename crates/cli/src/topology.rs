//! Process topology for `tokenpath serve`: where the workers are (started here as child
//! processes; the cluster file's are read by `tokenpath_cli::cluster_file`) and which cores each
//! may use.
//!
//! Children are owned by a [`Children`] guard that kills and reaps them when dropped — on a clean
//! exit, on an error, and on Ctrl-C (the gateway returns, the guard drops) — so a serve never
//! leaves orphaned workers holding cores and memory.

use anyhow::Context as _;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenpath_protocol::auth::ClusterSecret;
use tokenpath_worker::Role;

/// The environment variable the cluster secret travels in (never the command line, which every
/// user of the machine can read in /proc).
pub const CLUSTER_SECRET_ENV: &str = "TOKENPATH_CLUSTER_SECRET";

/// The secret gateway and workers share.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Cluster secret")]
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

/// Worker processes started by this one, each watched by a supervisor thread that restarts it
/// (same address, so the gateway's registry finds it again) with exponential backoff when it
/// dies; killed and reaped on drop.
#[derive(Debug, Default)]
pub struct Children(Vec<Supervised>);

#[derive(Debug)]
struct Supervised {
    name: String,
    state: Arc<Mutex<Watch>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct Watch {
    child: Option<Child>,
    stopping: bool,
    restarts: u32,
}

/// The flags and environment every child worker gets beyond its role and name.
#[derive(Clone, Debug, Default)]
pub struct ChildArgs {
    /// Flags.
    pub args: Vec<String>,
    /// Environment variables (secrets go here, never on a command line another user can read).
    pub env: Vec<(&'static str, String)>,
}

/// What it takes to start one worker again.
#[derive(Clone, Debug)]
struct Launch {
    name: String,
    role: Role,
    cpus: Option<String>,
    extra: ChildArgs,
    secret: String,
}

/// Longest pause between two restarts of a worker that keeps dying.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

fn lock(m: &Mutex<Watch>) -> std::sync::MutexGuard<'_, Watch> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Launch {
    /// Starts `tokenpath worker --role ROLE --listen LISTEN …` and reads the address it bound.
    fn start(&self, listen: &str) -> anyhow::Result<(Child, String)> {
        let name = &self.name;
        let exe = std::env::current_exe().context("finding the tokenpath executable")?;
        let mut cmd = Command::new(exe);
        if self.secret.is_empty() {
            // No secret (loopback only): the child runs without one too.
            cmd.env_remove(CLUSTER_SECRET_ENV);
        } else {
            cmd.env(CLUSTER_SECRET_ENV, &self.secret);
        }
        cmd.args(["worker", "--role", &self.role.to_string(), "--listen", listen, "--id", name]);
        if let Some(c) = &self.cpus {
            cmd.args(["--cpus", c]);
        }
        cmd.envs(self.extra.env.iter().map(|(k, v)| (k, v)));
        cmd.args(&self.extra.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        // A server killed outright (SIGKILL, OOM) runs no guard: the kernel kills its workers.
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches only the child.
        unsafe {
            use std::os::unix::process::CommandExt as _;
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting worker {name}"))?;
        let stdout = child.stdout.take().context("worker stdout")?;
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
            .map_err(|_| anyhow::anyhow!("worker {name} did not start in time"))
            .and_then(|l| l.with_context(|| format!("worker {name} exited before listening")))
            .and_then(|l| l.with_context(|| format!("reading worker {name}'s address")));
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        let addr = line
            .strip_prefix("tokenpath worker listening on ")
            .with_context(|| format!("worker {name} said {line:?} instead of its address"))?
            .trim()
            .to_owned();
        Ok((child, addr))
    }
}

/// Restarts the worker in `state` whenever it exits, until told to stop.
fn supervise(launch: Launch, addr: String, state: Arc<Mutex<Watch>>) {
    let mut backoff = Duration::from_secs(1);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let exited = {
            let mut w = lock(&state);
            if w.stopping {
                return;
            }
            match w.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                Some(Ok(None)) => None,
                Some(Err(e)) => Some(e.to_string()),
                None => Some("not running".into()),
            }
        };
        let Some(why) = exited else {
            backoff = Duration::from_secs(1);
            continue;
        };
        tracing::warn!(worker = %launch.name, %addr, "worker exited ({why}); restarting in {backoff:?}");
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(MAX_BACKOFF);
        if lock(&state).stopping {
            return;
        }
        match launch.start(&addr) {
            Ok((child, got)) => {
                let mut w = lock(&state);
                w.restarts += 1;
                tracing::info!(worker = %launch.name, addr = %got, restarts = w.restarts, "worker restarted");
                if w.stopping {
                    let mut c = child;
                    let _ = c.kill();
                    let _ = c.wait();
                    return;
                }
                if let Some(mut old) = w.child.replace(child) {
                    let _ = old.wait();
                }
            }
            Err(e) => tracing::error!(worker = %launch.name, "restarting the worker failed: {e:#}"),
        }
    }
}

impl Children {
    /// Starts `tokenpath worker --role ROLE --listen 127.0.0.1:0 …extra` with the cluster
    /// `secret` in its environment, returns its address, and keeps it running.
    pub fn spawn(
        &mut self,
        name: &str,
        role: Role,
        cpus: Option<&CpuList>,
        extra: &ChildArgs,
        secret: &str,
    ) -> anyhow::Result<String> {
        let launch = Launch {
            name: name.to_owned(),
            role,
            cpus: cpus.map(ToString::to_string),
            extra: extra.clone(),
            secret: secret.to_owned(),
        };
        let (child, addr) = launch.start("127.0.0.1:0")?;
        let state = Arc::new(Mutex::new(Watch { child: Some(child), stopping: false, restarts: 0 }));
        let (st, a) = (Arc::clone(&state), addr.clone());
        let thread = std::thread::Builder::new()
            .name(format!("supervise-{name}"))
            .spawn(move || supervise(launch, a, st))
            .context("starting a supervisor thread")?;
        self.0.push(Supervised { name: name.to_owned(), state, thread: Some(thread) });
        Ok(addr)
    }

    /// Names of children whose process has exited (and not been restarted yet).
    pub fn exited(&mut self) -> Vec<String> {
        self.0
            .iter()
            .filter(|s| {
                let mut w = lock(&s.state);
                w.child.as_mut().is_none_or(|c| matches!(c.try_wait(), Ok(Some(_))))
            })
            .map(|s| s.name.clone())
            .collect()
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for s in &mut self.0 {
            let child = {
                let mut w = lock(&s.state);
                w.stopping = true;
                w.child.take()
            };
            if let Some(mut c) = child {
                if let Ok(None) = c.try_wait() {
                    tracing::debug!(worker = %s.name, "stopping worker");
                    let _ = c.kill();
                }
                let _ = c.wait();
            }
            if let Some(t) = s.thread.take() {
                let _ = t.join();
            }
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
