//! A simulated path for the transport, on simulated time (no sockets, no
//! sleeps): senders -> [random loss] -> bottleneck (drop-tail queue served
//! at a fixed rate, or the real `ka_core::router::Router` with RCP) ->
//! propagation delay [+ reordering, duplication] -> receiver, and a plain
//! delayed (optionally lossy) reverse path.
//!
//! Forward datagrams travel as real IPv4 packets (ka-core's `ipv4::Repr`
//! plus a UDP header). A "router" marks them with ka-core's own fragmenter
//! (`fragment::classify` + `split` at `encoding::leading_fragment_len(rate)`);
//! at the receiver the harness does what the AF_PACKET shell will do: read
//! the leading fragment's payload length before reassembly, reassemble
//! (`fragment::reassemble`), and hand the UDP payload to the receiver core
//! with that `leading_fragment_len`.

#![allow(dead_code)]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use ka_core::encoding;
use ka_core::fragment::{self, Verdict};
use ka_core::rng::SplitMix64;
use ka_core::router::Router;
use ka_core::wire::ipv4::{Packet as Ipv4Packet, Repr as Ipv4Repr};
use ka_core::Nanos;
use ka_transport::{
    pattern_byte, Config, Connection, Event, FlowRecord, Payload, Receiver, ReceiverConfig,
    ReceiverEvent, ReceiverStats, RttIndicatorClock, RxInfo, TokenRequest, TokenValidator,
};

pub const MS: Nanos = 1_000_000;
pub const SEC: Nanos = 1_000_000_000;
pub const TOKEN: &[u8] = b"trial-token-42";
const SENDER_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
const RECEIVER_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
const RECEIVER_PORT: u16 = 9000;

/// Accepts exactly one token.
pub struct TokenIs(pub Vec<u8>);

impl TokenValidator for TokenIs {
    fn validate(&mut self, r: &TokenRequest<'_>) -> bool {
        r.token == self.0.as_slice()
    }
}

/// The router `ka-router` runs with by default at this capacity, with
/// `KA_REPLAY_ROUTER` overrides (`alpha=0.1,beta=1,hold=3,hold_rate=1`) for
/// trying a change on the simulated path without rebuilding.
pub fn router_config(
    capacity_bps: f64,
    kind: ka_core::router::RouterKind,
) -> ka_core::router::RouterConfig {
    let mut rc = ka_core::router::RouterConfig {
        kind,
        ..ka_core::router::RouterConfig::with_capacity(capacity_bps)
    };
    for kv in std::env::var("KA_REPLAY_ROUTER")
        .unwrap_or_default()
        .split(',')
    {
        let Some((k, v)) = kv.split_once('=') else {
            continue;
        };
        let x: f64 = v.parse().expect("a number");
        match k {
            "alpha" => rc.alpha = x,
            "beta" => rc.beta = x,
            "hold" => rc.tcp_mode_hold_rtts = x,
            "hold_rate" => rc.hold_rate_in_tcp_mode = x != 0.0,
            "on" => rc.tcp_mode_on = x,
            "off" => rc.tcp_mode_off = x,
            "buffer" => rc.buffer = ka_core::units::Limit::Bytes(x as usize),
            "target" => rc.target_queue_ms = x,
            "markable" => rc.tcp_mode_markable_share = x,
            _ => panic!("KA_REPLAY_ROUTER: unknown {k}"),
        }
    }
    rc
}

/// Advertised rate (bytes/ms) the simulated router marks with at time t.
pub type RateSchedule = Box<dyn FnMut(Nanos) -> Option<f64>>;
/// Whether a forward packet gets ECN CE at time t.
pub type CeSchedule = Box<dyn FnMut(Nanos) -> bool>;

pub enum Bottleneck {
    /// Drop-tail FIFO of `queue_packets` served at `rate_bps`, marking with
    /// the schedule's rate (if any) as packets leave.
    DropTail {
        rate_bps: f64,
        queue_packets: usize,
        marker: Option<RateSchedule>,
    },
    /// The real edge router core (RCP, TCP-mode hysteresis, its pacer).
    KaRouter(Box<Router>),
}

pub struct PathConfig {
    pub bottleneck: Bottleneck,
    /// One-way propagation delay, each direction.
    pub delay: Nanos,
    pub loss: f64,
    pub reverse_loss: f64,
    /// Probability a forward datagram is held back by `reorder_extra`.
    pub reorder: f64,
    pub reorder_extra: Nanos,
    pub duplicate: f64,
    pub ce: Option<CeSchedule>,
    pub seed: u64,
}

impl PathConfig {
    /// A clean drop-tail path: `rate_bps`, RTT `rtt`, BDP-sized queue.
    pub fn droptail(rate_bps: f64, rtt: Nanos) -> Self {
        let bdp_packets = (rate_bps / 8.0 * (rtt as f64 / 1e9) / 1500.0).ceil() as usize;
        PathConfig {
            bottleneck: Bottleneck::DropTail {
                rate_bps,
                queue_packets: bdp_packets.max(20),
                marker: None,
            },
            delay: rtt / 2,
            loss: 0.0,
            reverse_loss: 0.0,
            reorder: 0.0,
            reorder_extra: 0,
            duplicate: 0.0,
            ce: None,
            seed: 1,
        }
    }

    /// Mark every eligible packet with the rate `rate_bps` (bits/s).
    pub fn with_fixed_rate(mut self, rate_bps: f64) -> Self {
        let r = encoding::bps_to_bytes_per_ms(rate_bps);
        self.set_marker(Box::new(move |_| Some(r)));
        self
    }

    pub fn set_marker(&mut self, m: RateSchedule) {
        if let Bottleneck::DropTail { marker, .. } = &mut self.bottleneck {
            *marker = Some(m);
        }
    }
}

/// One flow to run.
pub struct FlowSpec {
    pub cfg: Config,
    pub size: u64,
    /// Open loop: when it starts.
    pub start: Nanos,
    /// Closed loop (paper III-B's on-off senders): starts this long after
    /// flow `.0` ended (completed, failed or cut), instead of at `start`.
    pub after: Option<(usize, Nanos)>,
    /// The sending endpoint: flows of one endpoint share its RTT indicator
    /// clock (paper II-B), as the flows of one `ka-send` do.
    pub endpoint: usize,
    /// Cut (not completed) at this time, as a trial period's deadline cuts
    /// a flow.
    pub deadline: Option<Nanos>,
    /// A closed-loop flow whose start would come later never starts (the
    /// period ended first), nor do the flows after it.
    pub not_after: Option<Nanos>,
    pub token: Vec<u8>,
}

impl FlowSpec {
    pub fn new(cfg: Config, size: u64) -> Self {
        FlowSpec {
            cfg,
            size,
            start: 0,
            after: None,
            endpoint: 0,
            deadline: None,
            not_after: None,
            token: TOKEN.to_vec(),
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct PathStats {
    pub forward_datagrams: u64,
    pub random_losses: u64,
    pub queue_drops: u64,
    pub reverse_losses: u64,
    pub duplicated: u64,
    pub reordered: u64,
    /// Datagrams that arrived as two fragments.
    pub fragmented: u64,
    /// IP lengths of RTT indicators that crossed the path.
    pub rtt_indicator_lens: Vec<usize>,
    /// IP bytes each sender put on the path, and how many of them were
    /// DATA payload (the wire cost of a flow: ratio of the two).
    pub forward_ip_bytes: u64,
    /// Leading fragment lengths seen at the receiver.
    pub leading_fragment_lens: Vec<u16>,
    pub max_queue: usize,
}

pub struct FlowOutcome {
    pub record: FlowRecord,
    pub events: Vec<Event>,
    pub delivered: u64,
    pub closed_at: Option<Nanos>,
    /// When the flow was created (its start, or its closed-loop start).
    pub started_at: Option<Nanos>,
    /// Stopped by its deadline before completing.
    pub cut: bool,
}

pub struct Outcome {
    pub flows: Vec<FlowOutcome>,
    pub path: PathStats,
    pub receiver: ReceiverStats,
    pub end: Nanos,
    /// Router telemetry of the KaRouter bottleneck, one per control interval.
    pub router_samples: Vec<ka_core::router::Sample>,
    /// With `Sim::log_deliveries`: (time, flow, bytes) as the receiver
    /// delivered them in order (per-flow throughput over time).
    pub deliveries: Vec<(Nanos, usize, u64)>,
}

enum Ev {
    /// IP packet(s) of one datagram reaching the receiver host.
    Forward {
        flow: usize,
        pieces: Vec<Vec<u8>>,
    },
    Reverse {
        flow: usize,
        bytes: Vec<u8>,
    },
}

struct Queued {
    at: Nanos,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

pub struct Sim {
    now: Nanos,
    path: PathConfig,
    rng: SplitMix64,
    heap: BinaryHeap<Reverse<Queued>>,
    seq: u64,
    link_free_at: Nanos,
    in_queue: std::collections::VecDeque<Nanos>,
    conns: Vec<Option<Connection>>,
    specs: Vec<FlowSpec>,
    events: Vec<Vec<Event>>,
    closed_at: Vec<Option<Nanos>>,
    started_at: Vec<Option<Nanos>>,
    cut: Vec<bool>,
    delivered: Vec<u64>,
    /// Flows started and not closed, in start order.
    active: Vec<usize>,
    /// Open-loop flows not started yet, latest start first.
    pending: Vec<usize>,
    /// Closed-loop flows waiting for their predecessor: (predecessor, flow).
    waiting: Vec<(usize, usize)>,
    /// Closed-loop flows whose start time is known, not started yet.
    scheduled: Vec<(Nanos, usize)>,
    clocks: Vec<RttIndicatorClock>,
    recv: Receiver<TokenIs>,
    ip_ident: u16,
    stats: PathStats,
    router_samples: Vec<ka_core::router::Sample>,
    deliveries: Option<Vec<(Nanos, usize, u64)>>,
}

fn sender_addr(flow: usize) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(SENDER_IP, 5000 + flow as u16))
}

impl Sim {
    pub fn new(path: PathConfig, flows: Vec<FlowSpec>) -> Self {
        Self::with_receiver(path, flows, ReceiverConfig::default())
    }

    pub fn with_receiver(path: PathConfig, flows: Vec<FlowSpec>, rcfg: ReceiverConfig) -> Self {
        let n = flows.len();
        let mut pending: Vec<usize> = (0..n).filter(|&i| flows[i].after.is_none()).collect();
        pending.sort_by_key(|&i| std::cmp::Reverse((flows[i].start, i)));
        let waiting = (0..n)
            .filter_map(|i| flows[i].after.map(|(p, _)| (p, i)))
            .collect();
        let endpoints = flows.iter().map(|f| f.endpoint + 1).max().unwrap_or(0);
        Sim {
            now: 0,
            rng: SplitMix64::new(path.seed),
            path,
            heap: BinaryHeap::new(),
            seq: 0,
            link_free_at: 0,
            in_queue: Default::default(),
            conns: (0..n).map(|_| None).collect(),
            specs: flows,
            events: vec![Vec::new(); n],
            closed_at: vec![None; n],
            started_at: vec![None; n],
            cut: vec![false; n],
            delivered: vec![0; n],
            active: Vec::new(),
            pending,
            waiting,
            scheduled: Vec::new(),
            clocks: vec![RttIndicatorClock::default(); endpoints],
            recv: Receiver::new(rcfg, TokenIs(TOKEN.to_vec())),
            ip_ident: 1,
            stats: PathStats::default(),
            router_samples: Vec::new(),
            deliveries: None,
        }
    }

    /// Keep every in-order delivery with its time (per-flow throughput).
    pub fn log_deliveries(mut self) -> Self {
        self.deliveries = Some(Vec::new());
        self
    }

    fn push(&mut self, at: Nanos, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse(Queued {
            at,
            seq: self.seq,
            ev,
        }));
    }

    fn flow_id(i: usize) -> u64 {
        0x6b61_0000_0000_0000 | i as u64
    }

    /// Wrap a UDP payload into an IPv4 packet as the sender host would.
    fn ip_packet(&mut self, flow: usize, payload: &[u8], df: bool) -> Vec<u8> {
        let mut udp = Vec::with_capacity(8 + payload.len());
        udp.extend_from_slice(&(5000 + flow as u16).to_be_bytes());
        udp.extend_from_slice(&RECEIVER_PORT.to_be_bytes());
        udp.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(payload);
        self.ip_ident = self.ip_ident.wrapping_add(1);
        Ipv4Repr {
            src_addr: SENDER_IP,
            dst_addr: RECEIVER_IP,
            protocol: 17,
            ttl: 64,
            tos: 0,
            ident: self.ip_ident,
            dont_frag: df,
            more_frags: false,
            frag_offset: 0,
            options: vec![],
            payload_len: udp.len(),
        }
        .to_bytes(&udp)
    }

    /// A datagram leaves a sender.
    fn forward(&mut self, flow: usize, payload: &[u8], df: bool) {
        self.stats.forward_datagrams += 1;
        let ip = self.ip_packet(flow, payload, df);
        self.stats.forward_ip_bytes += ip.len() as u64;
        if encoding::is_rtt_indicator(ip.len(), df) {
            self.stats.rtt_indicator_lens.push(ip.len());
        }
        if self.rng.next_f64() < self.path.loss {
            self.stats.random_losses += 1;
            return;
        }
        let now = self.now;
        match &mut self.path.bottleneck {
            Bottleneck::DropTail {
                rate_bps,
                queue_packets,
                marker,
            } => {
                while self.in_queue.front().is_some_and(|&d| d <= now) {
                    self.in_queue.pop_front();
                }
                if self.in_queue.len() >= *queue_packets {
                    self.stats.queue_drops += 1;
                    return;
                }
                let rate = *rate_bps;
                // Marking as the packet is dequeued (the paper's qdisc).
                let start = now.max(self.link_free_at);
                let l = marker
                    .as_mut()
                    .and_then(|m| m(start))
                    .and_then(encoding::leading_fragment_len);
                let pieces = match fragment::classify(&ip, l) {
                    Verdict::Cut {
                        leading_fragment_len,
                    } => {
                        let s = fragment::split(&ip, leading_fragment_len).expect("cut");
                        s.to_packets(&ip).to_vec()
                    }
                    Verdict::Pass(_) => vec![ip],
                };
                let wire: usize = pieces.iter().map(|p| p.len()).sum();
                let dep = start + (wire as f64 * 8.0 / rate * 1e9).round() as Nanos;
                self.link_free_at = dep;
                self.in_queue.push_back(dep);
                self.stats.max_queue = self.stats.max_queue.max(self.in_queue.len());
                self.propagate(flow, dep, pieces);
            }
            Bottleneck::KaRouter(r) => {
                if r.on_packet(now, ip).is_err() {
                    self.stats.queue_drops += 1;
                }
            }
        }
    }

    /// Propagation, reordering, duplication after the bottleneck.
    fn propagate(&mut self, flow: usize, departed: Nanos, pieces: Vec<Vec<u8>>) {
        let mut at = departed + self.path.delay;
        if self.path.reorder > 0.0 && self.rng.next_f64() < self.path.reorder {
            self.stats.reordered += 1;
            at += self.path.reorder_extra;
        }
        if self.path.duplicate > 0.0 && self.rng.next_f64() < self.path.duplicate {
            self.stats.duplicated += 1;
            let copy = pieces.clone();
            self.push(at + 3 * MS, Ev::Forward { flow, pieces: copy });
        }
        self.push(at, Ev::Forward { flow, pieces });
    }

    fn router_step(&mut self) {
        let now = self.now;
        let mut out = Vec::new();
        if let Bottleneck::KaRouter(r) = &mut self.path.bottleneck {
            if let Some(s) = r.handle_timeout(now) {
                self.router_samples.push(s);
            }
            while let Some(t) = r.poll_transmit(now) {
                let pieces = match &t.split {
                    Some(s) => s.to_packets(&t.packet).to_vec(),
                    None => vec![t.packet],
                };
                out.push(pieces);
            }
        }
        for pieces in out {
            let flow = flow_of(&pieces[0]);
            self.propagate(flow, now, pieces);
        }
    }

    fn router_timeout(&self) -> Option<Nanos> {
        match &self.path.bottleneck {
            Bottleneck::KaRouter(r) => Some(r.poll_timeout()),
            _ => None,
        }
    }

    /// What the receiver host does: AF_PACKET sees the leading fragment's
    /// length, the kernel reassembles, the socket gets the UDP payload.
    fn deliver_forward(&mut self, flow: usize, pieces: Vec<Vec<u8>>) {
        let (ip, lfl) = if pieces.len() == 1 {
            (pieces.into_iter().next().expect("one"), None)
        } else {
            let lead = Ipv4Packet::new_checked(&pieces[0][..]).expect("ipv4");
            assert_eq!(lead.frag_offset(), 0);
            let l = lead.payload_len() as u16;
            let whole = fragment::reassemble(&pieces).expect("reassembles");
            self.stats.fragmented += 1;
            self.stats.leading_fragment_lens.push(l);
            (whole, Some(l))
        };
        let p = Ipv4Packet::new_checked(&ip[..]).expect("ipv4");
        let udp = p.payload();
        let datagram = &udp[8..];
        let ce = match &mut self.path.ce {
            Some(f) => f(self.now),
            None => false,
        };
        let rx = RxInfo {
            leading_fragment_len: lfl,
            ecn_ce: ce,
        };
        let _ = self
            .recv
            .handle_datagram(self.now, sender_addr(flow), datagram, rx);
    }

    fn end_flow(&mut self, i: usize) {
        self.closed_at[i] = Some(self.now);
        self.active.retain(|&a| a != i);
        let waiting = std::mem::take(&mut self.waiting);
        for (p, f) in waiting {
            if p == i {
                let off = self.specs[f].after.expect("closed loop").1;
                self.scheduled.push((self.now + off, f));
            } else {
                self.waiting.push((p, f));
            }
        }
    }

    fn drain_outputs(&mut self) {
        let mut buf = Vec::new();
        loop {
            let mut progressed = false;
            // Each endpoint's RTT indicator, carried by one of its flows.
            for e in 0..self.clocks.len() {
                if !self.clocks[e].is_due(self.now) {
                    continue;
                }
                let mine: Vec<usize> = self
                    .active
                    .iter()
                    .copied()
                    .filter(|&i| self.specs[i].endpoint == e)
                    .collect();
                let mut conns: Vec<(usize, &mut Connection)> = self
                    .conns
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, c)| c.is_some() && mine.contains(i))
                    .map(|(i, c)| (i, c.as_mut().expect("some")))
                    .collect();
                let (idx, refs): (Vec<usize>, Vec<&mut Connection>) = conns.drain(..).unzip();
                if let Some((k, t)) = self.clocks[e].poll(self.now, refs, &mut buf) {
                    progressed = true;
                    let bytes = buf[..t.len].to_vec();
                    self.forward(idx[k], &bytes, t.dont_fragment);
                }
            }
            for k in 0..self.active.len() {
                let Some(&i) = self.active.get(k) else {
                    break;
                };
                while let Some(t) = self.conns[i]
                    .as_mut()
                    .and_then(|c| c.poll_transmit(self.now, &mut buf))
                {
                    progressed = true;
                    let bytes = buf[..t.len].to_vec();
                    self.forward(i, &bytes, t.dont_fragment);
                }
            }
            let mut ended = Vec::new();
            for &i in &self.active {
                if let Some(c) = self.conns[i].as_mut() {
                    while let Some(e) = c.poll_event() {
                        if matches!(e, Event::Closed | Event::Failed(_)) {
                            ended.push(i);
                        }
                        self.events[i].push(e);
                    }
                }
            }
            for i in ended {
                self.end_flow(i);
            }
            while let Some(t) = self.recv.poll_transmit(&mut buf) {
                progressed = true;
                let flow = (match t.dst {
                    SocketAddr::V4(a) => a.port(),
                    SocketAddr::V6(a) => a.port(),
                } - 5000) as usize;
                if self.rng.next_f64() < self.path.reverse_loss {
                    self.stats.reverse_losses += 1;
                    continue;
                }
                let bytes = buf[..t.len].to_vec();
                let at = self.now + self.path.delay;
                self.push(at, Ev::Reverse { flow, bytes });
            }
            while let Some(e) = self.recv.poll_event() {
                if let ReceiverEvent::Data { key, offset, data } = e {
                    let flow = (key.flow_id & 0xffff) as usize;
                    assert_eq!(
                        offset, self.delivered[flow],
                        "flow {flow}: bytes delivered out of order or twice"
                    );
                    for (i, b) in data.iter().enumerate() {
                        let off = offset + i as u64;
                        assert_eq!(
                            *b,
                            pattern_byte(key.flow_id, off),
                            "flow {flow}: wrong byte at {off}"
                        );
                    }
                    self.delivered[flow] += data.len() as u64;
                    if let Some(log) = self.deliveries.as_mut() {
                        log.push((self.now, flow, data.len() as u64));
                    }
                }
            }
            if !progressed {
                break;
            }
        }
    }

    fn start_flow(&mut self, i: usize) {
        let s = &self.specs[i];
        let c = Connection::new(
            s.cfg.clone(),
            Self::flow_id(i),
            s.token.clone(),
            Payload::Pattern { len: s.size },
            self.now,
        )
        .expect("valid flow");
        self.conns[i] = Some(c);
        self.started_at[i] = Some(self.now);
        self.active.push(i);
    }

    fn start_due(&mut self) {
        while let Some(&i) = self.pending.last() {
            if self.specs[i].start > self.now {
                break;
            }
            self.pending.pop();
            self.start_flow(i);
        }
        let due: Vec<usize> = self
            .scheduled
            .iter()
            .filter(|(t, _)| *t <= self.now)
            .map(|&(_, i)| i)
            .collect();
        self.scheduled.retain(|(t, _)| *t > self.now);
        for i in due {
            if self.specs[i].not_after.is_some_and(|t| self.now > t) {
                // Never started: closed at once, and so are its successors.
                self.end_flow(i);
                continue;
            }
            self.start_flow(i);
        }
    }

    /// Cut what passed its deadline (the record says what it had done).
    fn cut_due(&mut self) {
        let due: Vec<usize> = self
            .active
            .iter()
            .copied()
            .filter(|&i| self.specs[i].deadline.is_some_and(|d| d <= self.now))
            .collect();
        for i in due {
            let completed = self.conns[i].as_ref().is_some_and(|c| c.is_completed());
            self.cut[i] = !completed;
            self.end_flow(i);
        }
    }

    fn next_time(&self) -> Option<Nanos> {
        let mut next: Option<Nanos> = self.heap.peek().map(|Reverse(q)| q.at);
        let mut take = |t: Option<Nanos>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: Nanos| n.min(t)));
            }
        };
        for &i in &self.active {
            let c = self.conns[i].as_ref().expect("active flows exist");
            take(c.poll_timeout());
            take(self.specs[i].deadline);
        }
        for (e, clock) in self.clocks.iter().enumerate() {
            let mine = self
                .active
                .iter()
                .filter(|&&i| self.specs[i].endpoint == e)
                .filter_map(|&i| self.conns[i].as_ref());
            take(clock.poll_timeout(mine));
        }
        take(self.pending.last().map(|&i| self.specs[i].start));
        take(self.scheduled.iter().map(|&(t, _)| t).min());
        take(self.recv.poll_timeout());
        take(self.router_timeout());
        next
    }

    /// Run until every flow is closed or `limit` of simulated time.
    pub fn run(mut self, limit: Nanos) -> Outcome {
        let mut same_time_steps = 0u64;
        let mut last_now = 0;
        loop {
            self.start_due();
            self.drain_outputs();
            self.cut_due();
            let all_closed = self.closed_at.iter().all(|c| c.is_some());
            if all_closed {
                break;
            }
            let Some(next) = self.next_time() else { break };
            if next > limit {
                break;
            }
            self.now = self.now.max(next);
            if self.now == last_now {
                same_time_steps += 1;
                assert!(
                    same_time_steps < 100_000,
                    "simulation stuck at t={} ns",
                    self.now
                );
            } else {
                same_time_steps = 0;
                last_now = self.now;
            }
            while self.heap.peek().is_some_and(|Reverse(q)| q.at <= self.now) {
                let Reverse(q) = self.heap.pop().expect("peeked");
                match q.ev {
                    Ev::Forward { flow, pieces } => self.deliver_forward(flow, pieces),
                    Ev::Reverse { flow, bytes } => {
                        if self.closed_at[flow].is_none() {
                            if let Some(c) = self.conns[flow].as_mut() {
                                let _ = c.handle_datagram(self.now, &bytes);
                            }
                        }
                    }
                }
            }
            let now = self.now;
            for &i in &self.active {
                if let Some(c) = self.conns[i].as_mut() {
                    if c.poll_timeout().is_some_and(|t| t <= now) {
                        c.handle_timeout(now);
                    }
                }
            }
            if self.recv.poll_timeout().is_some_and(|t| t <= now) {
                self.recv.handle_timeout(now);
            }
            if self.router_timeout().is_some_and(|t| t <= now) {
                self.router_step();
            }
        }
        let flows = self
            .conns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                // A flow that never started (the limit came first) reports
                // the record of a flow that sent nothing.
                let record = match c {
                    Some(c) => c.record(),
                    None => {
                        let s = &self.specs[i];
                        Connection::new(
                            s.cfg.clone(),
                            Self::flow_id(i),
                            s.token.clone(),
                            Payload::Pattern { len: s.size },
                            self.now,
                        )
                        .expect("valid flow")
                        .record()
                    }
                };
                FlowOutcome {
                    record,
                    events: self.events[i].clone(),
                    delivered: self.delivered[i],
                    closed_at: self.closed_at[i],
                    started_at: self.started_at[i],
                    cut: self.cut[i],
                }
            })
            .collect();
        Outcome {
            flows,
            path: self.stats,
            receiver: self.recv.stats().clone(),
            end: self.now,
            router_samples: self.router_samples,
            deliveries: self.deliveries.unwrap_or_default(),
        }
    }
}

fn flow_of(ip: &[u8]) -> usize {
    let p = Ipv4Packet::new_checked(ip).expect("ipv4");
    let udp = p.payload();
    (u16::from_be_bytes([udp[0], udp[1]]) - 5000) as usize
}

/// Mode switches of a flow as (reason) for assertions.
pub fn switch_reasons(o: &FlowOutcome) -> Vec<ka_transport::SwitchReason> {
    o.record.mode_switches.iter().map(|s| s.reason).collect()
}

pub fn by_flow<T: Copy>(m: &HashMap<usize, T>, i: usize) -> T {
    m[&i]
}

pub mod manual;
