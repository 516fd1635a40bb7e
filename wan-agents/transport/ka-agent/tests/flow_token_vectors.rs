//! The receiver's token check against the shared byte vectors
//! (wan-agents/vectors/flow_token.json, also read by the Python agent's
//! tests): the MAC check accepts exactly those tokens under their secrets,
//! and the receiver's policy (Kick-Ass kind, unexpired, once) on top.

use std::net::SocketAddr;

use ka_agent::token::{encode, unhex, verify, FlowToken, Reject, ReplayGuard, KIND_KICKASS};
use ka_transport::wire::{Handshake, Repr};
use ka_transport::{Receiver, ReceiverConfig, ReceiverEvent, RxInfo};

struct Vector {
    secret: Vec<u8>,
    kind: u8,
    expires: u32,
    nonce: [u8; 8],
    token: Vec<u8>,
}

fn vectors() -> Vec<Vector> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../vectors/flow_token.json");
    let text = std::fs::read_to_string(path).expect("vectors file");
    let v: serde_json::Value = serde_json::from_str(&text).expect("vectors JSON");
    assert_eq!(v["version"], 1);
    let hex = |x: &serde_json::Value| unhex(x.as_str().expect("hex string")).expect("hex");
    let out: Vec<Vector> = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| Vector {
            secret: hex(&t["secret_hex"]),
            kind: t["kind"].as_u64().unwrap() as u8,
            expires: t["expires"].as_u64().unwrap() as u32,
            nonce: hex(&t["nonce_hex"]).try_into().expect("8-byte nonce"),
            token: hex(&t["token_hex"]),
        })
        .collect();
    assert!(out.len() >= 3);
    out
}

#[test]
fn mac_check_accepts_exactly_the_vectors() {
    let vs = vectors();
    for (i, v) in vs.iter().enumerate() {
        let want = FlowToken {
            kind: v.kind,
            expires: v.expires,
            nonce: v.nonce,
        };
        assert_eq!(verify(&v.secret, &v.token), Some(want), "vector {i}");
        assert_eq!(encode(&v.secret, &want).to_vec(), v.token, "vector {i}");
        // Under any other vector's secret: refused.
        for (j, w) in vs.iter().enumerate() {
            if w.secret != v.secret {
                assert_eq!(
                    verify(&w.secret, &v.token),
                    None,
                    "vector {i} under secret {j}"
                );
            }
        }
        // Any single bit flipped, or any length change: refused.
        for byte in 0..v.token.len() {
            for bit in 0..8 {
                let mut t = v.token.clone();
                t[byte] ^= 1 << bit;
                assert_eq!(
                    verify(&v.secret, &t),
                    None,
                    "vector {i} byte {byte} bit {bit}"
                );
            }
        }
        assert_eq!(verify(&v.secret, &v.token[..v.token.len() - 1]), None);
        let mut longer = v.token.clone();
        longer.push(0);
        assert_eq!(verify(&v.secret, &longer), None);
    }
}

fn at_2023() -> u64 {
    1_700_000_000
}

#[test]
fn guard_applies_kind_expiry_and_single_use() {
    for v in vectors() {
        let mut g = ReplayGuard::new(v.secret.clone(), at_2023);
        let r = g.check(&v.token, at_2023());
        if v.kind != KIND_KICKASS {
            assert_eq!(r, Err(Reject::WrongKind));
        } else if (v.expires as u64) < at_2023() {
            assert_eq!(r, Err(Reject::Expired));
        } else {
            assert!(r.is_ok());
            assert_eq!(g.check(&v.token, at_2023()), Err(Reject::Replayed));
            // Expired later on.
            let mut g2 = ReplayGuard::new(v.secret.clone(), at_2023);
            if v.expires < u32::MAX {
                assert_eq!(
                    g2.check(&v.token, v.expires as u64 + 1),
                    Err(Reject::Expired)
                );
            }
            assert!(
                g2.check(&v.token, v.expires as u64).is_ok(),
                "valid up to its second"
            );
        }
    }
}

/// The guard as the receiver core's validator: a HANDSHAKE carrying a
/// vector token opens a flow once; the same token from another flow is
/// refused with one small reply.
#[test]
fn receiver_core_opens_a_flow_with_a_vector_token() {
    let v = vectors()
        .into_iter()
        .find(|v| v.kind == KIND_KICKASS && v.expires as u64 >= at_2023())
        .expect("a live Kick-Ass vector");
    let mut rx = Receiver::new(
        ReceiverConfig::default(),
        ReplayGuard::new(v.secret.clone(), at_2023),
    );
    let peer: SocketAddr = "198.18.1.2:40000".parse().unwrap();
    let hs = |flow_id: u64| {
        Repr::Handshake(Handshake {
            flow_id,
            flow_size: 10_000,
            timestamp: 5,
            kickass: true,
            padded: false,
            token: &v.token,
            datagram_len: 64,
        })
        .to_vec()
    };
    rx.handle_datagram(10, peer, &hs(1), RxInfo::whole())
        .expect("accepted");
    assert!(matches!(
        rx.poll_event(),
        Some(ReceiverEvent::FlowAccepted { .. })
    ));
    assert!(rx
        .handle_datagram(11, peer, &hs(2), RxInfo::whole())
        .is_err());
    let mut buf = Vec::new();
    let mut replies = 0;
    while rx.poll_transmit(&mut buf).is_some() {
        replies += 1;
        assert!(buf.len() <= 64);
    }
    assert_eq!(replies, 2, "one accept, one refusal");
    assert!(rx.stats().unvalidated_bytes_out <= rx.stats().unvalidated_bytes_in);
}
