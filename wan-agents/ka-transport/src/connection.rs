//! The sender side: one flow of known size, as a sans-IO state machine
//! (quinn-proto's `Connection` shape).
//!
//! The shell feeds in datagrams ([`Connection::handle_datagram`]) and timer
//! expiries ([`Connection::handle_timeout`]), both with the time, and asks
//! for datagrams to send ([`Connection::poll_transmit`]), the next deadline
//! ([`Connection::poll_timeout`]) and events ([`Connection::poll_event`]).
//! Nothing here reads a clock or touches a socket.
//!
//! ```text
//!  Handshake --HANDSHAKE_ACK(accepted)--> Established --last byte acked--> Closing --FIN_ACK--> Closed
//!      \--refused / no answer------------------------------------------------------------------^
//!
//!  Established, ka_mode:  KickAss --(no rate > 1 SRTT | RTO | 3 dupacks | ECN)--> Tcp
//!                         Tcp --(a rate arrives and cwnd/SRTT >= last advertised_rate)--> KickAss
//! ```
//!
//! Loss recovery is TCP's: cumulative ACK + SACK scoreboard, fast
//! retransmit on the third duplicate ACK with RFC 6582's `recover`
//! variable and partial ACKs, RFC 6298 retransmission timer with backoff.
//! A duplicate ACK is one that SACKs new data (RFC 6675's definition), so a
//! datagram duplicated by the network does not fake a loss.

use core::fmt;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use ka_core::encoding::FULL_PACKET_LEN;
use ka_core::Nanos;

use crate::cc::{
    payload_rate, rfc5681_initial_window, CongestionSignal, Controller, ExplicitRate, NewReno,
    RecoveryAck,
};
use crate::pacer::{Pacer, DEFAULT_BURST_INTERVAL};
use crate::payload::Payload;
use crate::record::{FlowRecord, HandshakeMode, Mode, ModeSwitch, RateStats, SwitchReason};
use crate::rtt::{RttEstimator, INITIAL_RTO, LINUX_MIN_RTO, MAX_RTO};
use crate::wire::{
    self, rtt_indicator_payload_len, Ack, Data, Fin, Handshake, HandshakeAck, Kind, Repr,
    RttIndicator, Status, FULL_UDP_PAYLOAD_LEN, HANDSHAKE_HEADER_LEN, IP_UDP_OVERHEAD,
    MAX_DATA_PAYLOAD, MAX_TOKEN_LEN, MIN_HANDSHAKE_LEN,
};

/// SMSS: payload of a full-size DATA datagram.
pub const SMSS: u64 = MAX_DATA_PAYLOAD as u64;
/// IP length of a full-size DATA datagram.
const FULL_DATAGRAM: u64 = FULL_PACKET_LEN as u64;
/// RFC 5681 (3.2) DupThresh.
pub const DUP_THRESH: u32 = 3;

/// Sender configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Use Kick-Ass (clear DF, read advertised rates). `false` is the pure
    /// NewReno baseline: DF set, never in Kick-Ass mode.
    pub kickass: bool,
    pub handshake_mode: HandshakeMode,
    /// Lower bound of the RTO: [`LINUX_MIN_RTO`] (default, what the TCP we
    /// compare against uses) or RFC 6298's 1 s ([`crate::rtt::RFC_MIN_RTO`]).
    pub min_rto: Nanos,
    pub initial_rto: Nanos,
    pub max_rto: Nanos,
    /// Bytes; `None` = RFC 5681 (4380 bytes for our SMSS).
    pub initial_window: Option<u64>,
    /// Paper II-B: one RTT indicator every 100 ms. `None` disables.
    pub rtt_indicator_interval: Option<Nanos>,
    pub pacing_burst: Nanos,
    /// Pace TCP mode too (at 2x/1.2x cwnd/SRTT, as Linux with `fq`).
    /// `false` sends whatever the window allows at once, like classic TCP.
    /// Kick-Ass mode is always paced: the rate is the whole point.
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
            rtt_indicator_interval: Some(100_000_000),
            pacing_burst: DEFAULT_BURST_INTERVAL,
            pace_tcp_mode: true,
            max_handshake_attempts: 6,
            max_consecutive_rtos: 15,
            idle_timeout: 15_000_000_000,
            max_fin_attempts: 3,
            max_logged_switches: 32,
        }
    }
}

impl Config {
    /// The TCP baseline of the trials: same transport, Kick-Ass off.
    pub fn new_reno() -> Self {
        Config {
            kickass: false,
            ..Config::default()
        }
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
    /// Set IP DF. Clear on Kick-Ass data and the padded handshake so a
    /// router may fragment them (paper IV-C); set on RTT indicators, which
    /// a router must see whole (II-B).
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

#[derive(Debug, Clone)]
struct Segment {
    len: u64,
    transmissions: u32,
    /// Reported held by the receiver (never reneged: our receiver keeps
    /// what it SACKs).
    sacked: bool,
    /// Declared lost by an RTO, waiting in the retransmission queue.
    lost: bool,
    /// Counted in the flight size.
    in_flight: bool,
    /// Already resent once by the timer (RFC 5681: keep ssthresh).
    rto_retransmitted: bool,
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
    segments: BTreeMap<u64, Segment>,
    flight: u64,
    lost: BTreeSet<u64>,
    /// Fast retransmit / partial-ACK retransmission: sent at once,
    /// regardless of window and pacer (RFC 5681 3.2, RFC 6582 3.2).
    urgent: Option<u64>,
    dupacks: u32,
    in_recovery: bool,
    /// RFC 6582 `recover`, stored as an exclusive end (highest byte sent
    /// + 1): "the ACK covers more than recover" is `cum_ack >= recover`.
    recover: u64,
    /// Same idea for ECN (RFC 3168: react at most once per window).
    ecn_recover: u64,
    partial_ack_seen: bool,
    rto_deadline: Option<Nanos>,
    consecutive_rtos: u32,

    rtt: RttEstimator,
    pacer: Pacer,
    ka: ExplicitRate,
    reno: NewReno,
    mode: Mode,
    last_rate: Option<f64>,
    last_rate_at: Option<Nanos>,
    first_data_ack_at: Option<Nanos>,
    next_rtt_indicator: Option<Nanos>,

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
            .unwrap_or_else(|| rfc5681_initial_window(SMSS));
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
            segments: BTreeMap::new(),
            flight: 0,
            lost: BTreeSet::new(),
            urgent: None,
            dupacks: 0,
            in_recovery: false,
            recover: 0,
            ecn_recover: 0,
            partial_ack_seen: false,
            rto_deadline: None,
            consecutive_rtos: 0,
            rtt: RttEstimator::new(cfg.min_rto, cfg.initial_rto, cfg.max_rto),
            pacer: Pacer::new(cfg.pacing_burst, FULL_PACKET_LEN),
            ka: ExplicitRate::new(SMSS, FULL_DATAGRAM, iw),
            reno: NewReno::new(SMSS, FULL_DATAGRAM, iw),
            mode: if cfg.kickass {
                Mode::KickAss
            } else {
                Mode::Tcp
            },
            last_rate: None,
            last_rate_at: None,
            first_data_ack_at: None,
            next_rtt_indicator: None,
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

    /// The controller in force (ExplicitRate in Kick-Ass mode, else NewReno).
    pub fn controller(&self) -> &dyn Controller {
        match self.mode {
            Mode::KickAss => &self.ka,
            Mode::Tcp => &self.reno,
        }
    }

    fn controller_mut(&mut self) -> &mut dyn Controller {
        match self.mode {
            Mode::KickAss => &mut self.ka,
            Mode::Tcp => &mut self.reno,
        }
    }

    /// Congestion window in force (payload bytes).
    pub fn window(&self) -> u64 {
        self.controller().window()
    }

    /// NewReno's ssthresh (meaningful in TCP mode).
    pub fn ssthresh(&self) -> u64 {
        self.reno.ssthresh().unwrap_or(u64::MAX)
    }

    /// FlightSize: payload bytes sent and neither acknowledged nor
    /// declared lost by a timeout.
    pub fn flight_size(&self) -> u64 {
        self.flight
    }

    pub fn in_recovery(&self) -> bool {
        self.in_recovery
    }

    /// When the retransmission timer fires, if running.
    pub fn rto_deadline(&self) -> Option<Nanos> {
        self.rto_deadline
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
            State::Handshake => {
                if self.hs_due {
                    Some(self.send_handshake(now, buf))
                } else {
                    None
                }
            }
            State::Closing => {
                if self.fin_due {
                    Some(self.send_fin(now, buf))
                } else {
                    None
                }
            }
            State::Established => {
                if let Some(seq) = self.urgent.take() {
                    let live = self
                        .segments
                        .get(&seq)
                        .is_some_and(|s| !s.sacked && seq >= self.snd_una);
                    if live {
                        return Some(self.send_segment(now, seq, buf));
                    }
                }
                if self.rtt_indicator_due(now) {
                    return Some(self.send_rtt_indicator(now, buf));
                }
                let (seq, len) = self.next_data()?;
                if self.flight + len > self.window() {
                    return None;
                }
                if self
                    .pacer
                    .delay(now, len as usize + wire::DATA_HEADER_LEN + IP_UDP_OVERHEAD)
                    .is_some()
                {
                    return None;
                }
                Some(self.send_segment(now, seq, buf))
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
                if self.rtt_indicators_enabled() && self.rtt.srtt().is_some() {
                    take(self.next_rtt_indicator);
                }
                take(self.no_rate_deadline());
                take(Some(self.idle_deadline()));
                if self.urgent.is_some() {
                    take(Some(self.last_now));
                }
                if let Some((_, len)) = self.next_data() {
                    if self.flight + len <= self.window() {
                        let ip = len as usize + wire::DATA_HEADER_LEN + IP_UDP_OVERHEAD;
                        take(Some(self.pacer.ready_at(ip).unwrap_or(self.last_now)));
                    }
                }
                t
            }
        }
    }

    // ----- input -----------------------------------------------------

    /// Timers: handshake and FIN retries, the retransmission timer, and
    /// the Kick-Ass "no rate for more than one RTT" rule.
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
            State::Established => {
                if now >= self.idle_deadline() {
                    self.fail(ConnectionError::IdleTimeout);
                    return;
                }
                if self.rto_deadline.is_some_and(|d| now >= d) {
                    self.on_rto_expired(now);
                }
                self.check_no_rate(now);
            }
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

    fn process(&mut self, now: Nanos, bytes: &[u8]) -> Result<(), DatagramError> {
        let repr = Repr::parse_bytes(bytes).map_err(DatagramError::Malformed)?;
        if repr.flow_id() != self.flow_id {
            return Err(DatagramError::WrongFlow {
                expected: self.flow_id,
                got: repr.flow_id(),
            });
        }
        if self.state == State::Closed {
            return Err(DatagramError::Closed);
        }
        match repr {
            Repr::HandshakeAck(h) => self.on_handshake_ack(now, &h),
            Repr::Ack(a) => match self.state {
                State::Established => self.on_ack(now, &a),
                // Late ACKs after completion: harmless.
                State::Closing => Ok(()),
                _ => Err(DatagramError::UnexpectedKind(Kind::Ack)),
            },
            Repr::FinAck(f) => {
                if self.state == State::Closing && f.final_size == self.size {
                    self.close();
                    Ok(())
                } else {
                    Err(DatagramError::UnexpectedKind(Kind::FinAck))
                }
            }
            Repr::Reset(rs) => self.on_reset(now, &rs),
            other => Err(DatagramError::UnexpectedKind(other.kind())),
        }
    }

    /// The receiver has no flow for us. Believed only when it echoes a
    /// datagram we sent and is not yet acknowledged (or our FIN), so a
    /// forger must have seen our traffic.
    fn on_reset(&mut self, now: Nanos, rs: &wire::Reset) -> Result<(), DatagramError> {
        self.check_ts_echo(now, rs.ts_echo)?;
        match self.state {
            State::Established if self.segments.contains_key(&rs.seq_echo) => {
                self.fail(ConnectionError::Reset);
                Ok(())
            }
            // Every byte was acknowledged; the receiver forgot the flow
            // before our FIN: nothing is lost, stop repeating it.
            State::Closing if rs.seq_echo == self.size => {
                self.close();
                Ok(())
            }
            _ => Err(DatagramError::UnexpectedKind(Kind::Reset)),
        }
    }

    fn idle_deadline(&self) -> Nanos {
        self.last_heard.saturating_add(self.cfg.idle_timeout)
    }

    fn check_ts_echo(&self, now: Nanos, ts: u64) -> Result<(), DatagramError> {
        if ts < self.created_at || ts > now {
            Err(DatagramError::BadTimestampEcho)
        } else {
            Ok(())
        }
    }

    fn on_handshake_ack(&mut self, now: Nanos, h: &HandshakeAck) -> Result<(), DatagramError> {
        if self.state != State::Handshake {
            // A duplicate (our retransmitted HANDSHAKE was answered twice).
            return Ok(());
        }
        self.check_ts_echo(now, h.ts_echo)?;
        let negotiated = self.kickass && h.kickass;
        let rate = if negotiated {
            h.rate_echo
                .validate()
                .map_err(|_| DatagramError::BogusRateEcho)?
        } else {
            None
        };
        if h.status != Status::Accepted {
            self.fail(ConnectionError::Refused(h.status));
            return Ok(());
        }
        self.rtt.on_sample(now - h.ts_echo);
        self.state = State::Established;
        self.hs_deadline = None;
        self.hs_due = false;
        if self.kickass && !negotiated {
            self.kickass = false;
            self.switch_mode(now, Mode::Tcp, SwitchReason::NotNegotiated);
        }
        if self.kickass {
            self.next_rtt_indicator = Some(now);
        }
        if let Some(r) = rate {
            self.on_rate(now, r);
        }
        self.update_pacer(now);
        self.events.push_back(Event::Connected {
            kickass: self.kickass,
            advertised_rate: rate,
        });
        Ok(())
    }

    fn on_ack(&mut self, now: Nanos, ack: &Ack) -> Result<(), DatagramError> {
        // Validate everything before changing anything.
        if ack.cum_ack > self.snd_nxt {
            return Err(DatagramError::AckBeyondSent {
                acked: ack.cum_ack,
                sent: self.snd_nxt,
            });
        }
        if let Some(&(_, end)) = ack.sack.as_slice().iter().find(|b| b.1 > self.snd_nxt) {
            return Err(DatagramError::AckBeyondSent {
                acked: end,
                sent: self.snd_nxt,
            });
        }
        self.check_ts_echo(now, ack.ts_echo)?;
        let rate = if self.kickass {
            ack.rate_echo
                .validate()
                .map_err(|_| DatagramError::BogusRateEcho)?
        } else {
            None
        };

        if self.first_data_ack_at.is_none() {
            self.first_data_ack_at = Some(now);
        }
        if ack.cum_ack < self.snd_una {
            // Reordered ACK: its SACKs and rate still count, nothing else.
            self.stats.stale_acks += 1;
        }
        let newly_acked = ack.cum_ack.saturating_sub(self.snd_una);
        let newly_sacked = self.mark_sacked(ack);
        if newly_acked > 0 || newly_sacked > 0 {
            self.rtt.on_sample(now - ack.ts_echo);
        }
        if let Some(r) = rate {
            self.on_rate(now, r);
        }

        if newly_acked > 0 {
            self.advance_una(ack.cum_ack);
            self.consecutive_rtos = 0;
            self.dupacks = 0;
            let mut restart_timer = true;
            if self.in_recovery {
                if ack.cum_ack >= self.recover {
                    self.in_recovery = false;
                    let flight_size = self.flight;
                    self.reno
                        .on_recovery_ack(now, RecoveryAck::Full { flight_size });
                } else {
                    self.reno
                        .on_recovery_ack(now, RecoveryAck::Partial { acked: newly_acked });
                    // Retransmit the first unacknowledged segment.
                    self.urgent = self.segments.keys().next().copied();
                    // RFC 6582 "Impatient" variant: only the first partial
                    // ACK re-arms the timer.
                    restart_timer = !self.partial_ack_seen;
                    self.partial_ack_seen = true;
                }
            } else {
                let rtt = self.rtt.clone();
                self.controller_mut().on_ack(now, newly_acked, &rtt);
            }
            if self.snd_una >= self.snd_nxt {
                self.rto_deadline = None;
            } else if restart_timer {
                self.rto_deadline = Some(now + self.rtt.rto());
            }
        } else if ack.cum_ack == self.snd_una && self.snd_una < self.snd_nxt && newly_sacked > 0 {
            self.stats.duplicate_acks += 1;
            self.dupacks += 1;
            if self.in_recovery {
                self.reno.on_recovery_ack(now, RecoveryAck::Duplicate);
            } else if self.dupacks == DUP_THRESH {
                if self.mode == Mode::KickAss {
                    self.enter_tcp_mode(now, SwitchReason::DupAcks);
                }
                // RFC 6582 step 2: only if the ACK covers more than recover.
                if ack.cum_ack >= self.recover {
                    self.recover = self.snd_nxt;
                    self.in_recovery = true;
                    self.partial_ack_seen = false;
                    self.fast_retransmits += 1;
                    self.reno.on_congestion_event(
                        now,
                        CongestionSignal::DuplicateAcks,
                        self.flight,
                    );
                    self.urgent = self.segments.keys().next().copied();
                }
            }
        }

        if ack.ece {
            self.stats.ecn_echoes += 1;
            if self.mode == Mode::KickAss {
                self.enter_tcp_mode(now, SwitchReason::Ecn);
            }
            if !self.in_recovery && ack.cum_ack >= self.ecn_recover {
                self.ecn_recover = self.snd_nxt;
                self.reno
                    .on_congestion_event(now, CongestionSignal::Ecn, self.flight);
            }
        }

        // Paper II-C3: back to Kick-Ass mode once TCP's rate reaches the
        // last advertised rate, judged when a rate arrives.
        if rate.is_some() && self.mode == Mode::Tcp && !self.in_recovery && self.lost.is_empty() {
            if let (Some(r), Some(srtt)) = (self.last_rate, self.rtt.srtt()) {
                let tcp_rate = self.reno.cwnd() as f64 / (srtt as f64 / 1e9);
                // A relative 1e-9 absorbs float rounding of rate x SRTT / SRTT.
                if tcp_rate >= payload_rate(r, SMSS, FULL_DATAGRAM) * (1.0 - 1e-9) {
                    self.enter_ka_mode(now);
                }
            }
        }
        self.check_no_rate(now);

        if self.snd_una >= self.size && self.completed_at.is_none() {
            self.complete(now);
        }
        self.update_pacer(now);
        Ok(())
    }

    /// Mark segments fully inside SACK blocks; returns newly SACKed bytes.
    fn mark_sacked(&mut self, ack: &Ack) -> u64 {
        let mut newly = 0;
        for &(start, end) in ack.sack.as_slice() {
            let start = start.max(self.snd_una);
            if start >= end {
                continue;
            }
            // A segment that starts before `start` may still lie inside.
            let from = self
                .segments
                .range(..=start)
                .next_back()
                .map_or(start, |(&s, _)| s);
            for (&seq, seg) in self.segments.range_mut(from..end) {
                if seq >= start && seq + seg.len <= end && !seg.sacked {
                    seg.sacked = true;
                    newly += seg.len;
                    if seg.lost {
                        seg.lost = false;
                        self.lost.remove(&seq);
                    }
                }
            }
        }
        newly
    }

    fn advance_una(&mut self, cum: u64) {
        while let Some((&seq, seg)) = self.segments.first_key_value() {
            if seq + seg.len > cum {
                break;
            }
            if seg.in_flight {
                self.flight -= seg.len;
            }
            self.lost.remove(&seq);
            self.segments.remove(&seq);
        }
        self.snd_una = cum;
    }

    fn on_rate(&mut self, now: Nanos, r: f64) {
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
    fn no_rate_deadline(&self) -> Option<Nanos> {
        if self.state != State::Established || self.mode != Mode::KickAss || !self.kickass {
            return None;
        }
        let first = self.first_data_ack_at?;
        let srtt = self.rtt.srtt()?;
        Some(self.last_rate_at.unwrap_or(0).max(first) + srtt + 1)
    }

    fn check_no_rate(&mut self, now: Nanos) {
        if self.no_rate_deadline().is_some_and(|d| now >= d) {
            self.enter_tcp_mode(now, SwitchReason::NoRate);
            self.update_pacer(now);
        }
    }

    /// Kick-Ass -> TCP. NewReno takes over the window Kick-Ass mode was
    /// using, rate x SRTT, because that is what the path carried a moment
    /// ago:
    /// * no rate (II-C2): the router stopped advertising because it sees
    ///   unresponsive traffic, not because this flow lost anything, so
    ///   continue from there in congestion avoidance (ssthresh = cwnd)
    ///   rather than halve or slow-start past it; if rates resume at the
    ///   same level, cwnd/SRTT already equals the rate and the flow returns
    ///   at once ("the endpoints immediately return", II-C2);
    /// * loss, 3 dupacks, ECN (II-C3, "performing standard TCP back off
    ///   procedures"): the caller then applies NewReno's standard reaction,
    ///   ssthresh = max(FlightSize/2, 2 SMSS), which halves rate x RTT.
    ///
    /// Before any rate arrived there is no such window: the startup window
    /// carries over and slow start continues.
    fn enter_tcp_mode(&mut self, now: Nanos, reason: SwitchReason) {
        if self.mode == Mode::Tcp {
            return;
        }
        let (cwnd, ssthresh) = match (self.ka.bdp(), reason) {
            (None, _) => (self.ka.window(), u64::MAX),
            (Some(bdp), SwitchReason::NoRate) => (bdp, bdp),
            (Some(bdp), _) => (bdp, u64::MAX),
        };
        self.reno.seed(cwnd, ssthresh);
        self.in_recovery = false;
        self.switch_mode(now, Mode::Tcp, reason);
    }

    fn enter_ka_mode(&mut self, now: Nanos) {
        if let Some(r) = self.last_rate {
            self.ka.set_rate(r, &self.rtt);
            self.dupacks = 0;
            self.switch_mode(now, Mode::KickAss, SwitchReason::RateReached);
        }
    }

    fn switch_mode(&mut self, now: Nanos, to: Mode, reason: SwitchReason) {
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
        self.events.push_back(Event::ModeSwitched(sw));
    }

    fn account_mode_time(&mut self, now: Nanos) {
        let now = now.max(self.mode_since);
        if self.mode == Mode::KickAss {
            self.ka_time += now - self.mode_since;
        }
        self.mode_since = now;
    }

    fn on_rto_expired(&mut self, now: Nanos) {
        self.rto_deadline = None;
        if self.snd_una >= self.snd_nxt {
            return;
        }
        self.consecutive_rtos += 1;
        self.rto_count += 1;
        if self.consecutive_rtos > self.cfg.max_consecutive_rtos {
            self.fail(ConnectionError::TooManyTimeouts);
            return;
        }
        let first_expiry = self
            .segments
            .values()
            .next()
            .is_none_or(|s| !s.rto_retransmitted);
        if self.mode == Mode::KickAss {
            self.enter_tcp_mode(now, SwitchReason::Rto);
        }
        self.reno.on_rto(now, self.flight, first_expiry);
        // RFC 6582 step 4: record recover, leave fast recovery.
        self.recover = self.snd_nxt;
        self.in_recovery = false;
        self.dupacks = 0;
        self.urgent = None;
        // Everything outstanding is presumed lost (go-back-N from snd_una),
        // except what the receiver SACKed: it keeps it.
        for (&seq, seg) in self.segments.iter_mut() {
            seg.in_flight = false;
            if !seg.sacked {
                seg.lost = true;
                self.lost.insert(seq);
            }
        }
        self.flight = 0;
        if let Some(seg) = self.segments.values_mut().next() {
            seg.rto_retransmitted = true;
        }
        self.rtt.on_timeout();
        self.update_pacer(now);
    }

    fn complete(&mut self, now: Nanos) {
        self.account_mode_time(now);
        self.completed_at = Some(now);
        self.state = State::Closing;
        self.rto_deadline = None;
        self.urgent = None;
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
        self.hs_deadline = None;
        self.events.push_back(Event::Failed(e));
    }

    fn update_pacer(&mut self, now: Nanos) {
        let rate = if self.mode == Mode::Tcp && !self.cfg.pace_tcp_mode {
            None
        } else {
            self.controller().pacing_rate(&self.rtt)
        };
        self.pacer.set_rate(now, rate);
    }

    fn rtt_indicators_enabled(&self) -> bool {
        self.kickass && self.cfg.rtt_indicator_interval.is_some()
    }

    fn rtt_indicator_due(&self, now: Nanos) -> bool {
        self.rtt_indicators_enabled()
            && self.rtt.srtt().is_some()
            && self.next_rtt_indicator.is_some_and(|t| now >= t)
    }

    fn next_data(&self) -> Option<(u64, u64)> {
        if let Some(&seq) = self.lost.first() {
            return self.segments.get(&seq).map(|s| (seq, s.len));
        }
        if self.snd_nxt < self.size {
            return Some((self.snd_nxt, SMSS.min(self.size - self.snd_nxt)));
        }
        None
    }

    // ----- emission --------------------------------------------------

    fn send_handshake(&mut self, now: Nanos, buf: &mut Vec<u8>) -> Transmit {
        if self.start.is_none() {
            self.start = Some(now);
            self.mode_since = now;
        }
        self.hs_due = false;
        self.hs_attempts += 1;
        let backoff = 1u64 << (self.hs_attempts - 1).min(16);
        self.hs_deadline = Some(
            now + self
                .cfg
                .initial_rto
                .saturating_mul(backoff)
                .min(self.cfg.max_rto),
        );
        let padded = self.handshake_mode == HandshakeMode::Padded;
        let datagram_len = if padded {
            FULL_UDP_PAYLOAD_LEN
        } else {
            MIN_HANDSHAKE_LEN.max(HANDSHAKE_HEADER_LEN + self.token.len())
        };
        Repr::Handshake(Handshake {
            flow_id: self.flow_id,
            flow_size: self.size,
            timestamp: now,
            kickass: self.kickass,
            padded,
            token: &self.token,
            datagram_len,
        })
        .emit_into(buf);
        self.datagrams_sent += 1;
        Transmit {
            len: buf.len(),
            dont_fragment: !self.kickass,
            kind: Kind::Handshake,
        }
    }

    fn send_segment(&mut self, now: Nanos, seq: u64, buf: &mut Vec<u8>) -> Transmit {
        let retransmission = seq < self.snd_nxt;
        let len = if retransmission {
            let seg = self.segments.get_mut(&seq).expect("segment exists");
            seg.transmissions += 1;
            seg.lost = false;
            let len = seg.len;
            if !seg.in_flight {
                seg.in_flight = true;
                self.flight += len;
            }
            self.lost.remove(&seq);
            self.retransmissions += 1;
            self.retransmitted_bytes += len;
            len
        } else {
            let len = SMSS.min(self.size - seq);
            self.segments.insert(
                seq,
                Segment {
                    len,
                    transmissions: 1,
                    sacked: false,
                    lost: false,
                    in_flight: true,
                    rto_retransmitted: false,
                },
            );
            self.snd_nxt = seq + len;
            self.flight += len;
            len
        };
        self.scratch.clear();
        self.scratch.resize(len as usize, 0);
        self.payload.fill(self.flow_id, seq, &mut self.scratch);
        Repr::Data(Data {
            flow_id: self.flow_id,
            seq,
            timestamp: now,
            retransmission,
            payload: &self.scratch,
        })
        .emit_into(buf);
        self.pacer.on_sent(now, buf.len() + IP_UDP_OVERHEAD);
        if self.rto_deadline.is_none() {
            // RFC 6298 (5.1).
            self.rto_deadline = Some(now + self.rtt.rto());
        }
        self.datagrams_sent += 1;
        Transmit {
            len: buf.len(),
            dont_fragment: !self.kickass,
            kind: Kind::Data,
        }
    }

    fn send_rtt_indicator(&mut self, now: Nanos, buf: &mut Vec<u8>) -> Transmit {
        let srtt_ms = self.rtt.srtt_ms().unwrap_or(0.0);
        Repr::RttIndicator(RttIndicator {
            flow_id: self.flow_id,
            datagram_len: rtt_indicator_payload_len(srtt_ms),
        })
        .emit_into(buf);
        let interval = self.cfg.rtt_indicator_interval.unwrap_or(u64::MAX);
        let mut next = self
            .next_rtt_indicator
            .unwrap_or(now)
            .saturating_add(interval);
        if next <= now {
            next = now.saturating_add(interval);
        }
        self.next_rtt_indicator = Some(next);
        self.rtt_indicators_sent += 1;
        self.datagrams_sent += 1;
        Transmit {
            len: buf.len(),
            dont_fragment: true,
            kind: Kind::RttIndicator,
        }
    }

    fn send_fin(&mut self, now: Nanos, buf: &mut Vec<u8>) -> Transmit {
        self.fin_due = false;
        self.fin_attempts += 1;
        self.fin_deadline = Some(now + self.rtt.base_rto());
        Repr::Fin(Fin {
            flow_id: self.flow_id,
            final_size: self.size,
            timestamp: now,
        })
        .emit_into(buf);
        self.datagrams_sent += 1;
        Transmit {
            len: buf.len(),
            dont_fragment: true,
            kind: Kind::Fin,
        }
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
