//! The IO shell of `ka-router`, on one of two datapaths: AF_PACKET rings
//! (`packet`, the default; see `packet_path` and `lan_guard`) or a TUN
//! device fed by policy routing (`tun`).
//!
//! TUN setup (all undone on exit, stale copies removed at start):
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

use crate::lan_guard::LanGuard;
use crate::packet_path::{self, LanRx, NextHops, Received, WanTx, BATCH};
use crate::pool::Pool;
use crate::sys::{self, Error, Result};
use crate::tun::Tun;

/// How packets get from LAN into the router and from it onto WAN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DatapathKind {
    /// Policy routing into a TUN device; the kernel forwards what we write.
    Tun,
    /// AF_PACKET on both interfaces (see `packet_path`).
    Packet,
}

/// Everything the CLI decided.
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    pub lan: String,
    pub wan: String,
    pub datapath: DatapathKind,
    /// Packet datapath: slots of the LAN receive ring (0: recvmmsg).
    pub rx_ring_frames: usize,
    /// SCHED_FIFO priority of the router (0: ordinary).
    pub rt_priority: i32,
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
    /// Packet datapath: the nftables drop of the kernel's copy of what we
    /// forward (gone with us, even after SIGKILL: see `lan_guard`).
    guard: Option<LanGuard>,
    /// Packet datapath: GRO was on on LAN and we turned it off.
    lan_gro: bool,
    restore_sysctls: Vec<(String, String)>,
}

impl Installed {
    /// Hand new LAN traffic back to plain kernel forwarding (the policy
    /// rule goes, or the drop of the kernel's copy).
    fn remove_rule(&mut self) {
        if self.rule {
            while sys::ip_quiet(&["rule", "del", "iif", &self.lan, "table", &self.table]) {}
            self.rule = false;
        }
        if let Some(mut g) = self.guard.take() {
            g.remove();
        }
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        self.remove_rule();
        if self.lan_gro {
            let _ = packet_path::gro(&self.lan, Some(true));
        }
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
    // Both datapaths need forwarding on LAN. Routers before the nftables
    // guard switched it off on LAN alone for the packet datapath and a
    // crash left it so: put it back.
    let lan_fwd = format!("net.ipv4.conf.{lan}.forwarding");
    if sys::sysctl_read("net.ipv4.conf.all.forwarding").is_ok_and(|v| v == "1")
        && sys::sysctl_read(&lan_fwd).is_ok_and(|v| v == "0")
    {
        eprintln!("ka-router: IPv4 forwarding was off on {lan} alone (left by a crashed ka-router?): turned on");
        let _ = sys::sysctl_write(&lan_fwd, "1");
    }
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
        guard: None,
        lan_gro: false,
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
    if o.datapath == DatapathKind::Packet {
        // We forward LAN traffic ourselves from the packet tap: the kernel
        // must not forward a second copy. An nftables drop on LAN's ingress
        // hook (after the tap, before ip_rcv) takes exactly what we forward;
        // local delivery, ARP, IPv6 and WAN -> LAN are unaffected. It dies
        // with us, even on SIGKILL (see `lan_guard`). The TUN device stays
        // as the slow path (no route points into it).
        inst.guard = Some(LanGuard::install(
            &o.lan,
            tun.name(),
            &packet_path::local_addresses(),
        )?);
        // Merged super-packets (GRO) would reach the tap whole: we want
        // the frames as they were on the wire. Off while we run.
        match packet_path::gro(&o.lan, None) {
            Ok(true) => {
                packet_path::gro(&o.lan, Some(false)).map_err(|e| {
                    Error::new(format!("cannot turn GRO off on {}: {e}", o.lan))
                        .hint(format!("ethtool -K {} gro off, or --datapath tun", o.lan))
                })?;
                inst.lan_gro = true;
            }
            Ok(false) => {}
            Err(e) => eprintln!(
                "ka-router: warning: cannot read GRO on {} ({e}); merged packets would be dropped",
                o.lan
            ),
        }
        return Ok(inst);
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
    /// Packet datapath: packets handed to the kernel through the TUN
    /// device (TTL <= 1, too big, next hop not on WAN or unresolved).
    slow_path_packets: u64,
    /// Packet datapath: LAN packets the kernel dropped because our socket
    /// buffer was full (they never reached the router's queue).
    rx_socket_drops: u64,
    /// Packet datapath: LAN frames dropped as unusable (bad IPv4 header,
    /// GSO super-packet, truncated).
    rx_unusable_packets: u64,
    counters: &'a ka_core::router::Counters,
}

/// The packet datapath's sockets and state (see `packet_path`).
struct PacketIo {
    rx: LanRx,
    tx: WanTx,
    hops: NextHops,
    wan_mtu: usize,
    /// Receive buffers handed to the kernel (one per batch slot).
    rx_bufs: Vec<Vec<u8>>,
    rx_out: Vec<Received>,
    /// Still reading LAN (false once the drain handed LAN back).
    rx_open: bool,
    /// Transmissions waiting for the next `sendmmsg`.
    pending: Vec<Transmit>,
    /// Packets that went the slow way (through the TUN device).
    slow: u64,
}

struct Datapath {
    tun: Tun,
    packet: Option<PacketIo>,
    router: Router,
    pool: Pool,
    ttl_fix: bool,
    write_errors: u64,
    read_errors: u64,
}

impl Datapath {
    /// Read everything waiting (bounded per round so transmit keeps its
    /// turn). Returns the number of packets read.
    fn receive(&mut self, now: Nanos) -> Result<usize> {
        if self.packet.is_some() {
            return self.receive_packet(now);
        }
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
                    self.note_read_error(e)?;
                    break;
                }
            }
        }
        Ok(n)
    }

    fn note_read_error(&mut self, e: std::io::Error) -> Result<()> {
        self.read_errors += 1;
        if self.read_errors > 1000 {
            return Err(Error::new(format!(
                "reading LAN packets keeps failing: {e}"
            )));
        }
        Ok(())
    }

    fn receive_packet(&mut self, now: Nanos) -> Result<usize> {
        let Some(io) = self.packet.as_mut() else {
            return Ok(0);
        };
        if !io.rx_open {
            return Ok(0);
        }
        let mut n = 0;
        while n < 256 {
            let got = match io.rx.recv_batch(&mut io.rx_bufs, &mut io.rx_out) {
                Ok(g) => g,
                Err(e) => {
                    self.read_errors += 1;
                    if self.read_errors > 1000 {
                        return Err(Error::new(format!(
                            "reading {} keeps failing: {e}",
                            io.rx.name
                        )));
                    }
                    break;
                }
            };
            for i in 0..got {
                let len = io.rx_out[i].len;
                if len == 0 {
                    continue; // unusable: the buffer stays for the next read
                }
                let mut buf = std::mem::replace(&mut io.rx_bufs[i], self.pool.get());
                buf.truncate(len);
                let dst = u32::from_be_bytes([buf[16], buf[17], buf[18], buf[19]]);
                if io.hops.is_local(dst) {
                    // For this host (or broadcast): the kernel has its own
                    // copy and delivers it.
                    self.pool.put(buf);
                    continue;
                }
                if buf[8] <= 1 || len > io.wan_mtu {
                    // ICMP time exceeded / fragmentation needed, or the
                    // kernel's own fragmentation: the kernel's job.
                    io.slow += 1;
                    if sys::writev2(self.tun.fd(), &buf, &[]).is_err() {
                        self.write_errors += 1;
                    }
                    self.pool.put(buf);
                    continue;
                }
                packet_path::decrement_ttl(&mut buf);
                if let Err(b) = self.router.on_packet(now, buf) {
                    self.pool.put(b);
                }
            }
            n += got;
            if got < io.rx_bufs.len() {
                break;
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
        if self.packet.is_some() {
            // Everything the pacer releases at this instant leaves in
            // sendmmsg batches: the same departures as one write each.
            while let Some(t) = self.router.poll_transmit(now) {
                self.queue_frame(t);
                n += 1;
            }
            self.flush_frames();
            return n;
        }
        while let Some(t) = self.router.poll_transmit(now) {
            self.send(t);
            n += 1;
        }
        n
    }

    /// Packet datapath: queue `t` for the next batch, or send it the slow
    /// way (through the TUN device, kernel forwarding) when its next hop
    /// is not on WAN or not resolved yet.
    fn queue_frame(&mut self, t: Transmit) {
        let Some(io) = self.packet.as_mut() else {
            return self.send(t);
        };
        let dst = u32::from_be_bytes([t.packet[16], t.packet[17], t.packet[18], t.packet[19]]);
        if io.hops.lookup(dst).is_none() {
            io.slow += 1;
            // The kernel decrements TTL again on this way: give ours back.
            let fd = self.tun.fd();
            let res = match &t.split {
                Some(s) => {
                    let (a, b) = (hdr_ttl_up(&s.lead), hdr_ttl_up(&s.rest));
                    sys::writev2(fd, &a, &t.packet[s.lead_payload.clone()])
                        .and_then(|_| sys::writev2(fd, &b, &t.packet[s.rest_payload.clone()]))
                }
                None => {
                    let mut p = t.packet;
                    packet_path::increment_ttl(&mut p);
                    let r = sys::writev2(fd, &p, &[]);
                    self.pool.put(p);
                    if r.is_err() {
                        self.write_errors += 1;
                    }
                    return;
                }
            };
            if res.is_err() {
                self.write_errors += 1;
            }
            self.pool.put(t.packet);
            return;
        }
        io.pending.push(t);
        let frames: usize = io
            .pending
            .iter()
            .map(|t| 1 + t.split.is_some() as usize)
            .sum();
        if frames + 2 > BATCH {
            self.flush_frames();
        }
    }

    fn flush_frames(&mut self) {
        let Some(io) = self.packet.as_mut() else {
            return;
        };
        if io.pending.is_empty() {
            return;
        }
        let mut batch: Vec<(Transmit, [u8; 6])> = Vec::with_capacity(io.pending.len());
        for t in io.pending.drain(..) {
            let dst = u32::from_be_bytes([t.packet[16], t.packet[17], t.packet[18], t.packet[19]]);
            let mac = io.hops.lookup(dst).unwrap_or([0xff; 6]);
            batch.push((t, mac));
        }
        self.write_errors += send_frames(&io.tx, &batch);
        for (t, _) in batch {
            self.pool.put(t.packet);
        }
    }
}

/// `sendmmsg` one batch of frames (each a packet or its two pieces, to the
/// given next-hop MAC) out of WAN. Returns the number of frames lost.
fn send_frames(tx: &WanTx, batch: &[(Transmit, [u8; 6])]) -> u64 {
    let mut eth: Vec<[u8; 14]> = Vec::with_capacity(batch.len());
    for (_, mac) in batch {
        let mut h = [0u8; 14];
        h[..6].copy_from_slice(mac);
        h[6..12].copy_from_slice(&tx.mac);
        h[12..].copy_from_slice(&(libc::ETH_P_IP as u16).to_be_bytes());
        eth.push(h);
    }
    let iov = |s: &[u8]| libc::iovec {
        iov_base: s.as_ptr() as *mut libc::c_void,
        iov_len: s.len(),
    };
    let mut iovs: Vec<[libc::iovec; 3]> = Vec::with_capacity(BATCH);
    let mut counts: Vec<usize> = Vec::with_capacity(BATCH);
    for ((t, _), h) in batch.iter().zip(&eth) {
        match &t.split {
            Some(s) => {
                iovs.push([
                    iov(h),
                    iov(s.lead.as_bytes()),
                    iov(&t.packet[s.lead_payload.clone()]),
                ]);
                iovs.push([
                    iov(h),
                    iov(s.rest.as_bytes()),
                    iov(&t.packet[s.rest_payload.clone()]),
                ]);
                counts.extend([3, 3]);
            }
            None => {
                iovs.push([iov(h), iov(&t.packet), iov(&[])]);
                counts.push(2);
            }
        }
    }
    let sent = match tx.send_batch(&mut iovs, &counts) {
        Ok(k) => k,
        Err(e) => {
            static REPORTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = REPORTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                eprintln!("ka-router: sendmmsg on WAN failed ({n} times): {e}");
            }
            0
        }
    };
    (counts.len() - sent) as u64
}

/// A copy of a core-made header with TTL + 1.
fn hdr_ttl_up(h: &ka_core::fragment::Header) -> Vec<u8> {
    let mut v = h.as_bytes().to_vec();
    packet_path::increment_ttl(&mut v);
    v
}

pub fn run(o: Options) -> Result<()> {
    preflight(&o)?;
    let mut telemetry = Telemetry::open(o.telemetry.as_deref())?;
    prepare_process(&o)?;
    let tun = Tun::create(&o.tun)?;
    let mut installed = install(&o, &tun)?;
    let mtu = sys::iface_mtu(tun.name())?;
    let pool_size = mtu.max(1500) + 64;
    let packet = match o.datapath {
        DatapathKind::Tun => None,
        DatapathKind::Packet => Some(PacketIo::open(&o, pool_size)?),
    };
    // Ready (the metadata line is the readiness signal): set up and, on the
    // packet datapath, the receive ring is open.
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
        packet,
        pool: Pool::new(pool_size, 8192),
        ttl_fix: o.ttl_fix,
        write_errors: 0,
        read_errors: 0,
    };
    let fds: Vec<_> = match &dp.packet {
        Some(io) => vec![io.rx.fd()],
        None => vec![dp.tun.fd()],
    };
    // Which fd woke us does not matter: every pass reads them all.
    let mut ready = Vec::with_capacity(fds.len());
    forward(
        &o,
        &mut dp,
        &mut installed,
        &mut telemetry,
        &fds,
        &mut ready,
    )?;
    let (drained, abandoned) = drain(&o, &mut dp, &mut installed, &fds, &mut ready)?;
    telemetry.line(&ExitLine {
        kind: "exit",
        ts: sys::unix_time().as_secs_f64(),
        reason: "signal",
        drained_packets: drained,
        abandoned_packets: abandoned,
        write_errors: dp.write_errors,
        slow_path_packets: dp.packet.as_ref().map_or(0, |io| io.slow),
        rx_socket_drops: dp.packet.as_ref().map_or(0, |io| io.rx.kernel_drops()),
        rx_unusable_packets: dp.packet.as_ref().map_or(0, |io| io.rx.bad),
        counters: dp.router.counters(),
    });
    drop(installed);
    drop(dp);
    eprintln!("ka-router: stopped cleanly ({drained} packets drained, {abandoned} abandoned)");
    Ok(())
}

/// Refuse what cannot work before touching anything: missing capabilities,
/// unknown or identical interfaces, a TUN name in use.
fn preflight(o: &Options) -> Result<()> {
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
    Ok(())
}

/// The process's scheduling, signals and timer slack, and what a crashed
/// earlier run left behind.
fn prepare_process(o: &Options) -> Result<()> {
    if o.rt_priority > 0 && !sys::realtime_priority(o.rt_priority) {
        eprintln!(
            "ka-router: warning: SCHED_FIFO priority {} not permitted; running as an ordinary process",
            o.rt_priority
        );
    }
    sys::install_stop_handlers()?;
    sys::tight_timer_slack();
    remove_stale(&o.lan, &o.table.to_string());
    Ok(())
}

impl PacketIo {
    fn open(o: &Options, pool_size: usize) -> Result<PacketIo> {
        Ok(PacketIo {
            rx: LanRx::open(&o.lan, o.rx_ring_frames, sys::iface_mtu(&o.lan)? + 14)?,
            tx: WanTx::open(&o.wan)?,
            hops: NextHops::new(&o.wan, sys::now()),
            wan_mtu: sys::iface_mtu(&o.wan)?,
            rx_bufs: (0..BATCH).map(|_| vec![0u8; pool_size]).collect(),
            rx_out: Vec::with_capacity(BATCH),
            rx_open: true,
            pending: Vec::with_capacity(BATCH),
            slow: 0,
        })
    }
}

/// Forward until a stop signal: read, run the control interval, write what
/// the pacer allows, sleep until the core's next deadline.
fn forward(
    o: &Options,
    dp: &mut Datapath,
    installed: &mut Installed,
    telemetry: &mut Telemetry,
    fds: &[std::os::fd::RawFd],
    ready: &mut Vec<bool>,
) -> Result<()> {
    while !sys::stop_requested() {
        let now = sys::now();
        if let Some(io) = dp.packet.as_mut() {
            if io.hops.maybe_refresh(now) {
                if let Some(g) = installed.guard.as_mut() {
                    if !g.alive() {
                        return Err(Error::new(
                            "the nft process holding the LAN drop rule exited; the kernel \
                             would forward a second copy of every LAN packet",
                        ));
                    }
                    g.set_local(io.hops.local())?;
                }
            }
        }
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
        sys::poll_readable(fds, Some(wait.min(100_000_000)), ready)?;
    }
    Ok(())
}

/// Drain: new LAN traffic goes back to plain kernel forwarding at once;
/// what we hold leaves at the configured rate, within a time limit.
/// Returns the packets drained and those abandoned at the limit.
fn drain(
    o: &Options,
    dp: &mut Datapath,
    installed: &mut Installed,
    fds: &[std::os::fd::RawFd],
    ready: &mut Vec<bool>,
) -> Result<(u64, u64)> {
    if let Some(io) = dp.packet.as_mut() {
        // Nothing new queues on the tap from here on; what is queued
        // arrived while the kernel dropped its copy, so it is still ours.
        io.rx.stop_queueing();
    }
    installed.remove_rule();
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
            sys::poll_readable(fds, Some(wait), ready)?;
        }
    }
    let mut abandoned = 0u64;
    while dp.router.pop_any().is_some() {
        abandoned += 1;
    }
    Ok((drained, abandoned))
}
