//! How a same-host ring's descriptor gets from the decode worker to the prefill worker: through
//! a per-transfer abstract Unix socket (the "door") the prefill worker listens on, as
//! `SCM_RIGHTS` ancillary data next to the transfer's id and token.
//!
//! The alternative the first version used — the decode worker names `/proc/<pid>/fd/<fd>` and
//! the prefill worker opens it — made the prefill worker a confused deputy (security review H2):
//! whoever answered at `decode_addr` chose which file of which process it opened read-write and
//! wrote KV into. A passed descriptor is, by construction, one its sender holds; the prefill
//! worker opens no path a peer names, and still maps it only after checking it is a sealed memfd
//! of the offered size. Both ends check `SO_PEERCRED` (same user), the prefill worker takes the
//! descriptor only with this transfer's token (an abstract socket is reachable by any process of
//! the network namespace, and its name is listed in `/proc/net/unix`), and every step has a
//! deadline. The decode worker learns the prefill worker's pid from the same credentials, which is
//! what its ring pool keys reuse on (security review L9: a ring is reused only for the process
//! that already has it mapped).

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};
use tokenpath_protocol::cluster::{TransferId, TransferToken};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};

/// Longest either side waits on the door (connect, pass, accept the right peer).
pub(crate) const DOOR_WAIT: Duration = Duration::from_secs(5);
const PREFIX: &str = "tokenpath-kv-";
/// Transfer id (8, little-endian) then token (16).
const MESSAGE: usize = 24;

fn message(transfer: TransferId, token: &TransferToken) -> [u8; MESSAGE] {
    let mut m = [0u8; MESSAGE];
    m[..8].copy_from_slice(&transfer.0.to_le_bytes());
    m[8..].copy_from_slice(&token.0);
    m
}

fn same_user(stream: &UnixStream) -> io::Result<u32> {
    let cred = stream.peer_cred()?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if cred.uid() != me {
        return Err(io::Error::other(format!("door peer runs as uid {}, not {me}", cred.uid())));
    }
    cred.pid().and_then(|p| u32::try_from(p).ok()).ok_or_else(|| io::Error::other("door peer has no pid"))
}

fn abstract_addr(name: &str) -> io::Result<socket2::SockAddr> {
    let hex = name.strip_prefix(PREFIX).unwrap_or_default();
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(io::Error::other(format!("{name:?} is not a KV door name")));
    }
    socket2::SockAddr::unix(format!("\0{name}"))
}

/// The prefill worker's door for one transfer.
#[derive(Debug)]
pub struct Door {
    listener: UnixListener,
    name: String,
}

impl Door {
    /// Listens on a fresh random abstract name.
    pub fn open() -> io::Result<Self> {
        let raw = TransferToken::random().map_err(|e| io::Error::other(e.to_string()))?.0;
        let name = format!("{PREFIX}{}", raw.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
        socket.bind(&abstract_addr(&name)?)?;
        socket.listen(4)?;
        socket.set_nonblocking(true)?;
        let listener = UnixListener::from_std(std::os::unix::net::UnixListener::from(OwnedFd::from(socket)))?;
        Ok(Self { listener, name })
    }

    /// Its name, for `SameHost::door`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The descriptor the decode worker passed for `transfer`: connections from other users, or
    /// without this transfer's id and token, or with anything but one descriptor, are dropped and
    /// the door keeps waiting, up to [`DOOR_WAIT`] in all.
    pub async fn receive(&self, transfer: TransferId, token: &TransferToken) -> io::Result<OwnedFd> {
        let deadline = tokio::time::Instant::now() + DOOR_WAIT;
        loop {
            let (stream, _) = tokio::time::timeout_at(deadline, self.listener.accept())
                .await
                .map_err(|_| io::Error::other("no ring came through the door in time"))??;
            match tokio::time::timeout_at(deadline, take_fd(&stream, transfer, token)).await {
                Ok(Ok(fd)) => return Ok(fd),
                Ok(Err(e)) => tracing::debug!(transfer = transfer.0, "refused a caller at the KV door: {e}"),
                Err(_) => return Err(io::Error::other("no ring came through the door in time")),
            }
        }
    }
}

async fn take_fd(stream: &UnixStream, transfer: TransferId, token: &TransferToken) -> io::Result<OwnedFd> {
    same_user(stream)?;
    let mut got = [0u8; MESSAGE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let r = stream
        .async_io(Interest::READABLE, || {
            rustix::net::recvmsg(stream, &mut [IoSliceMut::new(&mut got)], &mut cmsg, RecvFlags::CMSG_CLOEXEC)
                .map_err(io::Error::from)
        })
        .await?;
    // Every descriptor received is owned here, so the ones refused close on drop.
    let mut fds: Vec<OwnedFd> = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    let (id, theirs) = got.split_at(8);
    let theirs = TransferToken(theirs.try_into().unwrap_or([0; 16]));
    if r.bytes != MESSAGE || id != transfer.0.to_le_bytes() || theirs != *token {
        return Err(io::Error::other("wrong transfer or token"));
    }
    match (fds.pop(), fds.is_empty()) {
        (Some(fd), true) => Ok(fd),
        _ => Err(io::Error::other("expected exactly one descriptor")),
    }
}

/// The decode worker's side: connects to the prefill worker's door; the caller learns its pid.
pub(crate) async fn knock(name: &str) -> io::Result<(UnixStream, u32)> {
    let addr = abstract_addr(name)?;
    let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    // A Unix connect either succeeds at once or (a full backlog) fails with EAGAIN: never waits.
    socket.connect(&addr)?;
    let stream = UnixStream::from_std(std::os::unix::net::UnixStream::from(OwnedFd::from(socket)))?;
    let pid = same_user(&stream)?;
    Ok((stream, pid))
}

/// Passes `fd` through a door opened by [`knock`], with the transfer's id and token.
pub(crate) async fn pass(
    stream: &UnixStream,
    transfer: TransferId,
    token: &TransferToken,
    fd: BorrowedFd<'_>,
) -> io::Result<()> {
    let m = message(transfer, token);
    let send = stream.async_io(Interest::WRITABLE, || {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut cmsg = SendAncillaryBuffer::new(&mut space);
        let fds = [fd.as_fd()];
        cmsg.push(SendAncillaryMessage::ScmRights(&fds));
        rustix::net::sendmsg(stream, &[IoSlice::new(&m)], &mut cmsg, SendFlags::NOSIGNAL)
            .map_err(io::Error::from)
    });
    match tokio::time::timeout(DOOR_WAIT, send).await {
        Ok(Ok(n)) if n == MESSAGE => Ok(()),
        Ok(Ok(n)) => Err(io::Error::other(format!("passed {n} of {MESSAGE} bytes"))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::other("the door did not take the ring in time")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> std::fs::File {
        let f = tempfile_in_memory();
        f.set_len(4096).unwrap();
        f
    }

    fn tempfile_in_memory() -> std::fs::File {
        // SAFETY: a NUL-terminated name; memfd_create has no other preconditions.
        let fd = unsafe { libc::memfd_create(c"tp-door-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor this function owns.
        unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) }
    }

    #[tokio::test]
    async fn a_descriptor_goes_through_only_with_the_transfers_token() {
        use std::os::unix::fs::MetadataExt;
        let door = Door::open().unwrap();
        let (transfer, token) = (TransferId(42), TransferToken([7; 16]));
        let file = memfd();
        let name = door.name().to_owned();
        let f2 = file.try_clone().unwrap();
        let sender = tokio::spawn(async move {
            // A caller with the wrong token first: refused, the door keeps waiting.
            let (s, pid) = knock(&name).await.unwrap();
            assert_eq!(pid, std::process::id());
            pass(&s, transfer, &TransferToken([8; 16]), f2.as_fd()).await.unwrap();
            let (s, _) = knock(&name).await.unwrap();
            pass(&s, TransferId(43), &token, f2.as_fd()).await.unwrap();
            let (s, _) = knock(&name).await.unwrap();
            pass(&s, transfer, &token, f2.as_fd()).await.unwrap();
        });
        let got = std::fs::File::from(door.receive(transfer, &token).await.unwrap());
        sender.await.unwrap();
        assert_eq!(got.metadata().unwrap().ino(), file.metadata().unwrap().ino());
    }

    #[tokio::test(start_paused = true)]
    async fn nobody_at_the_door_is_a_bounded_wait() {
        let door = Door::open().unwrap();
        let e = door.receive(TransferId(1), &TransferToken([1; 16])).await.unwrap_err();
        assert!(e.to_string().contains("in time"), "{e}");
    }

    #[test]
    fn only_door_names_are_dialled() {
        for bad in [
            "",
            "tokenpath-kv-",
            "/tmp/x",
            "tokenpath-kv-zz",
            "tokenpath-kv-0123456789abcdef0123456789abcdef0",
        ] {
            assert!(abstract_addr(bad).is_err(), "{bad:?}");
        }
        assert!(abstract_addr("tokenpath-kv-0123456789abcdef0123456789abcdef").is_ok());
    }
}
