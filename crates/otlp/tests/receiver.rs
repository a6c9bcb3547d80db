//! The receiver over real sockets: one port takes OTLP/HTTP protobuf, OTLP/HTTP JSON with gzip
//! and OTLP/gRPC; a collect returns every expected trace's spans; the bearer token, the size
//! bounds and malformed bodies are refused with each transport's own error shape.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message;
use tokenpath_otlp::{Receiver, ReceiverConfig, TraceId, GRPC_EXPORT_PATH, HTTP_TRACES_PATH};

fn export(trace: u8, queue_s: f64) -> ExportTraceServiceRequest {
    let attr = |k: &str, v| KeyValue {
        key: k.into(),
        value: Some(AnyValue { value: Some(v) }),
        ..Default::default()
    };
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            scope_spans: vec![ScopeSpans {
                spans: vec![Span {
                    trace_id: vec![trace; 16],
                    span_id: vec![trace; 8],
                    name: "llm_request".into(),
                    start_time_unix_nano: 1,
                    end_time_unix_nano: 2,
                    attributes: vec![attr(
                        "gen_ai.latency.time_in_queue",
                        any_value::Value::DoubleValue(queue_s),
                    )],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

fn grpc_frame(msg: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8];
    f.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    f.extend_from_slice(msg);
    f
}

async fn start(token: Option<&str>) -> (Receiver, String) {
    let mut cfg = ReceiverConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.token = token.map(str::to_owned);
    cfg.max_body = 64 << 10;
    let r = Receiver::start(cfg).await.unwrap();
    let base = format!("http://{}", r.addr);
    (r, base)
}

#[tokio::test]
async fn all_three_transports_land_in_one_store_and_join_by_trace_id() {
    let (rx, base) = start(None).await;
    for t in 1..=4u8 {
        rx.store.expect(TraceId([t; 16])).unwrap();
    }
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{base}{HTTP_TRACES_PATH}"))
        .header("content-type", "application/x-protobuf")
        .body(export(1, 0.001).encode_to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-protobuf");

    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(serde_json::to_string(&export(2, 0.002)).unwrap().as_bytes()).unwrap();
    let r = http
        .post(format!("{base}{HTTP_TRACES_PATH}"))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(gz.finish().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);

    let h2 = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let r = h2
        .post(format!("{base}{GRPC_EXPORT_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(grpc_frame(&export(3, 0.003).encode_to_vec()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("grpc-status").is_none(), "success sends its status as a trailer");
    assert_eq!(r.bytes().await.unwrap().as_ref(), &[0, 0, 0, 0, 0], "one empty ExportTraceServiceResponse");

    let got = rx.store.collect(Duration::from_millis(300), Duration::ZERO).await.unwrap();
    assert_eq!(got.spans.len(), 3);
    assert_eq!(got.missing, 1, "trace 4 never came");
    for t in 1..=3u8 {
        let s = &got.spans[&TraceId([t; 16])][0];
        assert_eq!(s.attributes["gen_ai.latency.time_in_queue"], f64::from(t) / 1000.0);
    }
}

#[tokio::test]
async fn a_token_is_required_and_bad_bodies_get_each_transports_error() {
    let (rx, base) = start(Some("s3cret")).await;
    rx.store.expect(TraceId([1; 16])).unwrap();
    let http = reqwest::Client::new();
    let post = |body: Vec<u8>, ctype: &'static str, token: Option<&'static str>| {
        let mut b = http.post(format!("{base}{HTTP_TRACES_PATH}")).header("content-type", ctype).body(body);
        if let Some(t) = token {
            b = b.bearer_auth(t);
        }
        b.send()
    };
    let pb = export(1, 0.5).encode_to_vec();
    assert_eq!(post(pb.clone(), "application/x-protobuf", None).await.unwrap().status(), 401);
    assert_eq!(post(pb.clone(), "application/x-protobuf", Some("wrong")).await.unwrap().status(), 401);
    assert_eq!(post(vec![0xff; 8], "application/x-protobuf", Some("s3cret")).await.unwrap().status(), 400);
    assert_eq!(post(pb.clone(), "text/plain", Some("s3cret")).await.unwrap().status(), 415);
    assert_eq!(
        post(vec![0; 65 << 10], "application/x-protobuf", Some("s3cret")).await.unwrap().status(),
        413
    );

    let h2 = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let grpc = |body: Vec<u8>, token: Option<&'static str>| {
        let mut b = h2
            .post(format!("{base}{GRPC_EXPORT_PATH}"))
            .header("content-type", "application/grpc")
            .body(body);
        if let Some(t) = token {
            b = b.bearer_auth(t);
        }
        b.send()
    };
    let r = grpc(grpc_frame(&pb), None).await.unwrap();
    assert_eq!(r.headers()["grpc-status"], "16");
    let r = grpc(vec![0, 0, 0, 0, 9, 1], Some("s3cret")).await.unwrap();
    assert_eq!(r.headers()["grpc-status"], "3");
    assert!(r.headers()["grpc-message"].to_str().unwrap().contains("prefix"));

    // Nothing refused reached the store; the good export with the token does.
    assert_eq!(post(pb, "application/x-protobuf", Some("s3cret")).await.unwrap().status(), 200);
    let got = rx.store.collect(Duration::from_secs(5), Duration::ZERO).await.unwrap();
    assert_eq!(got.spans[&TraceId([1; 16])].len(), 1);
}

/// Regression (review of issue 18): a gRPC export that stalled got an HTTP 408 (a status a gRPC
/// exporter cannot read), a gRPC call without gRPC's content type was decoded anyway, and a
/// body that broke off was reported as too large. Each transport now hears its own error.
#[tokio::test]
async fn a_stalled_export_times_out_in_each_transports_terms() {
    let mut cfg = ReceiverConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.timeout = Duration::from_millis(300);
    let rx = Receiver::start(cfg).await.unwrap();
    let base = format!("http://{}", rx.addr);
    let stalled = || {
        let first = futures_util::stream::iter([Ok::<_, std::io::Error>(vec![0u8, 0, 0, 0, 9])]);
        reqwest::Body::wrap_stream(futures_util::StreamExt::chain(first, futures_util::stream::pending()))
    };
    let h2 = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let r = h2
        .post(format!("{base}{GRPC_EXPORT_PATH}"))
        .header("content-type", "application/grpc")
        .body(stalled())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "gRPC errors travel in grpc-status");
    assert_eq!(r.headers()["grpc-status"], "4", "DEADLINE_EXCEEDED");
    let r = h2
        .post(format!("{base}{GRPC_EXPORT_PATH}"))
        .header("content-type", "application/json")
        .body(grpc_frame(&export(1, 0.5).encode_to_vec()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["grpc-status"], "12", "not a gRPC call: refused, not decoded");
    let r = reqwest::Client::new()
        .post(format!("{base}{HTTP_TRACES_PATH}"))
        .header("content-type", "application/x-protobuf")
        .body(stalled())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 408);
    let r = h2
        .post(format!("{base}/nowhere"))
        .header("content-type", "application/grpc")
        .body(grpc_frame(&[]))
        .send()
        .await
        .unwrap();
    assert_eq!((r.status().as_u16(), &r.headers()["grpc-status"]), (200, &"12".parse().unwrap()));
}
