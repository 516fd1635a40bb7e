//! The edge Kick-Ass router as a pure state machine (boringtun / quinn-proto
//! style): the shell hands in packets and the time, and asks what to send
//! and when to wake up. No sockets, no clocks: everything here runs on
//! simulated time in tests.
//!
//! LAN -> WAN path: arrival -> RTT-indicator sniffing -> drop-tail queue
//! (y counted here, drops included) -> virtual-clock pacer at C -> mode
//! check -> fragmenter (leading fragment = floor8(F(R))) -> out.
//! Every control interval the RCP controller updates R from y, q and d.

use serde::Serialize;

use crate::encoding::{self, bps_to_bytes_per_ms};
use crate::fragment::{self, Pass, Split, Verdict};
use crate::mode::{Mode, ModeSwitch};
use crate::rcp::{Measurement, RateController, Rcp, RcpConfig, RttEstimator};
use crate::rng::SplitMix64;
use crate::shaper::{DropTail, VirtualClock};
use crate::units::Limit;
use crate::wire::ipv4::Packet;
use crate::Nanos;

/// ns-2 RCP: update every min(d, 10 ms).
pub const MAX_DEFAULT_INTERVAL: Nanos = 10_000_000;
/// See `RouterConfig::unmarkable_share`: a few percent of unmarkable bytes
/// is what TCP's ACKs and the endpoints' RTT indicators may add; a TCP flow
/// sending data adds far more.
pub const DEFAULT_UNMARKABLE_SHARE: f64 = 0.05;
/// RCP's spare-capacity gain at the edge router: ns-2's 0.4. Twice that
/// (0.8) halves RCP's climb back after a flow ends, which the bench's heavy
/// load rewards (replayed on simulated time, `ka-transport`
/// `tests/replay.rs`: open-loop heavy 0.90x -> 0.98x the transport's CUBIC,
/// closed loop 1.12x -> 1.13x), but it traps a synchronized start: eight
/// flows that fell to TCP mode in their first RTT saw R climb back to the
/// whole link faster than their slow start (about 2.1x per RTT against
/// 2x), could not reach it (cwnd/SRTT >= R, II-C3), kept the queue up, and
/// stayed in TCP mode for 11 s of 13 (namespaces, `tests/wan/
/// test_trials_netns.py` fair share: time in Kick-Ass mode 0.06-0.08; 0.70-0.76
/// at 0.4, back in 3.4 s). 0.6, whose climb (1.06^10 = 1.79x per RTT at the
/// 10 ms interval) is under slow start's 2x, traps it too: 0.07, 0.15 and
/// 0.25 in three runs, though the replay gains as much (open loop 0.96x,
/// closed 1.13x, queue p99 72 ms against 76): flows that fell to TCP mode on
/// a loss grow by congestion avoidance, not slow start. Ending TCP mode once
/// the traffic has obeyed it (`tcp_mode_markable_share`) frees the router
/// (no TCP-mode sample left in three runs, 30-37% before) but not the flows:
/// time in Kick-Ass mode 0.49 in all three, and R stays at 1.75-2.05x the
/// fair share, which flows in TCP mode filling the link (y = C, no queue)
/// neither reach nor pull down. At 0.4: 0.70-0.79, R at 0.98-1.01x.
pub const DEFAULT_ALPHA: f64 = 0.4;
/// Slots of the router's memory of Kick-Ass flows (`Router::ka_flows`):
/// 8 KiB; two flows share a slot with probability about n/4096.
pub const KA_FLOW_SLOTS: usize = 4096;
/// How long a flow that sent a markable packet stays a Kick-Ass flow: at
/// least four times d, and never under this (a flow in TCP mode sends its
/// one markable probe per smoothed RTT, queueing included).
pub const KA_FLOW_MEMORY_MIN_NS: Nanos = 200_000_000;
/// See `RouterConfig::tcp_mode_hold_rtts` and the note in `mode.rs`.
pub const DEFAULT_TCP_MODE_HOLD_RTTS: f64 = 5.0;
/// See `RouterConfig::tcp_mode_markable_share`: a Kick-Ass endpoint in TCP
/// mode sends one markable segment per RTT (a few percent of its bytes,
/// a quarter at a window of four); traffic that ignores the mode sends
/// nothing else, and only such traffic above capacity keeps the queue up
/// with the Kick-Ass flows squeezed, so it is then the majority.
pub const DEFAULT_TCP_MODE_MARKABLE_SHARE: f64 = 0.5;

/// Kick-Ass router or the plain drop-tail baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RouterKind {
    #[serde(rename = "kickass")]
    KickAss,
    #[serde(rename = "droptail")]
    DropTail,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouterConfig {
    pub kind: RouterKind,
    pub capacity_bps: f64,
    pub buffer: Limit,
    pub alpha: f64,
    pub beta: f64,
    pub initial_rate_bps: f64,
    pub min_rate_bps: f64,
    /// The queue RCP steers to, ms at capacity (0: RCP as published).
    pub target_queue_ms: f64,
    /// Fixed control interval; `None`: min(d, 10 ms), re-evaluated each time.
    pub interval_ns: Option<Nanos>,
    /// d before any RTT indicator is seen.
    pub default_rtt_ms: f64,
    /// EWMA gain of the RTT-indicator average.
    pub rtt_gain: f64,
    /// Enter TCP mode above this buffer fraction...
    pub tcp_mode_on: f64,
    /// ...and leave it below this one.
    pub tcp_mode_off: f64,
    /// ...at once when at least this share of the bytes that arrived over
    /// the last d could never be marked (DF set or not full size, RTT
    /// indicators aside) and came from flows that sent no markable packet
    /// lately (`KA_FLOW_MEMORY_MIN_NS`): traffic that is not Kick-Ass's
    /// own, the paper's rule;
    pub unmarkable_share: f64,
    /// ...else once the queue has stayed above `tcp_mode_on` for this many
    /// average RTTs d: Kick-Ass's own arrivals overshoot for about one
    /// feedback delay and RCP drains what they built. See `mode.rs`.
    pub tcp_mode_hold_rtts: f64,
    /// TCP mode ends, whatever the queue, once the traffic has obeyed it:
    /// under this share of the bytes that arrived over about d/2 could
    /// still be marked (full size, DF clear) and no traffic that is not
    /// Kick-Ass's own is left (`unmarkable_share`). What holds the queue
    /// then are Kick-Ass endpoints in TCP mode (DF on all but one segment
    /// per RTT), which come back only when rates do (II-C3); a markable
    /// flood never obeys and keeps the mode. 0: the queue alone ends it.
    pub tcp_mode_markable_share: f64,
    /// Keep R while in TCP mode; when traffic that is not Kick-Ass's own
    /// started the mode, go back to the R from before it showed. The traffic then is unresponsive by
    /// definition (that is why the mode is on), so y and q say nothing
    /// about the fair share of Kick-Ass flows; updating R from them drives
    /// it to its floor, where the flows would come back when the mode ends.
    pub hold_rate_in_tcp_mode: bool,
    /// How much pacer lateness may be caught up in one burst.
    pub max_burst_ns: Nanos,
    /// Seeds the randomised first control timer.
    pub seed: u64,
}

impl RouterConfig {
    /// Documented defaults (README): ns-2 RCP gains, 100 ms default RTT,
    /// buffer of one bandwidth-delay product at that RTT (>= 30 packets).
    pub fn with_capacity(capacity_bps: f64) -> Self {
        let rcp = RcpConfig::ns2_defaults(capacity_bps);
        let bdp = (capacity_bps / 8.0 * 0.100) as usize;
        RouterConfig {
            kind: RouterKind::KickAss,
            capacity_bps,
            buffer: Limit::Bytes(bdp.max(30 * 1500)),
            alpha: DEFAULT_ALPHA,
            beta: rcp.beta,
            initial_rate_bps: rcp.initial_rate_bps,
            min_rate_bps: rcp.min_rate_bps,
            target_queue_ms: 0.0,
            interval_ns: None,
            default_rtt_ms: 100.0,
            rtt_gain: 0.1,
            tcp_mode_on: 0.5,
            tcp_mode_off: 0.4,
            unmarkable_share: DEFAULT_UNMARKABLE_SHARE,
            tcp_mode_hold_rtts: DEFAULT_TCP_MODE_HOLD_RTTS,
            tcp_mode_markable_share: DEFAULT_TCP_MODE_MARKABLE_SHARE,
            hold_rate_in_tcp_mode: true,
            max_burst_ns: 1_000_000,
            seed: 0x6b69_636b_6173_7321,
        }
    }
}

/// Cumulative counters since start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    pub arrived_packets: u64,
    pub arrived_bytes: u64,
    pub drops: u64,
    pub dropped_bytes: u64,
    /// Packets that left (a cut packet counts once).
    pub forwarded_packets: u64,
    /// IP bytes that left (both pieces of a cut packet).
    pub forwarded_bytes: u64,
    /// Packets cut into a leading fragment of the advertised length.
    pub fragmented: u64,
    pub rtt_indicators: u64,
}

/// One telemetry record per control interval (an NDJSON line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Seconds since the router started.
    pub t: f64,
    pub advertised_rate_bps: f64,
    /// Leading fragment IP payload length in force; null when not fragmenting.
    pub leading_fragment_len: Option<usize>,
    /// y over the interval that just ended, in wire bytes (a packet the
    /// router cuts counts its second header).
    pub input_rate_bps: f64,
    /// Bytes that left during the interval, as a rate.
    pub output_rate_bps: f64,
    pub queue_bytes: usize,
    pub queue_packets: usize,
    /// Kick-Ass marking or TCP mode (paper section III); "droptail" for the baseline.
    pub marking_mode: &'static str,
    /// d, the average of the RTT indicators (or the default).
    pub rtt_ms: f64,
    /// The share of the arriving bytes no router could mark (DF set, not
    /// full size; RTT indicators aside) from flows that sent no markable
    /// packet lately, averaged over about d: traffic that is not Kick-Ass's
    /// own.
    pub unmarkable_share: f64,
    /// The share of the arriving bytes the router could mark (full size,
    /// DF clear), averaged over about d/2: in TCP mode, the traffic that
    /// ignores it.
    pub markable_share: f64,
    pub interval_ms: f64,
    pub mode_switches: u64,
    #[serde(flatten)]
    pub counters: Counters,
}

/// A packet ready to leave now.
#[derive(Debug)]
pub struct Transmit {
    pub packet: Vec<u8>,
    /// `Some`: send the two pieces instead of `packet`.
    pub split: Option<Split>,
}

pub struct Router {
    cfg: RouterConfig,
    queue: DropTail<Vec<u8>>,
    pacer: VirtualClock,
    rcp: Rcp,
    rtt: RttEstimator,
    mode: ModeSwitch,
    start: Nanos,
    last_control: Nanos,
    next_control: Nanos,
    interval_arrived: u64,
    /// Bytes this interval that no router could mark (DF set, not full
    /// size), RTT indicators aside.
    interval_unmarkable: u64,
    /// Their share of the arrivals, averaged over about d.
    unmarkable: f64,
    /// Bytes this interval that a router could mark (full size, DF clear).
    interval_markable: u64,
    /// Their share, averaged the same way.
    markable: f64,
    /// R before the current unresponsive episode (unmarkable traffic seen,
    /// or the queue above `tcp_mode_on`) began: TCP mode goes back to it.
    rate_before_episode: Option<f64>,
    /// TCP mode is on because of traffic that is not Kick-Ass's own.
    tcp_for_unmarkable: bool,
    /// Since when the queue has been below `tcp_mode_off` in such a TCP mode.
    below_since: Option<Nanos>,
    /// When each flow (a hash of addresses, protocol and ports) last sent a
    /// packet the router could mark, plus one (0: never). A Kick-Ass
    /// endpoint in TCP mode sets DF on all but one segment per RTT (so
    /// that a legacy bottleneck further on sees whole packets); without
    /// this memory its own segments would read as traffic that is not
    /// Kick-Ass's and hold the router in TCP mode for good.
    ka_flows: Vec<Nanos>,
    interval_sent: u64,
    leading_fragment_len: Option<usize>,
    counters: Counters,
}

/// The slot of a packet's flow in `Router::ka_flows`: addresses, protocol
/// and, for TCP and UDP, the ports. `None` for a non-leading fragment (its
/// ports are not in it).
fn flow_slot(p: &Packet<&[u8]>) -> Option<usize> {
    if p.frag_offset() > 0 {
        return None;
    }
    let payload = p.payload();
    let ports = match p.protocol() {
        6 | 17 if payload.len() >= 4 => {
            u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
        }
        _ => 0,
    };
    let key = (u64::from(u32::from(p.src_addr())) << 32 | u64::from(u32::from(p.dst_addr())))
        ^ (u64::from(ports)).rotate_left(17)
        ^ u64::from(p.protocol()) << 56;
    Some((SplitMix64::new(key).next_u64() % KA_FLOW_SLOTS as u64) as usize)
}

impl Router {
    pub fn new(cfg: RouterConfig, now: Nanos) -> Self {
        let rcp = Rcp::new(RcpConfig {
            capacity_bps: cfg.capacity_bps,
            alpha: cfg.alpha,
            beta: cfg.beta,
            initial_rate_bps: cfg.initial_rate_bps,
            min_rate_bps: cfg.min_rate_bps,
            target_queue_s: cfg.target_queue_ms / 1e3,
        });
        let rtt = RttEstimator::new(cfg.default_rtt_ms, cfg.rtt_gain);
        let mut r = Router {
            queue: DropTail::new(cfg.buffer),
            pacer: VirtualClock::new(cfg.capacity_bps, cfg.max_burst_ns),
            rcp,
            rtt,
            mode: ModeSwitch::new(cfg.tcp_mode_on, cfg.tcp_mode_off),
            start: now,
            last_control: now,
            next_control: now,
            interval_arrived: 0,
            interval_unmarkable: 0,
            unmarkable: 0.0,
            interval_markable: 0,
            markable: 0.0,
            rate_before_episode: None,
            tcp_for_unmarkable: false,
            below_since: None,
            ka_flows: vec![0; KA_FLOW_SLOTS],
            interval_sent: 0,
            leading_fragment_len: None,
            counters: Counters::default(),
            cfg,
        };
        // First timer randomised within one interval so routers started
        // together do not update in lock-step (ns-2 RCP does the same).
        let mut rng = SplitMix64::new(r.cfg.seed);
        r.next_control = now + (rng.next_f64() * r.interval() as f64) as Nanos;
        r.refresh_leading_fragment_len();
        r
    }

    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Current control interval T.
    pub fn interval(&self) -> Nanos {
        self.cfg.interval_ns.unwrap_or_else(|| {
            let d = (self.rtt.rtt_ms() * 1e6) as Nanos;
            d.clamp(100_000, MAX_DEFAULT_INTERVAL)
        })
    }

    pub fn advertised_rate_bps(&self) -> f64 {
        self.rcp.rate_bps()
    }

    pub fn leading_fragment_len(&self) -> Option<usize> {
        self.leading_fragment_len
    }

    pub fn rtt_ms(&self) -> f64 {
        self.rtt.rtt_ms()
    }

    pub fn mode(&self) -> Mode {
        match self.cfg.kind {
            RouterKind::DropTail => Mode::DropTail,
            RouterKind::KickAss if self.mode.tcp() => Mode::Tcp,
            RouterKind::KickAss => Mode::KickAss,
        }
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn queue_bytes(&self) -> usize {
        self.queue.bytes()
    }

    pub fn queue_packets(&self) -> usize {
        self.queue.len()
    }

    fn refresh_leading_fragment_len(&mut self) {
        self.leading_fragment_len =
            encoding::leading_fragment_len(bps_to_bytes_per_ms(self.rcp.rate_bps()));
    }

    /// The bytes `packet` of IP length `len` will take on the link: a
    /// packet the router will cut carries a second IP header (as long as
    /// its own: 1520 bytes for a full-size packet). RCP's input y, the queue and the
    /// link's pacer all count these, so the rate is computed against the
    /// capacity the link really has.
    fn wire_len(&self, packet: &[u8], len: usize) -> usize {
        let marking = match self.cfg.kind {
            RouterKind::KickAss if !self.mode.tcp() => self.leading_fragment_len,
            _ => None,
        };
        match fragment::classify(packet, marking) {
            Verdict::Cut { .. } => len + Packet::new_checked(packet).map_or(0, |p| p.header_len()),
            Verdict::Pass(_) => len,
        }
    }

    /// A LAN -> WAN packet arrived. `Err` hands the buffer back: dropped
    /// (queue full), so the shell can reuse it.
    pub fn on_packet(&mut self, now: Nanos, packet: Vec<u8>) -> Result<(), Vec<u8>> {
        let len = match Packet::new_checked(&packet[..]) {
            Ok(p) => {
                let len = p.total_len() as usize;
                if encoding::is_rtt_indicator(len, p.dont_frag()) {
                    if let Some(ms) = encoding::rtt_indicator_midpoint_ms(len) {
                        self.rtt.on_sample(ms);
                        self.counters.rtt_indicators += 1;
                    }
                } else {
                    let slot = flow_slot(&p);
                    match fragment::classify(&packet, Some(encoding::MIN_LEADING_FRAGMENT_LEN)) {
                        Verdict::Cut { .. } => {
                            self.interval_markable += len as u64;
                            if let Some(i) = slot {
                                self.ka_flows[i] = now.saturating_add(1);
                            }
                        }
                        Verdict::Pass(Pass::DontFragment | Pass::NotFullSize)
                            if !slot.is_some_and(|i| self.recently_markable(now, i)) =>
                        {
                            self.interval_unmarkable += len as u64;
                        }
                        Verdict::Pass(_) => {}
                    }
                }
                len
            }
            // Not IPv4 we can read: still forwarded, and still load.
            Err(_) => {
                self.interval_unmarkable += packet.len() as u64;
                packet.len()
            }
        };
        let wire = self.wire_len(&packet, len);
        self.counters.arrived_packets += 1;
        self.counters.arrived_bytes += len as u64;
        self.interval_arrived += wire as u64;
        let was_idle = self.queue.is_empty();
        match self.queue.push(packet, wire) {
            Ok(()) => {
                if was_idle {
                    self.pacer.on_arrival_to_idle(now);
                }
                self.update_mode(now);
                Ok(())
            }
            Err(p) => {
                self.counters.drops += 1;
                self.counters.dropped_bytes += len as u64;
                Err(p)
            }
        }
    }

    fn update_mode(&mut self, now: Nanos) -> bool {
        let unmarkable = self.unmarkable >= self.cfg.unmarkable_share;
        let occupancy = self.queue.occupancy();
        // An episode begins when traffic that is not Kick-Ass's own shows,
        // or the queue crosses the threshold: remember R from before it.
        if unmarkable || occupancy > self.cfg.tcp_mode_on || self.mode.tcp() {
            self.rate_before_episode.get_or_insert(self.rcp.rate_bps());
        } else {
            self.rate_before_episode = None;
        }
        let was_tcp = self.mode.tcp();
        let hold_ns = (self.cfg.tcp_mode_hold_rtts * self.rtt.rtt_ms() * 1e6) as Nanos;
        let hold = if unmarkable { 0 } else { hold_ns };
        if was_tcp && self.tcp_for_unmarkable && unmarkable && occupancy < self.cfg.tcp_mode_off {
            // Traffic that no router could mark still here, the queue low:
            // a dip of TCP's own sawtooth (it refills within an RTT or two)
            // or the end of the congestion. Wait two RTTs to tell them
            // apart. (The traffic may be Kick-Ass endpoints' own, in TCP
            // mode: they set DF on all but one segment per RTT.)
            let since = *self.below_since.get_or_insert(now);
            if now.saturating_sub(since) < 2 * (self.rtt.rtt_ms() * 1e6) as Nanos {
                return true;
            }
        } else {
            self.below_since = None;
        }
        let mut tcp = self.mode.update(now, occupancy, hold);
        if tcp && was_tcp && !unmarkable && self.markable < self.cfg.tcp_mode_markable_share {
            // No traffic that is not Kick-Ass's own, and what arrives has
            // obeyed the mode: Kick-Ass endpoints in TCP mode hold the
            // queue, and they come back only when rates do. (Whatever
            // started the mode: traffic that was not Kick-Ass's and has
            // gone, or Kick-Ass's own overshoot held past the hold.)
            tcp = self.mode.leave();
        }
        if !tcp {
            self.below_since = None;
        }
        if tcp && !was_tcp {
            self.tcp_for_unmarkable = unmarkable;
            // Traffic that is not Kick-Ass's own pushed R down before the
            // mode started: the Kick-Ass flows' share is what it was before.
            // (Kick-Ass's own overshoot held past the hold: R is what RCP
            // made of it, kept from here on.)
            if self.cfg.hold_rate_in_tcp_mode && unmarkable {
                if let Some(r) = self.rate_before_episode {
                    self.rcp.set_rate_bps(r);
                    self.refresh_leading_fragment_len();
                }
            }
        }
        tcp
    }

    fn recently_markable(&self, now: Nanos, slot: usize) -> bool {
        let seen = self.ka_flows[slot];
        let memory = ((4.0 * self.rtt.rtt_ms() * 1e6) as Nanos).max(KA_FLOW_MEMORY_MIN_NS);
        seen != 0 && now.saturating_sub(seen - 1) <= memory
    }

    /// The share of the arrivals no router could mark, averaged over about d.
    pub fn unmarkable_share(&self) -> f64 {
        self.unmarkable
    }

    /// The next packet allowed to leave at `now`, fragmented as it must be.
    pub fn poll_transmit(&mut self, now: Nanos) -> Option<Transmit> {
        if self.queue.is_empty() || !self.pacer.ready(now) {
            return None;
        }
        let (packet, _len) = self.queue.pop()?;
        let tcp = self.update_mode(now);
        let marking = match self.cfg.kind {
            RouterKind::KickAss if !tcp => self.leading_fragment_len,
            _ => None,
        };
        let split = match fragment::classify(&packet, marking) {
            Verdict::Cut {
                leading_fragment_len,
            } => fragment::split(&packet, leading_fragment_len).ok(),
            Verdict::Pass(_) => None,
        };
        let wire = match &split {
            Some(s) => s.wire_len(),
            None => Packet::new_checked(&packet[..])
                .map(|p| p.total_len() as usize)
                .unwrap_or(packet.len()),
        };
        if split.is_some() {
            self.counters.fragmented += 1;
        }
        // The link carries what actually leaves, fragment headers included.
        self.pacer.on_departure(now, wire);
        self.counters.forwarded_packets += 1;
        self.counters.forwarded_bytes += wire as u64;
        self.interval_sent += wire as u64;
        Some(Transmit { packet, split })
    }

    /// When to call back: the next departure (if anything is queued) or the
    /// next control interval, whichever is first.
    pub fn poll_timeout(&self) -> Nanos {
        if self.queue.is_empty() {
            self.next_control
        } else {
            self.next_control.min(self.pacer.next_tx())
        }
    }

    /// Run the control loop if its time has come; returns the telemetry
    /// record of the interval that ended.
    pub fn handle_timeout(&mut self, now: Nanos) -> Option<Sample> {
        if now < self.next_control {
            return None;
        }
        let elapsed = now.saturating_sub(self.last_control).max(1);
        let interval_s = elapsed as f64 / 1e9;
        let m = Measurement {
            interval_s,
            arrived_bytes: self.interval_arrived,
            queue_bytes: self.queue.bytes(),
            rtt_s: self.rtt.rtt_ms() / 1e3,
        };
        if !(self.cfg.hold_rate_in_tcp_mode && self.mode.tcp()) {
            self.rcp.on_interval(&m);
        }
        // The unmarkable share, an average over about half of d (gain
        // 2T/d): long enough to ignore a stray packet, short enough that
        // TCP mode ends within a few RTTs of the traffic that caused it.
        let gain = (2.0 * interval_s / m.rtt_s.max(1e-6)).min(1.0);
        let arrived = self.interval_arrived;
        let share = |part: &mut u64| {
            let s = if arrived > 0 {
                (*part as f64 / arrived as f64).min(1.0)
            } else {
                0.0
            };
            *part = 0;
            s
        };
        self.unmarkable += gain * (share(&mut self.interval_unmarkable) - self.unmarkable);
        self.markable += gain * (share(&mut self.interval_markable) - self.markable);
        self.refresh_leading_fragment_len();
        let input = self.interval_arrived as f64 * 8.0 / interval_s;
        let output = self.interval_sent as f64 * 8.0 / interval_s;
        self.interval_arrived = 0;
        self.interval_sent = 0;
        self.last_control = now;
        let interval = self.interval();
        // Keep the grid if we are only slightly late; resync if far behind.
        self.next_control = (self.next_control + interval).max(now + interval / 2);
        let mode = self.mode();
        let leading = match mode {
            Mode::KickAss => self.leading_fragment_len,
            _ => None,
        };
        Some(Sample {
            kind: "sample",
            t: now.saturating_sub(self.start) as f64 / 1e9,
            advertised_rate_bps: self.rcp.rate_bps(),
            leading_fragment_len: leading,
            input_rate_bps: input,
            output_rate_bps: output,
            queue_bytes: self.queue.bytes(),
            queue_packets: self.queue.len(),
            marking_mode: mode.as_str(),
            rtt_ms: self.rtt.rtt_ms(),
            unmarkable_share: self.unmarkable,
            markable_share: self.markable,
            interval_ms: interval_s * 1e3,
            mode_switches: self.mode.switches(),
            counters: self.counters.clone(),
        })
    }

    /// Take the next queued packet regardless of pacing (drain on exit).
    pub fn pop_any(&mut self) -> Option<Vec<u8>> {
        self.queue.pop().map(|(p, _)| p)
    }
}

#[cfg(test)]
mod tests;
