//! gRPC's unary framing, by hand: one method (`TraceService/Export`) needs a 5-byte message
//! prefix each way and a `grpc-status` trailer — forty lines, where tonic would add a second
//! server stack and a client we do not use.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::OtlpError;

/// gRPC status codes the receiver answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Code {
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

/// The one message of a unary request: `(compressed, payload)`.
pub(crate) fn unframe(body: &[u8]) -> Result<(bool, &[u8]), OtlpError> {
    let [flag, l0, l1, l2, l3, rest @ ..] = body else {
        return Err(OtlpError::Decode(format!(
            "a gRPC message needs a 5-byte prefix, got {} bytes",
            body.len()
        )));
    };
    let len = u32::from_be_bytes([*l0, *l1, *l2, *l3]) as usize;
    if len != rest.len() {
        return Err(OtlpError::Decode(format!("gRPC prefix says {len} bytes, {} follow", rest.len())));
    }
    match flag {
        0 => Ok((false, rest)),
        1 => Ok((true, rest)),
        f => Err(OtlpError::Decode(format!("gRPC compressed flag {f}"))),
    }
}

/// One message framed for a unary call (uncompressed): what a client sends.
pub fn frame(message: &[u8]) -> Vec<u8> {
    let mut framed = Vec::with_capacity(5 + message.len());
    framed.push(0);
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(message);
    framed
}

fn headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("content-type", HeaderValue::from_static("application/grpc"));
    h
}

/// A successful unary reply: the framed `message`, then `grpc-status: 0` as a trailer.
pub(crate) fn ok(message: &[u8]) -> Response {
    let framed = frame(message);
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0")); // OK
    let body = Full::new(Bytes::from(framed))
        .map_err(|never| match never {})
        .with_trailers(async move { Some(Ok::<_, std::convert::Infallible>(trailers)) });
    let mut r = Response::new(Body::new(body));
    *r.headers_mut() = headers();
    r
}

/// A failed call, "trailers-only": status and message in the one header block, no body.
pub(crate) fn error(code: Code, message: &str) -> Response {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::OK;
    let mut h = headers();
    h.insert("grpc-status", HeaderValue::from(code as u32));
    // grpc-message is percent-encoded; keeping it to printable ASCII is enough for our texts.
    let clean: String =
        message.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect();
    if let Ok(v) = HeaderValue::from_str(&clean) {
        h.insert("grpc-message", v);
    }
    *r.headers_mut() = h;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_unframes_and_bad_prefixes_are_refused() {
        assert_eq!(unframe(&[0, 0, 0, 0, 2, 9, 9]).unwrap(), (false, &[9u8, 9][..]));
        assert_eq!(unframe(&[1, 0, 0, 0, 0]).unwrap(), (true, &[][..]));
        assert!(unframe(&[0, 0, 0, 0, 3, 9]).is_err());
        assert!(unframe(&[2, 0, 0, 0, 0]).is_err());
        assert!(unframe(&[0, 0]).is_err());
    }
}
