//! The router's own Linux calls (interfaces, capabilities, sysctls, `ip`
//! commands, `writev`, real-time priority) on top of the shared syscall
//! layer `ka-sys`, re-exported here so the shells name one module.
//! Every failure becomes an [`Error`] with a hint, never a panic.

use std::io;
use std::os::fd::RawFd;
use std::process::Command;

pub use ka_sys::*;

/// Print an error the way every binary here does and pick the exit code.
pub fn report(program: &str, e: &Error) -> i32 {
    eprintln!("{program}: ERROR: {e}");
    1
}

pub fn iface_exists(name: &str) -> bool {
    ifindex(name).is_ok()
}

#[repr(C)]
struct IfReqInt {
    name: [libc::c_char; libc::IFNAMSIZ],
    value: libc::c_int,
    _pad: [u8; 20],
}

/// MTU of an interface (SIOCGIFMTU: namespace-correct, unlike sysfs).
pub fn iface_mtu(name: &str) -> Result<usize> {
    // SAFETY: plain socket creation; closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::new(format!(
            "socket: {}",
            io::Error::last_os_error()
        )));
    }
    let mut req = IfReqInt {
        name: [0; libc::IFNAMSIZ],
        value: 0,
        _pad: [0; 20],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: req is a properly sized ifreq for SIOCGIFMTU.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) };
    let err = io::Error::last_os_error();
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return Err(Error::new(format!("cannot read the MTU of {name}: {err}")));
    }
    Ok(req.value as usize)
}

/// Does this process hold CAP_NET_ADMIN and CAP_NET_RAW (effective)?
pub fn has_net_caps() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    let Some(line) = status.lines().find(|l| l.starts_with("CapEff:")) else {
        return false;
    };
    let Ok(bits) = u64::from_str_radix(line["CapEff:".len()..].trim(), 16) else {
        return false;
    };
    const CAP_NET_ADMIN: u64 = 12;
    const CAP_NET_RAW: u64 = 13;
    bits & (1 << CAP_NET_ADMIN) != 0 && bits & (1 << CAP_NET_RAW) != 0
}

pub fn require_net_caps(program: &str) -> Result<()> {
    if has_net_caps() {
        return Ok(());
    }
    Err(Error::new(format!("{program} needs CAP_NET_ADMIN and CAP_NET_RAW"))
        .hint(format!("run it as root (sudo {program} ...) or grant the capabilities: setcap cap_net_admin,cap_net_raw+ep $(which {program})")))
}

/// Run `ip ARGS...`; an error carries ip's own message.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().map_err(|e| {
        Error::new(format!("cannot run `ip`: {e}"))
            .hint("install iproute2 (apt-get install iproute2)")
    })?;
    if !out.status.success() {
        return Err(Error::new(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Run `ip ARGS...` where failure is expected and fine (clean-up).
pub fn ip_quiet(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn sysctl_path(key: &str) -> String {
    format!("/proc/sys/{}", key.replace('.', "/"))
}

pub fn sysctl_read(key: &str) -> Result<String> {
    std::fs::read_to_string(sysctl_path(key))
        .map(|s| s.trim().to_string())
        .map_err(|e| Error::new(format!("cannot read sysctl {key}: {e}")))
}

pub fn sysctl_write(key: &str, value: &str) -> Result<()> {
    std::fs::write(sysctl_path(key), value)
        .map_err(|e| Error::new(format!("cannot set sysctl {key}={value}: {e}")))
}

/// `writev(2)` of up to two slices.
pub fn writev2(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<usize> {
    let iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    let cnt = if b.is_empty() { 1 } else { 2 };
    // SAFETY: iov points to live slices for the duration of the call.
    let n = unsafe { libc::writev(fd, iov.as_ptr(), cnt) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The headers `sendmmsg`/`recvmmsg` take: one a message, each naming its
/// iovecs as `(first, count)`. The iovecs must outlive every use of them.
pub fn mmsghdrs(iovs: impl Iterator<Item = (*mut libc::iovec, usize)>) -> Vec<libc::mmsghdr> {
    iovs.map(|(first, count)| {
        // SAFETY: mmsghdr is plain data; all-zero is valid.
        let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
        m.msg_hdr.msg_iov = first;
        m.msg_hdr.msg_iovlen = count as _;
        m
    })
    .collect()
}

/// Ask for SCHED_FIFO at `priority` (1..99) so a wake-up preempts ordinary
/// processes: timing, not throughput, is what the caller sells. Returns
/// false (and changes nothing) when not permitted.
pub fn realtime_priority(priority: i32) -> bool {
    let p = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: p is a valid sched_param; pid 0 is this thread.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) == 0 }
}
