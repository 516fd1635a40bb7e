//! The sender side: one flow of known size, as a sans-IO state machine
//! (quinn-proto's `Connection` shape), split by concern as quinn-proto
//! splits its own: `recovery` (SACK scoreboard, RACK-TLP, PRR), `ack`
//! (what comes back), `mode` (Kick-Ass mode and TCP mode, paper II-C),
//! `emit` (what leaves), `timers`.
//!
//! The shell feeds in datagrams ([`Connection::handle_datagram`]) and timer
//! expiries ([`Connection::handle_timeout`]), both with the time, and asks
//! for datagrams to send ([`Connection::poll_transmit`], and
//! [`Connection::poll_rtt_indicator`] when the endpoint's indicator is
//! due), the next deadline ([`Connection::poll_timeout`]) and events
//! ([`Connection::poll_event`]). Nothing here reads a clock or touches a
//! socket.
//!
//! ```text
//!  Handshake --HANDSHAKE_ACK(accepted)--> Established --last byte acked--> Closing --FIN_ACK--> Closed
//!      \--refused / no answer------------------------------------------------------------------^
//!
//!  Established, ka_mode:  KickAss --(no rate > 1 SRTT | RTO | loss | ECN)--> Tcp
//!                         Tcp --(a rate arrives and cwnd/SRTT >= last advertised_rate)--> KickAss
//! ```
//!
//! Loss recovery is Linux TCP's with SACK, in both modes: RFC 6675's
//! scoreboard and pipe, RACK-TLP (RFC 8985) for loss detection, PRR (RFC
//! 6937) for the window during recovery, RFC 6298's retransmission timer.
//! A duplicate ACK is one that SACKs new data (RFC 6675's definition), so a
//! datagram duplicated by the network does not fake a loss.

use core::fmt;
use std::collections::VecDeque;

use ka_core::encoding::FULL_PACKET_LEN;
use ka_core::Nanos;

use crate::cc::{rfc6928_initial_window, CongestionControl, Controller, ExplicitRate};
use crate::pacer::{Pacer, DEFAULT_BURST_INTERVAL};
use crate::payload::Payload;
use crate::record::{FlowRecord, HandshakeMode, Mode, ModeSwitch, RateStats};
use crate::rtt::{RttEstimator, INITIAL_RTO, LINUX_MIN_RTO, MAX_RTO};
use crate::wire::{self, Kind, Status, IP_UDP_OVERHEAD, MAX_DATA_PAYLOAD, MAX_TOKEN_LEN};

mod ack;
mod emit;
mod mode;
mod recovery;
mod timers;

pub use recovery::DUP_THRESH;
use recovery::{Rack, Recovery, Scoreboard};

/// SMSS: payload of a full-size DATA datagram.
pub const SMSS: u64 = MAX_DATA_PAYLOAD as u64;
/// `Config::start_fraction`'s default.
pub const DEFAULT_START_FRACTION: f64 = 0.5;
/// IP length of a full-size DATA datagram.
const FULL_DATAGRAM: u64 = FULL_PACKET_LEN as u64;

/// Sender configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Use Kick-Ass (clear DF, read advertised rates). `false` is this
    /// transport's own TCP (`cc`): DF set, never in Kick-Ass mode.
    pub kickass: bool,
    pub handshake_mode: HandshakeMode,
    /// Lower bound of the RTO: [`LINUX_MIN_RTO`] (default, what the TCP we
    /// compare against uses) or RFC 6298's 1 s ([`crate::rtt::RFC_MIN_RTO`]).
    pub min_rto: Nanos,
    pub initial_rto: Nanos,
    pub max_rto: Nanos,
    /// Bytes; `None` = RFC 6928's IW10 (14400 bytes for our SMSS), as the
    /// Linux TCP we compare against. Also Kick-Ass mode's start before a
    /// rate arrives.
    pub initial_window: Option<u64>,
    /// TCP mode's congestion control (Kick-Ass flows in TCP mode, and the
    /// transport's own TCP baseline).
    pub cc: CongestionControl,
    /// Kick-Ass mode: the share of the advertised rate a new flow paces at
    /// until its first data is acknowledged (1: the whole rate at once).
    /// A flow joining one other at R = C would otherwise double the input
    /// for the feedback delay and fill a one-BDP buffer to the brim; at a
    /// half it adds half a BDP, which RCP's queue term drains (see
    /// router-edge/README.md, "Whose queue is it").
    pub start_fraction: f64,
    pub pacing_burst: Nanos,
    /// Pace TCP mode too (at 2x/1.2x cwnd/SRTT, as Linux with `fq`).
    /// `false` (the default) sends whatever the window allows at once, as
    /// the Linux CUBIC the trials compare with and share links with does
    /// without `fq` (paced, our flows lost share beside it). Kick-Ass mode is
    /// always paced: the rate is the whole point.
    pub pace_tcp_mode: bool,
    /// HANDSHAKE transmissions before giving up (each waits twice as long).
    pub max_handshake_attempts: u32,
    /// Consecutive RTO expiries without progress before giving up.
    pub max_consecutive_rtos: u32,
    /// Give up when nothing valid has come from the receiver for this long
    /// while data is outstanding (a receiver that lost its network answers
    /// nothing, not even a RESET).
    pub idle_timeout: Nanos,
    pub max_fin_attempts: u32,
    /// Mode switches kept in the record (all are counted).
    pub max_logged_switches: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            kickass: true,
            handshake_mode: HandshakeMode::Padded,
            min_rto: LINUX_MIN_RTO,
            initial_rto: INITIAL_RTO,
            max_rto: MAX_RTO,
            initial_window: None,
            cc: CongestionControl::Cubic,
            start_fraction: DEFAULT_START_FRACTION,
            pacing_burst: DEFAULT_BURST_INTERVAL,
            pace_tcp_mode: false,
            max_handshake_attempts: 6,
            max_consecutive_rtos: 15,
            idle_timeout: 15_000_000_000,
            max_fin_attempts: 3,
            max_logged_switches: 32,
        }
    }
}

impl Config {
    /// This transport as plain TCP with `cc`: Kick-Ass off.
    pub fn tcp(cc: CongestionControl) -> Self {
        Config {
            kickass: false,
            cc,
            ..Config::default()
        }
    }

    /// The paper's TCP (III-A): NewReno, Kick-Ass off.
    pub fn new_reno() -> Self {
        Config::tcp(CongestionControl::NewReno)
    }
}

/// Why a connection could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigError {
    TokenTooLong,
    EmptyFlow,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::TokenTooLong => write!(f, "flow token longer than {MAX_TOKEN_LEN} bytes"),
            ConfigError::EmptyFlow => f.write_str("a flow must carry at least one byte"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// How a connection ended without completing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionError {
    /// No HANDSHAKE_ACK after every attempt.
    HandshakeTimeout,
    /// The receiver refused the flow.
    Refused(Status),
    /// Too many consecutive retransmission timeouts.
    TooManyTimeouts,
    /// The receiver answered with a RESET: it holds no state for the flow
    /// (restarted, or forgot the flow).
    Reset,
    /// Nothing valid heard from the receiver for the idle timeout.
    IdleTimeout,
}

impl fmt::Display for ConnectionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectionError::HandshakeTimeout => f.write_str("no answer to the handshake"),
            ConnectionError::Refused(s) => write!(f, "receiver refused the flow: {s:?}"),
            ConnectionError::TooManyTimeouts => {
                f.write_str("too many consecutive retransmission timeouts")
            }
            ConnectionError::Reset => f.write_str(
                "the receiver holds no state for this flow (RESET: it restarted or forgot the flow)",
            ),
            ConnectionError::IdleTimeout => {
                f.write_str("nothing heard from the receiver for the idle timeout")
            }
        }
    }
}

impl std::error::Error for ConnectionError {}

/// Why a received datagram was dropped. Every drop is also counted in
/// [`ConnectionStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatagramError {
    Malformed(wire::Error),
    WrongFlow {
        expected: u64,
        got: u64,
    },
    /// A kind this side never receives, or not in this state.
    UnexpectedKind(Kind),
    /// Acknowledges (cumulatively or by SACK) bytes never sent.
    AckBeyondSent {
        acked: u64,
        sent: u64,
    },
    /// The advertised_rate echo does not decode from its leading_fragment_len.
    BogusRateEcho,
    /// Echoes a timestamp from the future or before the flow existed.
    BadTimestampEcho,
    /// The connection is closed.
    Closed,
}

impl fmt::Display for DatagramError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatagramError::Malformed(e) => write!(f, "malformed datagram: {e}"),
            DatagramError::WrongFlow { expected, got } => {
                write!(f, "datagram for flow {got:#x}, this is flow {expected:#x}")
            }
            DatagramError::UnexpectedKind(k) => write!(f, "unexpected {}", k.as_str()),
            DatagramError::AckBeyondSent { acked, sent } => {
                write!(f, "ACK for byte {acked} but only {sent} were sent")
            }
            DatagramError::BogusRateEcho => f.write_str("inconsistent advertised_rate echo"),
            DatagramError::BadTimestampEcho => f.write_str("timestamp echo out of range"),
            DatagramError::Closed => f.write_str("connection closed"),
        }
    }
}

impl std::error::Error for DatagramError {}

/// Counters of what this connection received and dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectionStats {
    pub datagrams_received: u64,
    pub malformed: u64,
    pub wrong_flow: u64,
    pub unexpected_kind: u64,
    pub acks_beyond_sent: u64,
    pub bogus_rate_echoes: u64,
    pub bad_timestamp_echoes: u64,
    pub after_close: u64,
    pub duplicate_acks: u64,
    pub ecn_echoes: u64,
    pub stale_acks: u64,
    /// Tail loss probes sent (RFC 8985 7).
    pub tail_loss_probes: u64,
    /// Recovery episodes started by RACK or the DupThresh rule.
    pub recoveries: u64,
}

/// Something the application may want to know.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// HANDSHAKE_ACK accepted. `advertised_rate` (bytes/ms) is set when
    /// the padded handshake was marked by a router.
    Connected {
        kickass: bool,
        advertised_rate: Option<f64>,
    },
    ModeSwitched(ModeSwitch),
    /// The last byte was acknowledged.
    Completed {
        fct: Nanos,
    },
    /// FIN exchange over (or given up): nothing more to send.
    Closed,
    Failed(ConnectionError),
}

/// One datagram the shell must send: `buf[..len]` as a UDP payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub len: usize,
    /// This datagram is the endpoint's RTT indicator (paper II-B).
    pub rtt_indicator: bool,
    /// Set IP DF. Clear on Kick-Ass data and the padded handshake so a
    /// router may fragment them (paper IV-C); set on RTT indicators (a
    /// standalone one, or a data segment cut to the indicator's length),
    /// which a router must see whole (II-B).
    pub dont_fragment: bool,
    pub kind: Kind,
}

impl Transmit {
    /// IP total length on the wire.
    pub fn ip_len(&self) -> usize {
        self.len + IP_UDP_OVERHEAD
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Handshake,
    Established,
    Closing,
    Closed,
}

/// A tail loss probe episode (RFC 8985 7).
#[derive(Debug, Clone, Copy, Default)]
struct Tlp {
    /// When the probe timeout fires, if armed.
    deadline: Option<Nanos>,
    /// A probe is due: the next `poll_transmit` sends it.
    due: bool,
    /// snd_nxt when the probe left (TLP.end_seq), while the episode lasts.
    end_seq: Option<u64>,
    /// The probe resent old data (rather than new).
    retransmission: bool,
    sent_at: Nanos,
}

/// The sender state machine of one flow.
#[derive(Debug)]
pub struct Connection {
    cfg: Config,
    flow_id: u64,
    token: Vec<u8>,
    payload: Payload,
    size: u64,
    /// Kick-Ass configured and not refused by the receiver.
    kickass: bool,
    handshake_mode: HandshakeMode,
    created_at: Nanos,
    /// First HANDSHAKE sent: the flow's life starts here.
    start: Option<Nanos>,
    last_now: Nanos,
    /// Last valid datagram from the receiver (for the idle timeout).
    last_heard: Nanos,
    state: State,

    hs_attempts: u32,
    hs_deadline: Option<Nanos>,
    hs_due: bool,

    snd_una: u64,
    snd_nxt: u64,
    board: Scoreboard,
    rack: Rack,
    /// RACK's reorder timer.
    rack_deadline: Option<Nanos>,
    recovery: Option<Recovery>,
    /// After a retransmission timeout, losses below this are repaired in
    /// slow start without another reduction (Linux's TCP_CA_Loss).
    loss_recover: u64,
    dupacks: u32,
    /// Same idea for ECN (RFC 3168: react at most once per window).
    ecn_recover: u64,
    rto_deadline: Option<Nanos>,
    consecutive_rtos: u32,
    tlp: Tlp,

    rtt: RttEstimator,
    pacer: Pacer,
    ka: ExplicitRate,
    tcp: Box<dyn Controller>,
    mode: Mode,
    last_rate: Option<f64>,
    last_rate_at: Option<Nanos>,
    /// This TCP mode saw a congestion signal of its own (loss, RTO, ECN:
    /// II-C3), not only the router's silence (II-C2).
    congested_in_tcp_mode: bool,
    first_data_ack_at: Option<Nanos>,
    /// TCP mode: when the last segment left with DF clear (a rate probe).
    rate_probe_at: Option<Nanos>,

    fin_attempts: u32,
    fin_deadline: Option<Nanos>,
    fin_due: bool,

    completed_at: Option<Nanos>,
    mode_since: Nanos,
    ka_time: Nanos,
    switches: Vec<ModeSwitch>,
    switch_count: u64,
    retransmissions: u64,
    retransmitted_bytes: u64,
    rto_count: u64,
    fast_retransmits: u64,
    datagrams_sent: u64,
    rtt_indicators_sent: u64,
    rates: RateStats,
    error: Option<ConnectionError>,
    events: VecDeque<Event>,
    stats: ConnectionStats,
    scratch: Vec<u8>,
}

impl Connection {
    /// A flow of `payload` to be opened with `token`. Nothing is sent until
    /// [`poll_transmit`](Self::poll_transmit); the flow's life (its fct)
    /// starts with the first HANDSHAKE that leaves.
    pub fn new(
        cfg: Config,
        flow_id: u64,
        token: Vec<u8>,
        payload: Payload,
        now: Nanos,
    ) -> Result<Connection, ConfigError> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(ConfigError::TokenTooLong);
        }
        if payload.is_empty() {
            return Err(ConfigError::EmptyFlow);
        }
        let iw = cfg
            .initial_window
            .unwrap_or_else(|| rfc6928_initial_window(SMSS));
        let handshake_mode = if cfg.kickass {
            cfg.handshake_mode
        } else {
            // Without Kick-Ass there is nothing for a router to mark.
            HandshakeMode::Paper
        };
        Ok(Connection {
            flow_id,
            token,
            size: payload.len(),
            payload,
            kickass: cfg.kickass,
            handshake_mode,
            created_at: now,
            start: None,
            last_now: now,
            last_heard: now,
            state: State::Handshake,
            hs_attempts: 0,
            hs_deadline: None,
            hs_due: true,
            snd_una: 0,
            snd_nxt: 0,
            board: Scoreboard::default(),
            rack: Rack::default(),
            rack_deadline: None,
            recovery: None,
            loss_recover: 0,
            dupacks: 0,
            ecn_recover: 0,
            rto_deadline: None,
            consecutive_rtos: 0,
            tlp: Tlp::default(),
            rtt: RttEstimator::new(cfg.min_rto, cfg.initial_rto, cfg.max_rto),
            pacer: Pacer::new(cfg.pacing_burst, FULL_PACKET_LEN),
            ka: ExplicitRate::new(SMSS, FULL_DATAGRAM, iw).with_start_fraction(cfg.start_fraction),
            tcp: cfg.cc.build(SMSS, FULL_DATAGRAM, iw, cfg.pace_tcp_mode),
            mode: if cfg.kickass {
                Mode::KickAss
            } else {
                Mode::Tcp
            },
            last_rate: None,
            last_rate_at: None,
            congested_in_tcp_mode: false,
            first_data_ack_at: None,
            rate_probe_at: None,
            fin_attempts: 0,
            fin_deadline: None,
            fin_due: false,
            completed_at: None,
            mode_since: now,
            ka_time: 0,
            switches: Vec::new(),
            switch_count: 0,
            retransmissions: 0,
            retransmitted_bytes: 0,
            rto_count: 0,
            fast_retransmits: 0,
            datagrams_sent: 0,
            rtt_indicators_sent: 0,
            rates: RateStats::default(),
            error: None,
            events: VecDeque::new(),
            stats: ConnectionStats::default(),
            scratch: Vec::with_capacity(MAX_DATA_PAYLOAD),
            cfg,
        })
    }

    // ----- accessors -------------------------------------------------

    pub fn flow_id(&self) -> u64 {
        self.flow_id
    }

    /// Current endpoint mode (paper II-C).
    pub fn ka_mode(&self) -> Mode {
        self.mode
    }

    /// Kick-Ass configured and accepted by the receiver.
    pub fn kickass(&self) -> bool {
        self.kickass
    }

    pub fn is_established(&self) -> bool {
        self.state == State::Established
    }

    pub fn is_completed(&self) -> bool {
        self.completed_at.is_some()
    }

    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    pub fn error(&self) -> Option<ConnectionError> {
        self.error
    }

    pub fn rtt(&self) -> &RttEstimator {
        &self.rtt
    }

    pub fn stats(&self) -> &ConnectionStats {
        &self.stats
    }

    /// The controller in force (ExplicitRate in Kick-Ass mode, else TCP
    /// mode's `cc`).
    pub fn controller(&self) -> &dyn Controller {
        match self.mode {
            Mode::KickAss => &self.ka,
            Mode::Tcp => self.tcp.as_ref(),
        }
    }

    fn controller_mut(&mut self) -> &mut dyn Controller {
        match self.mode {
            Mode::KickAss => &mut self.ka,
            Mode::Tcp => self.tcp.as_mut(),
        }
    }

    /// TCP mode's controller, whichever mode is in force.
    pub fn tcp_controller(&self) -> &dyn Controller {
        self.tcp.as_ref()
    }

    /// Congestion window in force (payload bytes).
    pub fn window(&self) -> u64 {
        self.controller().window()
    }

    /// TCP mode's ssthresh.
    pub fn ssthresh(&self) -> u64 {
        self.tcp.ssthresh().unwrap_or(u64::MAX)
    }

    /// RFC 6675 pipe: payload bytes sent and neither acknowledged, SACKed
    /// nor declared lost (retransmissions counted again).
    pub fn flight_size(&self) -> u64 {
        self.board.flight()
    }

    /// In SACK loss recovery (RFC 6675 / PRR).
    pub fn in_recovery(&self) -> bool {
        self.recovery.is_some()
    }

    /// When the retransmission timer fires, if running.
    pub fn rto_deadline(&self) -> Option<Nanos> {
        self.rto_deadline
    }

    /// When the tail loss probe fires, if armed.
    pub fn tlp_deadline(&self) -> Option<Nanos> {
        self.tlp.deadline
    }

    /// The RTO the next timer will use (with backoff).
    pub fn rto(&self) -> Nanos {
        self.rtt.rto()
    }

    /// Pacing rate in force (IP bytes/s).
    pub fn pacing_rate(&self) -> Option<f64> {
        self.pacer.rate()
    }

    /// Last advertised rate accepted (bytes/ms), in either mode.
    pub fn last_advertised_rate(&self) -> Option<f64> {
        self.last_rate
    }

    /// Lowest unacknowledged byte and next new byte.
    pub fn snd_una(&self) -> u64 {
        self.snd_una
    }

    pub fn snd_nxt(&self) -> u64 {
        self.snd_nxt
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    // ----- output ----------------------------------------------------

    /// The next datagram to send now, written into `buf`.
    pub fn poll_transmit(&mut self, now: Nanos, buf: &mut Vec<u8>) -> Option<Transmit> {
        self.last_now = self.last_now.max(now);
        match self.state {
            State::Closed => None,
            State::Handshake => self.hs_due.then(|| self.send_handshake(now, buf)),
            State::Closing => self.fin_due.then(|| self.send_fin(now, buf)),
            State::Established => {
                if self.tlp.due {
                    return self.send_tail_loss_probe(now, buf);
                }
                let (seq, len) = self.next_data()?;
                if !self.window_allows(len) || self.paced_out(now, len) {
                    return None;
                }
                Some(self.send_segment(now, seq, len, buf))
            }
        }
    }

    /// The earliest time [`handle_timeout`](Self::handle_timeout) or
    /// [`poll_transmit`](Self::poll_transmit) has something to do.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        match self.state {
            State::Closed => None,
            State::Handshake => {
                if self.hs_due {
                    Some(self.last_now)
                } else {
                    self.hs_deadline
                }
            }
            State::Closing => {
                if self.fin_due {
                    Some(self.last_now)
                } else {
                    self.fin_deadline
                }
            }
            State::Established => {
                let mut t = self.rto_deadline;
                let mut take = |x: Option<Nanos>| {
                    if let Some(x) = x {
                        t = Some(t.map_or(x, |t| t.min(x)));
                    }
                };
                take(self.rack_deadline);
                take(self.tlp.deadline);
                take(self.no_rate_deadline());
                take(Some(self.idle_deadline()));
                if self.tlp.due {
                    take(Some(self.last_now));
                }
                if let Some((_, len)) = self.next_data() {
                    if self.window_allows(len) {
                        let ip = len as usize + wire::DATA_HEADER_LEN + IP_UDP_OVERHEAD;
                        take(Some(self.pacer.ready_at(ip).unwrap_or(self.last_now)));
                    }
                }
                t
            }
        }
    }

    // ----- input -----------------------------------------------------

    /// Timers: handshake and FIN retries, the retransmission timer, RACK's
    /// reorder timer, the tail loss probe, and the Kick-Ass "no rate for
    /// more than one RTT" rule.
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.last_now = self.last_now.max(now);
        match self.state {
            State::Handshake => {
                if self.hs_deadline.is_some_and(|d| now >= d) {
                    self.hs_deadline = None;
                    if self.hs_attempts >= self.cfg.max_handshake_attempts {
                        self.fail(ConnectionError::HandshakeTimeout);
                    } else {
                        self.hs_due = true;
                    }
                }
            }
            State::Established => self.on_established_timeout(now),
            State::Closing => {
                if self.fin_deadline.is_some_and(|d| now >= d) {
                    self.fin_deadline = None;
                    if self.fin_attempts >= self.cfg.max_fin_attempts {
                        self.close();
                    } else {
                        self.fin_due = true;
                    }
                }
            }
            State::Closed => {}
        }
    }

    /// One received UDP payload. Errors are drops (and counted); the
    /// connection is unaffected by them.
    pub fn handle_datagram(&mut self, now: Nanos, bytes: &[u8]) -> Result<(), DatagramError> {
        self.last_now = self.last_now.max(now);
        self.stats.datagrams_received += 1;
        let r = self.process(now, bytes);
        if r.is_ok() {
            self.last_heard = self.last_heard.max(now);
        }
        if let Err(e) = r {
            let s = &mut self.stats;
            match e {
                DatagramError::Malformed(_) => s.malformed += 1,
                DatagramError::WrongFlow { .. } => s.wrong_flow += 1,
                DatagramError::UnexpectedKind(_) => s.unexpected_kind += 1,
                DatagramError::AckBeyondSent { .. } => s.acks_beyond_sent += 1,
                DatagramError::BogusRateEcho => s.bogus_rate_echoes += 1,
                DatagramError::BadTimestampEcho => s.bad_timestamp_echoes += 1,
                DatagramError::Closed => s.after_close += 1,
            }
        }
        r
    }

    // ----- life cycle ------------------------------------------------

    fn idle_deadline(&self) -> Nanos {
        self.last_heard.saturating_add(self.cfg.idle_timeout)
    }

    fn complete(&mut self, now: Nanos) {
        self.account_mode_time(now);
        self.completed_at = Some(now);
        self.state = State::Closing;
        self.rto_deadline = None;
        self.rack_deadline = None;
        self.tlp = Tlp::default();
        self.fin_due = true;
        let fct = now.saturating_sub(self.start.unwrap_or(self.created_at));
        self.events.push_back(Event::Completed { fct });
    }

    fn close(&mut self) {
        self.state = State::Closed;
        self.fin_deadline = None;
        self.fin_due = false;
        self.events.push_back(Event::Closed);
    }

    fn fail(&mut self, e: ConnectionError) {
        if self.completed_at.is_none() {
            self.account_mode_time(self.last_now);
        }
        self.error = Some(e);
        self.state = State::Closed;
        self.rto_deadline = None;
        self.rack_deadline = None;
        self.tlp = Tlp::default();
        self.hs_deadline = None;
        self.events.push_back(Event::Failed(e));
    }

    // ----- the record ------------------------------------------------

    /// The per-flow record, as of the completion (or the latest input
    /// while the flow runs).
    pub fn record(&self) -> FlowRecord {
        let start = self.start.unwrap_or(self.created_at);
        let end = self.completed_at.unwrap_or(self.last_now).max(start);
        let life = end - start;
        let mut ka = self.ka_time;
        if self.completed_at.is_none() && self.error.is_none() && self.mode == Mode::KickAss {
            ka += end.saturating_sub(self.mode_since);
        }
        FlowRecord {
            flow_id: self.flow_id,
            protocol: if self.kickass { "kickass" } else { "tcp" }.to_string(),
            handshake_mode: self.handshake_mode,
            size_bytes: self.size,
            size_packets: self.size.div_ceil(SMSS),
            fct_ns: self.completed_at.map(|c| c.saturating_sub(start)),
            completed: self.completed_at.is_some(),
            error: self.error.map(|e| e.to_string()),
            ka_mode_ns: ka,
            ka_mode_fraction: if life > 0 {
                (ka as f64 / life as f64).min(1.0)
            } else {
                0.0
            },
            mode_switch_count: self.switch_count,
            mode_switches: self.switches.clone(),
            retransmissions: self.retransmissions,
            retransmitted_bytes: self.retransmitted_bytes,
            rto_count: self.rto_count,
            fast_retransmits: self.fast_retransmits,
            srtt_ns: self.rtt.srtt(),
            min_rtt_ns: self.rtt.min_rtt(),
            advertised_rates: self.rates,
            datagrams_sent: self.datagrams_sent,
            rtt_indicators_sent: self.rtt_indicators_sent,
        }
    }
}
