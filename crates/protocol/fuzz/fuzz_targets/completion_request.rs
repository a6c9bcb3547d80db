//! Fuzzes the legacy completions body (`/v1/completions`), the other HTTP body the gateway
//! decodes: any body either parses and validates or yields a typed `InvalidRequest`, never a
//! panic; and an accepted request re-serializes to a body that parses to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_protocol::{parse_completion_request, Limits, ProtocolError};

fuzz_target!(|data: &[u8]| {
    match parse_completion_request(data) {
        Ok(req) => {
            let again = serde_json::to_vec(&req).map(|b| parse_completion_request(&b));
            if let Ok(Ok(again)) = again {
                assert_eq!(again, req);
            }
            for cap in [0, Limits::default().max_tokens_cap, u32::MAX] {
                if let Err(e) = req.validate(&Limits { max_tokens_cap: cap }) {
                    let _ = e.api_error();
                }
            }
        }
        Err(e) => assert!(matches!(e, ProtocolError::InvalidRequest { .. })),
    }
});
