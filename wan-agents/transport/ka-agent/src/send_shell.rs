//! The trial sender as a process: flows of the sans-IO [`Connection`], each
//! on its own connected UDP socket (the kernel demultiplexes the replies),
//! driven by one `ppoll` loop. The shell only moves bytes and time:
//!
//! * every datagram leaves with the DF bit the core asks for
//!   (`Transmit::dont_fragment`): the socket is switched between
//!   `IP_PMTUDISC_DONT` (DF clear: Kick-Ass data and the padded handshake,
//!   which a router may cut) and `IP_PMTUDISC_DO` (DF set: RTT indicators,
//!   FIN, the TCP baseline) only when the bit changes, i.e. around each RTT
//!   indicator, one setsockopt per 100 ms;
//! * the process is one endpoint with one destination (the agent): one RTT
//!   indicator every 100 ms for all its flows (paper II-B), carried by
//!   whichever flow can send it ([`RttIndicatorClock`]);
//! * pacing: the core's pacer says when the next burst may leave
//!   (`poll_timeout`); the loop sleeps in `ppoll` with a nanosecond
//!   timeout and 1 ns timer slack (an hrtimer, not a millisecond tick), and
//!   the core releases about 2 ms worth of packets per wake-up.

use std::collections::HashSet;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4};

use ka_transport::wire::MAX_TOKEN_LEN;
use ka_transport::{Config, Connection, Event, FlowRecord, Nanos, Payload, RttIndicatorClock};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::sys::{self, Error, Fd, Result};
use crate::token::unhex;

/// One flow to run.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSpec {
    /// The caller's name for the flow (the schedule's `flow_id`).
    pub label: String,
    /// The transport's 64-bit flow id.
    pub wire_id: u64,
    /// Start, counted from the process start; with `after`, the off time
    /// counted from when that flow ended instead.
    pub start: Nanos,
    pub size: u64,
    pub token: Vec<u8>,
    /// Closed loop (the paper's on-off senders, III-B): start `start` after
    /// the flow of this label ended (completed, failed or cut).
    pub after: Option<String>,
    /// A flow that would start later than this (counted from the process
    /// start) is not started at all: its period ended first. It is reported
    /// with `skipped: true`, and so are the flows after it.
    pub not_after: Option<Nanos>,
}

#[derive(Debug, Clone)]
pub struct SendOptions {
    pub agent: SocketAddrV4,
    pub bind: Ipv4Addr,
    pub cfg: Config,
    /// Per flow, from the time it is due (its queueing included): a flow
    /// not completed by then fails, whether it started or still waits.
    pub timeout: Nanos,
    /// After completion, how long the FIN exchange may take.
    pub linger: Nanos,
    /// Flows in progress at once; a flow due while this many run waits, and
    /// its waiting time is reported (`queued_ns`). The trial runner gives
    /// its TCP flows the same cap, so both protocols are treated alike.
    pub max_concurrent: usize,
    /// Every this often, one progress line per running flow: the bytes
    /// acknowledged so far and its mode (per-flow rate and mode over time,
    /// for the congestion experiments). `None`: none.
    pub progress_interval: Option<Nanos>,
}

/// One running flow at one instant, as printed with `--progress`.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub flow_id: String,
    /// Since ka-send started.
    pub t_ns: Nanos,
    /// Payload bytes acknowledged so far (cumulatively).
    pub acked_bytes: u64,
    /// The flow's mode then (paper II-C): "kickass" or "tcp".
    pub ka_mode: &'static str,
    /// The window in force then (bytes: TCP mode's cwnd, or Kick-Ass
    /// mode's rate x SRTT), and the bytes in flight.
    pub cwnd_bytes: u64,
    pub flight_bytes: u64,
}

/// What `run` hands its printer.
pub enum Output<'a> {
    Flow(&'a FlowResult),
    Progress(&'a Progress),
}

/// How one flow ended, as printed.
#[derive(Debug, Clone, Serialize)]
pub struct FlowResult {
    pub flow_id: String,
    /// Never started: a closed loop's flow whose turn came after its
    /// `not_after_s` (not a failure: its period had ended first).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    pub record: Option<FlowRecord>,
    pub error: Option<String>,
    /// From the time the flow was due to the time it started (waiting for a
    /// concurrency slot); None if it never started. The flow's completion
    /// time counted from when it was due is `queued_ns + record.fct_ns`.
    pub queued_ns: Option<Nanos>,
}

impl FlowResult {
    pub fn completed(&self) -> bool {
        self.error.is_none() && self.record.as_ref().is_some_and(|r| r.completed)
    }
}

/// The wire flow id of a schedule's flow id: the first 8 bytes of its
/// SHA-256 (stable, and independent of how the runner names flows).
pub fn wire_flow_id(label: &str) -> u64 {
    let d = Sha256::digest(label.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_be_bytes(b)
}

/// Largest flow a schedule line may ask for (1 TiB: a typo guard).
pub const MAX_FLOW_SIZE: u64 = 1 << 40;

/// Parse one schedule line
/// `{"flow_id": str, "start_s": float, "size_bytes": int, "token_hex": str}`,
/// with, for a closed loop, `"after": str` (start `start_s` after the flow of
/// that id ended) and `"not_after_s": float` (start no later than this).
pub fn parse_schedule_line(line: &str) -> std::result::Result<FlowSpec, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let o = v.as_object().ok_or("not a JSON object")?;
    let label = match o.get("flow_id") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 200 => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => return Err("flow_id must be a non-empty string (at most 200 characters)".into()),
    };
    let start_s = o
        .get("start_s")
        .and_then(Value::as_f64)
        .filter(|s| s.is_finite() && *s >= 0.0 && *s <= 1e6)
        .ok_or_else(|| format!("{label}: start_s must be a number of seconds >= 0"))?;
    let size = o
        .get("size_bytes")
        .and_then(Value::as_u64)
        .filter(|&s| (1..=MAX_FLOW_SIZE).contains(&s))
        .ok_or_else(|| {
            format!("{label}: size_bytes must be an integer from 1 to {MAX_FLOW_SIZE}")
        })?;
    let token = o
        .get("token_hex")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{label}: token_hex must be a hex string"))
        .and_then(|s| parse_token(s).map_err(|e| format!("{label}: {e}")))?;
    let after = match o.get("after") {
        None | Some(Value::Null) => None,
        Some(Value::String(a)) if !a.is_empty() && a.len() <= 200 && *a != label => Some(a.clone()),
        _ => {
            return Err(format!(
                "{label}: after must name another flow_id (at most 200 characters)"
            ))
        }
    };
    let not_after = match o.get("not_after_s") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_f64()
                .filter(|s| s.is_finite() && *s >= 0.0 && *s <= 1e6)
                .map(|s| (s * 1e9).round() as Nanos)
                .ok_or_else(|| format!("{label}: not_after_s must be a number of seconds >= 0"))?,
        ),
    };
    Ok(FlowSpec {
        wire_id: wire_flow_id(&label),
        label,
        start: (start_s * 1e9).round() as Nanos,
        size,
        token,
        after,
        not_after,
    })
}

/// A flow token in hex: 1 to 64 bytes.
pub fn parse_token(s: &str) -> std::result::Result<Vec<u8>, String> {
    let t = unhex(s).ok_or("token_hex is not hex (an even number of 0-9a-f digits)")?;
    if t.is_empty() || t.len() > MAX_TOKEN_LEN {
        return Err(format!(
            "the token must be 1 to {MAX_TOKEN_LEN} bytes, got {}",
            t.len()
        ));
    }
    Ok(t)
}

struct Running {
    label: String,
    conn: Connection,
    sock: Fd,
    df: Option<bool>,
    /// A DF-set datagram was refused for the path MTU (`send_on`).
    df_refused: bool,
    queued: Nanos,
    deadline: Nanos,
    reported: bool,
    linger_until: Option<Nanos>,
    finished: bool,
}

impl Running {
    /// The flow's result: its record so far, and `error` when it failed.
    fn result(&self, error: Option<String>) -> FlowResult {
        FlowResult {
            skipped: false,
            flow_id: self.label.clone(),
            record: Some(self.conn.record()),
            error,
            queued_ns: Some(self.queued),
        }
    }

    /// The result of a flow we ended (timeout, abort): the transport never
    /// failed it, so its record carries `why` too.
    fn cut_short(&self, why: String) -> FlowResult {
        let mut res = self.result(Some(why.clone()));
        if let Some(rec) = res.record.as_mut() {
            rec.error = Some(why);
        }
        res
    }
}

/// The sender loop: flows are added (at any time, with their start
/// offsets), results come out as flows end.
pub struct Runner {
    opts: SendOptions,
    epoch: Nanos,
    pending: Vec<FlowSpec>,
    /// Closed-loop flows waiting for the flow they follow to end.
    waiting: Vec<FlowSpec>,
    /// Flows that ended (for closed-loop flows that name one later).
    ended: std::collections::HashMap<String, Nanos>,
    running: Vec<Running>,
    next_progress: Option<Nanos>,
    progress: Vec<Progress>,
    results: Vec<FlowResult>,
    labels: HashSet<String>,
    clock: RttIndicatorClock,
    buf: Vec<u8>,
    rbuf: Vec<u8>,
    pub send_errors: u64,
    pub recv_errors: u64,
}

impl Runner {
    pub fn new(opts: SendOptions) -> Self {
        Runner {
            opts,
            epoch: sys::now(),
            pending: Vec::new(),
            waiting: Vec::new(),
            ended: std::collections::HashMap::new(),
            running: Vec::new(),
            next_progress: None,
            progress: Vec::new(),
            results: Vec::new(),
            labels: HashSet::new(),
            clock: RttIndicatorClock::default(),
            buf: Vec::with_capacity(2048),
            rbuf: vec![0u8; 65_536],
            send_errors: 0,
            recv_errors: 0,
        }
    }

    /// Queue a flow; false if its label was used before.
    pub fn add(&mut self, mut spec: FlowSpec) -> bool {
        if !self.labels.insert(spec.label.clone()) {
            return false;
        }
        if let Some(prev) = &spec.after {
            match self.ended.get(prev) {
                // Its predecessor already ended: the off time runs from then.
                Some(&t) => spec.start += t.saturating_sub(self.epoch),
                None => {
                    self.waiting.push(spec);
                    return true;
                }
            }
        }
        self.schedule(spec);
        true
    }

    /// Into the start queue, or reported skipped when it would start after
    /// its `not_after`.
    fn schedule(&mut self, spec: FlowSpec) {
        if spec.not_after.is_some_and(|t| spec.start > t) {
            self.skip(spec);
            return;
        }
        // Kept sorted by start, latest first (pop the earliest).
        let pos = self.pending.partition_point(|p| p.start > spec.start);
        self.pending.insert(pos, spec);
    }

    fn skip(&mut self, spec: FlowSpec) {
        self.results.push(FlowResult {
            skipped: true,
            flow_id: spec.label.clone(),
            record: None,
            error: Some("not started: its period ended first".into()),
            queued_ns: None,
        });
        // Nothing follows a flow that never ran, in a closed loop.
        self.flow_ended(&spec.label, Nanos::MAX);
    }

    /// A flow ended at `now` (completed, failed, cut or skipped): start the
    /// closed-loop flows that follow it, their off time from now.
    fn flow_ended(&mut self, label: &str, now: Nanos) {
        self.ended.insert(label.to_string(), now);
        let (mine, rest): (Vec<FlowSpec>, Vec<FlowSpec>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| w.after.as_deref() == Some(label));
        self.waiting = rest;
        for mut spec in mine {
            if now == Nanos::MAX {
                self.skip(spec);
            } else {
                spec.start += now.saturating_sub(self.epoch);
                self.schedule(spec);
            }
        }
    }

    pub fn idle(&self) -> bool {
        self.pending.is_empty() && self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn take_results(&mut self) -> Vec<FlowResult> {
        std::mem::take(&mut self.results)
    }

    pub fn take_progress(&mut self) -> Vec<Progress> {
        std::mem::take(&mut self.progress)
    }

    /// A progress line per running flow, when one is due.
    fn sample_progress(&mut self, now: Nanos) {
        let Some(every) = self.opts.progress_interval else {
            return;
        };
        let due = *self.next_progress.get_or_insert(self.epoch);
        if now < due {
            return;
        }
        for r in self.running.iter().filter(|r| !r.reported) {
            self.progress.push(Progress {
                kind: "progress",
                flow_id: r.label.clone(),
                t_ns: now.saturating_sub(self.epoch),
                acked_bytes: r.conn.snd_una(),
                ka_mode: r.conn.ka_mode().as_str(),
                cwnd_bytes: r.conn.window(),
                flight_bytes: r.conn.flight_size(),
            });
        }
        // The next one on the grid, never in the past.
        let mut next = due.saturating_add(every);
        if next <= now {
            next = now.saturating_add(every);
        }
        self.next_progress = Some(next);
    }

    /// Descriptors to poll, in the order `on_readable` expects.
    pub fn fds(&self, out: &mut Vec<i32>) {
        out.extend(self.running.iter().map(|r| r.sock.0));
    }

    /// Flows started and not yet reported (a completed flow's FIN
    /// exchange does not hold a slot).
    fn in_progress(&self) -> usize {
        self.running.iter().filter(|r| !r.reported).count()
    }

    /// Start what is due (within the concurrency cap), fail what waited past
    /// its deadline, run timers and send what may be sent.
    pub fn service(&mut self, now: Nanos) {
        let before = self.results.len();
        while let Some(p) = self.pending.last() {
            let due = self.epoch + p.start;
            if due > now {
                break;
            }
            if now >= due.saturating_add(self.opts.timeout) {
                let spec = self.pending.pop().expect("checked");
                self.results.push(FlowResult {
                    skipped: false,
                    flow_id: spec.label,
                    record: None,
                    error: Some(format!(
                        "timeout: waited {:.1} s for one of the {} concurrent flows and never \
                         started",
                        self.opts.timeout as f64 / 1e9,
                        self.opts.max_concurrent
                    )),
                    queued_ns: None,
                });
                continue;
            }
            if self.in_progress() >= self.opts.max_concurrent {
                break;
            }
            let spec = self.pending.pop().expect("checked");
            self.start(now, due, spec);
        }
        self.send_rtt_indicator(now);
        for i in 0..self.running.len() {
            self.service_flow(i, now);
        }
        self.sample_progress(now);
        self.running.retain(|r| !r.finished);
        // Closed loops: what ended now starts its successors' off time.
        let ended: Vec<String> = self.results[before..]
            .iter()
            .filter(|r| !r.skipped)
            .map(|r| r.flow_id.clone())
            .collect();
        for label in ended {
            self.flow_ended(&label, now);
        }
    }

    /// The schedule has ended: a closed-loop flow that names a flow the
    /// schedule never had can never start.
    pub fn input_ended(&mut self) {
        let (orphans, rest): (Vec<FlowSpec>, Vec<FlowSpec>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| w.after.as_ref().is_some_and(|a| !self.labels.contains(a)));
        self.waiting = rest;
        for spec in orphans {
            self.results.push(FlowResult {
                skipped: false,
                error: Some(format!(
                    "not started: it follows {:?}, which the schedule does not have",
                    spec.after.as_deref().unwrap_or("")
                )),
                flow_id: spec.label,
                record: None,
                queued_ns: None,
            });
        }
    }

    /// The endpoint's RTT indicator, when due, from whichever running flow
    /// can carry it now.
    fn send_rtt_indicator(&mut self, now: Nanos) {
        let live: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                !self.running[i].finished && self.running[i].conn.can_carry_rtt_indicator()
            })
            .collect();
        if live.is_empty() {
            return;
        }
        let conns = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| live.contains(i))
            .map(|(_, r)| &mut r.conn);
        if let Some((k, t)) = self.clock.poll(now, conns, &mut self.buf) {
            let r = &mut self.running[live[k]];
            if !send_on(r, &self.buf[..t.len], t.dont_fragment) {
                self.send_errors += 1;
            }
        }
    }

    fn start(&mut self, now: Nanos, due: Nanos, spec: FlowSpec) {
        let opened = (|| -> Result<(Fd, Connection)> {
            let sock = sys::udp_socket(SocketAddrV4::new(self.opts.bind, 0))?;
            sys::connect(sock.0, self.opts.agent)?;
            sys::grow_buffer(sock.0, false, 2 << 20);
            sys::grow_buffer(sock.0, true, 2 << 20);
            let conn = Connection::new(
                self.opts.cfg.clone(),
                spec.wire_id,
                spec.token.clone(),
                Payload::Pattern { len: spec.size },
                now,
            )
            .map_err(|e| Error::new(e.to_string()))?;
            Ok((sock, conn))
        })();
        match opened {
            Ok((sock, conn)) => self.running.push(Running {
                label: spec.label,
                conn,
                sock,
                df: None,
                df_refused: false,
                queued: now - due,
                deadline: due.saturating_add(self.opts.timeout),
                reported: false,
                linger_until: None,
                finished: false,
            }),
            Err(e) => self.results.push(FlowResult {
                skipped: false,
                flow_id: spec.label,
                record: None,
                error: Some(e.msg),
                queued_ns: Some(now - due),
            }),
        }
    }

    fn service_flow(&mut self, i: usize, now: Nanos) {
        let r = &mut self.running[i];
        if r.conn.poll_timeout().is_some_and(|t| t <= now) {
            r.conn.handle_timeout(now);
        }
        while let Some(t) = r.conn.poll_transmit(now, &mut self.buf) {
            if !send_on(r, &self.buf[..t.len], t.dont_fragment) {
                self.send_errors += 1;
            }
        }
        while let Some(ev) = r.conn.poll_event() {
            match ev {
                Event::Completed { .. } => {
                    if !r.reported {
                        r.reported = true;
                        self.results.push(r.result(None));
                    }
                    r.linger_until = Some(now.saturating_add(self.opts.linger));
                }
                Event::Failed(e) => {
                    if !r.reported {
                        r.reported = true;
                        self.results.push(r.result(Some(e.to_string())));
                    }
                    r.finished = true;
                }
                Event::Closed => r.finished = true,
                Event::Connected { .. } | Event::ModeSwitched(_) => {}
            }
        }
        if !r.reported && now >= r.deadline {
            r.reported = true;
            r.finished = true;
            let msg = format!(
                "timeout: not completed within {:.1} s of being due",
                self.opts.timeout as f64 / 1e9
            );
            self.results.push(r.cut_short(msg));
        }
        if r.linger_until.is_some_and(|t| now >= t) {
            r.finished = true;
        }
    }

    /// When `service` next has something to do.
    pub fn next_wake(&self) -> Option<Nanos> {
        let mut t: Option<Nanos> = None;
        let mut take = |x: Nanos| t = Some(t.map_or(x, |t| t.min(x)));
        let live = self.running.iter().filter(|r| !r.finished).map(|r| &r.conn);
        if let Some(x) = self.clock.poll_timeout(live) {
            take(x);
        }
        if self.opts.progress_interval.is_some() && !self.running.is_empty() {
            take(self.next_progress.unwrap_or(self.epoch));
        }
        if let Some(p) = self.pending.last() {
            let due = self.epoch + p.start;
            // Waiting for a slot: only its deadline is a time of its own
            // (a slot frees on a flow's own events, which wake us anyway).
            if self.in_progress() >= self.opts.max_concurrent {
                take(due.saturating_add(self.opts.timeout));
            } else {
                take(due);
            }
        }
        for r in &self.running {
            if let Some(x) = r.conn.poll_timeout() {
                take(x);
            }
            if !r.reported {
                take(r.deadline);
            }
            if let Some(x) = r.linger_until {
                take(x);
            }
        }
        t
    }

    /// Read every waiting datagram of the flows whose sockets are ready
    /// (`ready` is parallel to what `fds` returned).
    pub fn on_readable(&mut self, ready: &[bool]) {
        for (r, _) in self
            .running
            .iter_mut()
            .zip(ready.iter())
            .filter(|(_, &ok)| ok)
        {
            for _ in 0..1024 {
                match sys::recv(r.sock.0, &mut self.rbuf) {
                    Ok(Some(n)) => {
                        // Drops (stray or bogus datagrams) are the core's
                        // business and counted there.
                        let _ = r.conn.handle_datagram(sys::now(), &self.rbuf[..n]);
                    }
                    Ok(None) => break,
                    // ECONNREFUSED (nobody listens yet) and the like: the
                    // handshake's retries and timeout decide.
                    Err(_) => {
                        self.recv_errors += 1;
                        break;
                    }
                }
            }
        }
    }

    /// Stop everything: every flow still running or waiting ends with `why`.
    pub fn abort(&mut self, why: &str) {
        for r in self.running.drain(..) {
            if !r.reported {
                self.results.push(r.cut_short(why.to_string()));
            }
        }
        let waiting: Vec<FlowSpec> = self.waiting.drain(..).collect();
        for p in self.pending.drain(..).rev().chain(waiting) {
            self.results.push(FlowResult {
                skipped: false,
                flow_id: p.label,
                record: None,
                error: Some(format!("not started: {why}")),
                queued_ns: None,
            });
        }
    }
}

/// Send one datagram on a flow's socket with the DF bit the core asked
/// for (switched only when it changes). False when the send failed: a full
/// buffer or a pending ICMP error is a lost datagram, which the core's loss
/// recovery deals with.
///
/// DF set is the core's preference, not a requirement: a datagram the path
/// cannot carry whole (the kernel learned a path MTU below it from an ICMP
/// "fragmentation needed" and refuses it with EMSGSIZE) leaves with DF
/// clear, fragmented. Without this a flow in TCP mode (DF set on all but one
/// datagram per SRTT) behind a link with a smaller MTU moved one datagram
/// per round trip.
fn send_on(r: &mut Running, bytes: &[u8], dont_fragment: bool) -> bool {
    let mut ok = true;
    if r.df != Some(dont_fragment) {
        ok &= sys::set_dont_fragment(r.sock.0, dont_fragment).is_ok();
        r.df = Some(dont_fragment);
    }
    match sys::send(r.sock.0, bytes) {
        Ok(()) => ok,
        Err(e) if dont_fragment && e.raw_os_error() == Some(libc::EMSGSIZE) => {
            if !r.df_refused {
                r.df_refused = true;
                eprintln!(
                    "ka-send: warning: flow {}: the path MTU is below {} bytes; datagrams \
                     that should leave with DF set leave fragmented",
                    r.label,
                    bytes.len() + 28
                );
            }
            r.df = Some(false);
            sys::set_dont_fragment(r.sock.0, false).is_ok() && sys::send(r.sock.0, bytes).is_ok()
        }
        Err(_) => false,
    }
}

/// Where flows come from.
pub enum Source {
    One(FlowSpec),
    /// NDJSON schedule lines on this descriptor (stdin), read as they come.
    Schedule(i32),
}

/// Outcome of a run: results were printed as they came.
#[derive(Debug, Default)]
pub struct Summary {
    pub flows: u64,
    pub completed: u64,
    pub bad_lines: u64,
    pub interrupted: bool,
}

/// Run flows until all ended (and, for a schedule, its input closed).
/// `print` gets each result as it happens.
pub fn run(
    opts: SendOptions,
    source: Source,
    mut print: impl FnMut(Output<'_>),
    mut warn: impl FnMut(&str),
) -> Result<Summary> {
    sys::tight_timer_slack();
    let mut runner = Runner::new(opts);
    let mut summary = Summary::default();
    let (mut input, input_fd) = match source {
        Source::One(spec) => {
            runner.add(spec);
            (None, None)
        }
        Source::Schedule(fd) => {
            // Not fatal: a regular file or a pipe both work blocking
            // too, but a pipe must not stall the flows.
            let _ = sys::set_nonblocking(fd);
            (Some(LineReader::default()), Some(fd))
        }
    };
    let mut fds = Vec::new();
    let mut ready = Vec::new();
    loop {
        let now = sys::now();
        runner.service(now);
        for p in runner.take_progress() {
            print(Output::Progress(&p));
        }
        for r in runner.take_results() {
            summary.flows += 1;
            if r.completed() {
                summary.completed += 1;
            }
            print(Output::Flow(&r));
        }
        if sys::stop_requested() {
            runner.abort("interrupted");
            summary.interrupted = true;
            for r in runner.take_results() {
                summary.flows += 1;
                print(Output::Flow(&r));
            }
            break;
        }
        if input.is_none() && runner.idle() {
            break;
        }
        fds.clear();
        runner.fds(&mut fds);
        let n_flows = fds.len();
        if let (Some(fd), Some(_)) = (input_fd, &input) {
            fds.push(fd);
        }
        let wait = runner
            .next_wake()
            .map(|t| t.saturating_sub(sys::now()))
            .unwrap_or(1_000_000_000)
            .min(1_000_000_000);
        sys::poll_readable(&fds, Some(wait), &mut ready)?;
        runner.on_readable(&ready[..n_flows]);
        if let (Some(fd), Some(rd)) = (input_fd, input.as_mut()) {
            if ready.get(n_flows).copied().unwrap_or(false) {
                let eof = rd.fill(fd);
                for (lineno, line) in rd.lines() {
                    let problem = match parse_schedule_line(&line) {
                        Ok(spec) => {
                            let label = spec.label.clone();
                            if runner.add(spec) {
                                None
                            } else {
                                Some(format!("flow_id {label:?} appears twice"))
                            }
                        }
                        Err(e) => Some(e),
                    };
                    if let Some(p) = problem {
                        summary.bad_lines += 1;
                        warn(&format!("schedule line {lineno}: {p}"));
                    }
                }
                if let Some(e) = rd.error.take() {
                    summary.bad_lines += 1;
                    warn(&e);
                }
                if eof {
                    input = None;
                    runner.input_ended();
                }
            }
        }
    }
    Ok(summary)
}

/// Splits a non-blocking byte stream into lines, bounded.
#[derive(Debug, Default)]
struct LineReader {
    buf: Vec<u8>,
    lineno: u64,
    lines: Vec<(u64, String)>,
    error: Option<String>,
    skipping: bool,
}

const MAX_LINE: usize = 64 * 1024;

impl LineReader {
    /// Read what is there; true at end of input (or a read error).
    fn fill(&mut self, fd: i32) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match sys::read_nb(fd, &mut chunk) {
                Ok(Some(0)) => {
                    if !self.buf.is_empty() {
                        // A last line without its newline.
                        self.buf.push(b'\n');
                        self.split();
                    }
                    return true;
                }
                Ok(Some(n)) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    self.split();
                }
                Ok(None) => return false,
                Err(e) => {
                    self.error = Some(format!("cannot read the schedule: {e}"));
                    return true;
                }
            }
        }
    }

    fn split(&mut self) {
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=pos).collect();
            self.lineno += 1;
            if self.skipping {
                self.skipping = false;
                continue;
            }
            let text = String::from_utf8_lossy(&line[..line.len() - 1])
                .trim()
                .to_string();
            if !text.is_empty() {
                self.lines.push((self.lineno, text));
            }
        }
        if self.buf.len() > MAX_LINE {
            self.buf.clear();
            if !self.skipping {
                self.error = Some(format!(
                    "schedule line {} is longer than {MAX_LINE} bytes",
                    self.lineno + 1
                ));
            }
            self.skipping = true;
        }
    }

    fn lines(&mut self) -> Vec<(u64, String)> {
        std::mem::take(&mut self.lines)
    }
}

/// Write one JSON value and a newline; false if stdout is gone.
pub fn print_json<T: Serialize>(w: &mut impl Write, v: &T) -> bool {
    serde_json::to_writer(&mut *w, v).is_ok() && w.write_all(b"\n").is_ok() && w.flush().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_lines() {
        let ok = parse_schedule_line(
            r#"{"flow_id": "t1-00003", "start_s": 1.25, "size_bytes": 15000, "token_hex": "0a0b"}"#,
        )
        .unwrap();
        assert_eq!(ok.label, "t1-00003");
        assert_eq!(ok.start, 1_250_000_000);
        assert_eq!(ok.size, 15000);
        assert_eq!(ok.token, vec![10, 11]);
        assert_eq!(ok.wire_id, wire_flow_id("t1-00003"));
        assert_ne!(wire_flow_id("a"), wire_flow_id("b"));
        for bad in [
            "nope",
            "[]",
            r#"{"start_s": 0, "size_bytes": 1, "token_hex": "00"}"#,
            r#"{"flow_id": "x", "start_s": -1, "size_bytes": 1, "token_hex": "00"}"#,
            r#"{"flow_id": "x", "start_s": 0, "size_bytes": 0, "token_hex": "00"}"#,
            r#"{"flow_id": "x", "start_s": 0, "size_bytes": 1.5, "token_hex": "00"}"#,
            r#"{"flow_id": "x", "start_s": 0, "size_bytes": 1, "token_hex": "0"}"#,
            r#"{"flow_id": "x", "start_s": 0, "size_bytes": 1, "token_hex": ""}"#,
            r#"{"flow_id": "", "start_s": 0, "size_bytes": 1, "token_hex": "00"}"#,
        ] {
            assert!(parse_schedule_line(bad).is_err(), "{bad}");
        }
        let long = "00".repeat(65);
        assert!(parse_token(&long).is_err());
    }

    #[test]
    fn line_reader_splits_and_bounds() {
        let mut r = LineReader::default();
        r.buf.extend_from_slice(b"a\n\n b \nc");
        r.split();
        assert_eq!(r.lines(), vec![(1, "a".into()), (3, "b".into())]);
        r.buf.extend_from_slice(&vec![b'x'; MAX_LINE + 1]);
        r.split();
        assert!(r.error.is_some());
        r.buf.extend_from_slice(b"yy\nz\n");
        r.split();
        assert_eq!(r.lines(), vec![(5, "z".into())]);
    }

    /// A runner towards the discard port: nothing answers, so a started flow
    /// never ends by itself (only at its timeout).
    fn runner(bind: Ipv4Addr, timeout: Nanos, max_concurrent: usize) -> Runner {
        Runner::new(SendOptions {
            agent: "127.0.0.1:9".parse().unwrap(),
            bind,
            cfg: Config::default(),
            timeout,
            linger: 1,
            max_concurrent,
            progress_interval: None,
        })
    }

    #[test]
    fn runner_orders_pending_by_start() {
        let mut r = runner(Ipv4Addr::UNSPECIFIED, 1, 256);
        for (l, s) in [("b", 5), ("a", 1), ("c", 9)] {
            assert!(r.add(FlowSpec {
                label: l.into(),
                wire_id: 1,
                start: s,
                size: 1,
                token: vec![1],
                after: None,
                not_after: None,
            }));
        }
        assert!(!r.add(FlowSpec {
            label: "a".into(),
            wire_id: 1,
            start: 0,
            size: 1,
            token: vec![1],
            after: None,
            not_after: None,
        }));
        let order: Vec<&str> = r.pending.iter().rev().map(|p| p.label.as_str()).collect();
        assert_eq!(order, vec!["a", "b", "c"]);
        assert_eq!(r.next_wake(), Some(r.epoch + 1));
    }

    #[test]
    fn a_flow_waits_for_a_slot_and_its_deadline_counts_from_when_it_was_due() {
        let mut r = runner(Ipv4Addr::LOCALHOST, 5_000_000, 1);
        for l in ["first", "second"] {
            assert!(r.add(FlowSpec {
                label: l.into(),
                wire_id: 1,
                start: 0,
                size: 1000,
                token: vec![1],
                after: None,
                not_after: None,
            }));
        }
        let t0 = r.epoch;
        r.service(t0 + 1_000_000);
        assert_eq!(
            (r.running.len(), r.pending.len()),
            (1, 1),
            "one slot: one runs, one waits"
        );
        // The waiting flow's only time of its own is its deadline.
        assert!(r.next_wake().is_some_and(|t| t <= t0 + 5_000_000));
        r.service(t0 + 6_000_000);
        let mut results = r.take_results();
        results.sort_by(|a, b| a.flow_id.cmp(&b.flow_id));
        assert_eq!(results.len(), 2);
        assert_eq!(results[0].flow_id, "first");
        assert_eq!(results[0].queued_ns, Some(1_000_000));
        assert!(results[0]
            .error
            .as_deref()
            .unwrap()
            .contains("of being due"));
        assert_eq!(results[1].queued_ns, None);
        assert!(results[1]
            .error
            .as_deref()
            .unwrap()
            .contains("never started"));
    }

    fn spec(label: &str, start: Nanos, after: Option<&str>, not_after: Option<Nanos>) -> FlowSpec {
        FlowSpec {
            label: label.into(),
            wire_id: wire_flow_id(label),
            start,
            size: 1000,
            token: vec![1],
            after: after.map(String::from),
            not_after,
        }
    }

    #[test]
    fn a_closed_loop_flow_starts_its_off_time_after_the_one_it_follows() {
        const MS: Nanos = 1_000_000;
        let mut r = runner(Ipv4Addr::LOCALHOST, 5 * MS, 8);
        assert!(r.add(spec("a", 0, None, None)));
        assert!(r.add(spec("b", 2 * MS, Some("a"), Some(100 * MS))));
        assert!(r.add(spec("c", 500 * MS, Some("b"), Some(100 * MS))));
        assert!(r.add(spec("d", 1, Some("c"), Some(100 * MS))));
        let t0 = r.epoch;
        r.service(t0 + MS);
        assert_eq!((r.running.len(), r.waiting.len()), (1, 3), "b waits for a");
        // a times out at 5 ms: b is due 2 ms after that.
        r.service(t0 + 6 * MS);
        assert_eq!(
            r.pending.last().map(|p| (p.label.as_str(), p.start)),
            Some(("b", 8 * MS))
        );
        assert!(!r.idle());
        r.service(t0 + 8 * MS);
        assert_eq!(r.running.len(), 1);
        // b ends at 13 ms: c would start at 513 ms, after its 100 ms limit:
        // skipped, and d after it.
        r.service(t0 + 14 * MS);
        let results = r.take_results();
        let got: Vec<(&str, bool)> = results
            .iter()
            .map(|x| (x.flow_id.as_str(), x.skipped))
            .collect();
        assert_eq!(
            got,
            vec![("a", false), ("b", false), ("c", true), ("d", true)]
        );
        assert!(r.idle());
        let line = serde_json::to_string(&results[2]).unwrap();
        assert!(line.contains("\"skipped\":true"), "{line}");
        assert!(!serde_json::to_string(&results[0])
            .unwrap()
            .contains("skipped"));
    }

    #[test]
    fn closed_loop_schedule_lines() {
        let ok = parse_schedule_line(
            r#"{"flow_id": "t-2", "start_s": 0.5, "size_bytes": 9, "token_hex": "0a", "after": "t-1", "not_after_s": 90}"#,
        )
        .unwrap();
        assert_eq!(ok.after.as_deref(), Some("t-1"));
        assert_eq!(ok.not_after, Some(90_000_000_000));
        for bad in [
            r#"{"flow_id": "x", "start_s": 0, "size_bytes": 1, "token_hex": "00", "after": "x"}"#,
            r#"{"flow_id": "x", "start_s": 0, "size_bytes": 1, "token_hex": "00", "after": 3}"#,
            r#"{"flow_id": "x", "start_s": 0, "size_bytes": 1, "token_hex": "00", "not_after_s": -1}"#,
        ] {
            assert!(parse_schedule_line(bad).is_err(), "{bad}");
        }
        let mut r = runner(Ipv4Addr::LOCALHOST, 1, 8);
        assert!(r.add(spec("b", 0, Some("nobody"), None)));
        r.input_ended();
        let res = r.take_results();
        assert!(res[0].error.as_deref().unwrap().contains("does not have"));
        assert!(r.idle());
    }
}
