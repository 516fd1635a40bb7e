//! A receiver that lost the flow (restarted, or forgot it) and one that
//! went silent: the sender must learn it at once from a RESET, or give up
//! after its idle timeout, instead of retransmitting into the void until
//! the caller's deadline. A RESET must be hard to forge and never an
//! amplifier.

mod common;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use common::manual::{ms, Manual, FLOW, L_10MBIT};
use common::{TokenIs, TOKEN};
use ka_transport::wire::{self, Data, Fin, Repr, FIN_LEN};
use ka_transport::{
    Config, ConnectionError, DatagramError, Event, Receiver, ReceiverConfig, RecvError, RxInfo,
    SMSS,
};

fn peer() -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 4000))
}

fn fresh_receiver() -> Receiver<TokenIs> {
    Receiver::new(ReceiverConfig::default(), TokenIs(TOKEN.to_vec()))
}

fn replies(r: &mut Receiver<TokenIs>) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    while let Some(t) = r.poll_transmit(&mut buf) {
        out.push(buf[..t.len].to_vec());
    }
    out
}

fn data_of(m: &Manual, seq: u64, ts: u64) -> Vec<u8> {
    let _ = m;
    Repr::Data(Data {
        flow_id: FLOW,
        seq,
        timestamp: ts,
        retransmission: false,
        payload: &[0u8; 1440],
    })
    .to_vec()
}

fn failed_with(m: &Manual) -> Option<ConnectionError> {
    m.events.iter().find_map(|e| match e {
        Event::Failed(e) => Some(*e),
        _ => None,
    })
}

#[test]
fn a_restarted_receiver_resets_and_the_sender_fails_at_once() {
    let mut m = Manual::connect(Config::default(), 100 * SMSS, ms(100), Some(L_10MBIT));
    let sent = m.send_now();
    assert!(!sent.is_empty());
    // The receiver restarted: it has never heard of this flow.
    let mut r = fresh_receiver();
    let dgram = data_of(&m, sent[0].seq, sent[0].ts);
    assert_eq!(
        r.handle_datagram(m.now, peer(), &dgram, RxInfo::fragmented(L_10MBIT)),
        Err(RecvError::UnknownFlow)
    );
    let out = replies(&mut r);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].len(), FIN_LEN);
    assert!(out[0].len() <= dgram.len());
    let Ok(Repr::Reset(rs)) = Repr::parse_bytes(&out[0]) else {
        panic!("not a RESET: {:?}", Repr::parse_bytes(&out[0]));
    };
    assert_eq!(
        (rs.flow_id, rs.seq_echo, rs.ts_echo),
        (FLOW, sent[0].seq, sent[0].ts)
    );
    assert_eq!(r.stats().resets_sent, 1);
    assert_eq!(r.stats().unvalidated_bytes_out, FIN_LEN as u64);

    m.advance(ms(50));
    m.conn.handle_datagram(m.now, &out[0]).expect("believed");
    m.drain_events();
    assert_eq!(failed_with(&m), Some(ConnectionError::Reset));
    assert!(m.conn.is_closed());
    assert_eq!(m.conn.error(), Some(ConnectionError::Reset));
    assert!(m.conn.poll_timeout().is_none(), "nothing left to do");
    let rec = m.conn.record();
    assert!(!rec.completed);
}

#[test]
fn a_forged_reset_is_not_believed() {
    let mut m = Manual::connect(Config::default(), 100 * SMSS, ms(100), Some(L_10MBIT));
    let sent = m.send_now();
    m.advance(ms(10));
    let forge = |seq: u64, ts: u64| {
        Repr::Reset(wire::Reset {
            flow_id: FLOW,
            seq_echo: seq,
            ts_echo: ts,
        })
        .to_vec()
    };
    // A sequence we never sent, one between segments, a timestamp from the
    // future, and the right one for another flow.
    let future = m.now + 1;
    for (bytes, want) in [
        (
            forge(1 << 40, sent[0].ts),
            DatagramError::UnexpectedKind(wire::Kind::Reset),
        ),
        (
            forge(sent[0].seq + 1, sent[0].ts),
            DatagramError::UnexpectedKind(wire::Kind::Reset),
        ),
        (forge(sent[0].seq, future), DatagramError::BadTimestampEcho),
    ] {
        assert_eq!(m.conn.handle_datagram(m.now, &bytes), Err(want));
    }
    let other = Repr::Reset(wire::Reset {
        flow_id: FLOW + 1,
        seq_echo: sent[0].seq,
        ts_echo: sent[0].ts,
    })
    .to_vec();
    assert!(matches!(
        m.conn.handle_datagram(m.now, &other),
        Err(DatagramError::WrongFlow { .. })
    ));
    m.drain_events();
    assert_eq!(failed_with(&m), None);
    assert!(m.conn.is_established());
    // A RESET for a segment already acknowledged is stale: ignored.
    m.ack(sent[0].seq + sent[0].len, &[], sent[0].ts, Some(L_10MBIT));
    assert!(m
        .conn
        .handle_datagram(m.now, &forge(sent[0].seq, sent[0].ts))
        .is_err());
    assert!(m.conn.is_established());
}

#[test]
fn a_reset_after_every_byte_was_acknowledged_just_closes() {
    let size = 2 * SMSS;
    let mut m = Manual::connect(Config::default(), size, ms(100), Some(L_10MBIT));
    let sent = m.fill_window();
    // The first segment carried the endpoint's RTT indicator (cut to it).
    assert_eq!(sent.iter().map(|s| s.len).sum::<u64>(), size);
    m.advance(ms(100));
    m.ack(size, &[], sent.last().unwrap().ts, Some(L_10MBIT));
    assert!(m
        .events
        .iter()
        .any(|e| matches!(e, Event::Completed { .. })));
    // The FIN goes out; the receiver forgot the flow meanwhile.
    let mut buf = Vec::new();
    let t = m.conn.poll_transmit(m.now, &mut buf).expect("FIN");
    let Ok(Repr::Fin(fin)) = Repr::parse_bytes(&buf[..t.len]) else {
        panic!("not a FIN");
    };
    let mut r = fresh_receiver();
    let fin_bytes = Repr::Fin(Fin { ..fin }).to_vec();
    assert_eq!(
        r.handle_datagram(m.now, peer(), &fin_bytes, RxInfo::whole()),
        Err(RecvError::UnknownFlow)
    );
    let out = replies(&mut r);
    assert_eq!(out.len(), 1);
    m.advance(ms(50));
    m.conn.handle_datagram(m.now, &out[0]).expect("believed");
    m.drain_events();
    assert!(m.conn.is_closed());
    assert_eq!(m.conn.error(), None);
    assert!(m.conn.record().completed);
}

#[test]
fn a_silent_receiver_is_given_up_after_the_idle_timeout() {
    let cfg = Config::default();
    let idle = cfg.idle_timeout;
    let mut m = Manual::connect(cfg, 1000 * SMSS, ms(100), Some(L_10MBIT));
    let heard = m.now;
    m.send_now();
    // Nothing ever comes back: RTOs back off, then the idle timeout ends it.
    let mut guard = 0;
    while !m.conn.is_closed() {
        let t = m.conn.poll_timeout().expect("a timer while open");
        m.advance_to(t);
        m.send_now();
        guard += 1;
        assert!(guard < 100_000, "never gave up");
    }
    assert_eq!(failed_with(&m), Some(ConnectionError::IdleTimeout));
    assert_eq!(m.now, heard + idle, "gave up exactly at the idle timeout");
    assert_eq!(idle, 15_000_000_000);
}

#[test]
fn every_ack_postpones_the_idle_timeout() {
    let cfg = Config {
        idle_timeout: ms(500),
        ..Config::default()
    };
    let mut m = Manual::connect(cfg, 10_000 * SMSS, ms(100), Some(L_10MBIT));
    for _ in 0..20 {
        let sent = m.fill_window();
        m.advance(ms(100));
        let last = sent.last().expect("sent something");
        m.ack(last.seq + last.len, &[], last.ts, Some(L_10MBIT));
    }
    assert!(m.conn.is_established(), "{:?}", m.conn.error());
    assert!(m.now > ms(2000));
}

#[test]
fn resets_stay_within_the_receivers_budget() {
    let mut r = fresh_receiver();
    let budget = u64::from(ReceiverConfig::default().max_resets_per_s);
    let m = Manual::new(Config::default(), SMSS);
    for i in 0..1000u64 {
        let d = data_of(&m, i * SMSS, 5);
        let _ = r.handle_datagram(0, peer(), &d, RxInfo::whole());
    }
    assert_eq!(replies(&mut r).len() as u64, budget);
    assert_eq!(r.stats().resets_suppressed, 1000 - budget);
    // Half a second later, half the budget is back.
    for i in 0..1000u64 {
        let d = data_of(&m, i * SMSS, 5);
        let _ = r.handle_datagram(500_000_000, peer(), &d, RxInfo::whole());
    }
    assert_eq!(replies(&mut r).len() as u64, budget / 2);
    let s = r.stats();
    assert!(s.unvalidated_bytes_out <= s.unvalidated_bytes_in);
    // And 0 turns RESETs off.
    let mut quiet = Receiver::new(
        ReceiverConfig {
            max_resets_per_s: 0,
            ..ReceiverConfig::default()
        },
        TokenIs(TOKEN.to_vec()),
    );
    let _ = quiet.handle_datagram(0, peer(), &data_of(&m, 0, 5), RxInfo::whole());
    assert!(replies(&mut quiet).is_empty());
}
