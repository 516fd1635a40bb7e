//! NewReno in TCP mode, ACK by ACK, against the RFC text:
//! RFC 5681 (slow start, fast retransmit, RTO window), RFC 6582 (fast
//! recovery with `recover`, partial and full ACKs, the Impatient timer),
//! RFC 6298 (RTO computation and backoff).

mod common;

use common::manual::{ms, Manual};
use ka_transport::rtt::RFC_MIN_RTO;
use ka_transport::{Config, Mode, SMSS};

const U: u64 = SMSS;

/// Baseline TCP, 10-segment initial window, unpaced (so a whole window
/// leaves at once, as in the RFC examples), min RTO 200 ms.
fn cfg() -> Config {
    Config {
        initial_window: Some(10 * U),
        pace_tcp_mode: false,
        ..Config::new_reno()
    }
}

/// Handshake RTT 100 ms: SRTT 100, RTTVAR 50, RTO 300 ms.
fn connected() -> Manual {
    let m = Manual::connect(cfg(), 1000 * U, ms(100), None);
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.conn.rto(), ms(300));
    m
}

#[test]
fn three_dupacks_fast_retransmit_inflation_partial_and_full_ack() {
    let mut m = connected();
    let sent = m.fill_window();
    assert_eq!(sent.len(), 10);
    assert!(sent.iter().all(|s| s.df), "baseline TCP sets DF");
    assert_eq!(m.conn.flight_size(), 10 * U);
    // Segments 0, 5 and 8 are lost; the others arrive in order.
    m.advance(ms(100));
    let ts = |i: usize| sent[i].ts;

    // Two duplicate ACKs: nothing happens (no limited transmit).
    m.ack(0, &[(U, 2 * U)], ts(1), None);
    m.ack(0, &[(U, 3 * U)], ts(2), None);
    assert_eq!(m.conn.window(), 10 * U);
    assert!(!m.conn.in_recovery());
    assert!(m.send_now().is_empty());

    // Third: ssthresh = max(FlightSize/2, 2 SMSS) = 5 SMSS,
    // cwnd = ssthresh + 3 SMSS, retransmit the first unacked segment.
    m.ack(0, &[(U, 4 * U)], ts(3), None);
    assert!(m.conn.in_recovery());
    assert_eq!(m.conn.ssthresh(), 5 * U);
    assert_eq!(m.conn.window(), 8 * U);
    let r = m.send_now();
    assert_eq!(
        r.len(),
        1,
        "only the retransmission: FlightSize 10 > cwnd 8"
    );
    assert_eq!((r[0].seq, r[0].retransmission), (0, true));
    let retx0 = r[0].ts;

    // Further duplicate ACKs inflate cwnd by SMSS each; new data leaves
    // once FlightSize + SMSS fits.
    m.ack(0, &[(U, 5 * U)], ts(4), None);
    assert_eq!(m.conn.window(), 9 * U);
    assert!(m.send_now().is_empty());
    m.ack(0, &[(6 * U, 7 * U), (U, 5 * U)], ts(6), None);
    assert_eq!(m.conn.window(), 10 * U);
    assert!(m.send_now().is_empty());
    m.ack(0, &[(6 * U, 8 * U), (U, 5 * U)], ts(7), None);
    assert_eq!(m.conn.window(), 11 * U);
    let n = m.send_now();
    assert_eq!(n.len(), 1);
    assert_eq!((n[0].seq, n[0].retransmission), (10 * U, false));
    m.ack(
        0,
        &[(9 * U, 10 * U), (6 * U, 8 * U), (U, 5 * U)],
        ts(9),
        None,
    );
    assert_eq!(m.conn.window(), 12 * U);
    let n = m.send_now();
    assert_eq!(n.iter().map(|s| s.seq).collect::<Vec<_>>(), vec![11 * U]);
    assert_eq!(m.conn.flight_size(), 12 * U);

    // The retransmitted segment 0 arrives: cumulative ACK to 5 (hole at 5),
    // below recover (10): a partial ACK. Deflate by the 5 SMSS acked, add
    // back SMSS: 12 - 5 + 1 = 8. Retransmit segment 5 at once; the first
    // partial ACK re-arms the timer (Impatient variant).
    m.advance(ms(100));
    m.ack(5 * U, &[(6 * U, 8 * U), (9 * U, 10 * U)], retx0, None);
    assert!(m.conn.in_recovery());
    assert_eq!(m.conn.window(), 8 * U);
    assert_eq!(m.conn.rto_deadline(), Some(m.now + m.conn.rto()));
    let timer_after_first_partial = m.conn.rto_deadline();
    let r = m.send_now();
    assert_eq!((r[0].seq, r[0].retransmission), (5 * U, true));
    // FlightSize 12 - 5 = 7, + SMSS <= 8: one new segment.
    assert_eq!(
        r[1..].iter().map(|s| s.seq).collect::<Vec<_>>(),
        vec![12 * U]
    );
    let retx5 = r[0].ts;

    // Segments 10 and 11 (sent during recovery) arrive: duplicate ACKs.
    m.advance(ms(10));
    m.ack(5 * U, &[(9 * U, 11 * U), (6 * U, 8 * U)], n[0].ts, None);
    m.ack(5 * U, &[(9 * U, 12 * U), (6 * U, 8 * U)], n[0].ts, None);
    assert_eq!(m.conn.window(), 10 * U);
    let r = m.send_now();
    assert_eq!(
        r.iter().map(|s| s.seq).collect::<Vec<_>>(),
        vec![13 * U, 14 * U]
    );

    // Retransmitted 5 arrives: cumulative ACK to 8 (hole at 8): a second
    // partial ACK. 10 - 3 + 1 = 8; retransmit 8; the timer is NOT re-armed.
    m.advance(ms(90));
    m.ack(8 * U, &[(9 * U, 12 * U)], retx5, None);
    assert_eq!(m.conn.window(), 8 * U);
    assert_eq!(m.conn.rto_deadline(), timer_after_first_partial);
    let r = m.send_now();
    assert_eq!((r[0].seq, r[0].retransmission), (8 * U, true));
    // FlightSize 7 (8..14) + SMSS <= 8: one new segment.
    assert_eq!(
        r[1..].iter().map(|s| s.seq).collect::<Vec<_>>(),
        vec![15 * U]
    );
    let retx8 = r[0].ts;

    // Retransmitted 8 arrives (and 12 did): cumulative ACK to 13 >=
    // recover (10): full ACK. cwnd = min(ssthresh, max(FlightSize, SMSS) +
    // SMSS) with FlightSize = 13, 14, 15 outstanding = 3 SMSS: min(5, 4).
    // (It arrives before the un-re-armed timer, 200 ms after the first
    // partial ACK, would fire.)
    m.advance(ms(50));
    assert!(m.conn.rto_deadline().is_some_and(|d| d > m.now));
    m.ack(13 * U, &[], retx8, None);
    assert!(!m.conn.in_recovery());
    assert_eq!(m.conn.flight_size(), 3 * U);
    assert_eq!(m.conn.window(), 4 * U);
    assert_eq!(m.conn.ssthresh(), 5 * U);
    assert_eq!(m.conn.record().fast_retransmits, 1);
    assert_eq!(m.conn.record().retransmissions, 3);
    assert_eq!(m.conn.record().rto_count, 0);
}

#[test]
fn rto_loss_window_ssthresh_and_backoff() {
    let mut m = connected();
    let sent = m.fill_window();
    assert_eq!(sent.len(), 10);
    // RFC 6298 (5.1): the timer starts with the first segment: 100 + 300 ms.
    assert_eq!(m.conn.rto_deadline(), Some(ms(400)));

    m.advance_to(ms(400));
    // RFC 5681 (3.1): ssthresh = max(FlightSize/2, 2 SMSS), cwnd = LW = 1 SMSS;
    // RFC 6298 (5.5): RTO doubled.
    assert_eq!(m.conn.window(), U);
    assert_eq!(m.conn.ssthresh(), 5 * U);
    assert_eq!(m.conn.rto(), ms(600));
    let r = m.send_now();
    assert_eq!(r.len(), 1, "one segment in the loss window");
    assert_eq!((r[0].seq, r[0].retransmission), (0, true));
    assert_eq!(m.conn.rto_deadline(), Some(ms(400) + ms(600)));

    // Second expiry of the same segment: ssthresh held, RTO doubled again.
    m.advance_to(ms(1000));
    assert_eq!(m.conn.window(), U);
    assert_eq!(m.conn.ssthresh(), 5 * U);
    assert_eq!(m.conn.rto(), ms(1200));
    let r = m.send_now();
    assert_eq!((r.len(), r[0].seq), (1, 0));
    assert_eq!(m.conn.record().rto_count, 2);

    // Its ACK: a fresh RTT sample ends the backoff; slow start from 1 SMSS.
    m.advance(ms(100));
    m.ack(U, &[], r[0].ts, None);
    assert_eq!(m.conn.window(), 2 * U);
    assert!(m.conn.rto() < ms(600));
    // Go-back-N from snd_una.
    let r = m.send_now();
    assert_eq!(
        r.iter()
            .map(|s| (s.seq, s.retransmission))
            .collect::<Vec<_>>(),
        vec![(U, true), (2 * U, true)]
    );
    m.advance(ms(100));
    m.ack(3 * U, &[], r[1].ts, None);
    assert_eq!(m.conn.window(), 3 * U);
    let r = m.send_now();
    assert_eq!(r.len(), 3);
    m.advance(ms(100));
    m.ack(6 * U, &[], r[2].ts, None);
    let r = m.send_now();
    assert_eq!(
        r.iter().map(|s| s.seq).collect::<Vec<_>>(),
        vec![6 * U, 7 * U, 8 * U, 9 * U]
    );

    // Segment 6 is lost, 7, 8, 9 arrive: three duplicate ACKs, but the
    // cumulative ACK (6) does not cover recover (10, set at the RTO):
    // RFC 6582 step 2, no fast retransmit.
    let w = m.conn.window();
    m.advance(ms(100));
    m.ack(6 * U, &[(7 * U, 8 * U)], r[1].ts, None);
    m.ack(6 * U, &[(7 * U, 9 * U)], r[2].ts, None);
    m.ack(6 * U, &[(7 * U, 10 * U)], r[3].ts, None);
    assert!(!m.conn.in_recovery());
    assert_eq!(m.conn.window(), w);
    assert!(m.send_now().iter().all(|s| !s.retransmission));
}

#[test]
fn fast_retransmit_after_recover_is_passed() {
    // Once the cumulative ACK has passed recover, three duplicate ACKs do
    // trigger fast retransmit again.
    let mut m = connected();
    let sent = m.fill_window();
    m.advance(ms(100));
    m.ack(10 * U, &[], sent[9].ts, None);
    let sent = m.fill_window();
    assert!(sent.len() > 3);
    let base = sent[0].seq;
    m.advance(ms(100));
    for k in 1..=3u64 {
        m.ack(
            base,
            &[(base + U, base + (k + 1) * U)],
            sent[k as usize].ts,
            None,
        );
    }
    assert!(m.conn.in_recovery());
    let r = m.send_now();
    assert_eq!((r[0].seq, r[0].retransmission), (base, true));
}

#[test]
fn ecn_echo_halves_once_per_window() {
    let mut m = connected();
    let sent = m.fill_window();
    m.advance(ms(100));
    m.ack_full(
        U,
        &[],
        sent[0].ts,
        ka_transport::wire::RateEcho::default(),
        true,
    )
    .expect("valid");
    // RFC 3168 6.1.2 with RFC 5681's formula: FlightSize 9 SMSS.
    assert_eq!(m.conn.ssthresh(), 9 * U / 2);
    assert_eq!(m.conn.window(), 9 * U / 2);
    m.ack_full(
        2 * U,
        &[],
        sent[1].ts,
        ka_transport::wire::RateEcho::default(),
        true,
    )
    .expect("valid");
    // Same window: no second reduction (only congestion avoidance growth).
    assert!(m.conn.window() >= 9 * U / 2);
    assert!(m.conn.window() < 9 * U / 2 + U);
    assert_eq!(m.conn.stats().ecn_echoes, 2);
}

#[test]
fn min_rto_one_second_is_configurable() {
    let cfg = Config {
        min_rto: RFC_MIN_RTO,
        ..cfg()
    };
    let m = Manual::connect(cfg, 100 * U, ms(100), None);
    assert_eq!(m.conn.rto(), ms(1000));
}

#[test]
fn slow_start_counts_at_most_one_smss_per_ack() {
    let mut m = connected();
    let sent = m.fill_window();
    m.advance(ms(100));
    // One ACK for two segments: RFC 5681 eq. (2), cwnd += min(N, SMSS).
    m.ack(2 * U, &[], sent[1].ts, None);
    assert_eq!(m.conn.window(), 11 * U);
}
