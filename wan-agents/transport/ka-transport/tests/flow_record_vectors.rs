//! The flow record the runner builds from ka-send's output is defined once,
//! in Python (`kickass_core.flow_record`), and pinned here through the shared
//! vector file `core/vectors/flow_record.json`: every example of a transport
//! record must deserialise into [`FlowRecord`] and serialise back to exactly
//! the same JSON, so a renamed, retyped or dropped field fails on this side
//! as the conversion test fails on the Python side.

use std::path::PathBuf;

use ka_transport::FlowRecord;
use serde_json::Value;

fn vectors() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../core/vectors/flow_record.json");
    let text = std::fs::read_to_string(&path).expect("read core/vectors/flow_record.json");
    serde_json::from_str(&text).expect("valid JSON")
}

#[test]
fn transport_records_round_trip_exactly() {
    let doc = vectors();
    let examples = doc["examples"].as_array().expect("examples");
    assert!(examples.len() >= 3);
    for ex in examples {
        let case = ex["case"].as_str().unwrap_or("?");
        let transport = &ex["transport"];
        let record: FlowRecord = serde_json::from_value(transport.clone())
            .unwrap_or_else(|e| panic!("{case}: not a FlowRecord: {e}"));
        let back = serde_json::to_value(&record).expect("serialise");
        assert_eq!(
            &back, transport,
            "{case}: FlowRecord's JSON differs from the vector"
        );
    }
}

#[test]
fn the_counters_python_copies_are_fields_of_the_record() {
    let doc = vectors();
    let record = &doc["examples"][0]["transport"];
    for key in doc["transport_extra"].as_array().expect("transport_extra") {
        let key = key.as_str().expect("a name");
        assert!(record.get(key).is_some(), "{key} is not a FlowRecord field");
    }
}
