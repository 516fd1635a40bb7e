//! The trials' own flows replayed on simulated time through the real router
//! core (`ka_core::router::Router`) and the real transport: each pair's
//! flows once under Kick-Ass through a Kick-Ass router, once under this
//! transport's own TCP (CUBIC with SACK, RACK-TLP, PRR: *not* the kernel's
//! CUBIC the bench compares with, and named so) through the same router in
//! drop-tail mode. The flow lists are the bench's
//! (`wan-agents/vectors/make_replay.py`), so what the two-hour bench
//! measures in namespaces is found here in seconds.
//!
//! `cargo test -p ka-transport --test replay` runs one pair of the heavy
//! load and checks the floors; the whole list, with a table per arm:
//! `cargo test --release -p ka-transport --test replay -- --ignored --nocapture`.
//! Beside the whole lists, the ignored tests are diagnostics of issue 24's
//! heavy-load gap: ideal processor sharing at both overheads (in every
//! list's last line), `unused_by_active_flows`, `against_the_ideal_by_size`
//! and `synchronized_start` (the trap that keeps RCP's alpha at 0.4).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use ka_core::router::{Router, RouterConfig, RouterKind, Sample};
use ka_core::Nanos;
use ka_transport::{Config, CongestionControl, Mode, SwitchReason, SMSS};
use serde_json::Value;

/// Router idle before the period, as in a trial (RCP climbs to C meanwhile).
const WARMUP: Nanos = 5 * SEC;
/// A flow's own limit (`kickass trials run --flow-timeout`, default 60 s).
const FLOW_TIMEOUT: Nanos = 60 * SEC;
/// The gap after a period, less the runner's quiet second: flows still
/// running then are cut at the deadline.
const AFTER_PERIOD: Nanos = 4 * SEC;

struct Scenario {
    capacity_bps: f64,
    rtt: Nanos,
    period: Nanos,
    /// The paper's on-off senders: each flow starts its off time after the
    /// sender's previous flow ended (else at its start offset).
    closed_loop: bool,
    /// pairs -> senders -> (start or off time, size bytes)
    pairs: Vec<Vec<Vec<(Nanos, u64)>>>,
}

fn load(name: &str) -> Scenario {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../vectors/replay")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let v: Value = serde_json::from_str(&text).expect("json");
    let secs = |x: &Value| (x.as_f64().expect("number") * 1e9).round() as Nanos;
    let closed_loop = v["metadata"]["loop"] == "closed";
    let when = if closed_loop { "off_s" } else { "start_s" };
    let pairs = v["pairs"]
        .as_array()
        .expect("pairs")
        .iter()
        .map(|p| {
            p.as_array()
                .expect("senders")
                .iter()
                .map(|s| {
                    s.as_array()
                        .expect("flows")
                        .iter()
                        .map(|f| (secs(&f[when]), f["size_bytes"].as_u64().expect("size")))
                        .collect()
                })
                .collect()
        })
        .collect();
    Scenario {
        capacity_bps: v["capacity_bps"].as_f64().expect("capacity"),
        rtt: (v["rtt_ms"].as_f64().expect("rtt") * 1e6) as Nanos,
        period: secs(&v["period_s"]),
        closed_loop,
        pairs,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Arm {
    KickAss,
    /// This transport's TCP with CUBIC (Kick-Ass off), at a drop-tail router.
    TransportCubic,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::KickAss => "kickass",
            Arm::TransportCubic => "transport-cubic",
        }
    }

    fn config(self) -> Config {
        match self {
            Arm::KickAss => {
                let mut c = Config::default();
                if let Ok(f) = std::env::var("KA_REPLAY_START") {
                    c.start_fraction = f.parse().expect("a number");
                }
                if std::env::var("KA_REPLAY_HANDSHAKE").as_deref() == Ok("paper") {
                    c.handshake_mode = ka_transport::HandshakeMode::Paper;
                }
                c
            }
            Arm::TransportCubic => Config::tcp(CongestionControl::Cubic),
        }
    }
}

/// The router `ka-router` runs with by default, at this capacity, with
/// `KA_REPLAY_ROUTER` overrides (see `common::router_config`).
fn router(capacity_bps: f64, kind: RouterKind) -> RouterConfig {
    router_config(capacity_bps, kind)
}

#[derive(Debug, Clone)]
struct FlowResult {
    size: u64,
    /// It ran (a closed loop's flow may never start: the period ended first).
    started: bool,
    /// Seconds from the period's start to the flow's start and end.
    span: (f64, f64),
    fct: Option<Nanos>,
    ka_ns: Nanos,
    life_ns: Nanos,
    switches: Vec<SwitchReason>,
}

#[derive(Debug, Default)]
struct PeriodResult {
    flows: Vec<FlowResult>,
    samples: Vec<Sample>,
    forward_ip_bytes: u64,
    payload_bytes: u64,
    queue_drops: u64,
}

fn run_period(sc: &Scenario, pair: usize, arm: Arm, rc: &RouterConfig) -> PeriodResult {
    let mut specs = Vec::new();
    let end = WARMUP + sc.period + AFTER_PERIOD;
    for (e, flows) in sc.pairs[pair].iter().enumerate() {
        for (k, &(t, size)) in flows.iter().enumerate() {
            let mut spec = FlowSpec {
                start: WARMUP + t,
                endpoint: e,
                // Its own timeout counts from its start (below, for closed
                // loops, from its earliest start: a bound, not the limit).
                deadline: Some((WARMUP + t + FLOW_TIMEOUT).min(end)),
                ..FlowSpec::new(arm.config(), size)
            };
            if sc.closed_loop {
                spec.deadline = Some(end);
                spec.not_after = Some(WARMUP + sc.period);
                if k > 0 {
                    spec.after = Some((specs.len() - 1, t));
                }
            }
            specs.push(spec);
        }
    }
    let sizes: Vec<u64> = specs.iter().map(|s| s.size).collect();
    let mut path = PathConfig::droptail(sc.capacity_bps, sc.rtt);
    path.bottleneck = Bottleneck::KaRouter(Box::new(Router::new(rc.clone(), 0)));
    let o = Sim::new(path, specs).run(end + SEC);
    let flows = o
        .flows
        .iter()
        .zip(&sizes)
        .map(|(f, &size)| {
            let r = &f.record;
            let life = match (f.started_at, f.closed_at) {
                _ if r.fct_ns.is_some() => r.fct_ns.unwrap_or(0),
                (Some(s), Some(c)) => c - s,
                _ => 0,
            };
            let secs = |t: Nanos| t.saturating_sub(0) as f64 / 1e9;
            let began = f.started_at.map_or(0.0, secs);
            FlowResult {
                size,
                started: f.started_at.is_some(),
                span: (began, began + life as f64 / 1e9),
                fct: r.fct_ns,
                ka_ns: r.ka_mode_ns.min(life),
                life_ns: life,
                switches: r
                    .mode_switches
                    .iter()
                    .filter(|s| s.to == Mode::Tcp)
                    .map(|s| s.reason)
                    .collect(),
            }
        })
        .collect();
    PeriodResult {
        flows,
        samples: o.router_samples,
        forward_ip_bytes: o.path.forward_ip_bytes,
        payload_bytes: o.flows.iter().map(|f| f.delivered).sum(),
        queue_drops: o.path.queue_drops,
    }
}

#[derive(Debug)]
struct Summary {
    flows: usize,
    completed: usize,
    mean_fct_s: f64,
    /// Σ ka_mode / Σ lifetime over all flows (not a mean of fractions).
    ka_time: f64,
    switches: BTreeMap<String, usize>,
    queue_ms_p90: f64,
    queue_ms_p99: f64,
    wire_per_payload: f64,
    queue_drops: u64,
    /// Capacity left unused while some flow had not finished, as a share
    /// of the capacity over that time (what RCP's transients cost).
    idle_while_busy: f64,
}

fn pct(mut xs: Vec<f64>, q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[((q * xs.len() as f64) as usize).min(xs.len() - 1)]
}

fn summarize(sc: &Scenario, runs: &[PeriodResult]) -> Summary {
    let flows: Vec<&FlowResult> = runs
        .iter()
        .flat_map(|r| &r.flows)
        .filter(|f| f.started)
        .collect();
    let done: Vec<f64> = flows
        .iter()
        .filter_map(|f| f.fct.map(|x| x as f64 / 1e9))
        .collect();
    let mut switches = BTreeMap::new();
    for f in &flows {
        for s in &f.switches {
            *switches.entry(format!("{s:?}")).or_insert(0) += 1;
        }
    }
    // Queueing delay per control interval, during the period only.
    let lo = WARMUP as f64 / 1e9;
    let hi = (WARMUP + sc.period) as f64 / 1e9;
    let q: Vec<f64> = runs
        .iter()
        .flat_map(|r| &r.samples)
        .filter(|s| s.t >= lo && s.t < hi)
        .map(|s| s.queue_bytes as f64 * 8.0 / sc.capacity_bps * 1e3)
        .collect();
    let (mut busy, mut unused) = (0.0, 0.0);
    for r in runs {
        for s in &r.samples {
            let t0 = s.t - s.interval_ms / 1e3;
            if r.flows
                .iter()
                .any(|f| f.started && f.span.0 <= t0 && f.span.1 >= s.t)
            {
                busy += s.interval_ms;
                unused += s.interval_ms * (1.0 - s.output_rate_bps / sc.capacity_bps).max(0.0);
            }
        }
    }
    let life: Nanos = flows.iter().map(|f| f.life_ns).sum();
    let ka: Nanos = flows.iter().map(|f| f.ka_ns).sum();
    Summary {
        flows: flows.len(),
        completed: done.len(),
        mean_fct_s: done.iter().sum::<f64>() / done.len().max(1) as f64,
        ka_time: ka as f64 / life.max(1) as f64,
        switches,
        queue_ms_p90: pct(q.clone(), 0.90),
        queue_ms_p99: pct(q, 0.99),
        wire_per_payload: runs.iter().map(|r| r.forward_ip_bytes).sum::<u64>() as f64
            / runs.iter().map(|r| r.payload_bytes).sum::<u64>().max(1) as f64,
        queue_drops: runs.iter().map(|r| r.queue_drops).sum(),
        idle_while_busy: unused / busy.max(1e-9),
    }
}

/// Geometric mean of FCT(TCP) / FCT(Kick-Ass) over flows both completed,
/// as `kickass_analysis.stats.speedup` computes it.
fn matched_speedup(ka: &[PeriodResult], tcp: &[PeriodResult]) -> (f64, usize) {
    let mut logs = Vec::new();
    for (a, b) in ka.iter().zip(tcp) {
        for (x, y) in a.flows.iter().zip(&b.flows) {
            assert_eq!(x.size, y.size, "the same flow under both arms");
            if let (Some(k), Some(t)) = (x.fct, y.fct) {
                logs.push((t as f64).ln() - (k as f64).ln());
            }
        }
    }
    (geo_mean(&logs), logs.len())
}

/// exp of the mean of log ratios: the geometric mean of the ratios (1 for
/// none).
fn geo_mean(logs: &[f64]) -> f64 {
    (logs.iter().sum::<f64>() / logs.len().max(1) as f64).exp()
}

struct Replay {
    ka: Summary,
    tcp: Summary,
    speedup: f64,
    matched: usize,
    /// What no rate allocator can beat: the same flows as ideal processor
    /// sharing of the link's payload capacity, with no feedback delay (two
    /// RTTs per flow for the handshake and the last ACK), and the speedup
    /// over the TCP arm it would have.
    ideal_speedup: f64,
    /// The flows ideal processor sharing finishes in their time.
    ideal_completed: usize,
    /// The same ideal at TCP's overhead (1448 payload bytes of every 1500):
    /// what a rate allocator would reach without the second fragment's IP
    /// header and our 1440-byte payload. Near capacity the mean FCT goes
    /// as 1/(1 - load), so 2% more wire bytes per payload byte cost far
    /// more than 2% (issue 24's arithmetic).
    ideal_speedup_tcp_overhead: f64,
}

/// Payload bytes per wire byte of a full-size Kick-Ass datagram, cut by the
/// router: 1440 of 1500 + the second fragment's 20-byte IP header.
const KA_PAYLOAD_SHARE: f64 = 1440.0 / 1520.0;
/// The same for kernel TCP with timestamps: 1448 of 1500.
const TCP_PAYLOAD_SHARE: f64 = 1448.0 / 1500.0;

/// Geometric mean of FCT(TCP arm) / FCT(ideal) over flows both completed,
/// and how many the ideal completed.
fn ideal_against(sc: &Scenario, pairs: &[usize], tcp: &[PeriodResult], share: f64) -> (f64, usize) {
    let mut logs = Vec::new();
    let mut completed = 0;
    for (i, &p) in pairs.iter().enumerate() {
        let ideal = ideal_fcts(sc, p, share);
        completed += ideal.iter().filter(|x| x.is_some()).count();
        for (ideal, t) in ideal.into_iter().zip(&tcp[i].flows) {
            if let (Some(a), Some(b)) = (ideal, t.fct) {
                logs.push((b as f64).ln() - (a as f64).ln());
            }
        }
    }
    (geo_mean(&logs), completed)
}

/// Ideal processor sharing of the payload capacity (`payload_share` of the
/// link's bytes), open or closed loop as the scenario says: each flow's completion
/// time, plus two RTTs. `None` where the flow would not have started (a
/// closed loop's turn after the period) or would pass its deadline.
fn ideal_fcts(sc: &Scenario, pair: usize, payload_share: f64) -> Vec<Option<Nanos>> {
    let c = sc.capacity_bps / 8.0 * payload_share; // payload bytes/s
    let end = (sc.period + AFTER_PERIOD) as f64 / 1e9;
    let period = sc.period as f64 / 1e9;
    let rtt = sc.rtt as f64 / 1e9;
    // (sender, index in its list) -> fct
    let senders = &sc.pairs[pair];
    let mut out: Vec<Vec<Option<Nanos>>> = senders.iter().map(|f| vec![None; f.len()]).collect();
    // Active flows: (sender, index, bytes left, data starts at, due at).
    let mut active: Vec<(usize, usize, f64, f64)> = Vec::new();
    // The next flow of each sender and when it is due (closed loop: after
    // the last one ended), or every flow at its start (open loop).
    let mut next: Vec<(usize, f64)> = senders
        .iter()
        .map(|f| (0, f.first().map_or(f64::INFINITY, |x| x.0 as f64 / 1e9)))
        .collect();
    let mut t = 0.0f64;
    loop {
        // Due flows start (their data after the handshake's RTT).
        let mut any = false;
        for (e, flows) in senders.iter().enumerate() {
            while next[e].0 < flows.len() && next[e].1 <= t + 1e-9 {
                let k = next[e].0;
                if next[e].1 > period {
                    next[e] = (flows.len(), f64::INFINITY);
                    break;
                }
                active.push((e, k, flows[k].1 as f64, next[e].1));
                next[e].0 += 1;
                next[e].1 = if sc.closed_loop {
                    f64::INFINITY
                } else {
                    flows.get(k + 1).map_or(f64::INFINITY, |x| x.0 as f64 / 1e9)
                };
                any = true;
            }
        }
        let _ = any;
        let n = active.len() as f64;
        let next_due = next.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
        let next_done = active
            .iter()
            .map(|a| t + a.2 / (c / n))
            .fold(f64::INFINITY, f64::min);
        let step = next_due.min(next_done).min(end).max(t);
        if active.is_empty() && next_due.is_infinite() || step >= end {
            break;
        }
        for a in active.iter_mut() {
            a.2 -= (step - t) * c / n;
        }
        t = step;
        let (done, rest): (Vec<_>, Vec<_>) = active.into_iter().partition(|a| a.2 <= 1e-3);
        active = rest;
        for (e, k, _, due) in done {
            let fct = t - due + 2.0 * rtt;
            if t + rtt <= end && fct <= FLOW_TIMEOUT as f64 / 1e9 {
                out[e][k] = Some((fct * 1e9) as Nanos);
            }
            if sc.closed_loop {
                if let Some(f) = senders[e].get(k + 1) {
                    next[e] = (k + 1, t + rtt + f.0 as f64 / 1e9);
                }
            }
        }
    }
    out.into_iter().flatten().collect()
}

fn replay(name: &str, pairs: &[usize]) -> Replay {
    let sc = load(name);
    let mut ka = Vec::new();
    let mut tcp = Vec::new();
    for &p in pairs {
        ka.push(run_period(
            &sc,
            p,
            Arm::KickAss,
            &router(sc.capacity_bps, RouterKind::KickAss),
        ));
        tcp.push(run_period(
            &sc,
            p,
            Arm::TransportCubic,
            &router(sc.capacity_bps, RouterKind::DropTail),
        ));
    }
    let (speedup, matched) = matched_speedup(&ka, &tcp);
    let (ideal_speedup, ideal_completed) = ideal_against(&sc, pairs, &tcp, KA_PAYLOAD_SHARE);
    let (ideal_speedup_tcp_overhead, _) = ideal_against(&sc, pairs, &tcp, TCP_PAYLOAD_SHARE);
    let r = Replay {
        ka: summarize(&sc, &ka),
        tcp: summarize(&sc, &tcp),
        speedup,
        matched,
        ideal_speedup,
        ideal_completed,
        ideal_speedup_tcp_overhead,
    };
    for (arm, s) in [(Arm::KickAss, &r.ka), (Arm::TransportCubic, &r.tcp)] {
        println!(
            "{name} pairs {pairs:?} {:>16}: {}/{} completed, mean fct {:.2} s, time in Kick-Ass \
             mode {:.4}, to TCP mode {:?}, queue p90 {:.1} ms p99 {:.1} ms, drops {}, \
             wire/payload {:.4}, unused while busy {:.3}",
            arm.name(),
            s.completed,
            s.flows,
            s.mean_fct_s,
            s.ka_time,
            s.switches,
            s.queue_ms_p90,
            s.queue_ms_p99,
            s.queue_drops,
            s.wire_per_payload,
            s.idle_while_busy,
        );
    }
    println!(
        "{name} pairs {pairs:?}: Kick-Ass {:.3}x {} on {} matched flows; ideal processor \
         sharing {:.3}x, completing {} ({:.3}x at TCP's 1448 payload bytes per 1500)",
        r.speedup,
        Arm::TransportCubic.name(),
        r.matched,
        r.ideal_speedup,
        r.ideal_completed,
        r.ideal_speedup_tcp_overhead
    );
    r
}

/// One pair of the bench's heavy load (open loop, ~91% offered at 10
/// Mbit/s, no TCP in the Kick-Ass period), against regressions. The
/// bench's goals (issue 24: completion at least CUBIC's, 99% of the flow
/// time in Kick-Ass mode) are not all met: on this pair Kick-Ass finishes
/// 85 of 95 flows in their time, this CUBIC 88 and ideal processor sharing
/// 90 (all four pairs: 347, 352, 357 of 365), with 99.5% of the flow time
/// in Kick-Ass mode (99.7% over all four). The floors below are what the
/// code reaches now, so that a change that loses more shows here. (With
/// RCP's alpha at 0.8 Kick-Ass finished 86 here and 349 in all, 0.98x
/// CUBIC against 0.90x; see `DEFAULT_ALPHA` for why it is 0.4.)
#[test]
fn heavy_load_one_pair() {
    let r = replay("heavy_open_seed13", &[0]);
    assert!(
        r.ka.completed + 3 >= r.tcp.completed && r.ka.completed + 5 >= r.ideal_completed,
        "completion {} vs {} (ideal {})",
        r.ka.completed,
        r.tcp.completed,
        r.ideal_completed
    );
    assert!(
        r.ka.ka_time >= 0.975,
        "time in Kick-Ass mode {}",
        r.ka.ka_time
    );
    assert!(r.speedup >= 0.9, "speedup {}", r.speedup);
}

/// The whole list (release build: see the module's doc).
#[test]
#[ignore]
fn heavy_load_all_pairs() {
    let sc = load("heavy_open_seed13");
    let all: Vec<usize> = (0..sc.pairs.len()).collect();
    replay("heavy_open_seed13", &all);
}

/// The paper's heavy load as the paper ran it: closed-loop on-off senders.
#[test]
#[ignore]
fn heavy_closed_loop_all_pairs() {
    replay("heavy_closed_seed13", &[0, 1, 2, 3]);
}

#[test]
#[ignore]
fn light_load_all_pairs() {
    replay("light_open_seed11", &[0, 1, 2, 3]);
}

#[test]
fn the_flow_list_is_the_benchs() {
    let sc = load("heavy_open_seed13");
    let n: usize = sc.pairs.iter().flatten().map(|s| s.len()).sum();
    assert_eq!(n, 365, "regenerate with wan-agents/vectors/make_replay.py");
    assert_eq!(sc.pairs[0].len(), 8);
    let bytes: u64 = sc.pairs.iter().flatten().flatten().map(|f| f.1).sum();
    assert_eq!(bytes % SMSS, 0, "whole packets of {SMSS} bytes");
}

/// The router's samples of the first pair's Kick-Ass period wherever the
/// queue passed 60 kB (`KA_REPLAY_SCENARIO` names the flow list): where to
/// look first when a change moves the figures.
#[test]
#[ignore]
fn trace_first_pair() {
    let sc = load("heavy_open_seed13");
    let r = run_period(
        &sc,
        0,
        Arm::KickAss,
        &router(sc.capacity_bps, RouterKind::KickAss),
    );
    let mut last_print = 0.0;
    for s in &r.samples {
        if s.queue_bytes > 60_000 && s.t - last_print > 0.02 {
            println!(
                "t {:.3} rate {:.2} in {:.2} out {:.2} q {} mode {} d {:.1} drops {}",
                s.t,
                s.advertised_rate_bps / 1e6,
                s.input_rate_bps / 1e6,
                s.output_rate_bps / 1e6,
                s.queue_bytes,
                s.marking_mode,
                s.rtt_ms,
                s.counters.drops
            );
            last_print = s.t;
        }
    }
    let mut starts: Vec<(f64, u64)> = sc.pairs[0]
        .iter()
        .flatten()
        .map(|&(t, s)| (t as f64 / 1e9 + 5.0, s / 1440))
        .collect();
    starts.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!("{:?}", &starts[..20]);
}

/// The heavy open load's four Kick-Ass periods, with their pair.
fn heavy_kickass_periods(sc: &Scenario) -> Vec<(usize, PeriodResult)> {
    (0..sc.pairs.len().min(4))
        .map(|pair| {
            let rc = router(sc.capacity_bps, RouterKind::KickAss);
            (pair, run_period(sc, pair, Arm::KickAss, &rc))
        })
        .collect()
}

/// Where the heavy load's unused capacity is, by how many flows were open
/// (handshake to last ACK): a lone flow leaves a third of the link unused
/// (its handshake and last RTT, and the rate encoding's top step, 0.954 C
/// at 10 Mbit/s); from five flows on, 4-8%.
#[test]
#[ignore]
fn unused_by_active_flows() {
    let sc = load("heavy_open_seed13");
    let mut by_n: BTreeMap<usize, (f64, f64, f64)> = BTreeMap::new();
    for (_, r) in heavy_kickass_periods(&sc) {
        for s in &r.samples {
            let t0 = s.t - s.interval_ms / 1e3;
            let n = r
                .flows
                .iter()
                .filter(|f| f.started && f.span.0 <= t0 && f.span.1 >= s.t)
                .count();
            if n == 0 {
                continue;
            }
            let e = by_n.entry(n).or_default();
            e.0 += s.interval_ms;
            e.1 += s.interval_ms * (1.0 - s.output_rate_bps / sc.capacity_bps).max(0.0);
            e.2 += s.interval_ms * s.advertised_rate_bps / sc.capacity_bps;
        }
    }
    let total: f64 = by_n.values().map(|v| v.0).sum();
    let unused: f64 = by_n.values().map(|v| v.1).sum();
    for (n, (busy, un, adv)) in &by_n {
        println!(
            "n {n:2}: share of busy time {:.3}, unused {:.3} (of all busy unused {:.3}), mean R/C {:.3} (n*R/C {:.3})",
            busy / total,
            un / busy,
            un / unused,
            adv / busy,
            *n as f64 * adv / busy
        );
    }
}

/// Each Kick-Ass flow's FCT against ideal processor sharing's, by size
/// and by when it ran: which flows lose what to the ideal.
#[test]
#[ignore]
fn against_the_ideal_by_size() {
    let sc = load("heavy_open_seed13");
    let mut bins: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
    for (pair, r) in heavy_kickass_periods(&sc) {
        let ideal = ideal_fcts(&sc, pair, KA_PAYLOAD_SHARE);
        for (f, i) in r.flows.iter().zip(ideal) {
            if let (Some(k), Some(i)) = (f.fct, i) {
                let bin = match f.size / 1440 {
                    0..=300 => "101-300",
                    301..=1000 => "301-1000",
                    _ => "1001+",
                };
                let e = bins.entry(bin).or_default();
                e.0 += (k as f64).ln() - (i as f64).ln();
                e.1 += 1;
            }
        }
    }
    for (bin, (logs, n)) in bins {
        println!(
            "{bin}: {n} flows, Kick-Ass FCT / ideal {:.3}",
            (logs / n as f64).exp()
        );
    }
}

/// Eight 1000-packet Kick-Ass flows started at once through the 10 Mbit/s
/// router at 100 ms (the namespace test `test_eight_kickass_senders_
/// converge_to_the_fair_share`): time in Kick-Ass mode and the advertised
/// rate against C/8, with `KA_REPLAY_ROUTER` overrides. It finds the trap
/// that keeps RCP's alpha at 0.4 in a second: 0.70 of the flow time in
/// Kick-Ass mode at 0.4 (namespaces: 0.73), 0.12 at 0.6 (namespaces:
/// 0.07-0.25). Not at 0.8 (0.49 here, 0.06-0.08 in namespaces). Without
/// the rate hold in TCP mode (`hold_rate=0`) 0.6 stays trapped (0.06);
/// with a TCP-mode hold of 10 RTTs (`hold=10`) it reaches 0.48.
#[test]
#[ignore]
fn synchronized_start() {
    let c = 10e6;
    let specs: Vec<FlowSpec> = (0..8)
        .map(|e| FlowSpec {
            start: WARMUP,
            endpoint: e,
            deadline: Some(WARMUP + FLOW_TIMEOUT),
            ..FlowSpec::new(Arm::KickAss.config(), 1000 * 1440)
        })
        .collect();
    let mut path = PathConfig::droptail(c, 100 * MS);
    path.bottleneck =
        Bottleneck::KaRouter(Box::new(Router::new(router(c, RouterKind::KickAss), 0)));
    let o = Sim::new(path, specs).run(WARMUP + FLOW_TIMEOUT);
    let (mut ka, mut life) = (0, 0);
    for f in &o.flows {
        let l = f.record.fct_ns.unwrap_or(0);
        ka += f.record.ka_mode_ns.min(l);
        life += l;
    }
    let adv: Vec<f64> = o
        .router_samples
        .iter()
        .filter(|s| s.t >= 9.0 && s.t < 14.0)
        .map(|s| s.advertised_rate_bps / (c / 8.0))
        .collect();
    println!(
        "time in Kick-Ass mode {:.3}, completed {}/8, advertised / (C/8) 4-9 s after the start: median {:.2}",
        ka as f64 / life.max(1) as f64,
        o.flows.iter().filter(|f| f.record.fct_ns.is_some()).count(),
        pct(adv, 0.5)
    );
}
