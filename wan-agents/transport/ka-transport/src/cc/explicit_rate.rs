//! Kick-Ass mode: the router's advertised rate is the sending rate.
//!
//! Before the first rate arrives (the paper's handshake, where "the sender
//! sends packets as it would in a normal TCP connection", II) the window
//! starts at the initial window and grows as slow start does, so a path
//! without a Kick-Ass router costs nothing while the endpoint waits one RTT
//! for a rate that never comes.

use ka_core::Nanos;

use super::{payload_rate, AckSample, CongestionSignal, Controller};
use crate::rtt::RttEstimator;

#[derive(Debug, Clone)]
pub struct ExplicitRate {
    smss: u64,
    datagram_len: u64,
    /// Advertised rate in IP bytes per ms (the paper's unit).
    rate: Option<f64>,
    srtt: Option<Nanos>,
    startup_window: u64,
    /// The share of the advertised rate a new flow paces at until its
    /// first data is acknowledged (about one RTT): see `Config::start_fraction`.
    start_fraction: f64,
    /// Data sent at the advertised rate has been acknowledged.
    ramped: bool,
}

impl ExplicitRate {
    pub fn new(smss: u64, datagram_len: u64, initial_window: u64) -> Self {
        ExplicitRate {
            smss,
            datagram_len,
            rate: None,
            srtt: None,
            startup_window: initial_window.max(smss),
            start_fraction: 1.0,
            ramped: false,
        }
    }

    /// Pace at `fraction` of the advertised rate until the first data sent
    /// at a rate is acknowledged.
    pub fn with_start_fraction(mut self, fraction: f64) -> Self {
        self.start_fraction = if fraction.is_finite() {
            fraction.clamp(0.01, 1.0)
        } else {
            1.0
        };
        self
    }

    fn scale(&self) -> f64 {
        if self.ramped {
            1.0
        } else {
            self.start_fraction
        }
    }

    /// Follow a newly advertised rate (bytes/ms).
    pub fn set_rate(&mut self, rate_bytes_per_ms: f64, rtt: &RttEstimator) {
        self.rate = Some(rate_bytes_per_ms);
        self.srtt = rtt.srtt().or(self.srtt);
    }

    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// rate x SRTT in payload bytes (no headroom, rounded up): the window
    /// Kick-Ass mode is actually using, which TCP mode takes over. Rounded
    /// up so that cwnd/SRTT of a controller seeded with it is not below the
    /// rate (the return test of II-C3 then passes at once at the same rate).
    pub fn bdp(&self) -> Option<u64> {
        let (rate, srtt) = (self.rate? * self.scale(), self.srtt?);
        Some((payload_rate(rate, self.smss, self.datagram_len) * srtt as f64 / 1e9).ceil() as u64)
    }
}

impl Controller for ExplicitRate {
    fn name(&self) -> &'static str {
        "explicit_rate"
    }

    fn on_ack(&mut self, _now: Nanos, ack: &AckSample, rtt: &RttEstimator) {
        self.srtt = rtt.srtt().or(self.srtt);
        if self.rate.is_none() {
            self.startup_window += ack.delivered.min(self.smss);
        } else if ack.delivered > 0 {
            self.ramped = true;
        }
    }

    // The connection leaves Kick-Ass mode before any of these can matter
    // (paper II-C3: a loss signal means TCP mode), so they are no-ops.
    fn on_congestion_event(&mut self, _now: Nanos, _signal: CongestionSignal, _flight: u64) {}

    fn on_recovery_end(&mut self, _now: Nanos) {}

    fn on_rto(&mut self, _now: Nanos, _flight_size: u64, _first_expiry: bool) {}

    fn seed(&mut self, _now: Nanos, _cwnd: u64, _ssthresh: u64) {}

    /// rate x SRTT plus two segments, so the pacer's burst and the ACK
    /// clock's granularity never make the window, rather than the rate,
    /// the limit.
    fn window(&self) -> u64 {
        match self.bdp() {
            Some(bdp) => bdp + 2 * self.smss,
            None => self.startup_window,
        }
    }

    fn pacing_rate(&self, _rtt: &RttEstimator) -> Option<f64> {
        self.rate.map(|r| r * 1000.0 * self.scale())
    }

    fn in_slow_start(&self) -> bool {
        self.rate.is_none()
    }

    fn ssthresh(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rtt::{INITIAL_RTO, LINUX_MIN_RTO, MAX_RTO};

    const SMSS: u64 = 1440;

    #[test]
    fn window_and_pacing() {
        let mut r = RttEstimator::new(LINUX_MIN_RTO, INITIAL_RTO, MAX_RTO);
        r.on_sample(100_000_000);
        let mut ka = ExplicitRate::new(SMSS, 1500, 4380);
        assert_eq!(ka.window(), 4380);
        assert_eq!(ka.pacing_rate(&r), None);
        let one = AckSample {
            delivered: SMSS,
            ..AckSample::default()
        };
        ka.on_ack(0, &one, &r);
        assert_eq!(ka.window(), 4380 + SMSS, "slow start until a rate arrives");
        // 1250 B/ms (10 Mbit/s) of IP bytes = 1.2e6 payload bytes/s;
        // over 100 ms that is 120000 bytes.
        ka.set_rate(1250.0, &r);
        assert_eq!(ka.bdp(), Some(120_000));
        ka.set_rate(1191.958196024979, &r);
        assert_eq!(ka.bdp(), Some(114_428));
        ka.set_rate(1250.0, &r);
        assert_eq!(ka.window(), 120_000 + 2 * SMSS);
        assert_eq!(ka.pacing_rate(&r), Some(1.25e6));
        assert!(!ka.in_slow_start());
    }
}
