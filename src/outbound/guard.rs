//! Which addresses exportd may connect to on a tenant's behalf: public ones, and those inside
//! a network the operator allowed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// The operator's exceptions (`EXPORTD_WEBHOOK_ALLOW_NETS`, `EXPORTD_DELIVERY_ALLOW_NETS`).
#[derive(Debug, Clone)]
pub struct AddressGuard {
    allowed: Vec<IpNet>,
    /// The setting that allows more, named in refusals.
    setting: &'static str,
}

impl Default for AddressGuard {
    fn default() -> Self {
        AddressGuard::new(Vec::new())
    }
}

impl AddressGuard {
    /// The webhooks' guard.
    pub fn new(allowed: Vec<IpNet>) -> AddressGuard {
        AddressGuard { allowed, setting: "EXPORTD_WEBHOOK_ALLOW_NETS" }
    }

    /// A guard whose refusals name `setting` as the way to allow more.
    pub fn named(allowed: Vec<IpNet>, setting: &'static str) -> AddressGuard {
        AddressGuard { allowed, setting }
    }

    /// `Err` names why `ip` may not be connected to.
    pub fn check(&self, ip: IpAddr) -> Result<(), String> {
        let ip = canonical(ip);
        match non_public_kind(ip) {
            Some(kind) if !self.allowed.iter().any(|net| net.contains(&ip)) => {
                Err(format!("a {kind} address (allow its network with {})", self.setting))
            }
            _ => Ok(()),
        }
    }
}

/// An IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) is the IPv4 address it maps.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// What kind of non-public address `ip` is, if it is one.
fn non_public_kind(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_kind(v4),
        IpAddr::V6(v6) => v6_kind(v6),
    }
}

fn v4_kind(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_private() {
        Some("private")
    } else if ip.is_link_local() {
        Some("link-local (cloud metadata)")
    } else if ip.is_unspecified() || a == 0 {
        Some("unspecified")
    } else if a == 100 && (64..128).contains(&b) {
        Some("shared (carrier-grade NAT)")
    } else if ip.is_multicast() || ip.is_broadcast() || a >= 240 {
        Some("multicast or reserved")
    } else if ip.is_documentation() || (a == 198 && (18..20).contains(&b)) || (a == 192 && b == 0) {
        Some("reserved")
    } else {
        None
    }
}

fn v6_kind(ip: Ipv6Addr) -> Option<&'static str> {
    let segments = ip.segments();
    let first = segments[0];
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_unspecified() {
        Some("unspecified")
    } else if ip.is_unique_local() {
        Some("private (unique local)")
    } else if ip.is_unicast_link_local() {
        Some("link-local")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if first == 0x64 && ip.segments()[1] == 0xff9b {
        Some("NAT64 (maps IPv4)")
    } else if first == 0x2001 && ip.segments()[1] == 0x0db8 {
        Some("documentation")
    } else if first == 0x2002 || (first == 0x2001 && ip.segments()[1] == 0) {
        Some("6to4 or Teredo (maps IPv4)")
    } else if segments[..6] == [0; 6] {
        Some("IPv4-compatible (::/96, deprecated, maps IPv4)")
    } else if segments[..6] == [0, 0, 0, 0, 0xffff, 0] {
        Some("IPv4-translated (::ffff:0:0:0/96, maps IPv4)")
    } else if first & 0xffc0 == 0xfec0 {
        Some("site-local (fec0::/10, deprecated private)")
    } else if segments[..4] == [0x0100, 0, 0, 0] {
        Some("discard-only (100::/64)")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(guard: &AddressGuard, ip: &str) -> bool {
        guard.check(ip.parse().unwrap()).is_err()
    }

    #[test]
    fn internal_addresses_are_refused_unless_allowed() {
        let guard = AddressGuard::default();
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "fd00:ec2::254",
            "fe80::1",
            "64:ff9b::7f00:1",
            "::",
            "::127.0.0.1",
            "::a9fe:a9fe",
            "::ffff:0:7f00:1",
            "fec0::1",
            "feff::1",
            "100::1",
        ] {
            assert!(refused(&guard, ip), "{ip} must be refused");
        }
        for ip in ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111"] {
            assert!(!refused(&guard, ip), "{ip} is public");
        }
        let allowed = AddressGuard::new(vec!["127.0.0.0/8".parse().unwrap()]);
        assert!(!refused(&allowed, "127.0.0.1"));
        assert!(!refused(&allowed, "::ffff:127.0.0.1"));
        assert!(refused(&allowed, "169.254.169.254"));
        let message = guard.check("169.254.169.254".parse().unwrap()).unwrap_err();
        assert!(message.contains("link-local") && message.contains("EXPORTD_WEBHOOK_ALLOW_NETS"), "{message}");
    }
}
