//! The router's rate computation: RCP (Dukkipati), behind one small trait
//! so another explicit-rate algorithm can be dropped in.
//!
//! Every control interval T (T <= d):
//! `R <- R * (1 + (T/d) * (alpha*(C - y) - beta*q/d) / C)`, clamped to
//! [min_rate, C]. C capacity, y input rate over the interval (bytes counted
//! at enqueue, dropped ones too), q instantaneous backlog in bytes, d the
//! average RTT. The T/d factor is what keeps a short interval stable (ns-2
//! RCP); with T = d this is the paper's form.

/// What the router measured over one control interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measurement {
    /// Actual length of the interval, seconds.
    pub interval_s: f64,
    /// Bytes that arrived at the queue during it, dropped ones included.
    pub arrived_bytes: u64,
    /// Backlog at the end of it, bytes.
    pub queue_bytes: usize,
    /// Average RTT d, seconds.
    pub rtt_s: f64,
}

/// An explicit-rate controller: one rate for every flow on the link.
pub trait RateController {
    /// Fold in one interval and return the new rate, bits per second.
    fn on_interval(&mut self, m: &Measurement) -> f64;
    /// Current rate, bits per second.
    fn rate_bps(&self) -> f64;
}

#[derive(Debug, Clone, PartialEq)]
pub struct RcpConfig {
    pub capacity_bps: f64,
    pub alpha: f64,
    pub beta: f64,
    pub initial_rate_bps: f64,
    pub min_rate_bps: f64,
    /// The queue RCP's beta term steers to, seconds at capacity (0: an
    /// empty queue, RCP as published).
    pub target_queue_s: f64,
}

impl RcpConfig {
    /// ns-2 RCP defaults: alpha 0.4, beta 0.4, initial rate 0.05 C, and
    /// the floor at the smallest encodable rate (~120 kbit/s, L = 24).
    ///
    /// Why not lower, as the paper lets the rate fall: below the encodable
    /// minimum the router stops fragmenting, its flows go to TCP mode and
    /// keep the link full, so y stays at C and RCP never climbs back; the
    /// flows never return to Kick-Ass mode while the load lasts (measured
    /// in tests/test_trials_netns.py). At the floor the router keeps
    /// advertising, flows in TCP mode see a rate they already exceed and
    /// switch back, and a real overload is still handed to TCP mode by the
    /// queue rule (mode.rs).
    pub fn ns2_defaults(capacity_bps: f64) -> Self {
        RcpConfig {
            capacity_bps,
            alpha: 0.4,
            beta: 0.4,
            initial_rate_bps: 0.05 * capacity_bps,
            min_rate_bps: min_encodable_rate_bps(),
            target_queue_s: 0.0,
        }
    }
}

/// The smallest rate a leading fragment carries, bits per second: the
/// default floor of R.
pub fn min_encodable_rate_bps() -> f64 {
    crate::encoding::bytes_per_ms_to_bps(crate::encoding::min_advertised_rate_bytes_per_ms())
}

#[derive(Debug, Clone)]
pub struct Rcp {
    cfg: RcpConfig,
    /// Bytes per second, like every other quantity in the formula.
    rate: f64,
}

impl Rcp {
    pub fn new(cfg: RcpConfig) -> Self {
        let rate =
            (cfg.initial_rate_bps / 8.0).clamp(cfg.min_rate_bps / 8.0, cfg.capacity_bps / 8.0);
        Rcp { cfg, rate }
    }

    pub fn config(&self) -> &RcpConfig {
        &self.cfg
    }

    /// Put R back to `rate_bps` (clamped to [min, C]).
    pub fn set_rate_bps(&mut self, rate_bps: f64) {
        self.rate =
            (rate_bps / 8.0).clamp(self.cfg.min_rate_bps / 8.0, self.cfg.capacity_bps / 8.0);
    }
}

impl RateController for Rcp {
    fn on_interval(&mut self, m: &Measurement) -> f64 {
        let c = self.cfg.capacity_bps / 8.0;
        if m.interval_s > 0.0 && m.rtt_s > 0.0 {
            let y = m.arrived_bytes as f64 / m.interval_s;
            let target = self.cfg.target_queue_s * c;
            // T > d would overshoot; the seeds' form (T = d) is the limit.
            let gain = (m.interval_s / m.rtt_s).min(1.0);
            let feedback = self.cfg.alpha * (c - y)
                - self.cfg.beta * (m.queue_bytes as f64 - target) / m.rtt_s;
            let next = self.rate * (1.0 + gain * feedback / c);
            self.rate = next.clamp(self.cfg.min_rate_bps / 8.0, c);
        }
        self.rate * 8.0
    }

    fn rate_bps(&self) -> f64 {
        self.rate * 8.0
    }
}

/// d: moving average of the RTT indicators seen (EWMA), with a default
/// until the first one arrives.
#[derive(Debug, Clone)]
pub struct RttEstimator {
    avg_ms: Option<f64>,
    gain: f64,
    default_ms: f64,
    samples: u64,
}

impl RttEstimator {
    pub fn new(default_ms: f64, gain: f64) -> Self {
        RttEstimator {
            avg_ms: None,
            gain,
            default_ms,
            samples: 0,
        }
    }

    /// Fold in one indicator's midpoint. The first sample replaces the
    /// default outright: the default is a guess, not a measurement.
    pub fn on_sample(&mut self, rtt_ms: f64) {
        self.samples += 1;
        self.avg_ms = Some(match self.avg_ms {
            None => rtt_ms,
            Some(a) => a + self.gain * (rtt_ms - a),
        });
    }

    pub fn rtt_ms(&self) -> f64 {
        self.avg_ms.unwrap_or(self.default_ms)
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fluid model: N flows each send at the rate advertised one RTT ago
    /// through a link of capacity C with an unbounded queue. RCP must bring
    /// every flow to C/N with an empty queue.
    fn fluid(n: usize, alpha: f64, beta: f64, rtt_s: f64, t_s: f64) -> (f64, f64) {
        let c_bps = 10e6;
        let mut cfg = RcpConfig::ns2_defaults(c_bps);
        cfg.alpha = alpha;
        cfg.beta = beta;
        let mut rcp = Rcp::new(cfg);
        let dt = (rtt_s).min(0.010);
        let delay_steps = (rtt_s / dt).round() as usize;
        let mut history = vec![rcp.rate_bps(); delay_steps.max(1)];
        let mut q = 0.0f64; // bytes
        let steps = (t_s / dt) as usize;
        for i in 0..steps {
            let sending_bps = history[i % history.len()];
            let arrived = n as f64 * sending_bps / 8.0 * dt;
            q = (q + arrived - c_bps / 8.0 * dt).max(0.0);
            let r = rcp.on_interval(&Measurement {
                interval_s: dt,
                arrived_bytes: arrived as u64,
                queue_bytes: q as usize,
                rtt_s,
            });
            let slot = i % history.len();
            history[slot] = r;
        }
        (rcp.rate_bps(), q)
    }

    #[test]
    fn converges_to_fair_share() {
        for &(n, alpha, beta) in &[
            (1, 0.4, 0.4),
            (4, 0.4, 0.4),
            (10, 0.1, 1.0),
            (3, 0.4, 0.226),
            // Twice ns-2's alpha (see router.rs: DEFAULT_ALPHA).
            (1, 0.8, 0.4),
            (8, 0.8, 0.4),
            (64, 0.8, 0.4),
        ] {
            for &rtt in &[0.01, 0.1] {
                let (r, q) = fluid(n, alpha, beta, rtt, 300.0 * rtt + 5.0);
                let share = 10e6 / n as f64;
                assert!(
                    (r - share).abs() / share < 0.01,
                    "n={n} a={alpha} b={beta} rtt={rtt}: {r} vs {share}"
                );
                assert!(q < 1500.0, "queue {q}");
            }
        }
    }

    #[test]
    fn clamps_to_capacity_and_floor() {
        let mut rcp = Rcp::new(RcpConfig::ns2_defaults(10e6));
        for _ in 0..1000 {
            rcp.on_interval(&Measurement {
                interval_s: 0.01,
                arrived_bytes: 0,
                queue_bytes: 0,
                rtt_s: 0.1,
            });
        }
        assert_eq!(rcp.rate_bps(), 10e6);
        overload(&mut rcp);
        assert_eq!(rcp.rate_bps(), min_encodable_rate_bps());
        // The floor is still a rate the router can write into a fragment.
        let floor = crate::encoding::bps_to_bytes_per_ms(rcp.rate_bps());
        assert_eq!(crate::encoding::leading_fragment_len(floor), Some(24));
    }

    /// 10 s of a link loaded far past its capacity, queue full.
    fn overload(rcp: &mut Rcp) {
        for _ in 0..1000 {
            rcp.on_interval(&Measurement {
                interval_s: 0.01,
                arrived_bytes: 1_000_000,
                queue_bytes: 1_000_000,
                rtt_s: 0.1,
            });
        }
    }

    /// The paper's literal floor (anything under the encodable minimum) is
    /// still there for whoever asks for it.
    #[test]
    fn a_lower_floor_can_be_configured() {
        let mut cfg = RcpConfig::ns2_defaults(10e6);
        cfg.min_rate_bps = 8_000.0;
        let mut rcp = Rcp::new(cfg);
        overload(&mut rcp);
        assert_eq!(rcp.rate_bps(), 8000.0);
        let r = crate::encoding::bps_to_bytes_per_ms(rcp.rate_bps());
        assert_eq!(crate::encoding::leading_fragment_len(r), None);
    }

    #[test]
    fn rtt_average() {
        let mut e = RttEstimator::new(100.0, 0.5);
        assert_eq!(e.rtt_ms(), 100.0);
        e.on_sample(24.0);
        assert_eq!(e.rtt_ms(), 24.0);
        e.on_sample(48.0);
        assert_eq!(e.rtt_ms(), 36.0);
    }
}
