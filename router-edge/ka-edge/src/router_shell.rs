//! The IO shell of `ka-router`: a TUN device fed by policy routing.
//!
//! Setup (all undone on exit, stale copies removed at start):
//!   TUN `ka0` up, MTU = WAN MTU; `ip route add default dev ka0 table T`;
//!   `ip rule add iif LAN table T`; rp_filter off on ka0 (loose if `all`
//!   was strict) and IPv4 forwarding on. Packets arriving on LAN are then
//!   routed into ka0, where we read them; what we write back into ka0 is
//!   routed by the main table out of WAN. WAN -> LAN never touches us.
//!
//! The loop: read every waiting packet into the core, run the control
//! interval, write whatever the pacer allows, then sleep until the core's
//! next deadline (ppoll with 1 ns timer slack; spin when it is very close).

use std::io::Write;

use ka_core::router::{Router, RouterConfig, Transmit};
use ka_core::wire::ipv4::Packet;
use ka_core::Nanos;
use serde::Serialize;

use crate::sys::{self, Error, Result};
use crate::tun::Tun;

/// Everything the CLI decided.
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    pub lan: String,
    pub wan: String,
    pub tun: String,
    pub table: u32,
    pub rule_priority: u32,
    pub telemetry: Option<String>,
    pub drain_timeout_ns: Nanos,
    pub spin_ns: Nanos,
    pub ttl_fix: bool,
    pub router: RouterConfig,
}

/// What setup changed, undone in reverse on drop (also on error paths).
struct Installed {
    lan: String,
    table: String,
    rule: bool,
    route: bool,
    restore_sysctls: Vec<(String, String)>,
}

impl Installed {
    fn remove_rule(&mut self) {
        if self.rule {
            while sys::ip_quiet(&["rule", "del", "iif", &self.lan, "table", &self.table]) {}
            self.rule = false;
        }
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        self.remove_rule();
        if self.route {
            sys::ip_quiet(&["route", "flush", "table", &self.table]);
        }
        for (k, v) in self.restore_sysctls.drain(..).rev() {
            let _ = sys::sysctl_write(&k, &v);
        }
    }
}

/// Remove what a crashed earlier run may have left: our policy rules and
/// the routes of our table. (A TUN device dies with its process.)
fn remove_stale(lan: &str, table: &str) {
    let mut n = 0;
    while n < 64 && sys::ip_quiet(&["rule", "del", "iif", lan, "table", table]) {
        n += 1;
    }
    if n > 0 {
        eprintln!("ka-router: removed {n} stale ip rule(s) for iif {lan} table {table}");
    }
    sys::ip_quiet(&["route", "flush", "table", table]);
}

fn install(o: &Options, tun: &Tun) -> Result<Installed> {
    let table = o.table.to_string();
    let mut inst = Installed {
        lan: o.lan.clone(),
        table: table.clone(),
        rule: false,
        route: false,
        restore_sysctls: vec![],
    };
    let wan_mtu = sys::iface_mtu(&o.wan)?;
    sys::ip(&[
        "link",
        "set",
        "dev",
        tun.name(),
        "mtu",
        &wan_mtu.to_string(),
        "txqueuelen",
        "4096",
        "up",
    ])?;
    // The kernel hands us packets with the source address of a LAN host on
    // an interface (ka0) that does not route back to it: strict reverse
    // path filtering would drop them.
    sys::sysctl_write(&format!("net.ipv4.conf.{}.rp_filter", tun.name()), "0")?;
    if sys::sysctl_read("net.ipv4.conf.all.rp_filter")? == "1" {
        inst.restore_sysctls
            .push(("net.ipv4.conf.all.rp_filter".into(), "1".into()));
        sys::sysctl_write("net.ipv4.conf.all.rp_filter", "2")?;
    }
    if sys::sysctl_read("net.ipv4.conf.all.forwarding")? != "1" {
        inst.restore_sysctls
            .push(("net.ipv4.conf.all.forwarding".into(), "0".into()));
        sys::sysctl_write("net.ipv4.conf.all.forwarding", "1")?;
    }
    if sys::sysctl_read(&format!("net.ipv4.conf.{}.forwarding", tun.name()))? != "1" {
        sys::sysctl_write(&format!("net.ipv4.conf.{}.forwarding", tun.name()), "1")?;
    }
    sys::ip(&[
        "route",
        "add",
        "default",
        "dev",
        tun.name(),
        "table",
        &table,
    ])?;
    inst.route = true;
    sys::ip(&[
        "rule",
        "add",
        "iif",
        &o.lan,
        "table",
        &table,
        "priority",
        &o.rule_priority.to_string(),
    ])?;
    inst.rule = true;
    Ok(inst)
}

/// Telemetry sink: one JSON object per line, flushed per line so a reader
/// (the Python side) sees samples as they happen.
struct Telemetry {
    out: Box<dyn Write>,
    broken: bool,
}

impl Telemetry {
    fn open(path: Option<&str>) -> Result<Telemetry> {
        let out: Box<dyn Write> = match path {
            None | Some("-") => Box::new(std::io::stdout()),
            Some(p) => Box::new(
                std::fs::File::create(p)
                    .map_err(|e| Error::new(format!("cannot create telemetry file {p}: {e}")))?,
            ),
        };
        Ok(Telemetry { out, broken: false })
    }

    fn line<T: Serialize>(&mut self, v: &T) {
        if self.broken {
            return;
        }
        // A closed reader must not stop the router: forwarding goes on.
        let ok = serde_json::to_writer(&mut self.out, v).is_ok()
            && self.out.write_all(b"\n").is_ok()
            && self.out.flush().is_ok();
        if !ok {
            eprintln!("ka-router: telemetry output closed; forwarding continues without it");
            self.broken = true;
        }
    }
}

#[derive(Serialize)]
struct Metadata<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    version: u32,
    program: &'static str,
    program_version: &'static str,
    started_unix: f64,
    options: &'a Options,
}

#[derive(Serialize)]
struct SampleLine<'a> {
    #[serde(flatten)]
    sample: &'a ka_core::router::Sample,
    /// Wall clock, seconds since the epoch.
    ts: f64,
}

#[derive(Serialize)]
struct ExitLine<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    ts: f64,
    reason: &'a str,
    drained_packets: u64,
    abandoned_packets: u64,
    write_errors: u64,
    counters: &'a ka_core::router::Counters,
}

/// Pool of packet buffers: the datapath allocates nothing per packet once
/// warm.
struct Pool {
    free: Vec<Vec<u8>>,
    size: usize,
}

impl Pool {
    fn get(&mut self) -> Vec<u8> {
        match self.free.pop() {
            Some(mut b) => {
                b.resize(self.size, 0);
                b
            }
            None => vec![0u8; self.size],
        }
    }

    fn put(&mut self, b: Vec<u8>) {
        if self.free.len() < 8192 {
            self.free.push(b);
        }
    }
}

struct Datapath {
    tun: Tun,
    router: Router,
    pool: Pool,
    ttl_fix: bool,
    write_errors: u64,
    read_errors: u64,
}

impl Datapath {
    /// Read everything waiting on the TUN (bounded per round so transmit
    /// keeps its turn). Returns the number of packets read.
    fn receive(&mut self, now: Nanos) -> Result<usize> {
        let mut n = 0;
        while n < 256 {
            let mut buf = self.pool.get();
            match sys::read_nb(self.tun.fd(), &mut buf) {
                Ok(Some(len)) if len > 0 => {
                    buf.truncate(len);
                    if self.ttl_fix {
                        if let Ok(mut p) = Packet::new_checked(&mut buf[..]) {
                            // The kernel decremented TTL on the way into ka0
                            // and will again on the way out: give one back so
                            // the router counts as one hop.
                            p.increment_ttl();
                        }
                    }
                    if let Err(b) = self.router.on_packet(now, buf) {
                        self.pool.put(b);
                    }
                    n += 1;
                }
                Ok(_) => {
                    self.pool.put(buf);
                    break;
                }
                Err(e) => {
                    self.pool.put(buf);
                    self.read_errors += 1;
                    if self.read_errors > 1000 {
                        return Err(Error::new(format!(
                            "reading {} keeps failing: {e}",
                            self.tun.name()
                        )));
                    }
                    break;
                }
            }
        }
        Ok(n)
    }

    fn send(&mut self, t: Transmit) {
        let fd = self.tun.fd();
        let res = match &t.split {
            Some(s) => sys::writev2(fd, s.lead.as_bytes(), &t.packet[s.lead_payload.clone()])
                .and_then(|_| {
                    sys::writev2(fd, s.rest.as_bytes(), &t.packet[s.rest_payload.clone()])
                }),
            None => sys::writev2(fd, &t.packet, &[]),
        };
        if let Err(e) = res {
            // A packet the kernel refuses (e.g. malformed) is dropped like
            // any router would; say so once in a while, do not stop.
            self.write_errors += 1;
            if self.write_errors.is_power_of_two() {
                eprintln!(
                    "ka-router: write to {} failed ({} so far): {e}",
                    self.tun.name(),
                    self.write_errors
                );
            }
        }
        self.pool.put(t.packet);
    }

    fn transmit(&mut self, now: Nanos) -> usize {
        let mut n = 0;
        while let Some(t) = self.router.poll_transmit(now) {
            self.send(t);
            n += 1;
        }
        n
    }
}

pub fn run(o: Options) -> Result<()> {
    sys::require_net_caps("ka-router")?;
    sys::ifindex(&o.lan)?;
    sys::ifindex(&o.wan)?;
    if o.lan == o.wan {
        return Err(Error::new("--lan and --wan must be different interfaces"));
    }
    if sys::iface_exists(&o.tun) {
        return Err(Error::new(format!("interface {} already exists", o.tun)).hint(
            "another ka-router may be running in this namespace (a crashed one leaves no device); \
             stop it or pick another --tun name",
        ));
    }
    // The module being loaded says nothing (hooks are per namespace); live
    // entries in this namespace do.
    if sys::sysctl_read("net.netfilter.nf_conntrack_count").is_ok_and(|c| c != "0") {
        eprintln!(
            "ka-router: warning: conntrack is tracking flows in this namespace; it reassembles \
             fragments and re-fragments them, which defeats Kick-Ass marking"
        );
    }
    let mut telemetry = Telemetry::open(o.telemetry.as_deref())?;
    sys::install_stop_handlers()?;
    sys::tight_timer_slack();
    remove_stale(&o.lan, &o.table.to_string());
    let tun = Tun::create(&o.tun)?;
    let mut installed = install(&o, &tun)?;
    let mtu = sys::iface_mtu(tun.name())?;
    telemetry.line(&Metadata {
        kind: "metadata",
        version: 1,
        program: "ka-router",
        program_version: env!("CARGO_PKG_VERSION"),
        started_unix: sys::unix_time().as_secs_f64(),
        options: &o,
    });
    eprintln!(
        "ka-router: {} -> {} via {} at {} bit/s, buffer {}, mode {:?}",
        o.lan, o.wan, o.tun, o.router.capacity_bps, o.router.buffer, o.router.kind
    );
    let mut dp = Datapath {
        router: Router::new(o.router.clone(), sys::now()),
        tun,
        pool: Pool {
            free: Vec::new(),
            size: mtu.max(1500) + 64,
        },
        ttl_fix: o.ttl_fix,
        write_errors: 0,
        read_errors: 0,
    };
    let fds = [dp.tun.fd()];
    // Which fd woke us does not matter: every pass reads them all.
    let mut ready = Vec::with_capacity(fds.len());
    while !sys::stop_requested() {
        let now = sys::now();
        dp.receive(now)?;
        if let Some(s) = dp.router.handle_timeout(now) {
            telemetry.line(&SampleLine {
                sample: &s,
                ts: sys::unix_time().as_secs_f64(),
            });
        }
        dp.transmit(now);
        let deadline = dp.router.poll_timeout();
        let now = sys::now();
        if deadline <= now {
            continue;
        }
        let wait = deadline - now;
        if wait <= o.spin_ns {
            // Closer than a timer can be trusted: check the TUN and spin.
            continue;
        }
        // Cap the sleep so a signal racing the flag check costs little.
        sys::poll_readable(&fds, Some(wait.min(100_000_000)), &mut ready)?;
    }

    // Drain: new LAN traffic goes back to plain kernel forwarding at once;
    // what we hold leaves at the configured rate, within a time limit.
    installed.remove_rule();
    let reason = "signal";
    let drain_until = sys::now() + o.drain_timeout_ns;
    let mut drained = 0u64;
    loop {
        let now = sys::now();
        if now >= drain_until {
            break;
        }
        let got = dp.receive(now)?;
        drained += dp.transmit(now) as u64;
        if got == 0 && dp.router.queue_packets() == 0 {
            break;
        }
        let wait = dp
            .router
            .poll_timeout()
            .saturating_sub(sys::now())
            .min(10_000_000);
        if wait > o.spin_ns {
            sys::poll_readable(&fds, Some(wait), &mut ready)?;
        }
    }
    let mut abandoned = 0u64;
    while dp.router.pop_any().is_some() {
        abandoned += 1;
    }
    telemetry.line(&ExitLine {
        kind: "exit",
        ts: sys::unix_time().as_secs_f64(),
        reason,
        drained_packets: drained,
        abandoned_packets: abandoned,
        write_errors: dp.write_errors,
        counters: dp.router.counters(),
    });
    drop(installed);
    drop(dp);
    eprintln!("ka-router: stopped cleanly ({drained} packets drained, {abandoned} abandoned)");
    Ok(())
}
