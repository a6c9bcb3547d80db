//! A connection that will not take bytes is cut off: [`WriteDeadline`] fails a write (or flush)
//! that has made no progress for its deadline.
//!
//! Generation already pauses for a client that stops reading (the worker's batcher does not
//! step a sequence whose reader is behind, and gives its KV up when others need it); what stayed
//! unbounded is the *connection*: a client that advertises a zero window kept the socket, its
//! buffered events and a connection place forever, since hyper has no write timeout. With this,
//! hyper sees `TimedOut`, drops the response body, and the request is cancelled like any other
//! disconnect (its KV freed at the worker's next step).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `inner`, except that a write, flush or shutdown pending for longer than `stall` fails.
pub(crate) struct WriteDeadline<S> {
    inner: S,
    stall: Duration,
    /// Armed when a write first returns `Pending`; cleared by any progress.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub(crate) fn new(inner: S, stall: Duration) -> Self {
        Self { inner, stall, timer: None }
    }

    fn pending<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.timer = None;
            return r;
        }
        let stall = self.stall;
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took no bytes for {:.0} s", stall.as_secs_f64()),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.pending(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.pending(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.pending(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.pending(cx, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_stops_taking_bytes_fails_the_write_after_the_stall() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(ours, Duration::from_secs(30));
        // A reader that keeps up: writes far past the pipe's 64 bytes succeed.
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; 4096];
            theirs.read_exact(&mut got).await.unwrap();
            theirs
        });
        w.write_all(&[7u8; 4096]).await.unwrap();
        let _theirs = reader.await.unwrap();
        // Now nobody reads: the pipe fills, and the write fails once 30 s pass without progress.
        let start = tokio::time::Instant::now();
        let e = w.write_all(&[1u8; 4096]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(start.elapsed() >= Duration::from_secs(30));
    }
}
