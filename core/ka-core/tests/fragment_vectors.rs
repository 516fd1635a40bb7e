//! Byte tables made by scapy (`core/vectors/make_fragment_vectors.py`, an
//! independent implementation of the ip_do_fragment rules): the fragmenter
//! must reproduce every output byte.

use std::path::PathBuf;

use ka_core::fragment::{self, Verdict};
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn fragment_outputs_match_the_vectors() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../vectors/fragment_kickass.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("JSON");
    let cases = v["cases"].as_array().expect("cases");
    assert!(cases.len() >= 10);
    for c in cases {
        let name = c["name"].as_str().expect("name");
        let input = unhex(c["input"].as_str().expect("input"));
        let l = c["leading_fragment_len"].as_u64().map(|x| x as usize);
        let want: Vec<Vec<u8>> = c["output"]
            .as_array()
            .expect("output")
            .iter()
            .map(|o| unhex(o.as_str().expect("hex")))
            .collect();
        let got: Vec<Vec<u8>> = match fragment::classify(&input, l) {
            Verdict::Pass(_) => vec![input.clone()],
            Verdict::Cut {
                leading_fragment_len,
            } => fragment::split(&input, leading_fragment_len)
                .expect("cut")
                .to_packets(&input)
                .to_vec(),
        };
        assert_eq!(got, want, "case {name}");
    }
}
