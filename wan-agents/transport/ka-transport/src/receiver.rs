//! The receiver side (the wan agent's end of a trial flow), sans IO.
//!
//! One [`Receiver`] serves many flows, keyed by (peer address, flow id).
//! The shell hands in each UDP payload with what it observed below UDP:
//! [`RxInfo::leading_fragment_len`], read before reassembly (AF_PACKET; a
//! datagram that arrived whole has none), and the ECN CE mark. Out come
//! replies to send, in-order data and flow events.
//!
//! Rules that protect the agent and third parties:
//! * no flow without a token the caller's [`TokenValidator`] accepts;
//! * anti-amplification: before a token is validated the receiver answers
//!   a HANDSHAKE with at most one reply, never larger than the handshake
//!   (HANDSHAKE >= 64 bytes, HANDSHAKE_ACK = 32); a DATA or FIN for no open
//!   flow gets at most a 32-byte RESET (never more than it carried, within
//!   a receiver-wide budget per second), so a sender whose flow the
//!   receiver lost (restart, idle expiry) learns it at once; the stats let a
//!   test check bytes out <= in;
//! * every buffer is bounded (flows, out-of-order bytes per flow, queued
//!   replies); malformed input is dropped and counted, never a panic.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;

use core::fmt;

use ka_core::Nanos;

use crate::wire::{
    self, Ack, Fin, Handshake, HandshakeAck, Kind, RateEcho, Repr, SackBlocks, Status,
    MAX_SACK_BLOCKS,
};

/// What the shell observed about one datagram below UDP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RxInfo {
    /// IP payload length of the datagram's leading fragment, observed
    /// before reassembly; `None` = arrived whole.
    pub leading_fragment_len: Option<u16>,
    /// The IP header carried ECN CE.
    pub ecn_ce: bool,
}

impl RxInfo {
    pub fn whole() -> Self {
        RxInfo::default()
    }

    pub fn fragmented(leading_fragment_len: u16) -> Self {
        RxInfo {
            leading_fragment_len: Some(leading_fragment_len),
            ecn_ce: false,
        }
    }
}

/// What the validator is asked about.
#[derive(Debug, Clone, Copy)]
pub struct TokenRequest<'a> {
    pub peer: SocketAddr,
    pub flow_id: u64,
    pub flow_size: u64,
    pub kickass: bool,
    pub token: &'a [u8],
}

/// Decides whether a flow may open (e.g. a per-trial token issued by the
/// measurement server). Closures `FnMut(&TokenRequest) -> bool` qualify.
pub trait TokenValidator {
    fn validate(&mut self, request: &TokenRequest<'_>) -> bool;
}

impl<F: FnMut(&TokenRequest<'_>) -> bool> TokenValidator for F {
    fn validate(&mut self, request: &TokenRequest<'_>) -> bool {
        self(request)
    }
}

/// Receiver configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiverConfig {
    /// The shell can observe leading fragments, so rates are echoed and
    /// Kick-Ass accepted. Without it every flow runs as TCP.
    pub kickass: bool,
    pub max_flows: usize,
    pub max_flow_size: u64,
    /// Out-of-order bytes held per flow; beyond, datagrams are dropped
    /// (and not SACKed), the sender retransmits them later.
    pub max_reorder_bytes: usize,
    /// A flow silent for this long is forgotten.
    pub idle_timeout: Nanos,
    /// After FIN_ACK, state is kept this long to answer a repeated FIN
    /// (the FIN_ACK may be lost).
    pub linger: Nanos,
    /// Replies waiting for the shell; beyond, replies are dropped.
    pub max_queued_transmits: usize,
    /// RESETs (answers to DATA/FIN for no open flow) per second, receiver
    /// wide; the same number may go at once. 0 never answers.
    pub max_resets_per_s: u32,
    /// A datagram that arrived whole (no router cut it: the sender is in
    /// TCP mode, or no Kick-Ass router is on the path) and in order is
    /// acknowledged with the next one or after this long, as TCP receivers
    /// do (RFC 5681 4.2, RFC 1122 4.2.3.2; Linux's minimum delayed-ACK
    /// timeout is 40 ms). Everything else is acknowledged at once: a cut
    /// datagram (its rate goes back to the sender without delay), data out
    /// of order, filling a hole or duplicated, CE marks, a flow's end and its
    /// first `quick_acks` datagrams. `None`: every datagram at once.
    ///
    /// Why: the kernel TCP our TCP mode shares links with acknowledges
    /// every second segment, so its sender answers an ACK with two or three
    /// segments back to back. Acknowledged one by one, our TCP mode sent
    /// smoother trains, lost fewer packets at a drop-tail queue and took
    /// 1.5-2x the kernel CUBIC flows' share beside them.
    pub delayed_ack: Option<Nanos>,
    /// Linux's TCP_MAX_QUICKACKS: a flow's first datagrams are acknowledged
    /// one by one (its sender's slow start).
    pub quick_acks: u64,
}

/// See `ReceiverConfig::delayed_ack`.
pub const DELAYED_ACK: Nanos = 40_000_000;
/// See `ReceiverConfig::quick_acks`.
pub const QUICK_ACKS: u64 = 16;

impl Default for ReceiverConfig {
    fn default() -> Self {
        ReceiverConfig {
            kickass: true,
            max_flows: 1024,
            max_flow_size: 1 << 32,
            max_reorder_bytes: 4 << 20,
            idle_timeout: 30_000_000_000,
            linger: 5_000_000_000,
            max_queued_transmits: 4096,
            max_resets_per_s: 100,
            delayed_ack: Some(DELAYED_ACK),
            quick_acks: QUICK_ACKS,
        }
    }
}

/// One flow at the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    pub peer: SocketAddr,
    pub flow_id: u64,
}

/// Per-flow receive counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecvFlowStats {
    pub data_datagrams: u64,
    pub payload_bytes: u64,
    pub duplicate_datagrams: u64,
    pub fragmented_datagrams: u64,
    pub ce_marked: u64,
    pub reorder_drops: u64,
    pub acks_sent: u64,
    pub last_leading_fragment_len: Option<u16>,
    pub accepted_at: Nanos,
    pub completed_at: Option<Nanos>,
}

/// Something the application may want to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiverEvent {
    FlowAccepted {
        key: FlowKey,
        size: u64,
        kickass: bool,
    },
    /// In-order bytes, each exactly once: `offset` is the stream offset of
    /// `data[0]`.
    Data {
        key: FlowKey,
        offset: u64,
        data: Vec<u8>,
    },
    /// Every byte delivered.
    FlowComplete { key: FlowKey, stats: RecvFlowStats },
    /// FIN received and answered.
    FlowClosed { key: FlowKey },
    /// Silent for the idle timeout before completing (or lingering over).
    FlowExpired { key: FlowKey, delivered: u64 },
    /// A handshake was refused (the reply, if any, is queued).
    Refused {
        peer: SocketAddr,
        flow_id: u64,
        status: Status,
    },
}

/// Why a datagram was dropped (also counted in [`ReceiverStats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvError {
    Malformed(wire::Error),
    /// DATA or FIN for no open flow: dropped, answered by a RESET while the
    /// budget lasts.
    UnknownFlow,
    Refused(Status),
    UnexpectedKind(Kind),
    /// DATA past the announced flow size.
    DataBeyondFlowSize,
    /// Out-of-order buffer full.
    ReorderBufferFull,
    /// FIN before every byte arrived, or with another size.
    BadFin,
}

impl fmt::Display for RecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecvError::Malformed(e) => write!(f, "malformed datagram: {e}"),
            RecvError::UnknownFlow => f.write_str("datagram for no open flow"),
            RecvError::Refused(s) => write!(f, "handshake refused: {s:?}"),
            RecvError::UnexpectedKind(k) => write!(f, "unexpected {}", k.as_str()),
            RecvError::DataBeyondFlowSize => f.write_str("data beyond the announced flow size"),
            RecvError::ReorderBufferFull => f.write_str("out-of-order buffer full"),
            RecvError::BadFin => f.write_str("FIN before all data or with another size"),
        }
    }
}

impl std::error::Error for RecvError {}

/// Receiver-wide counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    pub datagrams: u64,
    pub bytes_in: u64,
    pub malformed: u64,
    pub unknown_flow: u64,
    pub refused: u64,
    pub unexpected_kind: u64,
    pub beyond_flow_size: u64,
    pub reorder_drops: u64,
    pub bad_fin: u64,
    pub rtt_indicators: u64,
    pub queue_drops: u64,
    pub flows_accepted: u64,
    pub flows_completed: u64,
    pub flows_expired: u64,
    /// Bytes received from peers without a validated flow (refused
    /// handshakes, strays) and bytes sent back to them: the
    /// anti-amplification rule is `unvalidated_bytes_out <= unvalidated_bytes_in`.
    pub unvalidated_bytes_in: u64,
    pub unvalidated_bytes_out: u64,
    /// RESETs sent, and the ones the budget held back.
    pub resets_sent: u64,
    pub resets_suppressed: u64,
}

/// A reply to send: `buf[..len]` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiverTransmit {
    pub dst: SocketAddr,
    pub len: usize,
}

#[derive(Debug)]
struct RecvFlow {
    size: u64,
    kickass: bool,
    token: Vec<u8>,
    /// Next byte to deliver: everything below was delivered once.
    rcv_nxt: u64,
    /// Out-of-order chunks, non-overlapping, all at or above `rcv_nxt`.
    chunks: BTreeMap<u64, Vec<u8>>,
    chunk_bytes: usize,
    /// The same bytes as maximal ranges start -> end, for SACK blocks.
    ranges: BTreeMap<u64, u64>,
    /// Starts of the latest out-of-order arrivals, newest first (RFC 2018:
    /// the first SACK block reports the most recent one).
    recent: VecDeque<u64>,
    last_activity: Nanos,
    complete: bool,
    linger_until: Option<Nanos>,
    /// A datagram whose ACK waits (`ReceiverConfig::delayed_ack`).
    pending_ack: Option<PendingAck>,
    stats: RecvFlowStats,
}

#[derive(Debug, Clone, Copy)]
struct PendingAck {
    due: Nanos,
    /// Its timestamp: the earliest unacknowledged one is echoed (RFC 7323 4.3).
    ts_echo: u64,
    rate_echo: RateEcho,
}

impl RecvFlow {
    /// A flow accepted at `now`, nothing of it received yet.
    fn new(size: u64, kickass: bool, token: Vec<u8>, now: Nanos) -> Self {
        RecvFlow {
            size,
            kickass,
            token,
            rcv_nxt: 0,
            chunks: BTreeMap::new(),
            chunk_bytes: 0,
            ranges: BTreeMap::new(),
            recent: VecDeque::new(),
            last_activity: now,
            complete: false,
            linger_until: None,
            pending_ack: None,
            stats: RecvFlowStats {
                accepted_at: now,
                ..RecvFlowStats::default()
            },
        }
    }

    fn expiry(&self, idle_timeout: Nanos) -> Nanos {
        self.linger_until
            .unwrap_or(self.last_activity.saturating_add(idle_timeout))
    }

    fn next_timeout(&self, idle_timeout: Nanos) -> Nanos {
        let expiry = self.expiry(idle_timeout);
        self.pending_ack.map_or(expiry, |p| p.due.min(expiry))
    }

    /// The ACK of everything received so far.
    fn ack(&mut self, flow_id: u64, ts_echo: u64, ece: bool, rate_echo: RateEcho) -> Ack {
        self.stats.acks_sent += 1;
        Ack {
            flow_id,
            cum_ack: self.rcv_nxt,
            ts_echo,
            ece,
            rate_echo,
            sack: self.sack_blocks(),
        }
    }

    /// Add [start, end) of `data` (which begins at `seq`) without
    /// duplicating anything held; returns the gaps it filled.
    fn gaps(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut overl: Vec<(u64, u64)> = Vec::new();
        for (&s, v) in self.chunks.range(..end).rev() {
            let e = s + v.len() as u64;
            if e <= start {
                break;
            }
            overl.push((s, e));
        }
        overl.reverse();
        let mut out = Vec::new();
        let mut cursor = start;
        for (s, e) in overl {
            if cursor < s {
                out.push((cursor, s.min(end)));
            }
            cursor = cursor.max(e);
        }
        if cursor < end {
            out.push((cursor, end));
        }
        out
    }

    fn insert_range(&mut self, mut s: u64, mut e: u64) {
        // Merge with a range that touches from the left.
        if let Some((&ps, &pe)) = self.ranges.range(..=s).next_back() {
            if pe >= s {
                s = ps;
                e = e.max(pe);
                self.ranges.remove(&ps);
            }
        }
        // And with every range starting inside or touching [s, e].
        while let Some((&ns, &ne)) = self.ranges.range(s..).next() {
            if ns > e {
                break;
            }
            e = e.max(ne);
            self.ranges.remove(&ns);
        }
        self.ranges.insert(s, e);
    }

    fn range_containing(&self, off: u64) -> Option<(u64, u64)> {
        let (&s, &e) = self.ranges.range(..=off).next_back()?;
        (off < e).then_some((s, e))
    }

    fn sack_blocks(&self) -> SackBlocks {
        let mut out = SackBlocks::new();
        let push = |out: &mut SackBlocks, b: (u64, u64)| {
            if !out.as_slice().contains(&b) {
                out.push(b);
            }
        };
        for &off in &self.recent {
            if out.len() == MAX_SACK_BLOCKS {
                break;
            }
            if let Some(b) = self.range_containing(off) {
                push(&mut out, b);
            }
        }
        for (&s, &e) in self.ranges.iter().rev() {
            if out.len() == MAX_SACK_BLOCKS {
                break;
            }
            push(&mut out, (s, e));
        }
        out
    }
}

/// The receiver state machine.
#[derive(Debug)]
pub struct Receiver<V: TokenValidator> {
    cfg: ReceiverConfig,
    validator: V,
    flows: HashMap<FlowKey, RecvFlow>,
    transmits: VecDeque<(SocketAddr, Vec<u8>)>,
    events: VecDeque<ReceiverEvent>,
    stats: ReceiverStats,
    /// RESET token bucket: tokens left and when it was last refilled.
    reset_tokens: f64,
    reset_refilled: Nanos,
}

impl<V: TokenValidator> Receiver<V> {
    pub fn new(cfg: ReceiverConfig, validator: V) -> Self {
        Receiver {
            validator,
            flows: HashMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            reset_tokens: f64::from(cfg.max_resets_per_s),
            reset_refilled: 0,
            stats: ReceiverStats::default(),
            cfg,
        }
    }

    pub fn stats(&self) -> &ReceiverStats {
        &self.stats
    }

    pub fn config(&self) -> &ReceiverConfig {
        &self.cfg
    }

    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// Bytes delivered in order so far on a flow.
    pub fn delivered(&self, key: &FlowKey) -> Option<u64> {
        self.flows.get(key).map(|f| f.rcv_nxt)
    }

    pub fn flow_stats(&self, key: &FlowKey) -> Option<&RecvFlowStats> {
        self.flows.get(key).map(|f| &f.stats)
    }

    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.events.pop_front()
    }

    /// The next reply, written into `buf`.
    pub fn poll_transmit(&mut self, buf: &mut Vec<u8>) -> Option<ReceiverTransmit> {
        let (dst, bytes) = self.transmits.pop_front()?;
        *buf = bytes;
        Some(ReceiverTransmit {
            dst,
            len: buf.len(),
        })
    }

    /// Earliest flow expiry (idle timeout or end of linger) or delayed ACK.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.flows
            .values()
            .map(|f| f.next_timeout(self.cfg.idle_timeout))
            .min()
    }

    /// Send the delayed ACKs that are due; forget flows whose time is up.
    pub fn handle_timeout(&mut self, now: Nanos) {
        let mut due: Vec<(FlowKey, Ack)> = Vec::new();
        for (key, f) in self.flows.iter_mut() {
            if let Some(p) = f.pending_ack.filter(|p| p.due <= now) {
                f.pending_ack = None;
                due.push((*key, f.ack(key.flow_id, p.ts_echo, false, p.rate_echo)));
            }
        }
        due.sort_by_key(|(k, _)| *k);
        for (key, ack) in due {
            self.queue(key.peer, &Repr::Ack(ack));
        }
        let idle = self.cfg.idle_timeout;
        let mut expired: Vec<FlowKey> = self
            .flows
            .iter()
            .filter(|(_, f)| now >= f.expiry(idle))
            .map(|(k, _)| *k)
            .collect();
        expired.sort();
        for key in expired {
            if let Some(f) = self.flows.remove(&key) {
                if f.linger_until.is_none() {
                    self.stats.flows_expired += 1;
                    self.events.push_back(ReceiverEvent::FlowExpired {
                        key,
                        delivered: f.rcv_nxt,
                    });
                }
            }
        }
    }

    /// One received UDP payload from `peer`, with what the shell saw below
    /// UDP. Errors are drops, counted in the stats.
    pub fn handle_datagram(
        &mut self,
        now: Nanos,
        peer: SocketAddr,
        bytes: &[u8],
        rx: RxInfo,
    ) -> Result<(), RecvError> {
        self.stats.datagrams += 1;
        self.stats.bytes_in += bytes.len() as u64;
        let r = self.process(now, peer, bytes, rx);
        if let Err(e) = r {
            let s = &mut self.stats;
            match e {
                RecvError::Malformed(_) => s.malformed += 1,
                RecvError::UnknownFlow => s.unknown_flow += 1,
                RecvError::Refused(_) => s.refused += 1,
                RecvError::UnexpectedKind(_) => s.unexpected_kind += 1,
                RecvError::DataBeyondFlowSize => s.beyond_flow_size += 1,
                RecvError::ReorderBufferFull => s.reorder_drops += 1,
                RecvError::BadFin => s.bad_fin += 1,
            }
            let known = matches!(
                e,
                RecvError::DataBeyondFlowSize | RecvError::ReorderBufferFull | RecvError::BadFin
            );
            if !known {
                self.stats.unvalidated_bytes_in += bytes.len() as u64;
            }
        }
        r
    }

    fn process(
        &mut self,
        now: Nanos,
        peer: SocketAddr,
        bytes: &[u8],
        rx: RxInfo,
    ) -> Result<(), RecvError> {
        let repr = Repr::parse_bytes(bytes).map_err(RecvError::Malformed)?;
        match repr {
            Repr::Handshake(h) => self.on_handshake(now, peer, &h, rx),
            Repr::Data(d) => {
                let key = FlowKey {
                    peer,
                    flow_id: d.flow_id,
                };
                if !self.flows.contains_key(&key) {
                    self.reset(now, peer, d.flow_id, d.seq, d.timestamp);
                    return Err(RecvError::UnknownFlow);
                }
                self.on_data(now, key, d.seq, d.timestamp, d.payload, rx)
            }
            Repr::Fin(f) => {
                let r = self.on_fin(now, peer, &f);
                if r == Err(RecvError::UnknownFlow) {
                    self.reset(now, peer, f.flow_id, f.final_size, f.timestamp);
                }
                r
            }
            Repr::RttIndicator(_) => {
                // For the routers on the way; nothing for us.
                self.stats.rtt_indicators += 1;
                Ok(())
            }
            other => Err(RecvError::UnexpectedKind(other.kind())),
        }
    }

    /// Answer a DATA/FIN for no open flow with a RESET while the budget
    /// allows. Never larger than what came in: a RESET is FIN_LEN bytes, a
    /// FIN exactly that and a DATA at least its DATA_HEADER_LEN (the same).
    fn reset(&mut self, now: Nanos, peer: SocketAddr, flow_id: u64, seq: u64, ts: u64) {
        const _: () = assert!(wire::FIN_LEN <= wire::DATA_HEADER_LEN);
        let rate = f64::from(self.cfg.max_resets_per_s);
        let elapsed = now.saturating_sub(self.reset_refilled) as f64 / 1e9;
        self.reset_tokens = (self.reset_tokens + elapsed * rate).min(rate);
        self.reset_refilled = self.reset_refilled.max(now);
        if self.reset_tokens < 1.0 {
            self.stats.resets_suppressed += 1;
            return;
        }
        self.reset_tokens -= 1.0;
        let repr = Repr::Reset(wire::Reset {
            flow_id,
            seq_echo: seq,
            ts_echo: ts,
        });
        let sent = self.queue(peer, &repr);
        if sent > 0 {
            self.stats.resets_sent += 1;
            self.stats.unvalidated_bytes_out += sent as u64;
        }
    }

    fn queue(&mut self, dst: SocketAddr, repr: &Repr<'_>) -> usize {
        if self.transmits.len() >= self.cfg.max_queued_transmits {
            self.stats.queue_drops += 1;
            return 0;
        }
        let bytes = repr.to_vec();
        let len = bytes.len();
        self.transmits.push_back((dst, bytes));
        len
    }

    fn refuse(&mut self, peer: SocketAddr, h: &Handshake<'_>, status: Status) -> RecvError {
        let reply = Repr::HandshakeAck(HandshakeAck {
            flow_id: h.flow_id,
            status,
            kickass: false,
            rate_echo: RateEcho::default(),
            ts_echo: h.timestamp,
        });
        // Never more than what arrived (holds by the wire format's minimum
        // handshake size; checked anyway).
        if reply.buffer_len() <= h.datagram_len {
            let sent = self.queue(peer, &reply);
            self.stats.unvalidated_bytes_out += sent as u64;
        }
        self.events.push_back(ReceiverEvent::Refused {
            peer,
            flow_id: h.flow_id,
            status,
        });
        RecvError::Refused(status)
    }

    fn accept_reply(&mut self, peer: SocketAddr, h: &Handshake<'_>, kickass: bool, rx: RxInfo) {
        let rate_echo = if kickass {
            RateEcho::observed(rx.leading_fragment_len)
        } else {
            RateEcho::default()
        };
        let reply = Repr::HandshakeAck(HandshakeAck {
            flow_id: h.flow_id,
            status: Status::Accepted,
            kickass,
            rate_echo,
            ts_echo: h.timestamp,
        });
        self.queue(peer, &reply);
    }

    fn on_handshake(
        &mut self,
        now: Nanos,
        peer: SocketAddr,
        h: &Handshake<'_>,
        rx: RxInfo,
    ) -> Result<(), RecvError> {
        let key = FlowKey {
            peer,
            flow_id: h.flow_id,
        };
        if let Some(f) = self.flows.get_mut(&key) {
            // A retransmitted HANDSHAKE (our HANDSHAKE_ACK was lost).
            if f.token == h.token && f.size == h.flow_size {
                f.last_activity = now;
                let kickass = f.kickass;
                self.accept_reply(peer, h, kickass, rx);
                return Ok(());
            }
            return Err(self.refuse(peer, h, Status::FlowIdInUse));
        }
        if h.flow_size > self.cfg.max_flow_size {
            return Err(self.refuse(peer, h, Status::FlowTooLarge));
        }
        let request = TokenRequest {
            peer,
            flow_id: h.flow_id,
            flow_size: h.flow_size,
            kickass: h.kickass,
            token: h.token,
        };
        if h.token.is_empty() || !self.validator.validate(&request) {
            return Err(self.refuse(peer, h, Status::BadToken));
        }
        if self.flows.len() >= self.cfg.max_flows {
            return Err(self.refuse(peer, h, Status::Busy));
        }
        let kickass = self.cfg.kickass && h.kickass;
        let mut flow = RecvFlow::new(h.flow_size, kickass, h.token.to_vec(), now);
        self.stats.flows_accepted += 1;
        self.events.push_back(ReceiverEvent::FlowAccepted {
            key,
            size: h.flow_size,
            kickass,
        });
        if flow.size == 0 {
            flow.complete = true;
            flow.stats.completed_at = Some(now);
            self.stats.flows_completed += 1;
            self.events.push_back(ReceiverEvent::FlowComplete {
                key,
                stats: flow.stats.clone(),
            });
        }
        self.flows.insert(key, flow);
        self.accept_reply(peer, h, kickass, rx);
        Ok(())
    }

    fn on_data(
        &mut self,
        now: Nanos,
        key: FlowKey,
        seq: u64,
        timestamp: u64,
        payload: &[u8],
        rx: RxInfo,
    ) -> Result<(), RecvError> {
        let max_reorder = self.cfg.max_reorder_bytes;
        let f = self.flows.get_mut(&key).ok_or(RecvError::UnknownFlow)?;
        let end = seq
            .checked_add(payload.len() as u64)
            .filter(|&e| e <= f.size)
            .ok_or(RecvError::DataBeyondFlowSize)?;
        f.last_activity = now;
        f.stats.data_datagrams += 1;
        f.stats.payload_bytes += payload.len() as u64;
        f.stats.last_leading_fragment_len = rx.leading_fragment_len;
        if rx.leading_fragment_len.is_some() {
            f.stats.fragmented_datagrams += 1;
        }
        if rx.ecn_ce {
            f.stats.ce_marked += 1;
        }

        let mut result = Ok(());
        let start = seq.max(f.rcv_nxt);
        // In order: new data right at rcv_nxt with no hole beyond it.
        let in_order = seq == f.rcv_nxt && start < end && f.ranges.is_empty();
        if start >= end {
            f.stats.duplicate_datagrams += 1;
        } else {
            let gaps = f.gaps(start, end);
            let new_bytes: u64 = gaps.iter().map(|(s, e)| e - s).sum();
            if new_bytes == 0 {
                f.stats.duplicate_datagrams += 1;
            } else if start > f.rcv_nxt && f.chunk_bytes + new_bytes as usize > max_reorder {
                f.stats.reorder_drops += 1;
                result = Err(RecvError::ReorderBufferFull);
            } else {
                for (s, e) in gaps {
                    let a = (s - seq) as usize;
                    let b = (e - seq) as usize;
                    f.chunks.insert(s, payload[a..b].to_vec());
                    f.chunk_bytes += b - a;
                    f.insert_range(s, e);
                }
                if start > f.rcv_nxt {
                    f.recent.push_front(start);
                    f.recent.truncate(2 * MAX_SACK_BLOCKS);
                }
                // Deliver everything now contiguous, exactly once.
                while let Some(entry) = f.chunks.first_entry() {
                    if *entry.key() != f.rcv_nxt {
                        break;
                    }
                    let offset = *entry.key();
                    let data = entry.remove();
                    f.chunk_bytes -= data.len();
                    f.rcv_nxt += data.len() as u64;
                    self.events
                        .push_back(ReceiverEvent::Data { key, offset, data });
                }
                if let Some(e) = f.ranges.first_entry() {
                    if *e.key() < f.rcv_nxt {
                        e.remove();
                    }
                }
                let rcv_nxt = f.rcv_nxt;
                f.recent.retain(|&o| o >= rcv_nxt);
                if f.rcv_nxt == f.size && !f.complete {
                    f.complete = true;
                    f.stats.completed_at = Some(now);
                    self.stats.flows_completed += 1;
                    self.events.push_back(ReceiverEvent::FlowComplete {
                        key,
                        stats: f.stats.clone(),
                    });
                }
            }
        }

        // An ACK per data datagram, echoing what the router told us about
        // it; one for every second whole in-order datagram (see
        // `ReceiverConfig::delayed_ack`). At once for duplicates (the
        // previous ACK may have been lost) and data out of order or filling
        // a hole (RFC 5681 4.2).
        let rate_echo = if f.kickass {
            RateEcho::observed(rx.leading_fragment_len)
        } else {
            RateEcho::default()
        };
        let delay = self.cfg.delayed_ack.filter(|_| {
            in_order
                && result.is_ok()
                && rx.leading_fragment_len.is_none()
                && !rx.ecn_ce
                && !f.complete
                && f.pending_ack.is_none()
                && f.stats.data_datagrams > self.cfg.quick_acks
        });
        if let Some(d) = delay {
            f.pending_ack = Some(PendingAck {
                due: now.saturating_add(d),
                ts_echo: timestamp,
                rate_echo,
            });
            return result;
        }
        // RFC 7323 4.3: a delayed ACK echoes the earlier timestamp.
        let ts_echo = f
            .pending_ack
            .take()
            .map_or(timestamp, |p| p.ts_echo.min(timestamp));
        let ack = f.ack(key.flow_id, ts_echo, rx.ecn_ce, rate_echo);
        self.queue(key.peer, &Repr::Ack(ack));
        result
    }

    fn on_fin(&mut self, now: Nanos, peer: SocketAddr, fin: &Fin) -> Result<(), RecvError> {
        let key = FlowKey {
            peer,
            flow_id: fin.flow_id,
        };
        let linger = self.cfg.linger;
        let f = self.flows.get_mut(&key).ok_or(RecvError::UnknownFlow)?;
        if !f.complete || fin.final_size != f.size {
            return Err(RecvError::BadFin);
        }
        f.last_activity = now;
        let first = f.linger_until.is_none();
        f.linger_until = Some(now.saturating_add(linger));
        if first {
            self.events.push_back(ReceiverEvent::FlowClosed { key });
        }
        self.queue(peer, &Repr::FinAck(*fin));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_sack_order() {
        let mut f = RecvFlow::new(100, true, vec![], 0);
        f.insert_range(10, 20);
        f.insert_range(30, 40);
        f.insert_range(50, 60);
        f.insert_range(20, 30);
        assert_eq!(
            f.ranges.iter().map(|(a, b)| (*a, *b)).collect::<Vec<_>>(),
            vec![(10, 40), (50, 60)]
        );
        f.insert_range(5, 70);
        assert_eq!(f.ranges.len(), 1);
        f.ranges.clear();
        for (s, e) in [(10, 20), (30, 40), (50, 60), (70, 80), (90, 95)] {
            f.insert_range(s, e);
        }
        f.recent = [30, 70].into_iter().collect();
        assert_eq!(
            f.sack_blocks().as_slice(),
            &[(30, 40), (70, 80), (90, 95), (50, 60)]
        );
    }

    #[test]
    fn gaps_skip_held_bytes() {
        let mut f = RecvFlow::new(100, true, vec![], 0);
        f.chunks.insert(10, vec![0; 10]);
        f.chunks.insert(30, vec![0; 5]);
        assert_eq!(f.gaps(0, 50), vec![(0, 10), (20, 30), (35, 50)]);
        assert_eq!(f.gaps(12, 18), vec![]);
        assert_eq!(f.gaps(15, 32), vec![(20, 30)]);
    }
}
