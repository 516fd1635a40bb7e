//! Property tests of the wire format and of both endpoints' input paths:
//! parsing never panics on any bytes, every representable datagram
//! round-trips, and no input (random or mutated) panics an endpoint or
//! makes the receiver amplify.

mod common;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use common::manual::{ms, Manual, L_10MBIT};
use common::{TokenIs, TOKEN};
use ka_transport::wire::{
    Ack, Data, Fin, Handshake, HandshakeAck, RateEcho, Repr, RttIndicator, SackBlocks, Status,
    FULL_UDP_PAYLOAD_LEN, MAX_SACK_BLOCKS, MAX_TOKEN_LEN, MIN_HANDSHAKE_LEN,
};
use ka_transport::{Config, Receiver, ReceiverConfig, RxInfo, SMSS};
use proptest::prelude::*;

fn status() -> impl Strategy<Value = Status> {
    prop_oneof![
        Just(Status::Accepted),
        Just(Status::BadToken),
        Just(Status::FlowTooLarge),
        Just(Status::Busy),
        Just(Status::FlowIdInUse),
    ]
}

fn rate_echo() -> impl Strategy<Value = RateEcho> {
    prop_oneof![
        Just(RateEcho::default()),
        (1u16..=u16::MAX).prop_map(|l| RateEcho::observed(Some(l))),
        (any::<Option<u16>>(), any::<Option<u64>>()).prop_map(|(l, r)| RateEcho {
            leading_fragment_len: l.filter(|&x| x != 0),
            advertised_rate: r.filter(|&x| x != 0),
        }),
    ]
}

fn sack() -> impl Strategy<Value = SackBlocks> {
    proptest::collection::vec((any::<u64>(), 1u64..1 << 40), 0..=MAX_SACK_BLOCKS).prop_map(|v| {
        v.into_iter()
            .map(|(s, l)| (s.min(u64::MAX - l), s.min(u64::MAX - l) + l))
            .collect()
    })
}

/// Owned pieces of a datagram (Repr borrows its token/payload).
#[derive(Debug, Clone)]
enum Spec {
    Handshake(u64, u64, u64, bool, bool, Vec<u8>, usize),
    HandshakeAck(u64, Status, bool, RateEcho, u64),
    Data(u64, u64, u64, bool, Vec<u8>),
    Ack(u64, u64, u64, bool, RateEcho, SackBlocks),
    Fin(u64, u64, u64, bool),
    Rtt(u64, usize),
}

impl Spec {
    fn repr(&self) -> Repr<'_> {
        match self {
            Spec::Handshake(id, size, ts, ka, padded, token, len) => Repr::Handshake(Handshake {
                flow_id: *id,
                flow_size: *size,
                timestamp: *ts,
                kickass: *ka,
                padded: *padded,
                token,
                datagram_len: *len,
            }),
            Spec::HandshakeAck(id, status, ka, echo, ts) => Repr::HandshakeAck(HandshakeAck {
                flow_id: *id,
                status: *status,
                kickass: *ka,
                rate_echo: *echo,
                ts_echo: *ts,
            }),
            Spec::Data(id, seq, ts, retx, payload) => Repr::Data(Data {
                flow_id: *id,
                seq: *seq,
                timestamp: *ts,
                retransmission: *retx,
                payload,
            }),
            Spec::Ack(id, cum, ts, ece, echo, sack) => Repr::Ack(Ack {
                flow_id: *id,
                cum_ack: *cum,
                ts_echo: *ts,
                ece: *ece,
                rate_echo: *echo,
                sack: *sack,
            }),
            Spec::Fin(id, size, ts, ack) => {
                let f = Fin {
                    flow_id: *id,
                    final_size: *size,
                    timestamp: *ts,
                };
                if *ack {
                    Repr::FinAck(f)
                } else {
                    Repr::Fin(f)
                }
            }
            Spec::Rtt(id, len) => Repr::RttIndicator(RttIndicator {
                flow_id: *id,
                datagram_len: *len,
            }),
        }
    }
}

fn spec() -> impl Strategy<Value = Spec> {
    prop_oneof![
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 0..=MAX_TOKEN_LEN),
            MIN_HANDSHAKE_LEN..=FULL_UDP_PAYLOAD_LEN,
        )
            .prop_map(|(a, b, c, d, e, t, l)| {
                let l = l.max(32 + t.len());
                Spec::Handshake(a, b, c, d, e, t, l)
            }),
        (
            any::<u64>(),
            status(),
            any::<bool>(),
            rate_echo(),
            any::<u64>()
        )
            .prop_map(|(a, b, c, d, e)| Spec::HandshakeAck(a, b, c, d, e)),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 0..1500),
        )
            .prop_map(|(a, b, c, d, p)| Spec::Data(a, b, c, d, p)),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            rate_echo(),
            sack()
        )
            .prop_map(|(a, b, c, d, e, f)| Spec::Ack(a, b, c, d, e, f)),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<bool>())
            .prop_map(|(a, b, c, d)| Spec::Fin(a, b, c, d)),
        (any::<u64>(), 16usize..1500).prop_map(|(a, l)| Spec::Rtt(a, l)),
    ]
}

/// A valid datagram, then damaged: bytes flipped, truncated or extended.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    (
        spec(),
        proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        prop_oneof![Just(None), any::<prop::sample::Index>().prop_map(Some)],
        proptest::collection::vec(any::<u8>(), 0..3),
    )
        .prop_map(|(s, flips, cut, extra)| {
            let mut b = s.repr().to_vec();
            for (i, v) in flips {
                let i = i.index(b.len());
                b[i] ^= v;
            }
            if let Some(c) = cut {
                b.truncate(c.index(b.len() + 1));
            }
            b.extend(extra);
            b
        })
}

fn addr(i: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), i))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn parse_never_panics_on_arbitrary_bytes(b in prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..1600),
        // Our magic and version, a plausible kind, random rest: reaches
        // every kind's length checks.
        (1u8..=8, proptest::collection::vec(any::<u8>(), 0..200)).prop_map(|(k, rest)| {
            let mut b = vec![b'K', b'A', 1, k];
            b.extend(rest);
            b
        }),
    ]) {
        if let Ok(r) = Repr::parse_bytes(&b) {
            // Whatever parses re-emits to something that parses the same.
            let again = r.to_vec();
            prop_assert_eq!(again.len(), b.len());
            prop_assert_eq!(Repr::parse_bytes(&again).unwrap(), r);
        }
    }

    #[test]
    fn parse_never_panics_on_damaged_datagrams(b in mutated()) {
        let _ = Repr::parse_bytes(&b);
    }

    #[test]
    fn every_datagram_round_trips(s in spec()) {
        let r = s.repr();
        let bytes = r.to_vec();
        prop_assert_eq!(bytes.len(), r.buffer_len());
        prop_assert_eq!(Repr::parse_bytes(&bytes).unwrap(), r);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any sequence of damaged or random datagrams into a receiver with a
    /// live flow: no panic, and never more bytes to unvalidated peers than
    /// they sent.
    #[test]
    fn receiver_survives_anything(
        inputs in proptest::collection::vec(
            (prop_oneof![mutated(), proptest::collection::vec(any::<u8>(), 0..200)],
             0u16..4, any::<Option<u16>>(), any::<bool>()),
            1..60),
    ) {
        let mut r = Receiver::new(ReceiverConfig::default(), TokenIs(TOKEN.to_vec()));
        let hs = Repr::Handshake(Handshake {
            flow_id: 1, flow_size: 100 * SMSS, timestamp: 0, kickass: true,
            padded: false, token: TOKEN, datagram_len: 64,
        }).to_vec();
        r.handle_datagram(0, addr(0), &hs, RxInfo::whole()).unwrap();
        let mut buf = Vec::new();
        while r.poll_transmit(&mut buf).is_some() {}
        for (i, (b, peer, lfl, ce)) in inputs.into_iter().enumerate() {
            let rx = RxInfo { leading_fragment_len: lfl, ecn_ce: ce };
            let _ = r.handle_datagram(i as u64, addr(peer), &b, rx);
            while let Some(t) = r.poll_transmit(&mut buf) {
                prop_assert!(t.len <= 40 + 16 * 4);
            }
            while r.poll_event().is_some() {}
        }
        let s = r.stats();
        prop_assert!(s.unvalidated_bytes_out <= s.unvalidated_bytes_in);
        if let Some(t) = r.poll_timeout() { r.handle_timeout(t); }
    }

    /// Any sequence of damaged or random datagrams into an established
    /// Kick-Ass sender: no panic, and its invariants hold.
    #[test]
    fn sender_survives_anything(
        inputs in proptest::collection::vec(
            prop_oneof![mutated(), proptest::collection::vec(any::<u8>(), 0..200)], 1..60),
    ) {
        let mut m = Manual::connect(Config::default(), 100 * SMSS, ms(100), Some(L_10MBIT));
        m.send_now();
        for b in inputs {
            m.now += ms(1);
            let _ = m.conn.handle_datagram(m.now, &b);
            if m.conn.poll_timeout().is_some_and(|t| t <= m.now) {
                m.conn.handle_timeout(m.now);
            }
            m.send_now();
            prop_assert!(m.conn.snd_una() <= m.conn.snd_nxt());
            prop_assert!(m.conn.snd_nxt() <= m.conn.size());
            prop_assert!(m.conn.flight_size() <= m.conn.snd_nxt() - m.conn.snd_una());
        }
        let _ = m.conn.record();
    }
}
