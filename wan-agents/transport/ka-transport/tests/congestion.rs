//! The paper's congestion experiments (§III-D) on simulated time, through
//! the real router core: long-lived Kick-Ass flows, and TCP cross traffic
//! switched on and off. The TCP here is this transport's own CUBIC with
//! Kick-Ass off (unresponsive to rates, as the paper's TCP flows are); the
//! namespace versions (`kickass testbed` scenarios) use the kernel's.
//!
//! Scaled to fit: 8 Kick-Ass and 8 TCP flows at 20 Mbit/s, 100 ms, a
//! 1-BDP buffer: 10.4 packets per RTT per flow in TCP epochs (the paper:
//! 150 Mbit/s over 128 flows, 9.8). Kick-Ass alone 0-20 s, with TCP 20-60 s,
//! alone again 60-80 s.

mod common;

use common::*;
use ka_core::router::{Router, RouterConfig, RouterKind, Sample};
use ka_core::Nanos;
use ka_transport::{Config, CongestionControl};

const C_BPS: f64 = 20e6;
const RTT: Nanos = 100 * MS;
const FLOWS: usize = 8;
/// Epochs: Kick-Ass alone, with TCP, alone again.
const TCP_ON: Nanos = 20 * SEC;
const TCP_OFF: Nanos = 60 * SEC;
const END: Nanos = 80 * SEC;

pub struct Epochs {
    pub samples: Vec<Sample>,
    /// Per Kick-Ass flow: its mode switches (at, to).
    pub switches: Vec<Vec<(f64, &'static str)>>,
    /// Per flow (Kick-Ass first, then TCP): bytes delivered in [from, to).
    pub deliveries: Vec<(Nanos, usize, u64)>,
}

impl Epochs {
    fn throughput(&self, flow: usize, from: Nanos, to: Nanos) -> f64 {
        let bytes: u64 = self
            .deliveries
            .iter()
            .filter(|(t, f, _)| *f == flow && *t >= from && *t < to)
            .map(|x| x.2)
            .sum();
        bytes as f64 * 8.0 / ((to - from) as f64 / 1e9)
    }

    /// The router's first sample in TCP mode at or after `t`, and the first
    /// back in Kick-Ass mode at or after `u`, in RTTs after them.
    fn switch_times(&self, t: Nanos, u: Nanos) -> (Option<f64>, Option<f64>) {
        let s = |x: Nanos| x as f64 / 1e9;
        let on = self
            .samples
            .iter()
            .find(|x| x.t >= s(t) && x.marking_mode == "tcp")
            .map(|x| (x.t - s(t)) / (RTT as f64 / 1e9));
        let off = self
            .samples
            .iter()
            .find(|x| x.t >= s(u) && x.marking_mode == "kickass")
            .map(|x| (x.t - s(u)) / (RTT as f64 / 1e9));
        (on, off)
    }
}

pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * sq)
}

fn router() -> RouterConfig {
    router_config(C_BPS, RouterKind::KickAss)
}

/// Experiment (a), paper §III-D1 Fig. 5: the congestion at our router.
fn kickass_bottleneck() -> Epochs {
    let mut flows = Vec::new();
    for i in 0..FLOWS {
        flows.push(FlowSpec {
            start: i as Nanos * 100 * MS,
            endpoint: i,
            deadline: Some(END),
            ..FlowSpec::new(Config::default(), 1 << 31)
        });
    }
    for i in 0..FLOWS {
        flows.push(FlowSpec {
            start: TCP_ON + i as Nanos * 10 * MS,
            endpoint: FLOWS + i,
            deadline: Some(TCP_OFF),
            ..FlowSpec::new(Config::tcp(CongestionControl::Cubic), 1 << 31)
        });
    }
    let mut path = PathConfig::droptail(C_BPS, RTT);
    path.bottleneck = Bottleneck::KaRouter(Box::new(Router::new(router(), 0)));
    let o = Sim::new(path, flows).log_deliveries().run(END);
    Epochs {
        samples: o.router_samples,
        switches: o
            .flows
            .iter()
            .take(FLOWS)
            .map(|f| {
                f.record
                    .mode_switches
                    .iter()
                    .map(|s| (s.at_ns as f64 / 1e9, s.to.as_str()))
                    .collect()
            })
            .collect(),
        deliveries: o.deliveries,
    }
}

#[test]
fn experiment_a_kickass_and_tcp_share_a_kickass_bottleneck() {
    let e = kickass_bottleneck();
    let (half, end) = ((TCP_ON + TCP_OFF) / 2, TCP_OFF);
    let rates: Vec<f64> = (0..2 * FLOWS).map(|f| e.throughput(f, half, end)).collect();
    let ka = rates[..FLOWS].iter().sum::<f64>() / FLOWS as f64;
    let tcp = rates[FLOWS..].iter().sum::<f64>() / FLOWS as f64;
    let util = rates.iter().sum::<f64>() / C_BPS;
    let (on, off) = e.switch_times(TCP_ON, TCP_OFF);
    let alone: Vec<f64> = (0..FLOWS)
        .map(|f| e.throughput(f, 10 * SEC, TCP_ON))
        .collect();
    let after: Vec<f64> = (0..FLOWS)
        .map(|f| e.throughput(f, TCP_OFF + 10 * SEC, END))
        .collect();
    println!(
        "(a) TCP epoch, 2nd half: Jain {:.3}, Kick-Ass/TCP mean {:.3}, utilisation {:.3}; \
         TCP mode on after {on:?} RTTs, off after {off:?} RTTs; Kick-Ass alone: Jain {:.3} \
         utilisation {:.3}, after: Jain {:.3} utilisation {:.3}",
        jain(&rates),
        ka / tcp,
        util,
        jain(&alone),
        alone.iter().sum::<f64>() / C_BPS,
        jain(&after),
        after.iter().sum::<f64>() / C_BPS,
    );
    if std::env::var("KA_TRACE").is_ok() {
        for (i, sw) in e.switches.iter().enumerate() {
            println!("ka flow {i}: switches {sw:?}");
        }
        for x in e.samples.iter().filter(|x| x.t > 19.5 && x.t < 62.0) {
            println!(
                "t {:.2} {} R {:.2} in {:.2} q {} d {:.0}",
                x.t,
                x.marking_mode,
                x.advertised_rate_bps / 1e6,
                x.input_rate_bps / 1e6,
                x.queue_bytes,
                x.rtt_ms
            );
        }
    }
    assert!(jain(&rates) >= 0.9, "Jain {}", jain(&rates));
    // Both groups are this transport's CUBIC here (the Kick-Ass flows in TCP
    // mode), entered differently (seeded at the rate, or slow start), and
    // drop-tail losses on simulated time are synchronised: the share between
    // the groups settles slowly (0.98-1.5 over 20 s for router gains 0.4-0.8).
    // That neither group starves is what this path can say; the paper's
    // [0.8, 1.25] is held against the kernel's CUBIC in namespaces
    // (tests/wan/test_congestion_netns.py).
    assert!(
        (0.5..=2.0).contains(&(ka / tcp)),
        "Kick-Ass/TCP {}",
        ka / tcp
    );
    assert!(util >= 0.9, "utilisation {util}");
    assert!(
        on.is_some_and(|x| x <= 3.0),
        "TCP mode entered after {on:?} RTTs"
    );
    assert!(
        off.is_some_and(|x| x <= 5.0),
        "TCP mode left after {off:?} RTTs"
    );
    assert!(jain(&after) >= 0.9 && after.iter().sum::<f64>() / C_BPS >= 0.9);
}
