//! Each of the paper's mode-switch rules (II-C2, II-C3) on its own, ACK by
//! ACK, then the whole story on the simulated path.

mod common;

use common::manual::{ms, Manual, L_10MBIT};
use common::*;
use ka_core::encoding::advertised_rate;
use ka_transport::cc::payload_rate;
use ka_transport::wire::RateEcho;
use ka_transport::{Config, Event, HandshakeMode, Mode, SwitchReason, SMSS};

const U: u64 = SMSS;

fn rate_10mbit() -> f64 {
    advertised_rate(L_10MBIT as usize).expect("valid code")
}

/// Kick-Ass flow, padded handshake marked at 10 Mbit/s, RTT 100 ms, at the
/// whole rate from the start (`start_fraction` 1: the rules here are the
/// paper's, the start has its own test).
fn ka() -> Manual {
    let cfg = Config {
        start_fraction: 1.0,
        ..Config::default()
    };
    let m = Manual::connect(cfg, 5000 * U, ms(100), Some(L_10MBIT));
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
    assert_eq!(
        m.events[0],
        Event::Connected {
            kickass: true,
            advertised_rate: Some(rate_10mbit())
        }
    );
    m
}

/// Send for `d` of simulated time at the paced rate.
fn send_for(m: &mut Manual, d: u64) -> Vec<common::manual::Sent> {
    let end = m.now + d;
    let mut out = Vec::new();
    loop {
        out.extend(m.send_now());
        match m.next_timeout() {
            Some(t) if t > m.now && t <= end => m.advance_to(t),
            _ => break,
        }
    }
    out
}

#[test]
fn kickass_mode_paces_at_the_advertised_rate_with_df_clear() {
    let mut m = ka().with_indicators();
    assert_eq!(m.conn.pacing_rate(), Some(rate_10mbit() * 1000.0));
    // rate x SRTT (rounded up) + 2 SMSS of headroom.
    let bdp = (payload_rate(rate_10mbit(), U, 1500) * 0.1).ceil() as u64;
    assert_eq!(m.conn.window(), bdp + 2 * U);
    let sent = send_for(&mut m, ms(50));
    assert!(
        sent.iter().all(|s| s.df == s.indicator),
        "Kick-Ass data leaves with DF clear, the indicator with DF set"
    );
    // 50 ms at 1191.96 B/ms of 1500-byte datagrams, plus the 2-packet
    // burst (the indicator's 606 bytes count as 0.4 of one).
    let expect = 50.0 * rate_10mbit() / 1500.0 + 2.0 + 0.6;
    assert!(
        (sent.len() as f64 - expect).abs() <= 1.0,
        "{} vs {expect}",
        sent.len()
    );
    // An RTT indicator went out at once (srtt known from the handshake),
    // DF set, IP length 606 for 100 ms (paper II-B: [64, 128) ms), as the
    // first data segment cut to that length.
    assert_eq!(m.indicators, vec![606]);
    assert!(sent[0].indicator && sent[0].len == 606 - 28 - 32);
}

/// A new flow paces at `start_fraction` of the advertised rate until data
/// sent at a rate is acknowledged, then at the rate.
#[test]
fn a_new_flow_starts_at_half_the_rate_for_one_rtt() {
    let mut m = Manual::connect(Config::default(), 5000 * U, ms(100), Some(L_10MBIT));
    let half = rate_10mbit() * 1000.0 * 0.5;
    assert_eq!(m.conn.pacing_rate(), Some(half));
    let sent = send_for(&mut m, ms(100));
    let expect = 100.0 * rate_10mbit() * 0.5 / 1500.0 + 2.0;
    assert!(
        (sent.len() as f64 - expect).abs() <= 1.0,
        "{} vs {expect}",
        sent.len()
    );
    m.ack(sent[0].seq + sent[0].len, &[], sent[0].ts, Some(L_10MBIT));
    assert_eq!(m.conn.pacing_rate(), Some(rate_10mbit() * 1000.0));
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
}

#[test]
fn no_rate_for_more_than_one_rtt() {
    let mut m = ka();
    let sent = send_for(&mut m, ms(20));
    // First data ACK at 200 ms, datagram arrived whole: no rate. The last
    // rate came with the HANDSHAKE_ACK at 100 ms.
    m.advance_to(ms(200));
    m.ack(sent[0].len, &[], sent[0].ts, None);
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
    // A rate at 250 ms restarts the clock.
    m.advance_to(ms(250));
    m.ack(sent[1].seq + sent[1].len, &[], sent[1].ts, Some(L_10MBIT));
    let srtt = m.conn.rtt().srtt().expect("sampled");
    m.advance_to(ms(250) + srtt);
    assert_eq!(
        m.conn.ka_mode(),
        Mode::KickAss,
        "exactly one SRTT is not more"
    );
    m.advance_to(ms(250) + srtt + 1);
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    let sw = m.switches();
    assert_eq!(sw.len(), 1);
    assert_eq!(
        (sw[0].from, sw[0].to, sw[0].reason),
        (Mode::KickAss, Mode::Tcp, SwitchReason::NoRate)
    );
    // TCP mode (CUBIC) takes over rate x SRTT in congestion avoidance.
    let bdp = (payload_rate(rate_10mbit(), U, 1500) * srtt as f64 / 1e9) as u64;
    assert!(
        m.conn.window().abs_diff(bdp) < U,
        "{} vs {bdp}",
        m.conn.window()
    );
    assert_eq!(m.conn.ssthresh(), m.conn.window());
    // TCP mode keeps listening for rates (II-C3: "the sender continues to
    // record information it receives from Kick-Ass routers") with one
    // DF-clear segment per SRTT; the others go with DF set, whole through a
    // legacy bottleneck further on.
    let more = send_for(&mut m, ms(5));
    assert!(more.len() >= 2, "{}", more.len());
    assert!(!more[0].df, "the rate probe");
    assert!(more[1..].iter().all(|s| s.df));
}

#[test]
fn loss_by_retransmission_timeout() {
    let mut m = ka();
    let sent = send_for(&mut m, ms(50));
    let flight = m.conn.flight_size();
    assert_eq!(flight, sent.iter().map(|s| s.len).sum::<u64>());
    let deadline = m.conn.rto_deadline().expect("armed");
    m.advance_to(deadline);
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.switches()[0].reason, SwitchReason::Rto);
    assert_eq!(m.conn.window(), U);
    // CUBIC's beta from the window Kick-Ass mode was using (rate x SRTT).
    assert!(
        m.conn.ssthresh().abs_diff((0.7 * ka_bdp(&m) as f64) as u64) <= 1,
        "{} (flight {flight})",
        m.conn.ssthresh()
    );
}

/// rate x SRTT: the window TCP mode takes over.
fn ka_bdp(m: &Manual) -> u64 {
    let srtt = m.conn.rtt().srtt().expect("sampled");
    (payload_rate(rate_10mbit(), U, 1500) * srtt as f64 / 1e9).ceil() as u64
}

#[test]
fn three_duplicate_acks() {
    let mut m = ka();
    let sent = send_for(&mut m, ms(30));
    assert!(sent.len() >= 10);
    m.advance_to(ms(200));
    // Segment 0 lost; 1 and 2 arrive: two dupacks, still Kick-Ass.
    m.ack(0, &[(U, 2 * U)], sent[1].ts, Some(L_10MBIT));
    m.ack(0, &[(U, 3 * U)], sent[2].ts, Some(L_10MBIT));
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
    let flight = m.conn.flight_size();
    m.ack(0, &[(U, 4 * U)], sent[3].ts, Some(L_10MBIT));
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.switches()[0].reason, SwitchReason::DupAcks);
    // Standard TCP back-off from the Kick-Ass window (II-C3): CUBIC's
    // beta, the window coming down through PRR, the hole resent first.
    assert!(m.conn.in_recovery());
    assert!(flight > 0);
    assert!(m.conn.ssthresh().abs_diff((0.7 * ka_bdp(&m) as f64) as u64) <= 1);
    let r = m.send_now();
    assert_eq!((r[0].seq, r[0].retransmission), (0, true));
}

#[test]
fn ecn_echo() {
    let mut m = ka();
    let sent = send_for(&mut m, ms(30));
    m.advance_to(ms(200));
    m.ack(U, &[], sent[0].ts, Some(L_10MBIT));
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
    m.ack_full(
        2 * U,
        &[],
        sent[1].ts,
        RateEcho::observed(Some(L_10MBIT)),
        true,
    )
    .expect("valid");
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.switches()[0].reason, SwitchReason::Ecn);
    assert!(m.conn.ssthresh().abs_diff((0.7 * ka_bdp(&m) as f64) as u64) <= 1);
    assert_eq!(m.conn.window(), m.conn.ssthresh());
    assert!(!m.conn.in_recovery());
}

#[test]
fn back_to_kickass_when_tcp_rate_reaches_the_last_advertised_rate() {
    let mut m = ka();
    let sent = send_for(&mut m, ms(30));
    m.advance_to(ms(200));
    m.ack_full(U, &[], sent[0].ts, RateEcho::observed(Some(L_10MBIT)), true)
        .expect("valid");
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    let cwnd = m.conn.window();
    let srtt = m.conn.rtt().srtt().expect("sampled") as f64 / 1e9;
    let tcp_rate = cwnd as f64 / srtt;
    // The rate codes just above and at-or-below TCP's current rate.
    let codes: Vec<u16> = (24..=1480u16).step_by(8).collect();
    let above = *codes
        .iter()
        .find(|&&l| payload_rate(advertised_rate(l as usize).unwrap(), U, 1500) > tcp_rate)
        .expect("some rate is above");
    let below = above - 8;
    // ACKs that acknowledge nothing new (so cwnd stays put) but carry rates.
    let una = m.conn.snd_una();
    m.ack(una, &[], sent[1].ts, Some(above));
    assert_eq!(
        m.conn.ka_mode(),
        Mode::Tcp,
        "cwnd/SRTT below the advertised rate"
    );
    assert_eq!(
        m.conn.last_advertised_rate(),
        advertised_rate(above as usize),
        "TCP mode keeps reading rates"
    );
    m.ack(una, &[], sent[1].ts, None);
    assert_eq!(
        m.conn.ka_mode(),
        Mode::Tcp,
        "an ACK without a rate is no reason"
    );
    m.ack(una, &[], sent[1].ts, Some(below));
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
    let sw = m.switches();
    assert_eq!(
        (sw[1].from, sw[1].to, sw[1].reason),
        (Mode::Tcp, Mode::KickAss, SwitchReason::RateReached)
    );
    let r = advertised_rate(below as usize).unwrap();
    assert_eq!(m.conn.pacing_rate(), Some(r * 1000.0));
}

/// A Kick-Ass flow whose router fell silent: data sent for 20 ms, its first
/// ACK without a rate, then one SRTT more (II-C2): TCP mode. Returns what
/// was sent and the SRTT.
fn in_tcp_mode_for_no_rate() -> (Manual, Vec<common::manual::Sent>, u64) {
    let mut m = ka();
    let sent = send_for(&mut m, ms(20));
    m.advance_to(ms(200));
    m.ack(U, &[], sent[0].ts, None);
    let srtt = m.conn.rtt().srtt().expect("sampled");
    m.advance_to(ms(200) + srtt + 1);
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    (m, sent, srtt)
}

#[test]
fn immediate_return_when_rates_resume_after_no_rate() {
    // II-C2: "On receipt of such rates, the endpoints immediately return
    // to Kick-Ass mode": NewReno took over rate x SRTT, so the first ACK
    // with the same rate brings the flow back.
    let (mut m, sent, _) = in_tcp_mode_for_no_rate();
    // An ACK that acknowledges nothing new (no RTT sample, no growth).
    m.ack(U, &[], sent[0].ts, Some(L_10MBIT));
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
    let reasons: Vec<_> = m.switches().iter().map(|s| s.reason).collect();
    assert_eq!(
        reasons,
        vec![SwitchReason::NoRate, SwitchReason::RateReached]
    );
}

#[test]
fn immediate_return_after_no_rate_even_to_a_higher_rate() {
    // II-C2 again, the rate resuming at twice what it was: TCP's window
    // (rate x SRTT) is half of it, yet the flow returns on the first ACK
    // that carries it; the router's silence was the only reason to leave.
    let (mut m, sent, srtt) = in_tcp_mode_for_no_rate();
    let twice = (L_10MBIT..=1480)
        .step_by(8)
        .find(|&l| advertised_rate(l as usize).unwrap() >= 2.0 * rate_10mbit())
        .expect("a code for twice the rate");
    let tcp_rate = m.conn.window() as f64 / (srtt as f64 / 1e9);
    assert!(tcp_rate < payload_rate(advertised_rate(twice as usize).unwrap(), U, 1500));
    m.ack(U, &[], sent[0].ts, Some(twice));
    assert_eq!(m.conn.ka_mode(), Mode::KickAss);
    assert_eq!(
        m.conn.last_advertised_rate(),
        advertised_rate(twice as usize)
    );
}

#[test]
fn a_loss_in_a_no_rate_tcp_mode_makes_the_return_wait_for_the_rate() {
    // The router fell silent (II-C2), then the flow lost a segment in TCP
    // mode: a congestion signal of its own (II-C3), which may come from a
    // router that advertises nothing, so back only once TCP's rate
    // reaches the advertised one.
    let (mut m, sent, _) = in_tcp_mode_for_no_rate();
    // The second segment is lost: three duplicate ACKs (SACKs of 3..5).
    for k in 3..6u64 {
        m.ack(U, &[(2 * U, k * U)], sent[k as usize - 1].ts, None);
    }
    let reasons: Vec<_> = m.switches().iter().map(|s| s.reason).collect();
    assert_eq!(reasons, vec![SwitchReason::NoRate]);
    // The repair; the recovery ends with everything sent so far acknowledged.
    let una_to = m.conn.snd_nxt();
    m.ack(una_to, &[], sent[sent.len() - 1].ts, None);
    let srtt = m.conn.rtt().srtt().expect("sampled");
    let tcp_rate = m.conn.window() as f64 / (srtt as f64 / 1e9);
    assert!(
        tcp_rate < payload_rate(rate_10mbit(), U, 1500),
        "{tcp_rate}"
    );
    m.ack(una_to, &[], sent[sent.len() - 1].ts, Some(L_10MBIT));
    assert_eq!(
        m.conn.ka_mode(),
        Mode::Tcp,
        "cwnd/SRTT below the advertised rate"
    );
}

#[test]
fn kickass_disabled_is_pure_newreno() {
    // The receiver would echo rates, the router would mark: ignored.
    let mut m = Manual::connect(Config::new_reno(), 100 * U, ms(100), Some(L_10MBIT));
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert!(!m.conn.kickass());
    let sent = m.fill_window();
    assert!(sent.iter().all(|s| s.df), "baseline sets DF");
    m.advance(ms(100));
    m.ack(3 * U, &[], sent[2].ts, Some(L_10MBIT));
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.conn.last_advertised_rate(), None);
    assert!(
        m.indicators.is_empty(),
        "no RTT indicators without Kick-Ass"
    );
    assert!(m.switches().is_empty());
    let rec = m.conn.record();
    assert_eq!(rec.protocol, "tcp");
    assert_eq!(rec.ka_mode_ns, 0);
}

#[test]
fn receiver_without_kickass_means_tcp_mode() {
    let mut m = Manual::new(Config::default(), 100 * U);
    let mut buf = Vec::new();
    let t = m.conn.poll_transmit(0, &mut buf).expect("handshake");
    let Ok(ka_transport::wire::Repr::Handshake(h)) =
        ka_transport::wire::Repr::parse_bytes(&buf[..t.len])
    else {
        panic!()
    };
    assert!(h.kickass && h.padded);
    assert_eq!(t.ip_len(), 1500);
    assert!(!t.dont_fragment);
    let ack = ka_transport::wire::Repr::HandshakeAck(ka_transport::wire::HandshakeAck {
        flow_id: h.flow_id,
        status: ka_transport::wire::Status::Accepted,
        kickass: false,
        rate_echo: RateEcho::default(),
        ts_echo: h.timestamp,
    })
    .to_vec();
    m.now = ms(100);
    m.conn.handle_datagram(m.now, &ack).expect("ok");
    m.drain_events();
    assert_eq!(m.conn.ka_mode(), Mode::Tcp);
    assert_eq!(m.switches()[0].reason, SwitchReason::NotNegotiated);
    assert!(m.fill_window().iter().all(|s| s.df));
}

// ----- the whole story on the simulated path -----------------------------

#[test]
fn router_pause_sends_flow_to_tcp_mode_and_back() {
    // The router stops advertising between 0.6 s and 1.0 s (its TCP mode,
    // II-C2): the flow leaves Kick-Ass mode about one RTT later and comes
    // back as soon as rates return.
    let mut path = PathConfig::droptail(10e6, 100 * MS);
    let r = ka_core::encoding::bps_to_bytes_per_ms(10e6);
    path.set_marker(Box::new(move |t| {
        if (600 * MS..1000 * MS).contains(&t) {
            None
        } else {
            Some(r)
        }
    }));
    let o = Sim::new(path, vec![FlowSpec::new(Config::default(), 2000 * U)]).run(100 * SEC);
    let f = &o.flows[0];
    assert_eq!(f.delivered, 2000 * U);
    let sw = &f.record.mode_switches;
    assert_eq!(sw.len(), 2, "{sw:?}");
    assert_eq!(sw[0].reason, SwitchReason::NoRate);
    assert_eq!(sw[1].reason, SwitchReason::RateReached);
    // Last rate-bearing ACK returns ~100 ms after the pause begins (the
    // last marked packet's round trip), then one SRTT more.
    let left = sw[0].at_ns as f64 / 1e6;
    assert!(
        (790.0..830.0).contains(&left),
        "left Kick-Ass mode at {left} ms"
    );
    // Rates return on the ACKs of packets marked after 1.0 s.
    let back = sw[1].at_ns as f64 / 1e6;
    assert!((1090.0..1130.0).contains(&back), "back at {back} ms");
    assert!(f.record.ka_mode_fraction > 0.8);
    assert_eq!(f.record.retransmissions, 0);
    println!(
        "pause: left {left:.1} ms, back {back:.1} ms, fct {:.1} ms, ka fraction {:.3}",
        f.record.fct_ns.unwrap() as f64 / 1e6,
        f.record.ka_mode_fraction
    );
}

#[test]
fn ecn_mark_sends_flow_to_tcp_and_it_climbs_back() {
    // A legacy AQM downstream marks one packet CE (II-C3): TCP back-off,
    // then congestion avoidance until cwnd/SRTT reaches the advertised
    // rate again.
    let mut path = PathConfig::droptail(10e6, 100 * MS).with_fixed_rate(10e6);
    let mut marked = false;
    path.ce = Some(Box::new(move |t| {
        if t >= 500 * MS && !marked {
            marked = true;
            true
        } else {
            false
        }
    }));
    let o = Sim::new(path, vec![FlowSpec::new(Config::default(), 8000 * U)]).run(100 * SEC);
    let f = &o.flows[0];
    assert_eq!(f.delivered, 8000 * U);
    let reasons = switch_reasons(f);
    assert_eq!(reasons, vec![SwitchReason::Ecn, SwitchReason::RateReached]);
    let sw = &f.record.mode_switches;
    let tcp_time = (sw[1].at_ns - sw[0].at_ns) as f64 / 1e9;
    // From half the BDP (~40 segments) back to the BDP at one SMSS per RTT.
    assert!((3.0..6.0).contains(&tcp_time), "{tcp_time} s in TCP mode");
    println!(
        "ecn: {tcp_time:.2} s in TCP mode, ka fraction {:.3}",
        f.record.ka_mode_fraction
    );
}

#[test]
fn paper_handshake_on_a_path_without_router_goes_tcp_after_one_rtt() {
    let path = PathConfig::droptail(10e6, 100 * MS);
    let cfg = Config {
        handshake_mode: HandshakeMode::Paper,
        ..Config::default()
    };
    let o = Sim::new(path, vec![FlowSpec::new(cfg, 500 * U)]).run(100 * SEC);
    let f = &o.flows[0];
    assert_eq!(f.delivered, 500 * U);
    assert_eq!(switch_reasons(f), vec![SwitchReason::NoRate]);
    // Handshake RTT + first data ACK + one SRTT.
    let at = f.record.mode_switches[0].at_ns as f64 / 1e6;
    assert!((300.0..330.0).contains(&at), "{at} ms");
    assert_eq!(f.record.advertised_rates.count, 0);
}
