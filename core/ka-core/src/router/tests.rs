//! The router core on simulated time: no sockets, no sleeping.

use super::*;
use crate::wire::ipv4::Repr;
use core::net::Ipv4Addr;
use std::collections::VecDeque;

const MS: Nanos = 1_000_000;
const SEC: Nanos = 1_000_000_000;

fn packet(flow: u16, seq: u32, total: usize, df: bool) -> Vec<u8> {
    let mut payload = vec![0u8; total - 20];
    // A UDP-like header: source port = flow, then a sequence number.
    payload[0..2].copy_from_slice(&flow.to_be_bytes());
    payload[8..12].copy_from_slice(&seq.to_be_bytes());
    Repr {
        src_addr: Ipv4Addr::new(198, 18, 1, 2),
        dst_addr: Ipv4Addr::new(198, 18, 2, 2),
        protocol: 17,
        ttl: 64,
        tos: 0,
        ident: seq as u16,
        dont_frag: df,
        more_frags: false,
        frag_offset: 0,
        options: vec![],
        payload_len: total - 20,
    }
    .to_bytes(&payload)
}

/// Everything that left, as (time, packets on the wire).
fn drain(r: &mut Router, now: Nanos, out: &mut Vec<(Nanos, Vec<Vec<u8>>)>) {
    while let Some(t) = r.poll_transmit(now) {
        let pieces = match &t.split {
            Some(s) => s.to_packets(&t.packet).to_vec(),
            None => vec![t.packet],
        };
        out.push((now, pieces));
    }
}

/// Step the router to `until`, waking exactly when it asks (plus `late`).
fn run_until(
    r: &mut Router,
    now: &mut Nanos,
    until: Nanos,
    late: Nanos,
    out: &mut Vec<(Nanos, Vec<Vec<u8>>)>,
    samples: &mut Vec<Sample>,
) {
    while *now < until {
        if let Some(s) = r.handle_timeout(*now) {
            samples.push(s);
        }
        drain(r, *now, out);
        *now = (r.poll_timeout() + late).clamp(*now + 1, until);
    }
}

#[test]
fn serves_exactly_at_capacity_in_order() {
    let mut cfg = RouterConfig::with_capacity(12e6); // 1500 B per ms
    cfg.kind = RouterKind::DropTail;
    cfg.buffer = Limit::Packets(100);
    let mut r = Router::new(cfg, 0);
    let mut out = Vec::new();
    let mut samples = Vec::new();
    let mut now = 0;
    let mut seq = 0;
    // Offer twice the capacity for one second, waking 200 us late each time.
    while now < SEC {
        for _ in 0..2 {
            let _ = r.on_packet(now, packet(1, seq, 1500, true));
            seq += 1;
        }
        let next = now + MS;
        run_until(&mut r, &mut now, next, 200_000, &mut out, &mut samples);
    }
    let sent_in_first_second = out.iter().filter(|(t, _)| *t < SEC).count();
    assert!(
        (999..=1001).contains(&sent_in_first_second),
        "{sent_in_first_second}"
    );
    assert!(r.counters().drops > 800);
    // Never reordered.
    let seqs: Vec<u32> = out
        .iter()
        .map(|(_, p)| u32::from_be_bytes(p[0][28..32].try_into().expect("4 bytes")))
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    // y counts drops too: about twice the capacity.
    let s = samples.last().expect("samples");
    assert!(
        (s.input_rate_bps / 24e6 - 1.0).abs() < 0.1,
        "{}",
        s.input_rate_bps
    );
    assert_eq!(s.marking_mode, "droptail");
    assert_eq!(s.leading_fragment_len, None);
}

#[test]
fn fragments_full_packets_at_advertised_length() {
    let mut cfg = RouterConfig::with_capacity(100e6);
    // Frozen controller: R stays at the initial rate.
    cfg.alpha = 0.0;
    cfg.beta = 0.0;
    cfg.initial_rate_bps = 10e6;
    let mut r = Router::new(cfg, 0);
    let l = encoding::leading_fragment_len(10e6 / 8000.0).expect("encodable");
    assert_eq!(r.leading_fragment_len(), Some(l));
    let mut out = Vec::new();
    let mut samples = Vec::new();
    let mut now = 0;
    for (i, (len, df)) in [(1500, false), (1500, true), (1499, false), (600, true)]
        .into_iter()
        .enumerate()
    {
        r.on_packet(now, packet(1, i as u32, len, df))
            .expect("room");
        let until = now + MS;
        run_until(&mut r, &mut now, until, 0, &mut out, &mut samples);
    }
    assert_eq!(out.len(), 4);
    let lead = Packet::new_checked(&out[0].1[0][..]).expect("ip");
    assert_eq!(lead.payload_len(), l);
    assert!(lead.more_frags());
    assert_eq!(
        fragment::reassemble(&out[0].1),
        Some(packet(1, 0, 1500, false))
    );
    assert_eq!(out[1].1, vec![packet(1, 1, 1500, true)]);
    assert_eq!(out[2].1, vec![packet(1, 2, 1499, false)]);
    assert_eq!(out[3].1, vec![packet(1, 3, 600, true)]);
    assert_eq!(r.counters().fragmented, 1);
    // The 600-byte DF packet is an RTT indicator: d = 1 ms.
    assert_eq!(r.rtt_ms(), 1.0);
    assert_eq!(r.counters().rtt_indicators, 1);
}

#[test]
fn rtt_indicators_set_d_and_the_interval() {
    let r0 = Router::new(RouterConfig::with_capacity(10e6), 0);
    assert_eq!(r0.rtt_ms(), 100.0);
    assert_eq!(r0.interval(), 10 * MS);
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    for i in 0..50 {
        r.on_packet(i, packet(1, i as u32, 602, true))
            .expect("room");
    }
    assert_eq!(r.rtt_ms(), 6.0);
    assert_eq!(r.interval(), 6 * MS);
    // Same length without DF: not an indicator.
    let mut r2 = Router::new(RouterConfig::with_capacity(10e6), 0);
    r2.on_packet(0, packet(1, 0, 602, false)).expect("room");
    assert_eq!(r2.rtt_ms(), 100.0);
}

#[test]
fn unresponsive_flood_switches_to_tcp_mode_and_back() {
    unresponsive_flood(0.0);
}

/// With a hold, a queue that stays up still means TCP mode: 2x capacity
/// fills the 100-packet buffer past half in ~50 ms; TCP mode follows one
/// hold (3 x d, d = 100 ms by default) later.
#[test]
fn unresponsive_flood_switches_to_tcp_mode_also_with_a_hold() {
    let entered = unresponsive_flood(3.0);
    assert!((330 * MS..=400 * MS).contains(&entered), "{entered}");
}

/// Returns when TCP mode started.
fn unresponsive_flood(hold_rtts: f64) -> Nanos {
    let mut cfg = RouterConfig::with_capacity(12e6);
    cfg.buffer = Limit::Packets(100);
    cfg.initial_rate_bps = 6e6;
    cfg.tcp_mode_hold_rtts = hold_rtts;
    let mut r = Router::new(cfg, 0);
    let mut entered = None;
    let mut out = Vec::new();
    let mut samples = Vec::new();
    let mut now = 0;
    let mut seq = 0;
    // 2x capacity of DF-clear full packets for 2 s.
    while now < 2 * SEC {
        for _ in 0..2 {
            let _ = r.on_packet(now, packet(9, seq, 1500, false));
            seq += 1;
        }
        let next = now + MS;
        run_until(&mut r, &mut now, next, 0, &mut out, &mut samples);
        if entered.is_none() && r.mode() == Mode::Tcp {
            entered = Some(now);
        }
    }
    assert_eq!(r.mode(), Mode::Tcp);
    let cut_late = out.iter().filter(|(t, p)| *t > SEC && p.len() > 1).count();
    assert_eq!(cut_late, 0, "fragments left in TCP mode");
    assert!(samples
        .iter()
        .any(|s| s.marking_mode == "tcp" && s.leading_fragment_len.is_none()));
    // Flood stops; a light flow of full packets follows for 3 s.
    let stop = now;
    while now < stop + 3 * SEC {
        let _ = r.on_packet(now, packet(1, seq, 1500, false));
        seq += 1;
        let next = now + 10 * MS;
        run_until(&mut r, &mut now, next, 0, &mut out, &mut samples);
    }
    assert_eq!(r.mode(), Mode::KickAss);
    let cut_after = out
        .iter()
        .filter(|(t, p)| *t > stop + 2 * SEC && p.len() > 1)
        .count();
    assert!(cut_after > 50, "{cut_after}");
    assert!(r.mode.switches() >= 2);
    entered.expect("entered TCP mode")
}

/// An RTT indicator for `rtt` every 100 ms, as a Kick-Ass sender sends them.
fn indicator_if_due(r: &mut Router, now: Nanos, next: &mut Nanos, rtt: Nanos) {
    if *next <= now {
        let _ = r.on_packet(
            now,
            packet(999, 0, encoding::rtt_indicator(rtt as f64 / 1e6), true),
        );
        *next += 100 * MS;
    }
}

/// For a cut datagram: its flow (the source port `packet` wrote) and the
/// rate its leading fragment advertises, bits/s, as a receiver reads them.
fn advertised_to(t: &Transmit) -> Option<(usize, f64)> {
    let s = t.split.as_ref()?;
    let [lead, _] = s.to_packets(&t.packet);
    let p = Packet::new_checked(&lead[..]).expect("ip");
    let flow = u16::from_be_bytes([p.payload()[0], p.payload()[1]]) as usize;
    let bpms = encoding::advertised_rate(p.payload_len()).expect("valid length");
    Some((flow, encoding::bytes_per_ms_to_bps(bpms)))
}

/// N senders that obey the advertised rate, as a receiver reading
/// leading-fragment lengths would tell them one RTT later, converge to C/N
/// with a short queue and a busy link.
fn obeying_flows(n: usize, capacity_bps: f64, rtt: Nanos, alpha: f64, beta: f64) {
    let mut cfg = RouterConfig::with_capacity(capacity_bps);
    cfg.buffer = Limit::Packets(200);
    cfg.alpha = alpha;
    cfg.beta = beta;
    let mut r = Router::new(cfg, 0);
    let half = rtt / 2;
    // Per flow: rate in bits/s (None before any feedback) and next send time.
    let mut rate: Vec<f64> = vec![0.0; n];
    let mut next_send: Vec<Nanos> = (0..n as u64).map(|i| i * 137_000).collect();
    let mut feedback: VecDeque<(Nanos, usize, f64)> = VecDeque::new();
    let mut seq = 0u32;
    let mut now: Nanos = 0;
    let end = 20 * SEC;
    let measure_from = 12 * SEC;
    let mut delivered = vec![0u64; n];
    let mut queue_sum = 0f64;
    let mut queue_n = 0f64;
    let mut next_indicator = 0;
    while now < end {
        // Feedback from the receiver, half an RTT after delivery.
        while feedback.front().is_some_and(|f| f.0 <= now) {
            let (_, flow, bps) = feedback.pop_front().expect("front");
            rate[flow] = bps;
        }
        for f in 0..n {
            if next_send[f] <= now {
                let _ = r.on_packet(now, packet(f as u16, seq, 1500, false));
                seq += 1;
                // Before the first rate: one packet per RTT, as a Kick-Ass
                // endpoint in TCP mode would roughly start.
                let gap = if rate[f] > 0.0 {
                    (1500.0 * 8.0 / rate[f] * 1e9) as Nanos
                } else {
                    rtt
                };
                next_send[f] += gap.max(1);
            }
        }
        indicator_if_due(&mut r, now, &mut next_indicator, rtt);
        r.handle_timeout(now);
        while let Some(t) = r.poll_transmit(now) {
            if let Some((flow, bps)) = advertised_to(&t).filter(|(f, _)| *f < n) {
                feedback.push_back((now + half + half, flow, bps));
                if now >= measure_from {
                    delivered[flow] += 1500;
                }
            }
        }
        if now >= measure_from {
            queue_sum += r.queue_bytes() as f64;
            queue_n += 1.0;
        }
        let wake = next_send
            .iter()
            .copied()
            .min()
            .unwrap_or(end)
            .min(r.poll_timeout())
            .min(next_indicator);
        let wake = feedback.front().map_or(wake, |f| wake.min(f.0));
        now = wake.max(now + 1);
    }
    let secs = (end - measure_from) as f64 / 1e9;
    let rates: Vec<f64> = delivered.iter().map(|b| *b as f64 * 8.0 / secs).collect();
    // The link carries 1520 bytes per 1500 delivered (one extra header).
    let fair = capacity_bps * 1500.0 / 1520.0 / n as f64;
    for (f, got) in rates.iter().enumerate() {
        assert!(
            (got / fair - 1.0).abs() < 0.10,
            "flow {f}: {got} vs fair {fair} ({rates:?})"
        );
    }
    let util = rates.iter().sum::<f64>() / (capacity_bps * 1500.0 / 1520.0);
    assert!(util > 0.90, "utilization {util}");
    let avg_q = queue_sum / queue_n;
    assert!(avg_q < 0.2 * 200.0 * 1500.0, "average queue {avg_q}");
    assert_eq!(r.counters().drops, 0);
}

#[test]
fn obeying_flows_converge_to_fair_share_ns2_gains() {
    obeying_flows(4, 10e6, 40 * MS, 0.4, 0.4);
}

#[test]
fn obeying_flows_converge_to_fair_share_fct_seeds() {
    obeying_flows(3, 100e6, 100 * MS, 0.1, 1.0);
}

#[test]
fn below_encodable_rate_stops_fragmenting() {
    let mut cfg = RouterConfig::with_capacity(10e6);
    cfg.alpha = 0.0;
    cfg.beta = 0.0;
    cfg.min_rate_bps = 8e3; // the paper's floor; the default keeps R encodable
    cfg.initial_rate_bps = 100e3; // below ~120 kbit/s
    let mut r = Router::new(cfg, 0);
    assert_eq!(r.leading_fragment_len(), None);
    r.on_packet(0, packet(1, 0, 1500, false)).expect("room");
    let t = r.poll_transmit(0).expect("ready");
    assert!(t.split.is_none());
    assert_eq!(t.packet, packet(1, 0, 1500, false));
}

#[test]
fn default_floor_keeps_advertising_under_overload() {
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    assert!(r.config().min_rate_bps > 119e3 && r.config().min_rate_bps < 121e3);
    // 6 s at four times the capacity: RCP pushes R down as far as it may.
    let mut now = 0;
    for i in 0..20_000u32 {
        now += 300_000;
        let _ = r.on_packet(now, packet(1, i, 1500, false));
        while r.poll_transmit(now).is_some() {}
        if now >= r.poll_timeout() {
            r.handle_timeout(now);
        }
    }
    assert_eq!(r.advertised_rate_bps(), r.config().min_rate_bps);
    let floor = bps_to_bytes_per_ms(r.advertised_rate_bps());
    assert_eq!(encoding::leading_fragment_len(floor), Some(24));
}

/// Flows that each open with one full-size packet (the padded handshake),
/// then pace at the rate its leading fragment advertised, and follow every
/// later rate one RTT after it was cut; in TCP mode (nothing cut) they keep
/// the last rate. Returns, from the last flow's arrival on: (max buffer
/// occupancy, router mode switches, drops).
fn arrivals(cfg: RouterConfig, rtt: Nanos, flows: &[(Nanos, u32)]) -> (f64, u64, u64) {
    let mut r = Router::new(cfg, 0);
    let n = flows.len();
    let mut rate: Vec<f64> = vec![0.0; n];
    let mut next_send: Vec<Nanos> = flows.iter().map(|f| f.0).collect();
    let mut left: Vec<u32> = flows.iter().map(|f| f.1).collect();
    let mut opened = vec![false; n];
    let mut feedback: VecDeque<(Nanos, usize, f64)> = VecDeque::new();
    let (mut seq, mut now, mut max_occ) = (0u32, 0 as Nanos, 0f64);
    let last = flows.iter().map(|f| f.0).max().unwrap_or(0);
    let end = last + 20 * SEC;
    let mut next_indicator = 0;
    let mut at_last: Option<(u64, u64)> = None;
    while now < end {
        while feedback.front().is_some_and(|f| f.0 <= now) {
            let (_, flow, bps) = feedback.pop_front().expect("front");
            rate[flow] = bps;
        }
        for f in 0..n {
            if left[f] == 0 || next_send[f] > now {
                continue;
            }
            if !opened[f] || rate[f] > 0.0 {
                let _ = r.on_packet(now, packet(f as u16, seq, 1500, false));
                seq += 1;
                left[f] -= 1;
                opened[f] = true;
            }
            next_send[f] = if rate[f] > 0.0 {
                now + ((1500.0 * 8.0 / rate[f] * 1e9) as Nanos).max(1)
            } else {
                now + MS // waiting for the handshake answer
            };
        }
        indicator_if_due(&mut r, now, &mut next_indicator, rtt);
        r.handle_timeout(now);
        if now >= last {
            at_last.get_or_insert((r.mode.switches(), r.counters().drops));
            max_occ = max_occ.max(r.queue.occupancy());
        }
        while let Some(t) = r.poll_transmit(now) {
            if let Some((flow, bps)) = advertised_to(&t).filter(|(f, _)| *f < n) {
                feedback.push_back((now + rtt, flow, bps));
            }
        }
        let wake = next_send
            .iter()
            .zip(&left)
            .filter(|(_, l)| **l > 0)
            .map(|(t, _)| *t)
            .min()
            .unwrap_or(end)
            .min(r.poll_timeout())
            .min(next_indicator);
        let wake = feedback.front().map_or(wake, |f| wake.min(f.0));
        now = wake.max(now + 1);
    }
    let (sw, dr) = at_last.expect("ran past the last arrival");
    (max_occ, r.mode.switches() - sw, r.counters().drops - dr)
}

/// One more flow arrives while `active` flows share the link at the fair
/// rate (each started 2 s after the previous one). It starts at the rate
/// its handshake was cut to, so the link runs at (active + 1) / active x C
/// for about one RTT, and RCP drains the excess in the next few.
fn one_more_arrival(hold_rtts: f64, active: u64) -> (f64, u64, u64) {
    let mut cfg = RouterConfig::with_capacity(10e6);
    cfg.tcp_mode_hold_rtts = hold_rtts;
    let mut fl: Vec<(Nanos, u32)> = (0..active).map(|i| (SEC + i * 2 * SEC, 8000)).collect();
    fl.push((SEC + active * 2 * SEC + 3 * SEC, 700));
    arrivals(cfg, 100 * MS, &fl)
}

#[test]
fn an_arrival_overshoot_trips_the_papers_rule_but_not_the_hold() {
    // Measured (max occupancy after the arrival, switches, drops), 10 Mbit/s,
    // 100 ms, one-BDP buffer: the arrival lifts the queue to 59-82% of the
    // buffer with 2-3 flows active, 30-35% with 5-7, and never drops.
    for active in [2, 3] {
        let (occ, switches, drops) = one_more_arrival(3.0, active);
        assert!(occ > 0.5, "{active}: {occ}");
        assert_eq!((switches, drops), (0, 0), "{active} active, hold 3 RTTs");
        let (_, paper_switches, _) = one_more_arrival(0.0, active);
        assert!(paper_switches >= 1, "{active} active, the paper's rule");
    }
    for active in [5, 7] {
        assert_eq!(one_more_arrival(3.0, active).1, 0);
    }
}

/// Full-size packets at `bps` (IP bytes) from `from` to `to`, DF as given,
/// and RTT indicators of 100 ms every 100 ms; the router stepped between.
fn offered(
    r: &mut Router,
    now: &mut Nanos,
    to: Nanos,
    streams: &[(f64, bool)],
    samples: &mut Vec<Sample>,
) {
    let streams: Vec<(u16, f64, Df)> = streams
        .iter()
        .enumerate()
        .map(|(i, &(bps, df))| (i as u16, bps, if df { Df::Set } else { Df::Clear }))
        .collect();
    offered_flows(r, now, to, &streams, samples)
}

/// How a stream of `offered_flows` sets DF.
#[derive(Clone, Copy)]
enum Df {
    Clear,
    Set,
    /// Set but on one packet per this long: a Kick-Ass endpoint in TCP mode.
    SetButOnePer(Nanos),
}

/// `offered` with each stream's flow (its source port) and DF policy given.
fn offered_flows(
    r: &mut Router,
    now: &mut Nanos,
    to: Nanos,
    streams: &[(u16, f64, Df)],
    samples: &mut Vec<Sample>,
) {
    let mut next: Vec<Nanos> = vec![*now; streams.len()];
    let mut probed: Vec<Option<Nanos>> = vec![None; streams.len()];
    let mut next_indicator = *now;
    let mut seq = 0u32;
    while *now < to {
        for (i, &(flow, bps, df)) in streams.iter().enumerate() {
            while next[i] <= *now {
                let set = match df {
                    Df::Clear => false,
                    Df::Set => true,
                    Df::SetButOnePer(every) => {
                        if probed[i].is_none_or(|t| *now >= t + every) {
                            probed[i] = Some(*now);
                            false
                        } else {
                            true
                        }
                    }
                };
                let _ = r.on_packet(*now, packet(flow, seq, 1500, set));
                seq += 1;
                next[i] += (1500.0 * 8.0 / bps * 1e9) as Nanos;
            }
        }
        indicator_if_due(r, *now, &mut next_indicator, 100 * MS);
        if let Some(s) = r.handle_timeout(*now) {
            samples.push(s);
        }
        while r.poll_transmit(*now).is_some() {}
        let wake = next
            .iter()
            .copied()
            .min()
            .unwrap_or(to)
            .min(r.poll_timeout());
        *now = wake.min(next_indicator).clamp(*now + 1, to);
    }
}

#[test]
fn rcp_counts_the_bytes_the_link_carries() {
    // Kick-Ass traffic at 9 Mbit/s of IP bytes: every packet is cut, so the
    // link carries 1520 bytes for each 1500 and RCP's y says 9.12 Mbit/s.
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    let (mut now, mut samples) = (0, Vec::new());
    offered(&mut r, &mut now, 3 * SEC, &[(9e6, false)], &mut samples);
    let late: Vec<&Sample> = samples.iter().filter(|s| s.t > 1.0).collect();
    let y = late.iter().map(|s| s.input_rate_bps).sum::<f64>() / late.len() as f64;
    assert!((y / 9.12e6 - 1.0).abs() < 0.02, "{y}");
    // The same rate with DF set is not cut: 9 Mbit/s.
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    let (mut now, mut samples) = (0, Vec::new());
    offered(&mut r, &mut now, 3 * SEC, &[(9e6, true)], &mut samples);
    let late: Vec<&Sample> = samples.iter().filter(|s| s.t > 1.0).collect();
    let y = late.iter().map(|s| s.input_rate_bps).sum::<f64>() / late.len() as f64;
    assert!((y / 9e6 - 1.0).abs() < 0.02, "{y}");
}

/// Traffic no router could mark (DF set, as TCP with path MTU discovery
/// sends) holding the queue: TCP mode at once, the paper's rule; R goes back
/// to what the Kick-Ass flows had before it came, and stays there.
#[test]
fn unresponsive_traffic_is_tcp_mode_at_once_and_r_keeps_the_kickass_share() {
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    let (mut now, mut samples) = (0, Vec::new());
    // Kick-Ass traffic at about the rate: R settles near C.
    offered(&mut r, &mut now, 3 * SEC, &[(8e6, false)], &mut samples);
    let before = r.advertised_rate_bps();
    assert_eq!(r.mode(), Mode::KickAss);
    // DF-set traffic at 6 Mbit/s joins: 14 Mbit/s into 10.
    let t0 = now;
    offered(
        &mut r,
        &mut now,
        t0 + 3 * SEC,
        &[(8e6, false), (6e6, true)],
        &mut samples,
    );
    let first_tcp = samples
        .iter()
        .find(|s| s.t * 1e9 >= t0 as f64 && s.marking_mode == "tcp")
        .expect("TCP mode");
    let crossing = samples
        .iter()
        .find(|s| s.t * 1e9 >= t0 as f64 && s.queue_bytes as f64 > 0.5 * 125_000.0)
        .expect("the queue crossed half the buffer");
    assert!(
        first_tcp.t - crossing.t <= 0.011,
        "at once: {} vs {}",
        first_tcp.t,
        crossing.t
    );
    assert!(first_tcp.unmarkable_share >= 0.05);
    let held: Vec<f64> = samples
        .iter()
        .filter(|s| s.t >= first_tcp.t && s.marking_mode == "tcp")
        .map(|s| s.advertised_rate_bps)
        .collect();
    assert!(
        held.iter().all(|&x| (x - before).abs() / before < 0.05),
        "{before} {held:?}"
    );
    // The DF-set traffic stops; the Kick-Ass source, in TCP mode (DF on all
    // but one segment per RTT) and more than the link, keeps the queue up:
    // the mode still ends, within a few RTTs, because what holds the queue
    // is Kick-Ass's own.
    let t1 = now;
    let own = [(0, 12e6, Df::SetButOnePer(100 * MS))];
    offered_flows(&mut r, &mut now, t1 + 2 * SEC, &own, &mut samples);
    let back = samples
        .iter()
        .find(|s| s.t * 1e9 >= t1 as f64 && s.marking_mode == "kickass")
        .expect("back in Kick-Ass mode");
    assert!(
        back.t - t1 as f64 / 1e9 <= 0.5,
        "{} s",
        back.t - t1 as f64 / 1e9
    );
}

/// Kick-Ass's own traffic above half the buffer: TCP mode only once the
/// queue has stayed there for the hold (5 average RTTs by default).
#[test]
fn kickass_traffic_above_the_threshold_waits_for_the_hold() {
    let cfg = RouterConfig::with_capacity(10e6);
    assert_eq!(cfg.tcp_mode_hold_rtts, 5.0);
    let mut r = Router::new(cfg, 0);
    let (mut now, mut samples) = (0, Vec::new());
    // 13 Mbit/s of markable traffic that never slows down.
    offered(&mut r, &mut now, 3 * SEC, &[(13e6, false)], &mut samples);
    let crossing = samples
        .iter()
        .find(|s| s.queue_bytes as f64 > 0.5 * 125_000.0)
        .expect("crossed");
    let tcp = samples
        .iter()
        .find(|s| s.marking_mode == "tcp")
        .expect("TCP mode after the hold");
    let waited = tcp.t - crossing.t;
    let d = tcp.rtt_ms / 1e3;
    assert!(
        waited >= 5.0 * d - 0.011 && waited <= 5.0 * d + 0.03,
        "waited {waited} s, d {d}"
    );
    assert!(crossing.unmarkable_share < 0.05);
}

/// A Kick-Ass flow (flow 1, 8 Mbit/s) alone for 2 s, then for 2 s beside
/// a legacy flow (flow 2, 6 Mbit/s, DF set): the router in TCP mode and the
/// Kick-Ass flow too (DF on all but one packet per 100 ms).
fn legacy_joins_a_kickass_flow() -> (Router, Nanos, Vec<Sample>) {
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    let (mut now, mut samples) = (0, Vec::new());
    let alone = [(1, 8e6, Df::Clear)];
    offered_flows(&mut r, &mut now, 2 * SEC, &alone, &mut samples);
    let t0 = now;
    let both = [(1, 8e6, Df::SetButOnePer(100 * MS)), (2, 6e6, Df::Set)];
    offered_flows(&mut r, &mut now, t0 + 2 * SEC, &both, &mut samples);
    assert_eq!(r.mode(), Mode::Tcp);
    (r, now, samples)
}

/// Kick-Ass endpoints in TCP mode set DF on all but one segment per RTT
/// (wan-agents' transport): the router remembers their flows as its own, so
/// once the traffic that was not Kick-Ass's leaves, the mode ends within a
/// few RTTs even though the queue stays up. A flow that never sends a
/// markable packet is still traffic that is not Kick-Ass's own.
#[test]
fn kickass_flows_in_tcp_mode_are_not_taken_for_legacy_traffic() {
    // A legacy flow joins: TCP mode; the Kick-Ass flow goes to TCP mode too.
    let (mut r, mut now, mut samples) = legacy_joins_a_kickass_flow();
    let legacy_share = samples.last().expect("samples").unmarkable_share;
    assert!(legacy_share > 0.3, "{legacy_share}");
    // The legacy flow leaves; the Kick-Ass flow (still in TCP mode, still
    // more than the link) keeps the queue above half the buffer.
    let t1 = now;
    let own = [(1, 12e6, Df::SetButOnePer(100 * MS))];
    offered_flows(&mut r, &mut now, t1 + 2 * SEC, &own, &mut samples);
    let back = samples
        .iter()
        .find(|s| s.t * 1e9 >= t1 as f64 && s.marking_mode == "kickass")
        .expect("back in Kick-Ass mode");
    assert!(
        back.t - t1 as f64 / 1e9 <= 0.5,
        "{} s",
        back.t - t1 as f64 / 1e9
    );
    assert!(back.unmarkable_share < 0.05, "{}", back.unmarkable_share);
    // The same with the flow never probing: traffic the router cannot tell
    // from legacy TCP, and TCP mode stays.
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    let (mut now, mut samples) = (0, Vec::new());
    offered_flows(
        &mut r,
        &mut now,
        2 * SEC,
        &[(3, 12e6, Df::Set)],
        &mut samples,
    );
    assert!(samples
        .iter()
        .filter(|s| s.t > 1.0)
        .all(|s| s.marking_mode == "tcp"));
}

/// TCP mode that traffic which is not Kick-Ass's own started, then a flood
/// the router could mark (full size, DF clear: as ka-blast sends) takes
/// its place and keeps the queue full. The flood ignores the mode, so the
/// mode stays for as long as it lasts; Kick-Ass mode follows once it ends.
#[test]
fn a_markable_flood_after_legacy_traffic_keeps_tcp_mode() {
    let (mut r, mut now, mut samples) = legacy_joins_a_kickass_flow();
    let t1 = now;
    let flood = [(1, 3e6, Df::SetButOnePer(100 * MS)), (3, 30e6, Df::Clear)];
    offered_flows(&mut r, &mut now, t1 + 3 * SEC, &flood, &mut samples);
    let during: Vec<&Sample> = samples.iter().filter(|s| s.t * 1e9 >= t1 as f64).collect();
    assert!(
        during.iter().all(|s| s.marking_mode == "tcp"),
        "{:?}",
        during
            .iter()
            .map(|s| (s.t, s.marking_mode, s.markable_share))
            .collect::<Vec<_>>()
    );
    assert!(during.last().expect("samples").markable_share > 0.8);
    let t2 = now;
    let own = [(1, 3e6, Df::SetButOnePer(100 * MS))];
    offered_flows(&mut r, &mut now, t2 + 2 * SEC, &own, &mut samples);
    assert_eq!(r.mode(), Mode::KickAss);
}

/// A 10 Mbit/s router with its defaults, offered `streams` from 0 to `until`.
fn fresh_router_offered(until: Nanos, streams: &[(u16, f64, Df)]) -> (Router, Nanos, Vec<Sample>) {
    let mut r = Router::new(RouterConfig::with_capacity(10e6), 0);
    let (mut now, mut samples) = (0, Vec::new());
    offered_flows(&mut r, &mut now, until, streams, &mut samples);
    (r, now, samples)
}

/// Kick-Ass's own overshoot held past the hold: TCP mode. Its flows obey
/// (DF on all but one segment per RTT) but, more than the link in TCP mode
/// too, keep the queue above half the buffer: the mode ends within a few
/// RTTs of their obeying, so that rates reach them again (II-C3), where
/// the queue alone would keep it for good.
#[test]
fn kickass_overshoot_that_obeyed_tcp_mode_ends_it() {
    let (mut r, mut now, mut samples) = fresh_router_offered(2 * SEC, &[(1, 13e6, Df::Clear)]);
    let entered = samples
        .iter()
        .find(|s| s.marking_mode == "tcp")
        .expect("TCP mode after the hold")
        .t;
    // From a little after the mode started, the flow obeys it.
    let t1 = now;
    let obeying = [(1, 13e6, Df::SetButOnePer(100 * MS))];
    offered_flows(&mut r, &mut now, t1 + SEC, &obeying, &mut samples);
    let back = samples
        .iter()
        .find(|s| s.t * 1e9 >= t1 as f64 && s.marking_mode == "kickass")
        .expect("back in Kick-Ass mode");
    assert!(entered < t1 as f64 / 1e9);
    let d = back.rtt_ms / 1e3;
    assert!(
        back.t - t1 as f64 / 1e9 <= 2.0 * d,
        "{} s, d {d}",
        back.t - t1 as f64 / 1e9
    );
    assert!(
        back.queue_bytes as f64 > 0.4 * 125_000.0,
        "{}",
        back.queue_bytes
    );
    // The same flow never obeying (a markable flood): TCP mode stays.
    let (_, _, samples) = fresh_router_offered(3 * SEC, &[(1, 13e6, Df::Clear)]);
    let first = samples
        .iter()
        .position(|s| s.marking_mode == "tcp")
        .expect("TCP mode");
    assert!(samples[first..].iter().all(|s| s.marking_mode == "tcp"));
}
