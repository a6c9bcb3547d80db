//! Bytes → spans: OTLP protobuf (HTTP and gRPC carry the same message) and OTLP/JSON, and the
//! bounded gzip both transports may use. Pure functions of untrusted bytes (fuzzed:
//! `fuzz/fuzz_targets/otlp_export.rs`).

use std::io::Read;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, ArrayValue, KeyValue, KeyValueList};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message;
use serde_json::{Map, Value};
use tokenpath_timeline::{EngineSpan, SpanId, TraceId};

use crate::OtlpError;

/// Most bytes an export may inflate to (a batch of a few thousand spans is a few MB).
pub const MAX_INFLATED: usize = 32 << 20;
/// Deepest nesting of attribute values kept (arrays and maps in maps); deeper ones become null.
const MAX_VALUE_DEPTH: usize = 8;

/// Decodes an OTLP/protobuf `ExportTraceServiceRequest`.
pub fn decode_protobuf(body: &[u8]) -> Result<Vec<EngineSpan>, OtlpError> {
    let req = ExportTraceServiceRequest::decode(body).map_err(|e| OtlpError::Decode(e.to_string()))?;
    Ok(spans_of(req))
}

/// Decodes an OTLP/JSON `ExportTraceServiceRequest` (hex ids, camelCase fields).
pub fn decode_json(body: &[u8]) -> Result<Vec<EngineSpan>, OtlpError> {
    let req: ExportTraceServiceRequest =
        serde_json::from_slice(body).map_err(|e| OtlpError::Decode(e.to_string()))?;
    Ok(spans_of(req))
}

/// Encodes `spans` as one OTLP/protobuf export (what an engine sends; the mock engine and the
/// tests use it), each span under a resource named by its `service`.
pub fn encode_protobuf(spans: &[EngineSpan]) -> Vec<u8> {
    let resource_spans = spans
        .iter()
        .map(|s| ResourceSpans {
            resource: Some(Resource {
                attributes: s
                    .service
                    .iter()
                    .map(|name| KeyValue {
                        key: "service.name".into(),
                        value: Some(AnyValue { value: Some(any_value::Value::StringValue(name.clone())) }),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                spans: vec![Span {
                    trace_id: s.trace_id.0.to_vec(),
                    span_id: s.span_id.0.to_vec(),
                    parent_span_id: s.parent.map(|p| p.0.to_vec()).unwrap_or_default(),
                    name: s.name.clone(),
                    kind: 2, // SERVER
                    start_time_unix_nano: s.start_unix_ns,
                    end_time_unix_nano: s.end_unix_ns,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|(k, v)| KeyValue {
                            key: k.clone(),
                            value: Some(any_of(v)),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        })
        .collect();
    ExportTraceServiceRequest { resource_spans }.encode_to_vec()
}

fn any_of(v: &Value) -> AnyValue {
    let value = match v {
        Value::Null => None,
        Value::Bool(b) => Some(any_value::Value::BoolValue(*b)),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Some(any_value::Value::IntValue(i)),
            None => Some(any_value::Value::DoubleValue(n.as_f64().unwrap_or(f64::NAN))),
        },
        Value::String(s) => Some(any_value::Value::StringValue(s.clone())),
        Value::Array(a) => {
            Some(any_value::Value::ArrayValue(ArrayValue { values: a.iter().map(any_of).collect() }))
        }
        Value::Object(o) => Some(any_value::Value::KvlistValue(KeyValueList {
            values: o
                .iter()
                .map(|(k, x)| KeyValue { key: k.clone(), value: Some(any_of(x)), ..Default::default() })
                .collect(),
        })),
    };
    AnyValue { value }
}

/// Inflates a gzip body, refusing to produce more than `limit` bytes (a gzip bomb stops there).
pub fn inflate_gzip(body: &[u8], limit: usize) -> Result<Vec<u8>, OtlpError> {
    let mut out = Vec::new();
    let mut reader = flate2::read::GzDecoder::new(body).take(limit as u64 + 1);
    reader.read_to_end(&mut out).map_err(|e| OtlpError::Decode(format!("gzip: {e}")))?;
    if out.len() > limit {
        return Err(OtlpError::TooLarge { got: out.len(), limit });
    }
    Ok(out)
}

/// Every span with valid ids, flattened out of its resource and scope. Spans whose trace or span
/// id is missing or all zero cannot be joined to anything and are left out.
fn spans_of(req: ExportTraceServiceRequest) -> Vec<EngineSpan> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs.resource.as_ref().and_then(|r| {
            r.attributes.iter().find(|kv| kv.key == "service.name").and_then(|kv| match &kv.value {
                Some(AnyValue { value: Some(any_value::Value::StringValue(s)) }) => Some(s.clone()),
                _ => None,
            })
        });
        for ss in rs.scope_spans {
            for span in ss.spans {
                let (Some(trace_id), Some(span_id)) =
                    (TraceId::from_slice(&span.trace_id), SpanId::from_slice(&span.span_id))
                else {
                    continue;
                };
                out.push(EngineSpan {
                    trace_id,
                    span_id,
                    parent: SpanId::from_slice(&span.parent_span_id),
                    name: span.name,
                    service: service.clone(),
                    start_unix_ns: span.start_time_unix_nano,
                    end_unix_ns: span.end_time_unix_nano,
                    attributes: attributes(&span.attributes),
                });
            }
        }
    }
    out
}

fn attributes(kvs: &[KeyValue]) -> Map<String, Value> {
    kvs.iter().map(|kv| (kv.key.clone(), kv.value.as_ref().map_or(Value::Null, |v| json(v, 0)))).collect()
}

fn json(v: &AnyValue, depth: usize) -> Value {
    if depth > MAX_VALUE_DEPTH {
        return Value::Null;
    }
    match &v.value {
        None => Value::Null,
        Some(any_value::Value::StringValue(s)) => Value::String(s.clone()),
        Some(any_value::Value::BoolValue(b)) => Value::Bool(*b),
        Some(any_value::Value::IntValue(i)) => Value::from(*i),
        Some(any_value::Value::DoubleValue(d)) => {
            serde_json::Number::from_f64(*d).map_or(Value::Null, Value::Number)
        }
        Some(any_value::Value::ArrayValue(a)) => {
            Value::Array(a.values.iter().map(|x| json(x, depth + 1)).collect())
        }
        Some(any_value::Value::KvlistValue(kv)) => Value::Object(
            kv.values
                .iter()
                .map(|kv| (kv.key.clone(), kv.value.as_ref().map_or(Value::Null, |x| json(x, depth + 1))))
                .collect(),
        ),
        Some(any_value::Value::BytesValue(b)) => {
            Value::String(b.iter().map(|x| format!("{x:02x}")).collect())
        }
        #[allow(unreachable_patterns)] // newer OTLP versions add kinds (string references)
        Some(_) => Value::Null,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn kv(key: &str, v: any_value::Value) -> KeyValue {
        KeyValue { key: key.into(), value: Some(AnyValue { value: Some(v) }), ..Default::default() }
    }

    /// An export holding one vLLM-shaped span per `(trace, queue s)`, plus one span with no ids.
    pub(crate) fn export(spans: &[([u8; 16], f64)]) -> ExportTraceServiceRequest {
        let mut out: Vec<Span> = spans
            .iter()
            .map(|(t, q)| Span {
                trace_id: t.to_vec(),
                span_id: vec![7; 8],
                parent_span_id: vec![9; 8],
                name: "llm_request".into(),
                start_time_unix_nano: 1_000,
                end_time_unix_nano: 2_000,
                attributes: vec![
                    kv("gen_ai.latency.time_in_queue", any_value::Value::DoubleValue(*q)),
                    kv("gen_ai.request.id", any_value::Value::StringValue("chatcmpl-1".into())),
                    kv("gen_ai.usage.prompt_tokens", any_value::Value::IntValue(37)),
                ],
                ..Default::default()
            })
            .collect();
        out.push(Span { name: "no ids".into(), ..Default::default() });
        ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource {
                    attributes: vec![kv("service.name", any_value::Value::StringValue("vllm".into()))],
                    ..Default::default()
                }),
                scope_spans: vec![ScopeSpans { spans: out, ..Default::default() }],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn protobuf_and_json_decode_to_the_same_spans() {
        let req = export(&[([1; 16], 0.25)]);
        let from_pb = decode_protobuf(&req.encode_to_vec()).unwrap();
        let from_json = decode_json(serde_json::to_string(&req).unwrap().as_bytes()).unwrap();
        assert_eq!(from_pb, from_json);
        assert_eq!(from_pb.len(), 1, "the span without ids is dropped");
        let s = &from_pb[0];
        assert_eq!(s.trace_id, TraceId([1; 16]));
        assert_eq!(s.parent, Some(SpanId([9; 8])));
        assert_eq!(s.service.as_deref(), Some("vllm"));
        assert_eq!(s.attributes["gen_ai.latency.time_in_queue"], 0.25);
        assert_eq!(s.attributes["gen_ai.usage.prompt_tokens"], 37);
    }

    #[test]
    fn what_is_encoded_decodes_back() {
        let spans = decode_protobuf(&export(&[([3; 16], 0.5), ([4; 16], 1.5)]).encode_to_vec()).unwrap();
        let mut with_map = spans.clone();
        with_map[0].attributes.insert("nested".into(), serde_json::json!({"a": [1, "x", true]}));
        assert_eq!(decode_protobuf(&encode_protobuf(&with_map)).unwrap(), with_map);
    }

    #[test]
    fn garbage_is_an_error_and_a_gzip_bomb_stops_at_the_limit() {
        assert!(decode_protobuf(&[0xff, 0xff, 0xff]).is_err());
        assert!(decode_json(b"{\"resourceSpans\": 3}").is_err());
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, &vec![0u8; 1 << 20]).unwrap();
        let bomb = gz.finish().unwrap();
        assert!(matches!(inflate_gzip(&bomb, 1000), Err(OtlpError::TooLarge { .. })));
        assert_eq!(inflate_gzip(&bomb, 1 << 20).unwrap().len(), 1 << 20);
        assert!(inflate_gzip(b"not gzip", 1000).is_err());
    }
}
