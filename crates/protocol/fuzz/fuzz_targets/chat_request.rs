//! Fuzzes request parsing and validation, the gateway's first contact with client bytes: any
//! body either parses and validates or yields a typed `InvalidRequest`, never a panic; and an
//! accepted request re-serializes to a body that parses to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_protocol::{parse_chat_request, parse_completion_request, Limits, ProtocolError};

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    match parse_chat_request(data) {
        Ok(req) => {
            let again = serde_json::to_vec(&req).map(|b| parse_chat_request(&b));
            if let Ok(Ok(again)) = again {
                assert_eq!(again, req);
            }
            if let Err(e) = req.validate(&limits) {
                let _ = e.api_error();
            }
        }
        Err(e) => assert!(matches!(e, ProtocolError::InvalidRequest { .. })),
    }
    if let Ok(req) = parse_completion_request(data) {
        let _ = req.validate(&limits);
    }
});
