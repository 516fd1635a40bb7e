//! The Rust encodings must produce exactly what the Python core pinned in
//! `core/vectors/*.json` (read from the repository, not copied).

use std::path::PathBuf;

use ka_core::encoding;
use serde_json::Value;

fn load(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../vectors")
        .join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("vector file is JSON")
}

#[test]
fn rate_encoding_vectors() {
    let v = load("rate_encoding.json");
    assert_eq!(v["version"], 1);
    let len_to_rate = v["len_to_rate"].as_array().expect("len_to_rate");
    assert!(len_to_rate.len() > 100);
    for case in len_to_rate {
        let l = case["leading_fragment_len"].as_u64().expect("len") as usize;
        let want = case["rate_bytes_per_ms"].as_f64().expect("rate");
        let got = encoding::advertised_rate(l).expect("valid length");
        assert!((got - want).abs() <= want * 1e-12, "L={l}: {got} vs {want}");
    }
    let rate_to_len = v["rate_to_len"].as_array().expect("rate_to_len");
    assert!(rate_to_len.len() > 100);
    for case in rate_to_len {
        let r = case["rate_bytes_per_ms"].as_f64().expect("rate");
        let want = case["leading_fragment_len"].as_u64().map(|x| x as usize);
        assert_eq!(encoding::leading_fragment_len(r), want, "R={r}");
    }
}

#[test]
fn rtt_indicator_vectors() {
    let v = load("rtt_indicator.json");
    assert_eq!(v["version"], 1);
    for case in v["rtt_to_indicator"].as_array().expect("rtt_to_indicator") {
        let rtt = case["rtt_ms"].as_f64().expect("rtt");
        let want = case["ip_len"].as_u64().expect("len") as usize;
        assert_eq!(encoding::rtt_indicator(rtt), want, "rtt={rtt}");
    }
    let back = v["indicator_to_rtt"].as_array().expect("indicator_to_rtt");
    assert_eq!(back.len(), 12);
    for case in back {
        let len = case["ip_len"].as_u64().expect("len") as usize;
        let want = case["midpoint_ms"].as_f64().expect("midpoint");
        assert_eq!(
            encoding::rtt_indicator_midpoint_ms(len),
            Some(want),
            "len={len}"
        );
        assert!(encoding::is_rtt_indicator(len, true));
        assert!(!encoding::is_rtt_indicator(len, false));
    }
    assert_eq!(encoding::rtt_indicator_midpoint_ms(599), None);
    assert_eq!(encoding::rtt_indicator_midpoint_ms(612), None);
}
