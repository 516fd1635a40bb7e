//! `ka-blast`: a fast UDP sender/receiver for benchmarks and tests (a
//! Python sender tops out far below what the router must be measured at).
//!
//! Every datagram carries a magic, a sequence number and the CLOCK_MONOTONIC
//! send time, so the receiver (in another namespace, same clock) reports
//! one-way latency percentiles, loss and reordering. Output: one JSON
//! object on stdout.

use std::io;
use std::net::SocketAddrV4;

use clap::{Parser, Subcommand};
use ka_core::units::parse_duration_ns;
use ka_edge::sys;
use serde::Serialize;

const MAGIC: &[u8; 8] = b"KABLAST1";
const HEADER: usize = 24;

#[derive(Debug, Parser)]
#[command(name = "ka-blast", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Send UDP datagrams as fast as possible or at a fixed rate
    Send {
        /// Destination IPv4 address and port
        #[arg(long)]
        dst: SocketAddrV4,
        /// Local address to bind (optional)
        #[arg(long)]
        bind: Option<SocketAddrV4>,
        /// UDP payload bytes (1472 makes 1500-byte IP packets)
        #[arg(long, default_value_t = 1472)]
        payload: usize,
        /// Mixed sizes instead of --payload: UDP payload bytes used in turn,
        /// e.g. 72,548,1472 (100-, 576- and 1500-byte IP packets)
        #[arg(long, value_delimiter = ',')]
        mix: Vec<usize>,
        /// Packets per second; 0 = as fast as possible
        #[arg(long, default_value_t = 0)]
        pps: u64,
        #[arg(long, value_parser = parse_duration_ns, default_value = "5s")]
        duration: u64,
        /// Stop after this many packets
        #[arg(long)]
        count: Option<u64>,
        /// Set DF (default: DF clear, so routers may fragment)
        #[arg(long)]
        df: bool,
        /// Datagrams per sendmmsg call at full speed
        #[arg(long, default_value_t = 32)]
        batch: usize,
    },
    /// Receive and report count, rate, one-way latency, loss, reordering
    Recv {
        #[arg(long)]
        bind: SocketAddrV4,
        /// Give up after this long in total
        #[arg(long, value_parser = parse_duration_ns, default_value = "10s")]
        duration: u64,
        /// Stop this long after the last datagram (once one arrived)
        #[arg(long, value_parser = parse_duration_ns, default_value = "1s")]
        idle: u64,
    },
}

#[derive(Serialize)]
struct SendReport {
    sent: u64,
    errors: u64,
    seconds: f64,
    pps: f64,
    bits_per_second: f64,
}

#[derive(Serialize)]
struct RecvReport {
    received: u64,
    bytes: u64,
    /// From the first to the last datagram.
    seconds: f64,
    pps: f64,
    /// Sequence numbers never seen between the lowest and highest seen.
    missing: u64,
    reordered: u64,
    duplicates: u64,
    bad: u64,
    latency_us: Option<Latency>,
}

#[derive(Serialize)]
struct Latency {
    min: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    mean: f64,
}

fn udp_socket(bind: Option<SocketAddrV4>) -> Result<sys::Fd, sys::Error> {
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(sys::Error::new(format!(
            "socket: {}",
            io::Error::last_os_error()
        )));
    }
    let fd = sys::Fd(fd);
    let big: libc::c_int = 8 << 20;
    for opt in [
        libc::SO_SNDBUF,
        libc::SO_RCVBUF,
        libc::SO_RCVBUFFORCE,
        libc::SO_SNDBUFFORCE,
    ] {
        // Best effort: failures are fine.
        let _ = sys::set_opt(fd.0, libc::SOL_SOCKET, opt, &big);
    }
    if let Some(b) = bind {
        let sa = sys::sockaddr_in(b);
        // SAFETY: sa is a valid sockaddr_in.
        let rc = unsafe { libc::bind(fd.0, (&sa as *const libc::sockaddr_in).cast(), 16) };
        if rc < 0 {
            return Err(sys::Error::new(format!(
                "cannot bind {b}: {}",
                io::Error::last_os_error()
            )));
        }
    }
    Ok(fd)
}

fn sleep_until(t: u64) {
    let ts = libc::timespec {
        tv_sec: (t / 1_000_000_000) as libc::time_t,
        tv_nsec: (t % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: ts is valid; EINTR simply returns early.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        )
    };
}

#[allow(clippy::too_many_arguments)]
fn send(
    dst: SocketAddrV4,
    bind: Option<SocketAddrV4>,
    payload: usize,
    mix: Vec<usize>,
    pps: u64,
    duration: u64,
    count: Option<u64>,
    df: bool,
    batch: usize,
) -> Result<SendReport, sys::Error> {
    let sizes = if mix.is_empty() { vec![payload] } else { mix };
    if sizes.iter().any(|&p| p < HEADER) {
        return Err(sys::Error::new(format!(
            "--payload and --mix sizes must be at least {HEADER} bytes"
        )));
    }
    let payload = sizes.iter().copied().max().unwrap_or(payload);
    let mut bytes = 0u64;
    let fd = udp_socket(bind)?;
    // Best effort, as the buffers.
    let _ = sys::set_dont_fragment(fd.0, df);
    let sa = sys::sockaddr_in(dst);
    // SAFETY: sa is a valid sockaddr_in.
    if unsafe { libc::connect(fd.0, (&sa as *const libc::sockaddr_in).cast(), 16) } < 0 {
        return Err(sys::Error::new(format!(
            "cannot connect to {dst}: {}",
            io::Error::last_os_error()
        )));
    }
    let batch = if pps == 0 { batch.clamp(1, 1024) } else { 1 };
    let mut bufs: Vec<Vec<u8>> = (0..batch).map(|_| vec![0xa5u8; payload]).collect();
    let limit = count.unwrap_or(u64::MAX);
    let start = sys::now();
    let end = start + duration;
    let mut seq = 0u64;
    let mut errors = 0u64;
    while seq < limit {
        let now = sys::now();
        if now >= end || sys::stop_requested() {
            break;
        }
        if let Some(gap) = (seq * 1_000_000_000).checked_div(pps) {
            let due = start + gap;
            if due > now {
                sleep_until(due);
            }
        }
        let n = batch.min((limit - seq) as usize);
        let ts = sys::now();
        for (i, b) in bufs.iter_mut().take(n).enumerate() {
            b[..8].copy_from_slice(MAGIC);
            b[8..16].copy_from_slice(&(seq + i as u64).to_be_bytes());
            b[16..24].copy_from_slice(&ts.to_be_bytes());
        }
        let mut iovs: Vec<libc::iovec> = bufs
            .iter()
            .take(n)
            .enumerate()
            .map(|(i, b)| libc::iovec {
                iov_base: b.as_ptr() as *mut _,
                iov_len: sizes[(seq as usize + i) % sizes.len()],
            })
            .collect();
        let mut msgs = sys::mmsghdrs(iovs.iter_mut().map(|iov| (iov as *mut _, 1)));
        // SAFETY: msgs is a valid array of n mmsghdr.
        let rc = unsafe { libc::sendmmsg(fd.0, msgs.as_mut_ptr(), n as u32, 0) };
        if rc < 0 {
            // ENOBUFS/ECONNREFUSED under overload: count, back off a hair.
            errors += 1;
            std::thread::yield_now();
            continue;
        }
        bytes += iovs[..rc as usize]
            .iter()
            .map(|v| (v.iov_len + 28) as u64)
            .sum::<u64>();
        seq += rc as u64;
    }
    let secs = (sys::now() - start) as f64 / 1e9;
    Ok(SendReport {
        sent: seq,
        errors,
        seconds: secs,
        pps: seq as f64 / secs,
        bits_per_second: bytes as f64 * 8.0 / secs,
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn recv(bind: SocketAddrV4, duration: u64, idle: u64) -> Result<RecvReport, sys::Error> {
    let fd = udp_socket(Some(bind))?;
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 50_000,
    };
    let _ = sys::set_opt(fd.0, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv);
    const B: usize = 64;
    let mut bufs = vec![[0u8; 2048]; B];
    let start = sys::now();
    let (mut first, mut last) = (0u64, 0u64);
    let mut r = RecvReport {
        received: 0,
        bytes: 0,
        seconds: 0.0,
        pps: 0.0,
        missing: 0,
        reordered: 0,
        duplicates: 0,
        bad: 0,
        latency_us: None,
    };
    let mut lat: Vec<f64> = Vec::new();
    let mut seen: Vec<u64> = Vec::new(); // bitmap of sequence numbers
    let (mut max_seq, mut min_seq) = (0u64, u64::MAX);
    loop {
        let now = sys::now();
        if now - start >= duration
            || sys::stop_requested()
            || (r.received > 0 && now - last >= idle)
        {
            break;
        }
        let mut iovs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        let mut msgs = sys::mmsghdrs(iovs.iter_mut().map(|iov| (iov as *mut _, 1)));
        // SAFETY: msgs is a valid array of B mmsghdr; MSG_WAITFORONE
        // returns as soon as one datagram is there.
        let n = unsafe {
            libc::recvmmsg(
                fd.0,
                msgs.as_mut_ptr(),
                B as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        let t = sys::now();
        if n <= 0 {
            continue;
        }
        for (i, m) in msgs.iter().take(n as usize).enumerate() {
            let len = m.msg_len as usize;
            let b = &bufs[i][..len.min(2048)];
            if len < HEADER || &b[..8] != MAGIC {
                r.bad += 1;
                continue;
            }
            let seq = u64::from_be_bytes(b[8..16].try_into().unwrap_or([0; 8]));
            let sent = u64::from_be_bytes(b[16..24].try_into().unwrap_or([0; 8]));
            if r.received == 0 {
                first = t;
            }
            last = t;
            let word = (seq / 64) as usize;
            if word < 1 << 24 {
                if seen.len() <= word {
                    seen.resize(word + 1, 0);
                }
                if seen[word] & (1 << (seq % 64)) != 0 {
                    r.duplicates += 1;
                    continue;
                }
                seen[word] |= 1 << (seq % 64);
            }
            if r.received > 0 && seq < max_seq {
                r.reordered += 1;
            }
            max_seq = max_seq.max(seq);
            min_seq = min_seq.min(seq);
            r.received += 1;
            r.bytes += len as u64;
            lat.push(t.saturating_sub(sent) as f64 / 1e3);
        }
    }
    if r.received > 0 {
        r.seconds = (last - first) as f64 / 1e9;
        r.pps = if r.seconds > 0.0 {
            (r.received - 1) as f64 / r.seconds
        } else {
            0.0
        };
        r.missing = (max_seq - min_seq + 1).saturating_sub(r.received);
        lat.sort_by(|a, b| a.total_cmp(b));
        r.latency_us = Some(Latency {
            min: lat[0],
            p50: percentile(&lat, 0.5),
            p90: percentile(&lat, 0.9),
            p99: percentile(&lat, 0.99),
            max: lat[lat.len() - 1],
            mean: lat.iter().sum::<f64>() / lat.len() as f64,
        });
    }
    Ok(r)
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = sys::install_stop_handlers() {
        std::process::exit(sys::report("ka-blast", &e));
    }
    let out = match cli.cmd {
        Cmd::Send {
            dst,
            bind,
            payload,
            mix,
            pps,
            duration,
            count,
            df,
            batch,
        } => send(dst, bind, payload, mix, pps, duration, count, df, batch)
            .and_then(|r| serde_json::to_string(&r).map_err(|e| sys::Error::new(e.to_string()))),
        Cmd::Recv {
            bind,
            duration,
            idle,
        } => recv(bind, duration, idle)
            .and_then(|r| serde_json::to_string(&r).map_err(|e| sys::Error::new(e.to_string()))),
    };
    match out {
        Ok(s) => println!("{s}"),
        Err(e) => std::process::exit(sys::report("ka-blast", &e)),
    }
}
