//! IO shells around `ka-core`: the TUN router, the AF_PACKET link
//! emulator, and the small syscall layer they share.

pub mod afpacket;
pub mod lan_guard;
pub mod linkem_shell;
pub mod packet_path;
pub mod pool;
pub mod router_shell;
pub mod sys;
pub mod tun;
