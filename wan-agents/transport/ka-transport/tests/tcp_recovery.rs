//! TCP mode's loss recovery, ACK by ACK, against the RFC text: RFC 6675
//! (SACK scoreboard, several holes repaired in one RTT), RFC 8985 (RACK
//! marks a loss by time, a tail loss probe instead of a timeout), RFC 6937
//! (PRR brings the window down to ssthresh), RFC 6298 (RTO and backoff),
//! RFC 6928 (IW10), RFC 3168 (ECN once per window). The same recovery
//! serves both controllers; the window arithmetic is each one's.

mod common;

use common::manual::{ms, Manual, Sent};
use ka_transport::rtt::RFC_MIN_RTO;
use ka_transport::wire::RateEcho;
use ka_transport::{Config, CongestionControl, Mode, SwitchReason, SMSS};

const U: u64 = SMSS;

/// This transport as plain TCP with `cc`, unpaced (so a whole window
/// leaves at once, as in the RFC examples), min RTO 200 ms.
fn cfg(cc: CongestionControl) -> Config {
    Config {
        pace_tcp_mode: false,
        ..Config::tcp(cc)
    }
}

/// Handshake RTT 100 ms: SRTT 100, RTTVAR 50, RTO 300 ms.
fn connected(cc: CongestionControl) -> Manual {
    let m = Manual::connect(cfg(cc), 1000 * U, ms(100), None);
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.conn.rto(), ms(300));
    m
}

fn seqs(v: &[Sent]) -> Vec<u64> {
    v.iter().map(|s| s.seq / U).collect()
}

#[test]
fn initial_window_is_ten_segments() {
    for cc in CongestionControl::ALL {
        let mut m = connected(cc);
        let sent = m.fill_window();
        assert_eq!(sent.len(), 10, "{cc}: RFC 6928 IW10");
        assert!(sent.iter().all(|s| s.df), "plain TCP sets DF");
    }
}

/// Segments 0, 5 and 8 of 20 are lost. The third SACK starts recovery;
/// every hole is resent before any retransmission could be acknowledged
/// (within one RTT), and the window comes down to ssthresh by PRR.
#[test]
fn sack_recovery_repairs_several_holes_in_one_rtt() {
    for cc in CongestionControl::ALL {
        let mut m = connected(cc);
        let first = m.fill_window();
        m.advance(ms(100));
        m.ack(10 * U, &[], first[9].ts, None);
        let sent = m.fill_window();
        // One cumulative ACK of 10 segments: NewReno adds one SMSS (RFC
        // 5681 eq. 2), CUBIC what was acknowledged (Linux tcp_slow_start).
        let n = match cc {
            CongestionControl::NewReno => 11,
            CongestionControl::Cubic => 20,
        };
        assert_eq!(sent.len(), n as usize, "{cc}");
        let base = sent[0].seq / U;
        let lost = [base, base + 5, base + 8];
        m.advance(ms(100));
        let mut blocks: Vec<(u64, u64)> = Vec::new();
        let mut retx = Vec::new();
        let mut new = Vec::new();
        let mut delivered = 0u64;
        for s in &sent {
            let k = s.seq / U;
            if lost.contains(&k) {
                continue;
            }
            // The receiver's SACK blocks: contiguous runs above the hole.
            match blocks.iter_mut().find(|b| b.1 == s.seq) {
                Some(b) => b.1 += U,
                None => blocks.push((s.seq, s.seq + U)),
            }
            blocks.sort_by_key(|b| std::cmp::Reverse(b.0));
            m.ack(base * U, &blocks, s.ts, None);
            let out = m.send_now();
            if m.conn.in_recovery() {
                delivered += 1;
            }
            for x in out {
                if x.retransmission {
                    retx.push(x.seq / U);
                } else {
                    new.push(x.seq / U);
                }
            }
        }
        assert!(m.conn.in_recovery(), "{cc}");
        assert_eq!(retx, lost.to_vec(), "{cc}: every hole, lowest first, once");
        // Conservation: in recovery no more leaves than was delivered, plus
        // the fast retransmit; and the pipe ends at ssthresh.
        assert!(
            retx.len() + new.len() <= delivered as usize + 1,
            "{cc}: PRR sent {} + {} for {delivered} delivered",
            retx.len(),
            new.len()
        );
        // (PRR counts whole segments: ssthresh rounded up to one.)
        assert!(
            m.conn.flight_size() < m.conn.ssthresh() + U,
            "{cc}: pipe {} ssthresh {}",
            m.conn.flight_size(),
            m.conn.ssthresh()
        );
        assert_eq!(m.conn.stats().recoveries, 1);
        // The retransmissions arrive: recovery ends at the recovery point,
        // the window is ssthresh.
        m.advance(ms(100));
        let end = sent.last().unwrap().seq + U;
        let top = new.iter().max().map_or(end, |&k| (k + 1) * U);
        m.ack(top, &[], m.now - ms(100), None);
        assert!(!m.conn.in_recovery(), "{cc}");
        let expect = m.conn.ssthresh();
        match cc {
            // RFC 5681: half the flight at the loss (the n segments and
            // what the first two SACKs let out, RFC 3042's limited transmit).
            CongestionControl::NewReno => {
                assert!((n * U / 2..=(n + 2) * U / 2).contains(&expect), "{expect}")
            }
            // RFC 9438: beta x cwnd at the loss (20 segments).
            CongestionControl::Cubic => assert_eq!(expect, 14 * U),
        }
        // ssthresh, and what the ACK that ended recovery added in
        // congestion avoidance (less than a segment).
        assert!(
            (expect..expect + U).contains(&m.conn.window()),
            "{cc}: window {} vs {expect}",
            m.conn.window()
        );
    }
}

/// One lost segment with only one SACKed after it (no three duplicate
/// ACKs): RACK marks it lost a quarter of the minimum RTT after the
/// segment sent after it was delivered (RFC 8985 6.2), and resends it.
#[test]
fn rack_marks_a_loss_by_time_without_three_dupacks() {
    let mut m = connected(CongestionControl::Cubic);
    let sent = m.fill_window();
    m.advance(ms(100));
    // 0..8 arrive, 8 is lost, 9 arrives.
    m.ack(8 * U, &[], sent[7].ts, None);
    m.ack(8 * U, &[(9 * U, 10 * U)], sent[9].ts, None);
    assert!(!m.conn.in_recovery(), "a reordering window first");
    let r: Vec<Sent> = m
        .send_now()
        .into_iter()
        .filter(|s| s.retransmission)
        .collect();
    assert!(r.is_empty());
    // reo_wnd = min_RTT / 4 = 25 ms after segment 8's RACK deadline.
    let t = m.conn.poll_timeout().expect("reorder timer");
    assert!(t <= m.now + ms(26), "{}", t - m.now);
    m.advance_to(t);
    assert!(m.conn.in_recovery());
    let r = m.send_now();
    assert_eq!((r[0].seq, r[0].retransmission), (8 * U, true));
    assert_eq!(m.conn.record().fast_retransmits, 1);
}

/// A retransmission that is lost again is found by RACK as the next
/// segments' ACKs come, not by a timeout.
#[test]
fn rack_finds_a_lost_retransmission() {
    let mut m = connected(CongestionControl::Cubic);
    let sent = m.fill_window();
    m.advance(ms(100));
    let mut later = Vec::new();
    for (k, s) in sent.iter().enumerate().skip(1) {
        m.ack(0, &[(U, (k as u64 + 1) * U)], s.ts, None);
        later.extend(m.send_now());
    }
    assert!(m.conn.in_recovery());
    let i = later
        .iter()
        .position(|s| s.seq == 0 && s.retransmission)
        .expect("segment 0 resent");
    let retx_ts = later[i].ts;
    let after: Vec<Sent> = later[i + 1..].to_vec();
    assert!(
        !after.is_empty(),
        "PRR let new data out behind the retransmission"
    );
    // One RTT later, data sent after the retransmission is SACKed; the
    // retransmission of 0 was lost again.
    m.advance(ms(100));
    let top = after.last().unwrap().seq + U;
    m.ack(0, &[(U, top)], after.last().unwrap().ts, None);
    let r = m.send_now();
    assert!(
        r.iter()
            .any(|s| s.seq == 0 && s.retransmission && s.ts > retx_ts),
        "segment 0 resent again at once: {r:?}"
    );
    assert_eq!(m.conn.record().rto_count, 0);
    assert!(m.now < m.conn.rto_deadline().unwrap());
}

/// The last two segments are lost and no ACK comes for them: two SRTT
/// later the tail loss probe resends the last one (RFC 8985 7.3), its
/// SACK lets RACK find the other, and no timeout happens.
#[test]
fn tail_loss_probe_instead_of_a_timeout() {
    let mut m = Manual::connect(cfg(CongestionControl::Cubic), 10 * U, ms(100), None);
    let sent = m.fill_window();
    assert_eq!(sent.len(), 10);
    m.advance(ms(100));
    m.ack(8 * U, &[], sent[7].ts, None);
    let pto = m.conn.tlp_deadline().expect("armed");
    assert_eq!(pto, m.now + 2 * m.conn.rtt().srtt().unwrap() + ms(1));
    assert!(pto < m.conn.rto_deadline().unwrap());
    m.advance_to(pto);
    let probe = m.send_now();
    assert_eq!(seqs(&probe), vec![9]);
    assert!(probe[0].retransmission);
    assert_eq!(m.conn.stats().tail_loss_probes, 1);
    m.advance(ms(100));
    m.ack(8 * U, &[(9 * U, 10 * U)], probe[0].ts, None);
    let t = m.conn.poll_timeout().unwrap();
    m.advance_to(t);
    let r = m.send_now();
    assert_eq!(seqs(&r), vec![8]);
    m.advance(ms(100));
    m.ack(10 * U, &[], r[0].ts, None);
    assert!(m.conn.is_completed());
    assert_eq!(m.conn.record().rto_count, 0);
}

/// A probe whose original arrives after all (its ACK echoes the
/// original's timestamp) was spurious: nothing is reduced.
#[test]
fn a_spurious_tail_loss_probe_reduces_nothing() {
    let mut m = Manual::connect(cfg(CongestionControl::Cubic), 10 * U, ms(100), None);
    let sent = m.fill_window();
    m.advance(ms(100));
    m.ack(9 * U, &[], sent[8].ts, None);
    let w = m.conn.window();
    m.advance_to(m.conn.tlp_deadline().unwrap());
    let probe = m.send_now();
    assert_eq!(seqs(&probe), vec![9]);
    // The original, merely late, is acknowledged first.
    m.ack(10 * U, &[], sent[9].ts, None);
    assert!(m.conn.window() >= w, "{} < {w}", m.conn.window());
}

#[test]
fn rto_loss_window_ssthresh_and_backoff() {
    for cc in CongestionControl::ALL {
        let mut m = connected(cc);
        let sent = m.fill_window();
        assert_eq!(sent.len(), 10);
        // RFC 6298 (5.1): the timer starts with the first segment: 100 + 300 ms.
        assert_eq!(m.conn.rto_deadline(), Some(ms(400)));
        // The probe goes first (2 SRTT + 1 ms: new data, segment 10) and
        // is lost too.
        m.advance_to(m.conn.tlp_deadline().unwrap());
        assert_eq!(seqs(&m.send_now()), vec![10]);
        let rto_at = m.conn.rto_deadline().unwrap();
        m.advance_to(rto_at);
        // The loss window is one segment; RFC 6298 (5.5): RTO doubled.
        assert_eq!(m.conn.window(), U, "{cc}");
        let ss = match cc {
            // Half the 11 segments outstanding.
            CongestionControl::NewReno => 11 * U / 2,
            // beta x cwnd (10 segments).
            CongestionControl::Cubic => 7 * U,
        };
        assert_eq!(m.conn.ssthresh(), ss, "{cc}");
        assert_eq!(m.conn.rto(), ms(600));
        let r = m.send_now();
        assert_eq!(r.len(), 1, "one segment in the loss window");
        assert_eq!((r[0].seq, r[0].retransmission), (0, true));
        assert_eq!(m.conn.rto_deadline(), Some(rto_at + ms(600)));
        // Second expiry of the same segment: ssthresh held, RTO doubled again.
        m.advance_to(rto_at + ms(600));
        assert_eq!(m.conn.window(), U);
        assert_eq!(m.conn.ssthresh(), ss, "{cc}");
        assert_eq!(m.conn.rto(), ms(1200));
        let r = m.send_now();
        assert_eq!((r.len(), r[0].seq), (1, 0));
        assert_eq!(m.conn.record().rto_count, 2);
        // Its ACK: a fresh RTT sample ends the backoff; slow start from
        // 1 SMSS resends what the timeout declared lost.
        m.advance(ms(100));
        m.ack(U, &[], r[0].ts, None);
        assert_eq!(m.conn.window(), 2 * U, "{cc}");
        assert!(m.conn.rto() < ms(600));
        let r = m.send_now();
        assert_eq!(seqs(&r), vec![1, 2]);
        assert!(r.iter().all(|s| s.retransmission));
    }
}

#[test]
fn ecn_echo_reduces_once_per_window() {
    for cc in CongestionControl::ALL {
        let mut m = connected(cc);
        let sent = m.fill_window();
        m.advance(ms(100));
        m.ack_full(U, &[], sent[0].ts, RateEcho::default(), true)
            .expect("valid");
        let reduced = match cc {
            // RFC 3168 6.1.2 with RFC 5681's formula: FlightSize 9 SMSS.
            CongestionControl::NewReno => 9 * U / 2,
            // RFC 9438: beta x cwnd (11 segments after the first ACK).
            CongestionControl::Cubic => (11.0 * 0.7 * U as f64).round() as u64,
        };
        assert_eq!(m.conn.ssthresh(), reduced, "{cc}");
        assert_eq!(m.conn.window(), reduced, "{cc}");
        m.ack_full(2 * U, &[], sent[1].ts, RateEcho::default(), true)
            .expect("valid");
        // Same window: no second reduction (only congestion avoidance growth).
        assert!(m.conn.window() >= reduced);
        assert!(m.conn.window() < reduced + U);
        assert_eq!(m.conn.stats().ecn_echoes, 2);
        assert!(!m.conn.in_recovery());
    }
}

#[test]
fn min_rto_one_second_is_configurable() {
    let cfg = Config {
        min_rto: RFC_MIN_RTO,
        ..cfg(CongestionControl::Cubic)
    };
    let m = Manual::connect(cfg, 100 * U, ms(100), None);
    assert_eq!(m.conn.rto(), ms(1000));
}

#[test]
fn newreno_slow_start_counts_at_most_one_smss_per_ack() {
    let mut m = connected(CongestionControl::NewReno);
    let sent = m.fill_window();
    m.advance(ms(100));
    // One ACK for two segments: RFC 5681 eq. (2), cwnd += min(N, SMSS).
    m.ack(2 * U, &[], sent[1].ts, None);
    assert_eq!(m.conn.window(), 11 * U);
}

/// Kick-Ass mode's loss by time (RACK, one SACK) switches with its own
/// reason: II-C3's "a dropped packet", not three duplicate ACKs.
#[test]
fn a_loss_found_by_time_switches_with_reason_loss() {
    let mut m = Manual::connect(Config::default(), 100 * U, ms(100), Some(584));
    loop {
        let s = m.send_now();
        if m.conn.snd_nxt() >= 10 * U {
            break;
        }
        let _ = s;
        let t = m.next_timeout().unwrap();
        m.advance_to(t);
    }
    m.advance_to(ms(200));
    m.ack(U, &[(2 * U, 3 * U)], m.now - ms(100), Some(584));
    let t = m.conn.poll_timeout().unwrap();
    m.advance_to(t.max(m.now + ms(26)));
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.switches()[0].reason, SwitchReason::Loss);
}
