//! A TUN device (layer 3, no packet-info header), non-blocking. The device
//! exists while the fd is open: a crashed router leaves no device behind.

use std::io;
use std::os::fd::RawFd;

use crate::sys::{Error, Fd, Result};

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;

#[repr(C)]
struct IfReqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

pub struct Tun {
    fd: Fd,
    name: String,
}

impl Tun {
    pub fn create(name: &str) -> Result<Tun> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(Error::new(format!(
                "bad TUN device name {name:?} (1-15 characters)"
            )));
        }
        let path = c"/dev/net/tun";
        // SAFETY: path is a valid C string.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            let err = Error::new(format!("cannot open /dev/net/tun: {e}"));
            return Err(match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENODEV) => {
                    err.hint("load the tun module: modprobe tun")
                }
                Some(libc::EACCES) | Some(libc::EPERM) => {
                    err.hint("run as root or with CAP_NET_ADMIN")
                }
                _ => err,
            });
        }
        let fd = Fd(fd);
        let mut req = IfReqFlags {
            name: [0; libc::IFNAMSIZ],
            flags: IFF_TUN | IFF_NO_PI,
            _pad: [0; 22],
        };
        for (d, s) in req.name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        // SAFETY: req is a correctly sized ifreq for TUNSETIFF.
        if unsafe { libc::ioctl(fd.0, TUNSETIFF, &mut req) } < 0 {
            let e = io::Error::last_os_error();
            let err = Error::new(format!("cannot create TUN device {name}: {e}"));
            return Err(match e.raw_os_error() {
                Some(libc::EPERM) => err.hint("run as root or with CAP_NET_ADMIN"),
                Some(libc::EBUSY) | Some(libc::EINVAL) => err.hint(format!(
                    "{name} exists and is not a free TUN device: pick another --tun name"
                )),
                _ => err,
            });
        }
        Ok(Tun {
            fd,
            name: name.to_string(),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.0
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}
