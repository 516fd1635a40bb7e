//! Kick-Ass mode and TCP mode (paper II-C): following advertised rates,
//! the "no rate for more than one RTT" rule, the hand-over of the window
//! between the modes, and the return once TCP's rate reaches the last
//! advertised rate.

use ka_core::Nanos;

use super::{Connection, State};
use crate::cc::{payload_rate, Controller};
use crate::record::{Mode, ModeSwitch, SwitchReason};

impl Connection {
    pub(super) fn on_rate(&mut self, now: Nanos, r: f64) {
        self.last_rate = Some(r);
        self.last_rate_at = Some(now);
        if self.completed_at.is_none() {
            self.rates.on_rate(r);
        }
        if self.mode == Mode::KickAss {
            self.ka.set_rate(r, &self.rtt);
        }
    }

    /// Paper II-C2: "failure to receive a rate signal from the router for
    /// more than a RTT indicates that they should revert to TCP mode". The
    /// clock starts at the first ACK of data (before that no rate can be
    /// due): from then on, a gap of more than one SRTT since the last rate
    /// switches.
    pub(super) fn no_rate_deadline(&self) -> Option<Nanos> {
        if self.state != State::Established || self.mode != Mode::KickAss || !self.kickass {
            return None;
        }
        let first = self.first_data_ack_at?;
        let srtt = self.rtt.srtt()?;
        Some(self.last_rate_at.unwrap_or(0).max(first) + srtt + 1)
    }

    pub(super) fn check_no_rate(&mut self, now: Nanos) {
        if self.no_rate_deadline().is_some_and(|d| now >= d) {
            self.enter_tcp_mode(now, SwitchReason::NoRate);
            self.update_pacer(now);
        }
    }

    /// Back to Kick-Ass mode when a rate arrives, outside recovery: at once
    /// if only the router's silence sent the flow to TCP mode ("On receipt
    /// of such rates, the endpoints immediately return", II-C2); after a
    /// congestion signal of its own, once TCP's rate reaches the advertised
    /// rate (II-C3: the congestion may be at a router that advertises
    /// nothing).
    pub(super) fn maybe_return_to_kickass(&mut self, now: Nanos) {
        if self.mode != Mode::Tcp || self.recovery.is_some() || !self.board.lost_is_empty() {
            return;
        }
        if !self.congested_in_tcp_mode {
            self.enter_ka_mode(now);
            return;
        }
        if let (Some(r), Some(srtt)) = (self.last_rate, self.rtt.srtt()) {
            let tcp_rate = self.tcp.window() as f64 / (srtt as f64 / 1e9);
            // A relative 1e-9 absorbs float rounding of rate x SRTT / SRTT.
            if tcp_rate >= payload_rate(r, super::SMSS, super::FULL_DATAGRAM) * (1.0 - 1e-9) {
                self.enter_ka_mode(now);
            }
        }
    }

    /// Kick-Ass -> TCP. TCP mode takes over the window Kick-Ass mode was
    /// using, rate x SRTT, because that is what the path carried a moment
    /// ago:
    /// * no rate (II-C2): the router stopped advertising because it sees
    ///   unresponsive traffic, not because this flow lost anything, so
    ///   continue from there in congestion avoidance (ssthresh = cwnd; for
    ///   CUBIC, W_max = cwnd and the epoch now) rather than halve or
    ///   slow-start past it; if rates resume at the same level, cwnd/SRTT
    ///   already equals the rate and the flow returns at once ("the
    ///   endpoints immediately return", II-C2);
    /// * loss, RTO, ECN (II-C3, "performing standard TCP back off
    ///   procedures"): the caller then applies the controller's standard
    ///   reaction from that window.
    ///
    /// Before any rate arrived there is no such window: the startup window
    /// carries over and slow start continues.
    pub(super) fn enter_tcp_mode(&mut self, now: Nanos, reason: SwitchReason) {
        if self.mode == Mode::Tcp {
            // A signal of its own in a TCP mode the router's silence began.
            self.congested_in_tcp_mode |= reason != SwitchReason::NoRate;
            return;
        }
        let (cwnd, ssthresh) = match (self.ka.bdp(), reason) {
            (None, _) => (self.ka.window(), u64::MAX),
            (Some(bdp), SwitchReason::NoRate) => (bdp, bdp),
            (Some(bdp), _) => (bdp, u64::MAX),
        };
        self.tcp.seed(now, cwnd, ssthresh);
        self.congested_in_tcp_mode = reason != SwitchReason::NoRate;
        self.switch_mode(now, Mode::Tcp, reason);
    }

    fn enter_ka_mode(&mut self, now: Nanos) {
        if let Some(r) = self.last_rate {
            self.ka.set_rate(r, &self.rtt);
            self.dupacks = 0;
            self.switch_mode(now, Mode::KickAss, SwitchReason::RateReached);
        }
    }

    pub(super) fn switch_mode(&mut self, now: Nanos, to: Mode, reason: SwitchReason) {
        if self.mode == to || self.completed_at.is_some() {
            return;
        }
        self.account_mode_time(now);
        let sw = ModeSwitch {
            at_ns: now.saturating_sub(self.start.unwrap_or(now)),
            from: self.mode,
            to,
            reason,
        };
        self.mode = to;
        self.switch_count += 1;
        if self.switches.len() < self.cfg.max_logged_switches {
            self.switches.push(sw);
        }
        self.events.push_back(super::Event::ModeSwitched(sw));
    }

    pub(super) fn account_mode_time(&mut self, now: Nanos) {
        let now = now.max(self.mode_since);
        if self.mode == Mode::KickAss {
            self.ka_time += now - self.mode_since;
        }
        self.mode_since = now;
    }

    pub(super) fn update_pacer(&mut self, now: Nanos) {
        let rate = if self.mode == Mode::Tcp && !self.cfg.pace_tcp_mode {
            None
        } else {
            self.controller().pacing_rate(&self.rtt)
        };
        self.pacer.set_rate(now, rate);
    }
}
