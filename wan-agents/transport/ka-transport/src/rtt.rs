//! RTT estimation and the retransmission timeout, exactly RFC 6298.
//!
//! Samples come from echoed send timestamps (the DATA timestamp comes back
//! in the ACK, RFC 7323 style), so a sample taken from a retransmission is
//! unambiguous and Karn's rule is not needed. The smoothed RTT also drives
//! the Kick-Ass side: the explicit-rate window is `rate x SRTT`, the mode
//! switch fires after one SRTT without a rate (paper II-C2), and the RTT
//! indicator the endpoint sends every 100 ms encodes it (paper II-B).

use ka_core::Nanos;

/// RFC 6298 (2.1): RTO before any sample.
pub const INITIAL_RTO: Nanos = 1_000_000_000;
/// RFC 6298 (2.4) says 1 s; Linux uses 200 ms (`TCP_RTO_MIN`). Both are
/// offered by [`crate::Config::min_rto`].
pub const RFC_MIN_RTO: Nanos = 1_000_000_000;
pub const LINUX_MIN_RTO: Nanos = 200_000_000;
/// RFC 6298 (2.5): a maximum of at least 60 s may be placed on the RTO.
pub const MAX_RTO: Nanos = 60_000_000_000;
/// Clock granularity G of RFC 6298 (2.2): our clock is in ns, but timers
/// in the shell are not finer than this.
pub const CLOCK_GRANULARITY: Nanos = 1_000_000;

/// SRTT, RTTVAR, min RTT and the (backed-off) RTO of one connection.
#[derive(Debug, Clone)]
pub struct RttEstimator {
    srtt: Option<Nanos>,
    rttvar: Nanos,
    min_rtt: Option<Nanos>,
    latest: Option<Nanos>,
    min_rto: Nanos,
    max_rto: Nanos,
    initial_rto: Nanos,
    /// Number of doublings since the last fresh sample (RFC 6298 5.5).
    backoff: u32,
    samples: u64,
}

impl RttEstimator {
    pub fn new(min_rto: Nanos, initial_rto: Nanos, max_rto: Nanos) -> Self {
        RttEstimator {
            srtt: None,
            rttvar: 0,
            min_rtt: None,
            latest: None,
            min_rto,
            max_rto: max_rto.max(min_rto),
            initial_rto,
            backoff: 0,
            samples: 0,
        }
    }

    /// RFC 6298 section 2: first sample SRTT = R, RTTVAR = R/2; then
    /// RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R|, SRTT = 7/8 SRTT + 1/8 R.
    /// A fresh sample also ends any timer backoff (the RTO is recomputed).
    pub fn on_sample(&mut self, rtt: Nanos) {
        let rtt = rtt.max(1);
        self.latest = Some(rtt);
        self.samples += 1;
        self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(srtt) => {
                let err = srtt.abs_diff(rtt);
                self.rttvar = (3 * self.rttvar + err) / 4;
                self.srtt = Some((7 * srtt + rtt) / 8);
            }
        }
        self.backoff = 0;
    }

    /// RFC 6298 (5.5): the timer expired, double the RTO.
    pub fn on_timeout(&mut self) {
        self.backoff = self.backoff.saturating_add(1).min(32);
    }

    pub fn srtt(&self) -> Option<Nanos> {
        self.srtt
    }

    pub fn rttvar(&self) -> Nanos {
        self.rttvar
    }

    pub fn min_rtt(&self) -> Option<Nanos> {
        self.min_rtt
    }

    pub fn latest(&self) -> Option<Nanos> {
        self.latest
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    pub fn backoff(&self) -> u32 {
        self.backoff
    }

    /// RTO without backoff: SRTT + max(G, 4 RTTVAR), at least `min_rto`
    /// (RFC 6298 2.2-2.4), or the initial 1 s before any sample.
    pub fn base_rto(&self) -> Nanos {
        match self.srtt {
            None => self.initial_rto,
            Some(srtt) => (srtt + CLOCK_GRANULARITY.max(4 * self.rttvar)).max(self.min_rto),
        }
        .min(self.max_rto)
    }

    /// The RTO in force: the base doubled once per expiry, capped at the
    /// maximum (RFC 6298 5.5).
    pub fn rto(&self) -> Nanos {
        let base = self.base_rto();
        let factor = 1u64.checked_shl(self.backoff).unwrap_or(u64::MAX);
        base.saturating_mul(factor).min(self.max_rto)
    }

    /// SRTT in milliseconds, for the RTT indicator; `None` before a sample.
    pub fn srtt_ms(&self) -> Option<f64> {
        self.srtt.map(|s| s as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    #[test]
    fn rfc6298_formulas() {
        let mut r = RttEstimator::new(LINUX_MIN_RTO, INITIAL_RTO, MAX_RTO);
        assert_eq!(r.rto(), INITIAL_RTO);
        r.on_sample(100 * MS);
        assert_eq!(r.srtt(), Some(100 * MS));
        assert_eq!(r.rttvar(), 50 * MS);
        // 100 + 4*50 = 300 ms.
        assert_eq!(r.rto(), 300 * MS);
        r.on_sample(200 * MS);
        // RTTVAR = 3/4*50 + 1/4*100 = 62.5; SRTT = 7/8*100 + 1/8*200 = 112.5.
        assert_eq!(r.rttvar(), 62_500_000);
        assert_eq!(r.srtt(), Some(112_500_000));
        assert_eq!(r.rto(), 112_500_000 + 250 * MS);
        assert_eq!(r.min_rtt(), Some(100 * MS));
    }

    #[test]
    fn min_rto_and_backoff() {
        let mut r = RttEstimator::new(RFC_MIN_RTO, INITIAL_RTO, MAX_RTO);
        r.on_sample(10 * MS);
        assert_eq!(r.rto(), RFC_MIN_RTO);
        r.on_timeout();
        assert_eq!(r.rto(), 2 * RFC_MIN_RTO);
        r.on_timeout();
        assert_eq!(r.rto(), 4 * RFC_MIN_RTO);
        for _ in 0..100 {
            r.on_timeout();
        }
        assert_eq!(r.rto(), MAX_RTO);
        r.on_sample(10 * MS);
        assert_eq!(r.rto(), RFC_MIN_RTO);
    }
}
