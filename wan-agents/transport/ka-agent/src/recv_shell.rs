//! The agent's Kick-Ass receiver as a process: one UDP socket, the fragment
//! tap, the sans-IO [`Receiver`] and nothing else. All protocol decisions
//! are the core's; this loop moves bytes, attaches to every datagram the
//! `leading_fragment_len` the tap saw before reassembly (and the ECN CE
//! mark), and reports flows as NDJSON on stdout:
//!
//! ```text
//! {"type":"start", ...}                    once, when the sockets are ready
//! {"type":"flow","status":"completed", ...} per flow that delivered every byte
//! {"type":"flow","status":"expired", ...}   per flow that went silent first
//! {"type":"refused", ...}                   per refused handshake (at most 10/s)
//! {"type":"exit","counters":{...}}          at SIGTERM/SIGINT
//! ```

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::rc::Rc;

use ka_core::encoding;
use ka_transport::wire::{Kind, Packet};
use ka_transport::{
    pattern_fill, FlowKey, Nanos, Receiver, ReceiverConfig, ReceiverEvent, RecvFlowStats, RxInfo,
    TokenRequest, TokenValidator,
};
use serde_json::{json, Value};

use crate::afpacket::{FragmentTap, SNAP_LEN};
use crate::fragments::{LeadingFragments, TableConfig};
use crate::sys::{self, Error, Result};
use crate::token::ReplayGuard;

#[derive(Debug, Clone)]
pub struct RecvOptions {
    pub bind: SocketAddrV4,
    /// Read leading fragments (AF_PACKET). Without, no rate can be read
    /// and every flow is accepted as TCP.
    pub leading_fragments: bool,
    /// Interface index for the tap (None: all).
    pub ifindex: Option<u32>,
    pub interface: Option<String>,
    pub secret: Vec<u8>,
    pub state_file: Option<PathBuf>,
    pub max_flows: usize,
    pub idle_timeout: Nanos,
    /// Compare every delivered byte with the sender's pattern.
    pub verify_payload: bool,
}

/// The guard shared between the receiver core (as its validator) and the
/// shell (which reports its counters).
struct SharedGuard(Rc<RefCell<ReplayGuard>>);

impl TokenValidator for SharedGuard {
    fn validate(&mut self, request: &TokenRequest<'_>) -> bool {
        self.0.borrow_mut().validate(request)
    }
}

/// What the shell observed about one flow (reporting only).
#[derive(Debug, Default)]
struct FlowObs {
    accepted_unix: f64,
    size: u64,
    kickass: bool,
    delivered: u64,
    payload_errors: u64,
    lfl_count: u64,
    lfl_min: Option<u16>,
    lfl_max: Option<u16>,
    lfl_last: Option<u16>,
    whole: u64,
}

impl FlowObs {
    fn on_data(&mut self, lfl: Option<u16>) {
        match lfl {
            Some(l) => {
                self.lfl_count += 1;
                self.lfl_min = Some(self.lfl_min.map_or(l, |m| m.min(l)));
                self.lfl_max = Some(self.lfl_max.map_or(l, |m| m.max(l)));
                self.lfl_last = Some(l);
            }
            None => self.whole += 1,
        }
    }
}

fn rate_bps(lfl: Option<u16>) -> Value {
    lfl.and_then(|l| encoding::advertised_rate(l as usize))
        .map_or(Value::Null, |r| json!(encoding::bytes_per_ms_to_bps(r)))
}

/// Writes NDJSON lines; a closed stdout is counted, never fatal (the
/// receiver keeps serving flows).
pub struct Out<W: Write> {
    w: W,
    pub errors: u64,
}

impl<W: Write> Out<W> {
    pub fn new(w: W) -> Self {
        Out { w, errors: 0 }
    }

    pub fn line(&mut self, v: &Value) {
        let ok = serde_json::to_writer(&mut self.w, v).is_ok()
            && self.w.write_all(b"\n").is_ok()
            && self.w.flush().is_ok();
        if !ok {
            self.errors += 1;
        }
    }
}

struct Shell<W: Write> {
    rx: Receiver<SharedGuard>,
    guard: Rc<RefCell<ReplayGuard>>,
    udp: sys::Fd,
    tap: Option<FragmentTap>,
    table: LeadingFragments,
    flows: HashMap<FlowKey, FlowObs>,
    out: Out<W>,
    opts: RecvOptions,
    send_errors: u64,
    recv_errors: u64,
    truncated: u64,
    tap_errors: u64,
    refused_lines: u64,
    refused_quiet: u64,
    refusal_budget: f64,
    refusal_at: Nanos,
    scratch: Vec<u8>,
}

const MAX_DATAGRAM: usize = 65_536;
/// Refused-handshake lines per second (a flood must not flood stdout).
const REFUSAL_LINES_PER_S: f64 = 10.0;

/// Run until SIGTERM/SIGINT. Returns the process exit code.
pub fn run<W: Write>(opts: RecvOptions, out: W) -> Result<i32> {
    let udp = sys::udp_socket(opts.bind)?;
    sys::grow_buffer(udp.0, true, 8 << 20);
    sys::grow_buffer(udp.0, false, 4 << 20);
    // ECN CE is optional information: a kernel without IP_RECVTOS is fine.
    let _ = sys::enable_recv_tos(udp.0);
    let tap = if opts.leading_fragments {
        Some(FragmentTap::open(opts.bind.port(), opts.ifindex)?)
    } else {
        None
    };
    let mut guard = ReplayGuard::new(opts.secret.clone(), || sys::unix_time().as_secs());
    if let Some(p) = &opts.state_file {
        guard = guard.with_state_file(p).map_err(|e| {
            Error::new(format!("cannot use the state file {}: {e}", p.display())).hint(
                "it keeps used tokens across restarts; check the directory exists and is writable",
            )
        })?;
    }
    let guard = Rc::new(RefCell::new(guard));
    let cfg = ReceiverConfig {
        kickass: tap.is_some(),
        max_flows: opts.max_flows,
        idle_timeout: opts.idle_timeout,
        ..ReceiverConfig::default()
    };
    let mut shell = Shell {
        rx: Receiver::new(cfg, SharedGuard(guard.clone())),
        guard,
        udp,
        tap,
        table: LeadingFragments::new(TableConfig::new(opts.bind.port())),
        flows: HashMap::new(),
        out: Out::new(out),
        opts,
        send_errors: 0,
        recv_errors: 0,
        truncated: 0,
        tap_errors: 0,
        refused_lines: 0,
        refused_quiet: 0,
        refusal_budget: REFUSAL_LINES_PER_S,
        refusal_at: sys::now(),
        scratch: Vec::with_capacity(2048),
    };
    shell.start_line();
    shell.run_loop()?;
    shell.exit_line();
    Ok(0)
}

impl<W: Write> Shell<W> {
    fn start_line(&mut self) {
        let v = json!({
            "type": "start",
            "program": "ka-agent-recv",
            "version": env!("CARGO_PKG_VERSION"),
            "bind": self.opts.bind.to_string(),
            "port": self.opts.bind.port(),
            "leading_fragments": self.tap.is_some(),
            "interface": self.opts.interface,
            "state_file": self.opts.state_file.as_ref().map(|p| p.display().to_string()),
            "snap_len": SNAP_LEN,
            "t": unix_f64(),
        });
        self.out.line(&v);
    }

    fn run_loop(&mut self) -> Result<()> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let mut cap = vec![0u8; 2048];
        let mut ready = Vec::new();
        let mut fds = vec![self.udp.0];
        if let Some(t) = &self.tap {
            fds.push(t.fd());
        }
        while !sys::stop_requested() {
            let now = sys::now();
            if self.rx.poll_timeout().is_some_and(|t| t <= now) {
                self.rx.handle_timeout(now);
            }
            self.table.expire(now);
            self.flush(now);
            // Wake at the next flow expiry, and at least every second to
            // age the fragment table.
            let wait = self
                .rx
                .poll_timeout()
                .map_or(1_000_000_000, |t| t.saturating_sub(now))
                .min(1_000_000_000);
            sys::poll_readable(&fds, Some(wait), &mut ready)?;
            // The tap first: a datagram's leading fragment is queued on the
            // tap before the kernel even starts reassembling it, so once
            // the datagram is readable its fragment is there to be read.
            self.drain_tap(&mut cap);
            for _ in 0..256 {
                let r = match sys::recv_from(self.udp.0, &mut buf) {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(_) => {
                        self.recv_errors += 1;
                        break;
                    }
                };
                if r.truncated {
                    self.truncated += 1;
                    continue;
                }
                let now = sys::now();
                let bytes = &buf[..r.len];
                let mut lfl = self.table.claim(now, r.peer, bytes);
                if lfl.is_none() && self.tap.is_some() {
                    // Its fragment may have been queued after the drain above.
                    self.drain_tap(&mut cap);
                    lfl = self.table.claim(now, r.peer, bytes);
                }
                if lfl.is_none() {
                    self.table.note_whole();
                }
                let info = RxInfo {
                    leading_fragment_len: lfl,
                    ecn_ce: r.tos.is_some_and(|t| t & 0x03 == 0x03),
                };
                let peer = SocketAddr::V4(r.peer);
                if self.rx.handle_datagram(now, peer, bytes, info).is_ok() {
                    self.observe_data(peer, bytes, lfl);
                }
                self.flush(now);
            }
        }
        Ok(())
    }

    fn drain_tap(&mut self, cap: &mut [u8]) {
        let Some(tap) = &self.tap else { return };
        for _ in 0..4096 {
            match tap.recv(cap) {
                Ok(Some(n)) => {
                    self.table.observe(sys::now(), &cap[..n]);
                }
                Ok(None) => break,
                Err(_) => {
                    self.tap_errors += 1;
                    break;
                }
            }
        }
    }

    fn observe_data(&mut self, peer: SocketAddr, bytes: &[u8], lfl: Option<u16>) {
        let Ok(p) = Packet::new_checked(bytes) else {
            return;
        };
        if p.kind() != Some(Kind::Data) {
            return;
        }
        let key = FlowKey {
            peer,
            flow_id: p.flow_id(),
        };
        if let Some(f) = self.flows.get_mut(&key) {
            f.on_data(lfl);
        }
    }

    /// Send every queued reply and handle every event.
    fn flush(&mut self, now: Nanos) {
        let mut buf = std::mem::take(&mut self.scratch);
        while let Some(t) = self.rx.poll_transmit(&mut buf) {
            let SocketAddr::V4(dst) = t.dst else { continue };
            if sys::send_to(self.udp.0, &buf[..t.len], dst).is_err() {
                self.send_errors += 1;
            }
        }
        self.scratch = buf;
        while let Some(ev) = self.rx.poll_event() {
            self.on_event(now, ev);
        }
    }

    fn on_event(&mut self, now: Nanos, ev: ReceiverEvent) {
        match ev {
            ReceiverEvent::FlowAccepted { key, size, kickass } => {
                self.flows.insert(
                    key,
                    FlowObs {
                        accepted_unix: unix_f64(),
                        size,
                        kickass,
                        ..FlowObs::default()
                    },
                );
            }
            ReceiverEvent::Data { key, offset, data } => {
                let verify = self.opts.verify_payload;
                if let Some(f) = self.flows.get_mut(&key) {
                    f.delivered += data.len() as u64;
                    if verify {
                        let mut want = vec![0u8; data.len()];
                        pattern_fill(key.flow_id, offset, &mut want);
                        if want != data {
                            f.payload_errors += 1;
                        }
                    }
                }
            }
            ReceiverEvent::FlowComplete { key, stats } => {
                if let Some(f) = self.flows.remove(&key) {
                    self.flow_line("completed", &key, &f, Some(&stats));
                }
            }
            ReceiverEvent::FlowExpired { key, .. } => {
                if let Some(f) = self.flows.remove(&key) {
                    self.flow_line("expired", &key, &f, None);
                }
            }
            ReceiverEvent::FlowClosed { .. } => {}
            ReceiverEvent::Refused {
                peer,
                flow_id,
                status,
            } => {
                let elapsed = now.saturating_sub(self.refusal_at) as f64 / 1e9;
                self.refusal_at = now;
                self.refusal_budget =
                    (self.refusal_budget + elapsed * REFUSAL_LINES_PER_S).min(REFUSAL_LINES_PER_S);
                if self.refusal_budget >= 1.0 {
                    self.refusal_budget -= 1.0;
                    self.refused_lines += 1;
                    let reason = self.guard.borrow_mut().last_reject.take();
                    let v = json!({
                        "type": "refused",
                        "peer": peer.to_string(),
                        "flow_id": flow_id,
                        "status": format!("{status:?}"),
                        "token": reason.map(|r| r.as_str()),
                        "t": unix_f64(),
                    });
                    self.out.line(&v);
                } else {
                    self.refused_quiet += 1;
                }
            }
        }
    }

    fn flow_line(&mut self, status: &str, key: &FlowKey, f: &FlowObs, st: Option<&RecvFlowStats>) {
        let stats = st.cloned().or_else(|| self.rx.flow_stats(key).cloned());
        let mut v = json!({
            "type": "flow",
            "status": status,
            "flow_id": key.flow_id,
            "flow_id_hex": format!("{:016x}", key.flow_id),
            "peer": key.peer.to_string(),
            "kickass": f.kickass,
            "size_bytes": f.size,
            "bytes": f.delivered,
            "payload_errors": if self.opts.verify_payload { json!(f.payload_errors) } else { Value::Null },
            "leading_fragment_len": {
                "count": f.lfl_count,
                "min": f.lfl_min,
                "max": f.lfl_max,
                "last": f.lfl_last,
            },
            "advertised_rate_bps": {
                "min": rate_bps(f.lfl_min),
                "max": rate_bps(f.lfl_max),
                "last": rate_bps(f.lfl_last),
            },
            "whole_datagrams": f.whole,
            // No leading fragment on any data datagram: no router on the
            // path advertised a rate.
            "no_rate": f.lfl_count == 0,
            "accepted_t": f.accepted_unix,
            "t": unix_f64(),
        });
        if let Some(s) = stats {
            v["data_datagrams"] = json!(s.data_datagrams);
            v["duplicate_datagrams"] = json!(s.duplicate_datagrams);
            v["fragmented_datagrams"] = json!(s.fragmented_datagrams);
            v["ce_marked"] = json!(s.ce_marked);
            v["reorder_drops"] = json!(s.reorder_drops);
            v["acks_sent"] = json!(s.acks_sent);
            v["duration_ns"] = json!(s.completed_at.map(|c| c.saturating_sub(s.accepted_at)));
        }
        self.out.line(&v);
    }

    fn exit_line(&mut self) {
        let s = self.rx.stats().clone();
        let t = self.table.stats().clone();
        let tap = self.tap.as_mut().map(|t| t.stats());
        let g = self.guard.borrow();
        let rejects: serde_json::Map<String, Value> = g
            .rejects
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), json!(v)))
            .collect();
        let v = json!({
            "type": "exit",
            "t": unix_f64(),
            "counters": {
                "receiver": {
                    "datagrams": s.datagrams,
                    "bytes_in": s.bytes_in,
                    "malformed": s.malformed,
                    "unknown_flow": s.unknown_flow,
                    "refused": s.refused,
                    "unexpected_kind": s.unexpected_kind,
                    "beyond_flow_size": s.beyond_flow_size,
                    "reorder_drops": s.reorder_drops,
                    "bad_fin": s.bad_fin,
                    "rtt_indicators": s.rtt_indicators,
                    "queue_drops": s.queue_drops,
                    "flows_accepted": s.flows_accepted,
                    "flows_completed": s.flows_completed,
                    "flows_expired": s.flows_expired,
                    "unvalidated_bytes_in": s.unvalidated_bytes_in,
                    "resets_sent": s.resets_sent,
                    "resets_suppressed": s.resets_suppressed,
                    "unvalidated_bytes_out": s.unvalidated_bytes_out,
                },
                "fragments": {
                    "captured": t.captured,
                    "ignored": t.ignored,
                    "leading_fragments": t.leading_fragments,
                    "assembled_keys": t.assembled_keys,
                    "other_port": t.other_port,
                    "matched": t.matched,
                    "unmatched": t.unmatched,
                    "expired": t.expired,
                    "evicted": t.evicted,
                    "partial_expired": t.partial_expired,
                    "partial_evicted": t.partial_evicted,
                    "tap_packets": tap.map(|x| x.packets),
                    "tap_drops": tap.map(|x| x.drops),
                    "tap_errors": self.tap_errors,
                },
                "tokens": {
                    "accepted": g.accepted,
                    "rejected": rejects,
                    "live_nonces": g.live_nonces(),
                },
                "shell": {
                    "send_errors": self.send_errors,
                    "recv_errors": self.recv_errors,
                    "truncated": self.truncated,
                    "refused_lines": self.refused_lines,
                    "refused_not_printed": self.refused_quiet,
                    "stdout_errors": self.out.errors,
                    "open_flows": self.flows.len(),
                },
            },
        });
        drop(g);
        self.out.line(&v);
    }
}

fn unix_f64() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
