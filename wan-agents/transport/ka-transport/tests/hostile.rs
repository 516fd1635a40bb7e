//! Hostile and broken input: malformed datagrams, ACKs for data never
//! sent, absurd rates, wrong flow ids, missing or invalid tokens. Nothing
//! panics, every drop is a clear error value and a counter, and the
//! receiver never sends more to an unvalidated address than it got.

mod common;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use common::manual::{ms, Manual, FLOW, L_10MBIT};
use common::{TokenIs, TOKEN};
use ka_core::rng::SplitMix64;
use ka_transport::wire::{
    self, Ack, Data, Fin, Handshake, HandshakeAck, Kind, RateEcho, Repr, SackBlocks, Status,
    FULL_UDP_PAYLOAD_LEN, HANDSHAKE_ACK_LEN, MIN_HANDSHAKE_LEN,
};
use ka_transport::{
    Config, ConnectionError, DatagramError, Event, FlowKey, Mode, Receiver, ReceiverConfig,
    ReceiverEvent, RecvError, RxInfo, SMSS,
};

const U: u64 = SMSS;

fn addr(i: u32) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(0x0a00_0000 + i), 4000))
}

fn handshake(flow_id: u64, token: &[u8], size: u64, len: usize) -> Vec<u8> {
    Repr::Handshake(Handshake {
        flow_id,
        flow_size: size,
        timestamp: 7,
        kickass: true,
        padded: len == FULL_UDP_PAYLOAD_LEN,
        token,
        datagram_len: len,
    })
    .to_vec()
}

fn data(flow_id: u64, seq: u64, payload: &[u8]) -> Vec<u8> {
    Repr::Data(Data {
        flow_id,
        seq,
        timestamp: 9,
        retransmission: false,
        payload,
    })
    .to_vec()
}

fn receiver() -> Receiver<TokenIs> {
    Receiver::new(ReceiverConfig::default(), TokenIs(TOKEN.to_vec()))
}

fn replies(r: &mut Receiver<TokenIs>) -> Vec<(SocketAddr, Vec<u8>)> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    while let Some(t) = r.poll_transmit(&mut buf) {
        out.push((t.dst, buf[..t.len].to_vec()));
    }
    out
}

// ----- sender side -----------------------------------------------------------

fn established() -> (Manual, Vec<common::manual::Sent>) {
    let mut m = Manual::connect(Config::default(), 100 * U, ms(100), Some(L_10MBIT));
    let sent = m.send_now();
    assert!(!sent.is_empty());
    m.advance(ms(100));
    (m, sent)
}

#[test]
fn sender_drops_garbage_with_clear_errors() {
    let (mut m, _) = established();
    let before = (m.conn.snd_una(), m.conn.window(), m.conn.ka_mode());
    assert_eq!(
        m.conn.handle_datagram(m.now, b""),
        Err(DatagramError::Malformed(wire::Error::Truncated))
    );
    assert_eq!(
        m.conn
            .handle_datagram(m.now, b"GET / HTTP/1.1\r\nHost: x\r\n"),
        Err(DatagramError::Malformed(wire::Error::BadMagic))
    );
    let mut rng = SplitMix64::new(3);
    for n in 0..2000 {
        let len = (rng.next_u64() % 200) as usize;
        let mut b: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        if n % 2 == 0 && b.len() >= 4 {
            // Right magic and version, random rest.
            b[..3].copy_from_slice(b"KA\x01");
        }
        assert!(m.conn.handle_datagram(m.now, &b).is_err());
    }
    assert_eq!(
        (m.conn.snd_una(), m.conn.window(), m.conn.ka_mode()),
        before
    );
    assert!(m.conn.stats().malformed > 1000);
}

#[test]
fn ack_beyond_what_was_sent_is_refused() {
    let (mut m, sent) = established();
    let nxt = m.conn.snd_nxt();
    assert_eq!(
        m.ack_full(nxt + 1, &[], sent[0].ts, RateEcho::default(), false),
        Err(DatagramError::AckBeyondSent {
            acked: nxt + 1,
            sent: nxt
        })
    );
    assert_eq!(
        m.ack_full(0, &[(nxt, nxt + U)], sent[0].ts, RateEcho::default(), false),
        Err(DatagramError::AckBeyondSent {
            acked: nxt + U,
            sent: nxt
        })
    );
    assert_eq!(
        m.ack_full(u64::MAX, &[], sent[0].ts, RateEcho::default(), false),
        Err(DatagramError::AckBeyondSent {
            acked: u64::MAX,
            sent: nxt
        })
    );
    assert_eq!(m.conn.snd_una(), 0);
    assert!(!m.conn.is_completed());
    assert_eq!(m.conn.stats().acks_beyond_sent, 3);
}

#[test]
fn absurd_rates_are_never_followed() {
    let (mut m, sent) = established();
    let rate = m.conn.last_advertised_rate();
    let pacing = m.conn.pacing_rate();
    let forged = [
        RateEcho {
            leading_fragment_len: Some(L_10MBIT),
            advertised_rate: Some(u64::MAX),
        },
        RateEcho {
            leading_fragment_len: Some(7),
            advertised_rate: Some(10_000_000_000),
        },
        RateEcho {
            leading_fragment_len: None,
            advertised_rate: Some(1),
        },
        RateEcho {
            leading_fragment_len: Some(u16::MAX),
            advertised_rate: Some(1_250_000_000),
        },
    ];
    for echo in forged {
        assert_eq!(
            m.ack_full(U, &[], sent[0].ts, echo, false),
            Err(DatagramError::BogusRateEcho),
            "{echo:?}"
        );
    }
    assert_eq!(m.conn.last_advertised_rate(), rate);
    assert_eq!(m.conn.pacing_rate(), pacing);
    assert_eq!(m.conn.snd_una(), 0, "a dropped ACK acknowledges nothing");
    // A length that is no rate code, echoed honestly, is simply "no rate".
    m.ack_full(U, &[], sent[0].ts, RateEcho::observed(Some(16)), false)
        .expect("honest echo");
    assert_eq!(m.conn.last_advertised_rate(), rate);
    assert_eq!(m.conn.snd_una(), U);
    assert_eq!(m.conn.stats().bogus_rate_echoes, 4);
}

#[test]
fn wrong_flow_wrong_kind_and_bad_timestamps() {
    let (mut m, sent) = established();
    let other = Repr::Ack(Ack {
        flow_id: FLOW + 1,
        cum_ack: U,
        ts_echo: sent[0].ts,
        ece: false,
        rate_echo: RateEcho::default(),
        sack: SackBlocks::new(),
    })
    .to_vec();
    assert_eq!(
        m.conn.handle_datagram(m.now, &other),
        Err(DatagramError::WrongFlow {
            expected: FLOW,
            got: FLOW + 1
        })
    );
    for (bytes, kind) in [
        (data(FLOW, 0, b"x"), Kind::Data),
        (
            handshake(FLOW, TOKEN, 10, MIN_HANDSHAKE_LEN),
            Kind::Handshake,
        ),
        (
            Repr::Fin(Fin {
                flow_id: FLOW,
                final_size: 1,
                timestamp: 1,
            })
            .to_vec(),
            Kind::Fin,
        ),
    ] {
        assert_eq!(
            m.conn.handle_datagram(m.now, &bytes),
            Err(DatagramError::UnexpectedKind(kind))
        );
    }
    // A timestamp from the future gives no RTT sample: dropped.
    assert_eq!(
        m.ack_full(U, &[], m.now + 1, RateEcho::default(), false),
        Err(DatagramError::BadTimestampEcho)
    );
    assert_eq!(m.conn.snd_una(), 0);
}

#[test]
fn refused_and_unanswered_handshakes_fail_cleanly() {
    let mut m = Manual::new(Config::default(), 10 * U);
    let mut buf = Vec::new();
    let t = m.conn.poll_transmit(0, &mut buf).expect("handshake");
    let Ok(Repr::Handshake(h)) = Repr::parse_bytes(&buf[..t.len]) else {
        panic!()
    };
    let refusal = Repr::HandshakeAck(HandshakeAck {
        flow_id: FLOW,
        status: Status::BadToken,
        kickass: false,
        rate_echo: RateEcho::default(),
        ts_echo: h.timestamp,
    })
    .to_vec();
    m.conn.handle_datagram(ms(50), &refusal).expect("valid");
    m.drain_events();
    assert!(m.conn.is_closed());
    assert_eq!(
        m.conn.error(),
        Some(ConnectionError::Refused(Status::BadToken))
    );
    assert!(m
        .events
        .contains(&Event::Failed(ConnectionError::Refused(Status::BadToken))));
    assert_eq!(m.conn.poll_timeout(), None);
    assert_eq!(
        m.conn.handle_datagram(ms(60), &refusal),
        Err(DatagramError::Closed)
    );

    // Nobody answers: 6 attempts, 1 + 2 + 4 + 8 + 16 + 32 s, then give up.
    let mut m = Manual::new(Config::default(), 10 * U);
    let mut sends = Vec::new();
    loop {
        let n = m.send_now_count();
        for _ in 0..n {
            sends.push(m.now);
        }
        match m.conn.poll_timeout() {
            Some(t) => m.advance_to(t),
            None => break,
        }
    }
    assert_eq!(
        sends,
        vec![0, 1, 3, 7, 15, 31]
            .into_iter()
            .map(|s| s * 1_000_000_000)
            .collect::<Vec<_>>()
    );
    assert_eq!(m.conn.error(), Some(ConnectionError::HandshakeTimeout));
    assert_eq!(
        m.conn.record().error.as_deref(),
        Some("no answer to the handshake")
    );
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
}

trait CountSends {
    fn send_now_count(&mut self) -> usize;
}

impl CountSends for Manual {
    fn send_now_count(&mut self) -> usize {
        let mut buf = Vec::new();
        let mut n = 0;
        while self.conn.poll_transmit(self.now, &mut buf).is_some() {
            n += 1;
        }
        self.drain_events();
        n
    }
}

#[test]
fn connection_rejects_bad_parameters() {
    use ka_transport::{ConfigError, Connection, Payload};
    assert_eq!(
        Connection::new(
            Config::default(),
            1,
            vec![0; 65],
            Payload::Pattern { len: 1 },
            0
        )
        .err(),
        Some(ConfigError::TokenTooLong)
    );
    assert_eq!(
        Connection::new(Config::default(), 1, vec![], Payload::Bytes(vec![]), 0).err(),
        Some(ConfigError::EmptyFlow)
    );
}

// ----- receiver side ---------------------------------------------------------

#[test]
fn no_flow_without_a_valid_token() {
    let mut r = receiver();
    let peer = addr(1);
    for (token, status) in [
        (&b""[..], Status::BadToken),
        (&b"guess"[..], Status::BadToken),
        (TOKEN, Status::Accepted),
    ] {
        let hs = handshake(0x77, token, 10 * U, MIN_HANDSHAKE_LEN);
        let res = r.handle_datagram(0, peer, &hs, RxInfo::whole());
        let out = replies(&mut r);
        assert_eq!(out.len(), 1, "exactly one reply per handshake");
        assert!(
            out[0].1.len() <= hs.len(),
            "never larger than the handshake"
        );
        let Ok(Repr::HandshakeAck(a)) = Repr::parse_bytes(&out[0].1) else {
            panic!()
        };
        assert_eq!(a.status, status);
        if status == Status::Accepted {
            assert_eq!(res, Ok(()));
        } else {
            assert_eq!(res, Err(RecvError::Refused(status)));
            assert!(!a.kickass);
        }
    }
    assert_eq!(r.flow_count(), 1);
    // Same flow id, different token: refused, the flow is untouched.
    let hs = handshake(0x77, b"other", 10 * U, MIN_HANDSHAKE_LEN);
    assert_eq!(
        r.handle_datagram(0, peer, &hs, RxInfo::whole()),
        Err(RecvError::Refused(Status::FlowIdInUse))
    );
    // Too large, and busy.
    let hs = handshake(0x78, TOKEN, u64::MAX, MIN_HANDSHAKE_LEN);
    assert_eq!(
        r.handle_datagram(0, peer, &hs, RxInfo::whole()),
        Err(RecvError::Refused(Status::FlowTooLarge))
    );
    let mut small = Receiver::new(
        ReceiverConfig {
            max_flows: 1,
            ..ReceiverConfig::default()
        },
        TokenIs(TOKEN.to_vec()),
    );
    small
        .handle_datagram(0, peer, &handshake(1, TOKEN, 10, 64), RxInfo::whole())
        .expect("first");
    assert_eq!(
        small.handle_datagram(0, peer, &handshake(2, TOKEN, 10, 64), RxInfo::whole()),
        Err(RecvError::Refused(Status::Busy))
    );
}

#[test]
fn no_amplification_before_validation() {
    let mut r = receiver();
    let mut rng = SplitMix64::new(11);
    let mut bytes_in = 0u64;
    let mut bytes_out = 0u64;
    for i in 0..3000u32 {
        let peer = addr(i % 500);
        let flow = rng.next_u64();
        let dgram = match i % 5 {
            // Spoofed handshakes with bad tokens, smallest and padded.
            0 => handshake(flow, b"nope", 10, MIN_HANDSHAKE_LEN),
            1 => handshake(flow, b"", 10, FULL_UDP_PAYLOAD_LEN),
            // Data, FIN and ACKs for flows that never opened.
            2 => data(flow, 0, &[1; 1440]),
            3 => Repr::Fin(Fin {
                flow_id: flow,
                final_size: 1,
                timestamp: 0,
            })
            .to_vec(),
            _ => (0..(rng.next_u64() % 1500) as usize)
                .map(|_| rng.next_u64() as u8)
                .collect(),
        };
        bytes_in += dgram.len() as u64;
        let res = r.handle_datagram(0, peer, &dgram, RxInfo::fragmented(584));
        assert!(res.is_err());
        for (dst, reply) in replies(&mut r) {
            assert_eq!(dst, peer);
            assert!(reply.len() <= dgram.len());
            assert_eq!(reply.len(), HANDSHAKE_ACK_LEN);
            bytes_out += reply.len() as u64;
        }
    }
    let s = r.stats();
    assert_eq!(r.flow_count(), 0);
    assert_eq!(s.unvalidated_bytes_out, bytes_out);
    assert!(s.unvalidated_bytes_out <= s.unvalidated_bytes_in);
    assert_eq!(s.unvalidated_bytes_in, bytes_in);
    assert_eq!(s.refused, 1200);
    assert_eq!(s.unknown_flow, 1200);
    println!(
        "amplification: {} bytes in, {} bytes out ({:.3})",
        bytes_in,
        bytes_out,
        bytes_out as f64 / bytes_in as f64
    );
}

#[test]
fn receiver_drops_bad_data_and_bounds_reordering() {
    let mut r = Receiver::new(
        ReceiverConfig {
            max_reorder_bytes: 4 * 1440,
            ..ReceiverConfig::default()
        },
        TokenIs(TOKEN.to_vec()),
    );
    let peer = addr(1);
    r.handle_datagram(0, peer, &handshake(5, TOKEN, 20 * U, 64), RxInfo::whole())
        .expect("accepted");
    replies(&mut r);
    let payload = [0xaa; 1440];
    // Beyond the announced size, and an offset that would overflow.
    assert_eq!(
        r.handle_datagram(1, peer, &data(5, 20 * U, &payload), RxInfo::whole()),
        Err(RecvError::DataBeyondFlowSize)
    );
    assert_eq!(
        r.handle_datagram(1, peer, &data(5, u64::MAX - 10, &payload), RxInfo::whole()),
        Err(RecvError::DataBeyondFlowSize)
    );
    // The same flow id from another address is another (unknown) flow: that
    // address alone gets a RESET, no larger than what it sent.
    assert_eq!(
        r.handle_datagram(1, addr(2), &data(5, 0, &payload), RxInfo::whole()),
        Err(RecvError::UnknownFlow)
    );
    let out = replies(&mut r);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, addr(2));
    assert!(matches!(Repr::parse_bytes(&out[0].1), Ok(Repr::Reset(rs)) if rs.flow_id == 5));
    assert_eq!(r.flow_count(), 1);
    // Four out-of-order segments fit, the fifth does not.
    for k in 2..6 {
        r.handle_datagram(2, peer, &data(5, k * U, &payload), RxInfo::whole())
            .expect("buffered");
    }
    assert_eq!(
        r.handle_datagram(2, peer, &data(5, 7 * U, &payload), RxInfo::whole()),
        Err(RecvError::ReorderBufferFull)
    );
    let acks = replies(&mut r);
    assert_eq!(acks.len(), 5, "every data datagram is acknowledged");
    let Ok(Repr::Ack(last)) = Repr::parse_bytes(&acks[4].1) else {
        panic!()
    };
    assert_eq!(last.cum_ack, 0);
    assert_eq!(
        last.sack.as_slice(),
        &[(2 * U, 6 * U)],
        "the dropped one is not SACKed"
    );
    // In-order data is always taken, and delivers the buffered run.
    r.handle_datagram(3, peer, &data(5, 0, &payload), RxInfo::whole())
        .expect("in order");
    r.handle_datagram(3, peer, &data(5, U, &payload), RxInfo::whole())
        .expect("in order");
    let key = FlowKey { peer, flow_id: 5 };
    assert_eq!(r.delivered(&key), Some(6 * U));
    // A FIN before all data is refused.
    let fin = Repr::Fin(Fin {
        flow_id: 5,
        final_size: 20 * U,
        timestamp: 0,
    })
    .to_vec();
    replies(&mut r);
    assert_eq!(
        r.handle_datagram(4, peer, &fin, RxInfo::whole()),
        Err(RecvError::BadFin)
    );
    assert!(replies(&mut r).is_empty());
    // Kinds a receiver never gets.
    let ha = Repr::HandshakeAck(HandshakeAck {
        flow_id: 5,
        status: Status::Accepted,
        kickass: true,
        rate_echo: RateEcho::default(),
        ts_echo: 0,
    })
    .to_vec();
    assert_eq!(
        r.handle_datagram(4, peer, &ha, RxInfo::whole()),
        Err(RecvError::UnexpectedKind(Kind::HandshakeAck))
    );
}

#[test]
fn receiver_echoes_what_it_observed_and_delivers_exactly_once() {
    let mut r = receiver();
    let peer = addr(1);
    r.handle_datagram(
        0,
        peer,
        &handshake(9, TOKEN, 3 * U, FULL_UDP_PAYLOAD_LEN),
        RxInfo::fragmented(L_10MBIT),
    )
    .expect("accepted");
    let out = replies(&mut r);
    let Ok(Repr::HandshakeAck(a)) = Repr::parse_bytes(&out[0].1) else {
        panic!()
    };
    assert!(a.kickass);
    assert_eq!(a.rate_echo, RateEcho::observed(Some(L_10MBIT)));
    assert_eq!(a.ts_echo, 7);
    // Retransmitted handshake: the same answer, no second flow.
    r.handle_datagram(1, peer, &handshake(9, TOKEN, 3 * U, 64), RxInfo::whole())
        .expect("duplicate");
    assert_eq!(replies(&mut r).len(), 1);
    assert_eq!(r.flow_count(), 1);

    let seg = |k: u64| -> Vec<u8> { (0..U).map(|i| (k * U + i) as u8).collect() };
    let mut rx = RxInfo::fragmented(L_10MBIT);
    rx.ecn_ce = true;
    for (k, rx) in [
        (2, rx),
        (0, RxInfo::whole()),
        (2, RxInfo::whole()),
        (1, RxInfo::fragmented(24)),
    ] {
        r.handle_datagram(2, peer, &data(9, k * U, &seg(k)), rx)
            .expect("accepted");
    }
    let acks: Vec<Ack> = replies(&mut r)
        .into_iter()
        .map(|(_, b)| match Repr::parse_bytes(&b) {
            Ok(Repr::Ack(a)) => a,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(acks.len(), 4);
    assert_eq!(
        (acks[0].cum_ack, acks[0].sack.as_slice()),
        (0, &[(2 * U, 3 * U)][..])
    );
    assert!(acks[0].ece);
    assert_eq!(acks[0].rate_echo, RateEcho::observed(Some(L_10MBIT)));
    assert_eq!(
        (acks[1].cum_ack, acks[1].rate_echo),
        (U, RateEcho::default())
    );
    assert!(!acks[1].ece);
    assert_eq!(acks[2].cum_ack, U, "duplicate still acknowledged");
    assert_eq!(acks[3].cum_ack, 3 * U);
    assert!(acks[3].sack.is_empty());
    assert_eq!(acks[3].rate_echo.leading_fragment_len, Some(24));
    let mut got = Vec::new();
    while let Some(e) = r.poll_event() {
        if let ReceiverEvent::Data { offset, data, .. } = e {
            assert_eq!(offset, got.len() as u64);
            got.extend(data);
        }
    }
    assert_eq!(got, [seg(0), seg(1), seg(2)].concat());
    let key = FlowKey { peer, flow_id: 9 };
    assert_eq!(r.flow_stats(&key).unwrap().duplicate_datagrams, 1);

    // FIN: answered once per FIN, state lingers, then goes.
    let fin = Repr::Fin(Fin {
        flow_id: 9,
        final_size: 3 * U,
        timestamp: 5,
    })
    .to_vec();
    r.handle_datagram(3, peer, &fin, RxInfo::whole())
        .expect("fin");
    r.handle_datagram(4, peer, &fin, RxInfo::whole())
        .expect("fin again");
    let out = replies(&mut r);
    assert_eq!(out.len(), 2);
    assert!(matches!(Repr::parse_bytes(&out[0].1), Ok(Repr::FinAck(_))));
    let t = r.poll_timeout().expect("linger");
    r.handle_timeout(t);
    assert_eq!(r.flow_count(), 0);
}

#[test]
fn silent_flows_expire() {
    let mut r = receiver();
    r.handle_datagram(
        0,
        addr(1),
        &handshake(3, TOKEN, 10 * U, 64),
        RxInfo::whole(),
    )
    .expect("accepted");
    let t = r.poll_timeout().expect("idle timer");
    assert_eq!(t, 30_000_000_000);
    r.handle_timeout(t - 1);
    assert_eq!(r.flow_count(), 1);
    r.handle_timeout(t);
    assert_eq!(r.flow_count(), 0);
    let mut expired = false;
    while let Some(e) = r.poll_event() {
        expired |= matches!(e, ReceiverEvent::FlowExpired { delivered: 0, .. });
    }
    assert!(expired);
    assert_eq!(r.stats().flows_expired, 1);
}
