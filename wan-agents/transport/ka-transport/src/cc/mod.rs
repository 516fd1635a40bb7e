//! Congestion control behind one small trait, as in quinn-proto's
//! `congestion/`: the connection does loss detection, loss recovery and
//! sequence bookkeeping (`connection/recovery.rs`: SACK scoreboard, RACK-TLP,
//! PRR), a [`Controller`] only turns events into a window and a pacing rate.
//! One file per controller:
//!
//! * [`ExplicitRate`] (`explicit_rate.rs`): Kick-Ass mode. Pace at the
//!   advertised rate, window = rate x SRTT (paper IV-A: "both the pacing
//!   delay and the congestion window are updated with the arrival of new
//!   rate information").
//! * TCP mode, chosen by [`CongestionControl`] and built by
//!   [`CongestionControl::build`]: [`Cubic`] (`cubic.rs`, RFC 9438 with
//!   HyStart as Linux's `tcp_cubic` does it; the default, because the TCP the
//!   trials compare with is Linux CUBIC) or [`NewReno`] (`newreno.rs`, RFC
//!   5681's window arithmetic: the paper's failover, III-A "For TCP failover
//!   mode, we use TCP NewReno"). Paper III-A: endpoints "can use whatever
//!   protocol they wish for handling TCP failover mode".
//!
//! Windows and flight sizes are in payload bytes (as TCP's cwnd counts
//! SMSS-sized segments); pacing rates are in IP bytes per second, because
//! that is what a router measures and advertises.

use core::fmt;
use core::str::FromStr;

use ka_core::Nanos;
use serde::{Deserialize, Serialize};

use crate::rtt::RttEstimator;

mod cubic;
mod explicit_rate;
mod newreno;

pub use cubic::{Cubic, HyStart, BETA_CUBIC, C_CUBIC};
pub use explicit_rate::ExplicitRate;
pub use newreno::NewReno;

/// What one ACK delivered, as the controller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AckSample {
    /// Payload bytes newly acknowledged, cumulatively or by SACK.
    pub delivered: u64,
    /// The RTT sample this ACK gave, if any.
    pub rtt: Option<Nanos>,
    /// Cumulative ACK after this ACK.
    pub cum_ack: u64,
    /// Next new byte to send (HyStart's round ends when `cum_ack` passes
    /// the `snd_nxt` of the round's start).
    pub snd_nxt: u64,
}

/// A congestion signal that is not a timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CongestionSignal {
    /// Loss detected (RACK, the DupThresh rule, or a tail loss probe that
    /// repaired a loss): loss recovery starts.
    Loss,
    /// An ECN-echo (RFC 3168 6.1.2): reduce once, retransmit nothing.
    Ecn,
}

/// Window and pacing from ACK and loss events.
pub trait Controller: fmt::Debug + Send {
    /// The controller's name (`cubic`, `newreno`, `explicit_rate`).
    fn name(&self) -> &'static str;
    /// New data delivered outside loss recovery.
    fn on_ack(&mut self, now: Nanos, ack: &AckSample, rtt: &RttEstimator);
    /// A loss or ECN episode starts: ssthresh is set (the window follows
    /// at once for ECN, through PRR and [`Controller::on_recovery_end`] for
    /// loss). `flight_size` is what was outstanding.
    fn on_congestion_event(&mut self, now: Nanos, signal: CongestionSignal, flight_size: u64);
    /// Loss recovery ended (everything up to `recover` acknowledged): the
    /// window becomes ssthresh (RFC 6937).
    fn on_recovery_end(&mut self, now: Nanos);
    /// The retransmission timer expired. `first_expiry` is false when the
    /// segment had already been retransmitted by the timer (RFC 5681 keeps
    /// ssthresh then).
    fn on_rto(&mut self, now: Nanos, flight_size: u64, first_expiry: bool);
    /// Take over the window Kick-Ass mode was using (see the connection's
    /// `enter_tcp_mode`).
    fn seed(&mut self, now: Nanos, cwnd: u64, ssthresh: u64);
    /// Bytes that may be outstanding.
    fn window(&self) -> u64;
    /// IP bytes per second to pace at; `None` = send as the window allows.
    fn pacing_rate(&self, rtt: &RttEstimator) -> Option<f64>;
    fn in_slow_start(&self) -> bool;
    /// Slow-start threshold, where the controller has one.
    fn ssthresh(&self) -> Option<u64>;
}

/// TCP mode's congestion control, chosen per flow (the arm's `/cc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CongestionControl {
    /// RFC 9438 with HyStart (Linux `tcp_cubic`).
    #[default]
    Cubic,
    /// RFC 5681 / RFC 6582's window arithmetic: the paper's choice.
    #[serde(rename = "newreno")]
    NewReno,
}

impl CongestionControl {
    pub const ALL: [CongestionControl; 2] = [CongestionControl::Cubic, CongestionControl::NewReno];

    pub fn as_str(self) -> &'static str {
        match self {
            CongestionControl::Cubic => "cubic",
            CongestionControl::NewReno => "newreno",
        }
    }

    /// The controller, with `smss` payload bytes per full segment of
    /// `datagram_len` IP bytes, an initial window of `initial_window`, for a
    /// sender that paces (`paced`) or not.
    pub fn build(
        self,
        smss: u64,
        datagram_len: u64,
        initial_window: u64,
        paced: bool,
    ) -> Box<dyn Controller> {
        match self {
            CongestionControl::Cubic => {
                Box::new(Cubic::new(smss, datagram_len, initial_window).paced(paced))
            }
            CongestionControl::NewReno => {
                Box::new(NewReno::new(smss, datagram_len, initial_window))
            }
        }
    }
}

impl fmt::Display for CongestionControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CongestionControl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CongestionControl::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = CongestionControl::ALL.iter().map(|c| c.as_str()).collect();
                format!(
                    "unknown congestion control {s:?} (one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Payload bytes per second carried by an advertised rate of
/// `rate_bytes_per_ms` IP bytes per ms, when every datagram of
/// `datagram_len` IP bytes carries `smss` payload bytes.
pub fn payload_rate(rate_bytes_per_ms: f64, smss: u64, datagram_len: u64) -> f64 {
    rate_bytes_per_ms * 1000.0 * smss as f64 / datagram_len as f64
}

/// RFC 5681 (3.1) initial window: min(4 SMSS, max(2 SMSS, 4380 bytes)).
pub fn rfc5681_initial_window(smss: u64) -> u64 {
    (4 * smss).min((2 * smss).max(4380))
}

/// RFC 6928 initial window (IW10, Linux's default since 2.6.39):
/// min(10 SMSS, max(2 SMSS, 14600 bytes)).
pub fn rfc6928_initial_window(smss: u64) -> u64 {
    (10 * smss).min((2 * smss).max(14_600))
}

/// Paced like Linux with `fq`: 2x cwnd/SRTT in slow start, 1.2x after
/// (`tcp_pacing_ss_ratio`, `tcp_pacing_ca_ratio`), so pacing smooths bursts
/// without ever being what limits TCP mode. In IP bytes per second.
pub fn fq_pacing_rate(
    cwnd: u64,
    slow_start: bool,
    rtt: &RttEstimator,
    smss: u64,
    datagram_len: u64,
) -> Option<f64> {
    let srtt = rtt.srtt()?;
    let gain = if slow_start { 2.0 } else { 1.2 };
    let payload_per_s = cwnd as f64 / (srtt as f64 / 1e9);
    Some(gain * payload_per_s * datagram_len as f64 / smss as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_windows() {
        // SMSS 1440: 4380 bytes; SMSS 536: 4 * 536; SMSS 2500: 2 * 2500.
        assert_eq!(rfc5681_initial_window(1440), 4380);
        assert_eq!(rfc5681_initial_window(536), 2144);
        assert_eq!(rfc5681_initial_window(2500), 5000);
        // IW10: 10 segments of 1440; 14600 caps 10 segments of 1460+; 2 SMSS floor.
        assert_eq!(rfc6928_initial_window(1440), 14_400);
        assert_eq!(rfc6928_initial_window(1500), 14_600);
        assert_eq!(rfc6928_initial_window(9000), 18_000);
    }

    #[test]
    fn names_round_trip() {
        for c in CongestionControl::ALL {
            assert_eq!(c.as_str().parse::<CongestionControl>(), Ok(c));
            assert_eq!(c.build(1440, 1500, 14_400, false).name(), c.as_str());
        }
        assert!("bbr".parse::<CongestionControl>().is_err());
        assert_eq!(CongestionControl::default(), CongestionControl::Cubic);
    }
}
