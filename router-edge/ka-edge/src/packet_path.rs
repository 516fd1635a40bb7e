//! The `packet` datapath of `ka-router`: AF_PACKET on both interfaces.
//!
//! LAN side: one AF_PACKET socket bound to the LAN interface, a classic BPF
//! filter keeps IPv4 frames addressed to our MAC (PACKET_HOST), read in
//! batches with `recvmmsg` (scatter: the virtio-net and Ethernet headers go
//! to a scratch area, the IP packet straight into a pool buffer the core
//! then owns: one copy, made by the kernel). The kernel does not forward
//! those packets itself: `net.ipv4.conf.LAN.forwarding` is 0 while we run,
//! so its route lookup for a non-local destination on LAN ends in a silent
//! drop (`ip_error` sends no ICMP when the input device does not forward).
//! Packets for the router itself, ARP, IPv6 and the WAN -> LAN direction
//! stay the kernel's.
//!
//! WAN side: one AF_PACKET socket bound to the WAN interface that receives
//! nothing (protocol 0), PACKET_QDISC_BYPASS, `sendmmsg` of frames built
//! from three slices (our Ethernet header, the IP header the core made, the
//! payload slice of the original buffer): no copy in user space. The
//! next-hop MAC comes from the kernel's own tables: the main routing table
//! (`/proc/net/route`, longest prefix) and the neighbour table
//! (`/proc/net/arp`), re-read every second.
//!
//! Slow path: what we cannot or should not send at L2 ourselves (TTL <= 1,
//! larger than the WAN MTU, a next hop not on WAN or not resolved yet) is
//! written into the TUN device `ka0` as in the `tun` datapath; the kernel
//! then forwards it and does the ICMP errors and the ARP resolution (the
//! next refresh then finds the MAC).

use std::collections::HashMap;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::RawFd;

use ka_core::wire::checksum;

use crate::afpacket::VNET_HDR_LEN;
use crate::sys::{self, grow_buffer, ifindex, packet, set_opt, Error, Fd, Result};

const PACKET_QDISC_BYPASS: libc::c_int = 20;
const ETH_HDR_LEN: usize = 14;
/// virtio-net header + Ethernet header in front of every received packet.
pub const RX_PREFIX: usize = VNET_HDR_LEN + ETH_HDR_LEN;
const VIRTIO_NET_HDR_F_NEEDS_CSUM: u8 = 1;
const VIRTIO_NET_HDR_GSO_NONE: u8 = 0;

/// Packets per `recvmmsg` / `sendmmsg`.
pub const BATCH: usize = 64;

fn mac_of(name: &str) -> Result<[u8; 6]> {
    let s = std::fs::read_to_string(format!("/sys/class/net/{name}/address"))
        .map_err(|e| Error::new(format!("cannot read the MAC address of {name}: {e}")))?;
    parse_mac(s.trim()).ok_or_else(|| {
        Error::new(format!("{name} has no Ethernet address"))
            .hint("the packet datapath needs Ethernet interfaces; use --datapath tun")
    })
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut m = [0u8; 6];
    let mut it = s.split(':');
    for b in m.iter_mut() {
        *b = u8::from_str_radix(it.next()?, 16).ok()?;
    }
    if it.next().is_some() {
        return None;
    }
    Some(m)
}

/// Classic BPF: IPv4 frames addressed to this host's MAC, whole.
fn lan_filter() -> [packet::Insn; 6] {
    use packet::Insn;
    const LD_H_ABS: u16 = 0x28; // BPF_LD | BPF_H | BPF_ABS
    const LD_B_ABS: u16 = 0x30; // BPF_LD | BPF_B | BPF_ABS
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const SKF_AD_PKTTYPE: u32 = 0xffff_f000 + 4;
    [
        Insn {
            code: LD_H_ABS,
            jt: 0,
            jf: 0,
            k: 12,
        },
        Insn {
            code: JEQ_K,
            jt: 0,
            jf: 3,
            k: libc::ETH_P_IP as u32,
        },
        Insn {
            code: LD_B_ABS,
            jt: 0,
            jf: 0,
            k: SKF_AD_PKTTYPE,
        },
        Insn {
            code: JEQ_K,
            jt: 0,
            jf: 1,
            k: libc::PACKET_HOST as u32,
        },
        Insn {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: 0x0004_0000,
        },
        Insn {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: 0,
        },
    ]
}

const PACKET_RX_RING: libc::c_int = 5;
const PACKET_VERSION: libc::c_int = 10;
const TPACKET_V2: libc::c_int = 1;
const TP_STATUS_KERNEL: u32 = 0;
const TP_STATUS_USER: u32 = 1;

#[repr(C)]
struct TpacketReq {
    block_size: u32,
    block_nr: u32,
    frame_size: u32,
    frame_nr: u32,
}

/// A TPACKET_V2 receive ring mapped into our memory: the kernel copies
/// each frame into a slot from its softirq (on the sender's CPU, with
/// veth) and we take it from there without a system call. V2 rather than
/// V3: a V3 block is handed over only when full or when its timer (>= 1
/// ms) fires, which would add up to a millisecond at low load; V2 hands
/// over every frame at once.
struct Ring {
    base: *mut u8,
    size: usize,
    frame_size: usize,
    frames: usize,
    next: usize,
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: base/size are the mapping made in `LanRx::open`.
        unsafe { libc::munmap(self.base.cast(), self.size) };
    }
}

#[repr(C)]
struct IfReqData {
    name: [libc::c_char; libc::IFNAMSIZ],
    data: *mut libc::c_void,
    _pad: [u8; 16],
}

/// Read (`set` None) or set an interface's generic receive offload
/// (SIOCETHTOOL, ETHTOOL_GGRO / ETHTOOL_SGRO). With GRO on, the tap would
/// see merged TCP super-packets, which are not ours to cut or to send.
pub fn gro(name: &str, set: Option<bool>) -> io::Result<bool> {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GGRO: u32 = 0x2b;
    const ETHTOOL_SGRO: u32 = 0x2c;
    // struct ethtool_value { u32 cmd; u32 data; }
    let mut val: [u32; 2] = match set {
        None => [ETHTOOL_GGRO, 0],
        Some(on) => [ETHTOOL_SGRO, on as u32],
    };
    let mut req = IfReqData {
        name: [0; libc::IFNAMSIZ],
        data: val.as_mut_ptr().cast(),
        _pad: [0; 16],
    };
    for (d, s) in req
        .name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *d = s as libc::c_char;
    }
    // SAFETY: plain socket creation; closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = Fd(fd);
    // SAFETY: req is an ifreq whose data points to a live ethtool_value.
    if unsafe { libc::ioctl(fd.0, SIOCETHTOOL, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(val[1] != 0)
}

/// The LAN receive socket.
pub struct LanRx {
    fd: Fd,
    pub name: String,
    scratch: Vec<[u8; RX_PREFIX]>,
    ring: Option<Ring>,
    /// Received packets whose checksum or length was unusable.
    pub bad: u64,
}

/// One packet out of [`LanRx::recv_batch`].
pub struct Received {
    /// IP length (the buffer holds the IP packet from offset 0).
    pub len: usize,
}

impl LanRx {
    /// `ring_frames`: slots of the TPACKET_V2 receive ring (0: no ring,
    /// `recvmmsg` batches instead); `frame_room`: the largest frame (MTU +
    /// Ethernet header) it must hold.
    pub fn open(name: &str, ring_frames: usize, frame_room: usize) -> Result<LanRx> {
        // Protocol 0 until the filter is in: nothing unfiltered queues up.
        let (fd, idx) = crate::afpacket::open_vnet(name, 0)?;
        packet::attach_filter(fd.0, &lan_filter())
            .map_err(|e| Error::new(format!("cannot attach the BPF filter on {name}: {e}")))?;
        grow_buffer(fd.0, true, 16 << 20);
        let ring = if ring_frames > 0 {
            Some(map_ring(fd.0, ring_frames, frame_room).map_err(|e| {
                Error::new(format!("cannot set up the receive ring on {name}: {e}"))
                    .hint("try --rx-ring-frames 0 (recvmmsg instead of a ring)")
            })?)
        } else {
            None
        };
        packet::bind(fd.0, libc::ETH_P_ALL as u16, idx)
            .map_err(|e| Error::new(format!("cannot bind to {name}: {e}")))?;
        Ok(LanRx {
            fd,
            name: name.to_string(),
            scratch: vec![[0u8; RX_PREFIX]; BATCH],
            ring,
            bad: 0,
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.0
    }

    /// Packets the kernel dropped for a full socket buffer, since the
    /// last call.
    pub fn kernel_drops(&self) -> u64 {
        packet::statistics(self.fd.0).map_or(0, |s| s.tp_drops as u64)
    }

    /// Accept nothing more (a filter that drops all); what is queued stays
    /// readable.
    pub fn stop_queueing(&self) {
        let drop_all = [packet::Insn {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: 0,
        }];
        let _ = packet::attach_filter(self.fd.0, &drop_all);
    }

    /// Read up to `bufs.len()` (<= BATCH) packets, each IP packet into the
    /// start of its buffer (whose length is the room offered). Returns how
    /// many of `bufs` were filled, with their IP lengths in `out`; a
    /// packet the sender left with a partial checksum (veth's "hardware"
    /// checksum) gets it finished here.
    pub fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        out: &mut Vec<Received>,
    ) -> io::Result<usize> {
        out.clear();
        if self.ring.is_some() {
            return Ok(self.recv_ring(bufs, out));
        }
        let n = bufs.len().min(BATCH);
        let mut iovs: Vec<[libc::iovec; 2]> = Vec::with_capacity(n);
        for (b, s) in bufs.iter_mut().zip(self.scratch.iter_mut()).take(n) {
            iovs.push([
                libc::iovec {
                    iov_base: s.as_mut_ptr().cast(),
                    iov_len: RX_PREFIX,
                },
                libc::iovec {
                    iov_base: b.as_mut_ptr().cast(),
                    iov_len: b.len(),
                },
            ]);
        }
        let mut msgs = sys::mmsghdrs(iovs.iter_mut().map(|iov| (iov.as_mut_ptr(), 2)));
        // SAFETY: msgs points to n headers whose iovecs point into live,
        // writable buffers that outlive the call.
        let rc = unsafe {
            libc::recvmmsg(
                self.fd.0,
                msgs.as_mut_ptr(),
                n as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        let got = match sys::nb_result(rc as libc::ssize_t)? {
            None => return Ok(0),
            Some(g) => g,
        };
        for i in 0..got {
            let m = &msgs[i];
            let total = m.msg_len as usize;
            let ok = m.msg_hdr.msg_flags & libc::MSG_TRUNC == 0 && total >= RX_PREFIX + 20;
            let len = if ok {
                finish(&self.scratch[i], &mut bufs[i][..total - RX_PREFIX])
            } else {
                None
            };
            match len {
                Some(len) => out.push(Received { len }),
                None => {
                    self.bad += 1;
                    out.push(Received { len: 0 });
                }
            }
        }
        Ok(got)
    }
}

impl LanRx {
    fn recv_ring(&mut self, bufs: &mut [Vec<u8>], out: &mut Vec<Received>) -> usize {
        let Some(r) = self.ring.as_mut() else {
            return 0;
        };
        let mut got = 0;
        while got < bufs.len() {
            // SAFETY: next < frames, so the slot lies inside the mapping.
            let slot = unsafe { r.base.add(r.next * r.frame_size) };
            let status = slot.cast::<u32>();
            // SAFETY: the slot starts with a tpacket2_hdr; the kernel
            // writes tp_status last, so read it first, with acquire
            // ordering, before the rest of the frame.
            let st = unsafe { std::ptr::read_volatile(status) };
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            if st & TP_STATUS_USER == 0 {
                break;
            }
            // SAFETY: tpacket2_hdr fields at their fixed offsets.
            let (snaplen, mac, net) = unsafe {
                (
                    std::ptr::read(slot.add(8).cast::<u32>()) as usize,
                    std::ptr::read(slot.add(12).cast::<u16>()) as usize,
                    std::ptr::read(slot.add(14).cast::<u16>()) as usize,
                )
            };
            let ip_len = (mac + snaplen).saturating_sub(net);
            let fits = mac >= VNET_HDR_LEN
                && net == mac + ETH_HDR_LEN
                && mac + snaplen <= r.frame_size
                && ip_len >= 20
                && ip_len <= bufs[got].len();
            let len = if fits {
                // SAFETY: the vnet header sits right before the MAC header
                // and the IP packet at `net`, all inside the slot (checked).
                let (prefix, ip) = unsafe {
                    (
                        std::slice::from_raw_parts(slot.add(mac - VNET_HDR_LEN), RX_PREFIX),
                        std::slice::from_raw_parts(slot.add(net), ip_len),
                    )
                };
                let mut p = [0u8; RX_PREFIX];
                p.copy_from_slice(prefix);
                bufs[got][..ip_len].copy_from_slice(ip);
                finish(&p, &mut bufs[got][..ip_len])
            } else {
                None
            };
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            // SAFETY: hand the slot back to the kernel.
            unsafe { std::ptr::write_volatile(status, TP_STATUS_KERNEL) };
            r.next = (r.next + 1) % r.frames;
            match len {
                Some(len) => out.push(Received { len }),
                None => {
                    self.bad += 1;
                    out.push(Received { len: 0 });
                }
            }
            got += 1;
        }
        got
    }
}

fn map_ring(fd: RawFd, frames: usize, frame_room: usize) -> io::Result<Ring> {
    let v2 = TPACKET_V2;
    set_opt(fd, libc::SOL_PACKET, PACKET_VERSION, &v2)?;
    // tpacket2_hdr + sockaddr_ll (aligned) + vnet header + frame.
    let frame_size = (frame_room + 32 + 32 + 16 + VNET_HDR_LEN).next_power_of_two();
    let block_size = (frame_size * 32).max(4096);
    let per_block = block_size / frame_size;
    let block_nr = frames.div_ceil(per_block);
    let req = TpacketReq {
        block_size: block_size as u32,
        block_nr: block_nr as u32,
        frame_size: frame_size as u32,
        frame_nr: (block_nr * per_block) as u32,
    };
    set_opt(fd, libc::SOL_PACKET, PACKET_RX_RING, &req)?;
    let size = block_size * block_nr;
    // SAFETY: mapping the ring the kernel just allocated for this socket.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(Ring {
        base: base.cast(),
        size,
        frame_size,
        frames: block_nr * per_block,
        next: 0,
    })
}

/// Check an IPv4 packet and finish a partial transport checksum. Returns
/// its IP length (Ethernet padding cut off), None if unusable.
fn finish(prefix: &[u8; RX_PREFIX], ip: &mut [u8]) -> Option<usize> {
    let flags = prefix[0];
    let gso_type = prefix[1];
    if gso_type != VIRTIO_NET_HDR_GSO_NONE {
        return None; // GRO/GSO left on: a super-packet, not ours to cut
    }
    if ip[0] >> 4 != 4 {
        return None;
    }
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    if ihl < 20 || total < ihl || total > ip.len() {
        return None;
    }
    if checksum::fold(checksum::sum(&ip[..ihl])) != 0xffff {
        return None;
    }
    if flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 {
        let start = u16::from_ne_bytes([prefix[6], prefix[7]]) as usize;
        let off = u16::from_ne_bytes([prefix[8], prefix[9]]) as usize;
        let start = start.checked_sub(ETH_HDR_LEN)?;
        if start < ihl || start + off + 2 > total {
            return None;
        }
        // The field holds the pseudo-header sum; the rest is ours to add
        // (as skb_checksum_help does).
        let c = !checksum::fold(checksum::sum(&ip[start..total]));
        let c = if c == 0 { 0xffff } else { c };
        ip[start + off..start + off + 2].copy_from_slice(&c.to_be_bytes());
    }
    Some(total)
}

/// TTL - 1 with an incremental checksum update (RFC 1624); the header
/// must be valid and TTL > 0.
pub fn decrement_ttl(ip: &mut [u8]) {
    adjust_ttl(ip, false)
}

/// TTL + 1 (for a packet that goes the slow way, whose TTL the kernel
/// decrements again).
pub fn increment_ttl(ip: &mut [u8]) {
    adjust_ttl(ip, true)
}

fn adjust_ttl(ip: &mut [u8], up: bool) {
    let ttl = ip[8];
    let new = if up {
        ttl.saturating_add(1)
    } else {
        ttl.saturating_sub(1)
    };
    let old_w = u16::from_be_bytes([ttl, ip[9]]);
    let new_w = u16::from_be_bytes([new, ip[9]]);
    let c = checksum::update(u16::from_be_bytes([ip[10], ip[11]]), old_w, new_w);
    ip[8] = new;
    ip[10..12].copy_from_slice(&c.to_be_bytes());
}

/// The WAN send socket.
pub struct WanTx {
    fd: Fd,
    pub mac: [u8; 6],
}

impl WanTx {
    pub fn open(name: &str) -> Result<WanTx> {
        let idx = ifindex(name)? as i32;
        let fd = packet::open(libc::SOCK_RAW, 0).map_err(|e| {
            Error::new(format!("cannot open an AF_PACKET socket: {e}"))
                .hint("run as root or with CAP_NET_RAW")
        })?;
        // Protocol 0: this socket receives nothing.
        packet::bind(fd.0, 0, idx)
            .map_err(|e| Error::new(format!("cannot bind to {name}: {e}")))?;
        let one: libc::c_int = 1;
        // Best effort (Linux 3.14+): straight to the driver, no qdisc.
        let _ = set_opt(fd.0, libc::SOL_PACKET, PACKET_QDISC_BYPASS, &one);
        grow_buffer(fd.0, false, 8 << 20);
        Ok(WanTx {
            fd,
            mac: mac_of(name)?,
        })
    }

    /// `sendmmsg` of frames given as iovec triples; returns how many the
    /// kernel took (the rest count as errors at the caller).
    pub fn send_batch(&self, iovs: &mut [[libc::iovec; 3]], counts: &[usize]) -> io::Result<usize> {
        let mut msgs = sys::mmsghdrs(
            iovs.iter_mut()
                .zip(counts)
                .map(|(iov, &c)| (iov.as_mut_ptr(), c)),
        );
        let mut done = 0;
        while done < msgs.len() {
            // SAFETY: msgs[done..] are valid headers whose iovecs point to
            // live slices for the duration of the call.
            let rc = unsafe {
                libc::sendmmsg(
                    self.fd.0,
                    msgs[done..].as_mut_ptr(),
                    (msgs.len() - done) as libc::c_uint,
                    0,
                )
            };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if done == 0 {
                    return Err(e);
                }
                break;
            }
            if rc == 0 {
                break;
            }
            done += rc as usize;
        }
        Ok(done)
    }
}

#[derive(Debug, Clone, Copy)]
struct Route {
    dst: u32,
    mask: u32,
    gw: Option<u32>,
    metric: u32,
    on_wan: bool,
}

/// Next hops out of WAN, from the kernel's main routing table and
/// neighbour table, re-read every `refresh_ns`.
pub struct NextHops {
    wan: String,
    routes: Vec<Route>,
    neigh: HashMap<u32, [u8; 6]>,
    cache: HashMap<u32, Option<[u8; 6]>>,
    /// Local and broadcast addresses: never ours to forward.
    local: Vec<u32>,
    refreshed: u64,
    refresh_ns: u64,
    /// A next hop on WAN was not resolved yet: the slow path has asked the
    /// kernel to resolve it, so look again soon rather than in a second.
    unresolved: bool,
}

/// How soon to re-read the neighbour table after a miss.
const MISS_REFRESH_NS: u64 = 2_000_000;

impl NextHops {
    pub fn new(wan: &str, now: u64) -> NextHops {
        let mut n = NextHops {
            wan: wan.to_string(),
            routes: vec![],
            neigh: HashMap::new(),
            cache: HashMap::new(),
            local: vec![],
            refreshed: now,
            refresh_ns: 1_000_000_000,
            unresolved: false,
        };
        n.refresh(now);
        n
    }

    /// Re-read the tables when due; true if it did.
    pub fn maybe_refresh(&mut self, now: u64) -> bool {
        let age = now.saturating_sub(self.refreshed);
        if age >= self.refresh_ns || (self.unresolved && age >= MISS_REFRESH_NS) {
            self.refresh(now);
            return true;
        }
        false
    }

    /// This namespace's own and broadcast addresses, as last read.
    pub fn local(&self) -> &[u32] {
        &self.local
    }

    pub fn refresh(&mut self, now: u64) {
        self.refreshed = now;
        self.unresolved = false;
        self.cache.clear();
        if let Ok(s) = std::fs::read_to_string("/proc/net/route") {
            self.routes = parse_routes(&s, &self.wan);
        }
        if let Ok(s) = std::fs::read_to_string("/proc/net/arp") {
            self.neigh = parse_arp(&s, &self.wan);
        }
        self.local = local_addresses();
    }

    pub fn is_local(&self, dst: u32) -> bool {
        dst >= 0xe000_0000 || self.local.contains(&dst)
    }

    /// The MAC to send a packet for `dst` to, None if it must go the slow
    /// way (not routed out of WAN, or the neighbour not resolved).
    pub fn lookup(&mut self, dst: u32) -> Option<[u8; 6]> {
        if let Some(m) = self.cache.get(&dst) {
            return *m;
        }
        let m = self.resolve(dst);
        self.cache.insert(dst, m);
        m
    }

    fn resolve(&mut self, dst: u32) -> Option<[u8; 6]> {
        let best = self
            .routes
            .iter()
            .filter(|r| dst & r.mask == r.dst)
            .max_by(|a, b| a.mask.cmp(&b.mask).then(b.metric.cmp(&a.metric)))
            .copied()?;
        if !best.on_wan {
            return None;
        }
        let m = self.neigh.get(&best.gw.unwrap_or(dst)).copied();
        self.unresolved |= m.is_none();
        m
    }
}

fn parse_routes(s: &str, wan: &str) -> Vec<Route> {
    const RTF_UP: u32 = 0x1;
    const RTF_GATEWAY: u32 = 0x2;
    let hex = |f: &str| u32::from_str_radix(f, 16).ok();
    s.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let flags = hex(f[3])?;
            if flags & RTF_UP == 0 {
                return None;
            }
            // The file prints network-order words as host integers.
            let dst = u32::from_be(hex(f[1])?);
            let gw = u32::from_be(hex(f[2])?);
            let mask = u32::from_be(hex(f[7])?);
            Some(Route {
                dst: dst & mask,
                mask,
                gw: (flags & RTF_GATEWAY != 0).then_some(gw),
                metric: f[6].parse().ok()?,
                on_wan: f[0] == wan,
            })
        })
        .collect()
}

fn parse_arp(s: &str, wan: &str) -> HashMap<u32, [u8; 6]> {
    const ATF_COM: u32 = 0x2;
    s.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 6 || f[5] != wan {
                return None;
            }
            let flags = u32::from_str_radix(f[2].trim_start_matches("0x"), 16).ok()?;
            if flags & ATF_COM == 0 {
                return None;
            }
            let ip: Ipv4Addr = f[0].parse().ok()?;
            Some((u32::from(ip), parse_mac(f[3])?))
        })
        .collect()
}

/// This namespace's IPv4 addresses and broadcast addresses.
pub fn local_addresses() -> Vec<u32> {
    let mut out = vec![];
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap with a list we free below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: p is a node of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        for sa in [ifa.ifa_addr, ifa.ifa_ifu] {
            // SAFETY: a non-null sockaddr of family AF_INET is a sockaddr_in.
            if !sa.is_null() && unsafe { (*sa).sa_family } as i32 == libc::AF_INET {
                let sin = unsafe { &*(sa as *const libc::sockaddr_in) };
                out.push(u32::from_be(sin.sin_addr.s_addr));
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: ifap came from getifaddrs.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_and_neighbours_parse_and_match_longest_prefix() {
        let routes =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
            wan\t00000000\t0102A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
            wan\t0002A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
            lan\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        let arp =
            "IP address       HW type     Flags       HW address            Mask     Device\n\
            192.168.2.1      0x1         0x2         02:00:00:00:00:01     *        wan\n\
            192.168.2.7      0x1         0x2         02:00:00:00:00:07     *        wan\n\
            192.168.2.9      0x1         0x0         00:00:00:00:00:00     *        wan\n\
            192.168.1.5      0x1         0x2         02:00:00:00:01:05     *        lan\n";
        let mut n = NextHops {
            wan: "wan".into(),
            routes: parse_routes(routes, "wan"),
            neigh: parse_arp(arp, "wan"),
            cache: HashMap::new(),
            local: vec![],
            refreshed: 0,
            refresh_ns: u64::MAX,
            unresolved: false,
        };
        let ip = |s: &str| u32::from(s.parse::<Ipv4Addr>().unwrap());
        // Connected: the destination itself.
        assert_eq!(n.lookup(ip("192.168.2.7")), Some([2, 0, 0, 0, 0, 7]));
        // Unresolved neighbour: slow path.
        assert_eq!(n.lookup(ip("192.168.2.9")), None);
        assert!(n.unresolved, "a miss on WAN asks for an early refresh");
        // Elsewhere: the default gateway.
        assert_eq!(n.lookup(ip("10.1.2.3")), Some([2, 0, 0, 0, 0, 1]));
        // Routed out of LAN: not ours to send.
        assert_eq!(n.lookup(ip("192.168.1.5")), None);
    }

    #[test]
    fn ttl_and_checksums() {
        let mut ip = [
            0x45, 0, 0, 28, 0x12, 0x34, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2, 0x13, 0x88,
            0x13, 0x89, 0, 8, 0, 0,
        ];
        let c = !checksum::fold(checksum::sum(&ip[..20]));
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        decrement_ttl(&mut ip);
        assert_eq!(ip[8], 63);
        assert_eq!(checksum::fold(checksum::sum(&ip[..20])), 0xffff);
        increment_ttl(&mut ip);
        assert_eq!(ip[8], 64);
        assert_eq!(checksum::fold(checksum::sum(&ip[..20])), 0xffff);
        // A partial UDP checksum (pseudo-header sum in the field) finished.
        let mut prefix = [0u8; RX_PREFIX];
        prefix[0] = VIRTIO_NET_HDR_F_NEEDS_CSUM;
        prefix[6..8].copy_from_slice(&(34u16).to_ne_bytes());
        prefix[8..10].copy_from_slice(&(6u16).to_ne_bytes());
        let mut pseudo = vec![];
        pseudo.extend_from_slice(&ip[12..20]);
        pseudo.extend_from_slice(&[0, 17, 0, 8]);
        let ph = checksum::fold(checksum::sum(&pseudo));
        ip[26..28].copy_from_slice(&ph.to_be_bytes());
        let mut padded = ip.to_vec();
        padded.extend_from_slice(&[0; 18]); // Ethernet padding
        assert_eq!(finish(&prefix, &mut padded), Some(28));
        let mut full = pseudo.clone();
        full.extend_from_slice(&padded[20..28]);
        assert_eq!(checksum::fold(checksum::sum(&full)), 0xffff);
        // A bad header checksum is refused.
        padded[10] ^= 1;
        assert_eq!(finish(&prefix, &mut padded), None);
    }

    #[test]
    fn macs_parse() {
        assert_eq!(parse_mac("02:0a:ff:00:01:10"), Some([2, 10, 255, 0, 1, 16]));
        assert_eq!(parse_mac("02:0a:ff:00:01"), None);
        assert_eq!(parse_mac("02:0a:ff:00:01:10:11"), None);
    }
}
