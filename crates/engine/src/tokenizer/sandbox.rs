//! Chat templates render in a child process, because a template is code that comes with an
//! untrusted model file and minijinja cannot bound what such code does in-process.
//!
//! Fuel bounds a render's instruction count, not its stack or its memory: a namespace stored in
//! itself (`{% set ns.x = ns %}{{ ns }}`) recurses without end when printed, `s ~ s` doubles a
//! string per instruction, `'a' * n` allocates `n` bytes at once, and a reference cycle leaks on
//! every render. In-process, a stack overflow or a failed allocation aborts the whole server,
//! and no hook in minijinja lets us refuse an allocation or a recursion step. A child process
//! with an address-space limit, no core dumps, an empty environment and a deadline turns each of
//! those into one failed render: the request gets `TemplateRender`, the child is replaced and
//! every other request carries on. (Static checks can catch the cycle, not the doubling through
//! an alias; a process boundary bounds every case, including the ones nobody has found yet.)
//!
//! The binary that wants this calls [`install`] once at start with a command that runs
//! [`serve_stdio`] (the `tokenpath` binary: itself, with a hidden subcommand); after that every
//! [`ChatTemplate`](super::ChatTemplate) built in the process renders through a small pool of
//! children. Without `install` (library users, unit tests, fuzzing) templates render in-process
//! under fuel and the work budget in `pycompat.rs` alone.
//!
//! Wire: each way, frames of a 4-byte little-endian length and a JSON body; the parent sends
//! `Init` once and then one `Render` per request and waits for one reply with a deadline. The
//! parent never trusts the child either: a reply is length-checked before it is read.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::TokenizerError;

/// Largest frame either side accepts (a rendered prompt, or the messages of one request).
pub const MAX_FRAME: usize = 64 << 20;
/// Address space a sandbox child may map (the binary, its heap and one render).
pub const CHILD_ADDRESS_SPACE: u64 = 2 << 30;
/// Children rendering at once; a render waits for a free one.
pub const MAX_CHILDREN: usize = 4;
/// Renders one child serves before it is replaced (what a leaking template can accumulate).
pub const RENDERS_PER_CHILD: u32 = 10_000;

/// How to start a sandbox child and how long one render may take.
#[derive(Debug, Clone)]
pub struct SandboxProgram {
    /// The executable.
    pub program: PathBuf,
    /// Its arguments (they must make it run [`serve_stdio`]).
    pub args: Vec<OsString>,
    /// Longest one render may take before the child is killed.
    pub deadline: Duration,
    /// Digests of templates the operator reviewed: they render in-process, like the built-in
    /// [`REVIEWED`](super::reviewed::REVIEWED) ones.
    pub trusted: Vec<String>,
}

static PROGRAM: OnceLock<SandboxProgram> = OnceLock::new();

/// Makes every chat template built from now on render in sandbox children started with
/// `program`. Returns `false` (and changes nothing) when one was installed already.
pub fn install(program: SandboxProgram) -> bool {
    PROGRAM.set(program).is_ok()
}

pub(crate) fn installed() -> Option<&'static SandboxProgram> {
    PROGRAM.get()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Init {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

#[derive(Debug, Serialize, Deserialize)]
enum ToChild {
    Init(Init),
    Render {
        messages: serde_json::Value,
        add_generation_prompt: bool,
        extra: serde_json::Map<String, serde_json::Value>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
enum FromChild {
    Ready,
    Rendered(String),
    Failed(String),
}

fn write_frame(w: &mut impl Write, msg: &impl Serialize) -> std::io::Result<()> {
    // One write per frame (length and body together): the reader wakes once, not twice.
    let mut frame = vec![0u8; 4];
    serde_json::to_writer(&mut frame, msg).map_err(std::io::Error::other)?;
    let len = frame.len() - 4;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("frame of {len} bytes is over {MAX_FRAME}")));
    }
    frame[..4].copy_from_slice(&(len as u32).to_le_bytes());
    w.write_all(&frame)?;
    w.flush()
}

/// `Ok(None)` on a clean end of stream before a frame starts.
fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("frame of {len} bytes is over {MAX_FRAME}")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map(Some).map_err(std::io::Error::other)
}

/// The child's main: limits itself, compiles the template it is sent, then renders until its
/// input ends. Exits non-zero on a broken pipe or frame; a render that overflows the stack or
/// runs out of address space aborts the process, which is the point.
pub fn serve_stdio() -> Result<(), TokenizerError> {
    limit_self();
    let io_err = |e: std::io::Error| TokenizerError::TemplateRender(format!("sandbox i/o: {e}"));
    let mut input = std::io::stdin().lock();
    let mut output = std::io::stdout().lock();
    let Some(ToChild::Init(init)) = read_frame(&mut input).map_err(io_err)? else {
        return Err(TokenizerError::TemplateRender("sandbox: the first frame must be Init".into()));
    };
    let template = match super::ChatTemplate::in_process(&init) {
        Ok(t) => {
            write_frame(&mut output, &FromChild::Ready).map_err(io_err)?;
            t
        }
        Err(e) => {
            write_frame(&mut output, &FromChild::Failed(e.to_string())).map_err(io_err)?;
            return Ok(());
        }
    };
    while let Some(msg) = read_frame::<ToChild>(&mut input).map_err(io_err)? {
        let ToChild::Render { messages, add_generation_prompt, extra } = msg else {
            return Err(TokenizerError::TemplateRender("sandbox: Init sent twice".into()));
        };
        let reply = match template.render_here(&messages, add_generation_prompt, &extra) {
            Ok(text) if text.len() + 64 <= MAX_FRAME => FromChild::Rendered(text),
            Ok(text) => {
                FromChild::Failed(format!("the rendered prompt is {} bytes, over {MAX_FRAME}", text.len()))
            }
            Err(TokenizerError::TemplateRender(m)) => FromChild::Failed(m),
            Err(e) => FromChild::Failed(e.to_string()),
        };
        write_frame(&mut output, &reply).map_err(io_err)?;
    }
    Ok(())
}

/// Address space, no core files, few descriptors, and death with the parent.
fn limit_self() {
    let set = |res, soft: u64| {
        let lim = libc::rlimit { rlim_cur: soft as libc::rlim_t, rlim_max: soft as libc::rlim_t };
        // SAFETY: setrlimit reads the struct we pass; failure leaves the old limit (logged).
        if unsafe { libc::setrlimit(res, &lim) } != 0 {
            tracing::warn!("sandbox: setrlimit({res}) failed: {}", std::io::Error::last_os_error());
        }
    };
    set(libc::RLIMIT_AS, CHILD_ADDRESS_SPACE);
    set(libc::RLIMIT_CORE, 0);
    set(libc::RLIMIT_NOFILE, 16);
    // SAFETY: PR_SET_PDEATHSIG takes a signal number; it only affects this process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) };
}

/// One running child: its pipes. Replies are read in the calling thread, each read preceded by
/// a `poll` bounded by the render's deadline (no reader thread: a render is one round trip
/// between two processes, not four thread wake-ups).
struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    renders: u32,
}

/// Reads from a child's stdout, failing with `TimedOut` once `until` has passed without data.
struct DeadlineReader<'a> {
    pipe: &'a mut ChildStdout,
    until: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let left = self.until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
            let mut pfd = libc::pollfd { fd: self.pipe.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            match unsafe { libc::poll(&mut pfd, 1, ms) } {
                0 => continue, // re-check the deadline (poll rounds to milliseconds)
                n if n < 0 => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
                // Readable, hung up or in error: the read says which.
                _ => return self.pipe.read(buf),
            }
        }
    }
}

impl Worker {
    fn spawn(program: &SandboxProgram, init: &Init) -> Result<Self, TokenizerError> {
        let err = |what: &str, e: std::io::Error| {
            TokenizerError::TemplateRender(format!(
                "template sandbox {}: {what}: {e}",
                program.program.display()
            ))
        };
        let mut child = Command::new(&program.program)
            .args(&program.args)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| err("start", e))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(TokenizerError::TemplateRender("template sandbox: no pipes".into()));
        };
        let mut w = Self { child, stdin, stdout, renders: 0 };
        match w.call(&ToChild::Init(init.clone()), program.deadline)? {
            FromChild::Ready => Ok(w),
            FromChild::Failed(m) => Err(TokenizerError::TemplateSyntax(m)),
            FromChild::Rendered(_) => Err(w.broken("answered Init with a render")),
        }
    }

    /// Sends one frame and waits for its reply; any failure leaves the child dead.
    fn call(&mut self, msg: &ToChild, deadline: Duration) -> Result<FromChild, TokenizerError> {
        let until = Instant::now() + deadline;
        if let Err(e) = write_frame(&mut self.stdin, msg) {
            return Err(self.broken(&format!("did not take the request ({e})")));
        }
        match read_frame::<FromChild>(&mut DeadlineReader { pipe: &mut self.stdout, until }) {
            Ok(Some(reply)) => Ok(reply),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                Err(self.broken(&format!("took longer than {:.1} s and was stopped", deadline.as_secs_f64())))
            }
            Ok(None) | Err(_) => {
                Err(self.broken("stopped (the template crashed it or exhausted its memory)"))
            }
        }
    }

    /// Kills the child and describes why, with how it ended.
    fn broken(&mut self, why: &str) -> TokenizerError {
        let _ = self.child.kill();
        let status = self.child.wait().map(|s| format!(" ({s})")).unwrap_or_default();
        tracing::warn!("chat template sandbox {why}{status}; a fresh one takes its place");
        TokenizerError::TemplateRender(format!("the chat template render {why}{status}"))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The children of one template: idle ones kept for reuse, at most [`MAX_CHILDREN`] at once.
pub(crate) struct Sandbox {
    program: &'static SandboxProgram,
    init: Init,
    idle: Mutex<Vec<Worker>>,
    busy: Mutex<usize>,
    freed: Condvar,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("program", &self.program.program).finish_non_exhaustive()
    }
}

impl Sandbox {
    /// The children of `init`'s template; the first starts with the first render (a worker
    /// process that only ever receives token ids never starts one).
    pub(crate) fn new(program: &'static SandboxProgram, init: Init) -> Self {
        Self { program, init, idle: Mutex::new(Vec::new()), busy: Mutex::new(0), freed: Condvar::new() }
    }

    pub(crate) fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        let _slot = self.take_slot();
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut worker = match idle {
            Some(w) => w,
            None => Worker::spawn(self.program, &self.init)?,
        };
        let msg = ToChild::Render { messages: messages.clone(), add_generation_prompt, extra: extra.clone() };
        let reply = worker.call(&msg, self.program.deadline)?;
        worker.renders += 1;
        if worker.renders < RENDERS_PER_CHILD {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(worker);
        }
        match reply {
            FromChild::Rendered(text) => Ok(text),
            FromChild::Failed(m) => Err(TokenizerError::TemplateRender(m)),
            FromChild::Ready => {
                Err(TokenizerError::TemplateRender("template sandbox answered out of turn".into()))
            }
        }
    }

    fn take_slot(&self) -> SlotGuard<'_> {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        while *busy >= MAX_CHILDREN {
            busy = self.freed.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        *busy += 1;
        SlotGuard(self)
    }
}

struct SlotGuard<'a>(&'a Sandbox);

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        *self.0.busy.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        self.0.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversized_lengths_are_refused_before_reading() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &FromChild::Rendered("hi".into())).unwrap();
        let back: Option<FromChild> = read_frame(&mut buf.as_slice()).unwrap();
        assert!(matches!(back, Some(FromChild::Rendered(ref s)) if s == "hi"));
        let empty: Option<FromChild> = read_frame(&mut [].as_slice()).unwrap();
        assert!(empty.is_none());
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        assert!(read_frame::<FromChild>(&mut huge.as_slice()).is_err());
        let garbage = [3u8, 0, 0, 0, b'x', b'y', b'z'];
        assert!(read_frame::<FromChild>(&mut garbage.as_slice()).is_err());
    }
}
