//! [`QpInfo`]: one side of an RDMA connection as exchanged in `Hello` /
//! `HelloAck` ([`Descriptor::Rdma`]), with the checks a peer's descriptor
//! must pass before a queue pair is connected to it.

use crate::protocol::{Descriptor, GID_LEN};
use crate::transport::{descriptor_kind, TransportError};

/// Queue pair numbers are 24-bit.
pub const MAX_QP_NUM: u32 = 0x00FF_FFFF;

/// One side of an RC connection: its queue pair, how to route to it, and
/// the memory region the other side may write (receiver) or the staging
/// buffer's registration (sender; the remote never writes it, so `rkey` is 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number (24 bits).
    pub qp_num: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID of the port (all zero on InfiniBand without global routing).
    pub gid: [u8; GID_LEN],
    /// Remote key of the memory region.
    pub rkey: u32,
    /// Start address of the memory region in the owner's address space.
    pub addr: u64,
    /// Length of the memory region in bytes.
    pub len: u64,
}

impl QpInfo {
    /// The wire form.
    pub fn to_descriptor(&self) -> Descriptor {
        Descriptor::Rdma {
            qp_num: self.qp_num,
            lid: self.lid,
            gid: self.gid.to_vec(),
            rkey: self.rkey,
            addr: self.addr,
            len: self.len,
        }
    }

    /// Parses and checks a peer's descriptor: it must be `rdma`
    /// ([`TransportError::Unsupported`] otherwise), with a 16-byte GID, a
    /// 24-bit non-zero QP number and a region that does not wrap around the
    /// address space ([`TransportError::BadDescriptor`]). A zero GID with a
    /// zero LID cannot be routed and is rejected too.
    pub fn from_descriptor(d: &Descriptor) -> Result<Self, TransportError> {
        let Descriptor::Rdma {
            qp_num,
            lid,
            gid,
            rkey,
            addr,
            len,
        } = d
        else {
            return Err(TransportError::Unsupported {
                transport: "rdma",
                descriptor: descriptor_kind(d),
            });
        };
        let gid: [u8; GID_LEN] = gid.as_slice().try_into().map_err(|_| {
            TransportError::BadDescriptor(format!(
                "rdma gid has {} bytes, expected {GID_LEN}",
                gid.len()
            ))
        })?;
        if *qp_num == 0 || *qp_num > MAX_QP_NUM {
            return Err(TransportError::BadDescriptor(format!(
                "rdma qp_num {qp_num:#x} is not a 24-bit queue pair number above 0"
            )));
        }
        if addr.checked_add(*len).is_none() {
            return Err(TransportError::BadDescriptor(format!(
                "rdma region at {addr:#x} of {len} bytes wraps around the address space"
            )));
        }
        if *lid == 0 && gid == [0; GID_LEN] {
            return Err(TransportError::BadDescriptor(
                "rdma descriptor has neither a LID nor a GID to route to".into(),
            ));
        }
        Ok(Self {
            qp_num: *qp_num,
            lid: *lid,
            gid,
            rkey: *rkey,
            addr: *addr,
            len: *len,
        })
    }

    /// True if the peer is reached through its GID (RoCE, or InfiniBand
    /// with global routing): the GID is not all zero.
    pub fn is_global(&self) -> bool {
        self.gid != [0; GID_LEN]
    }

    /// Checks that a receiver's region is exactly the announced geometry
    /// (`chunk_bytes * capacity_chunks` bytes).
    pub fn check_geometry(
        &self,
        chunk_bytes: u64,
        capacity_chunks: u64,
    ) -> Result<(), TransportError> {
        match chunk_bytes.checked_mul(capacity_chunks) {
            Some(n) if n == self.len => Ok(()),
            other => Err(TransportError::BadDescriptor(format!(
                "rdma region of {} bytes, but {capacity_chunks} slots of {chunk_bytes} bytes are {other:?}",
                self.len
            ))),
        }
    }
}

/// The initial packet sequence number of the send queue of QP `qp_num`
/// (and so the receive PSN its peer expects). `Descriptor::Rdma` carries no
/// PSN, so both sides derive it from the sender's QP number; mixing the bits
/// keeps a new QP that reuses a number from starting where an old one left.
pub fn initial_psn(qp_num: u32) -> u32 {
    qp_num.wrapping_mul(0x9E37_79B1).rotate_left(13) & MAX_QP_NUM
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> QpInfo {
        QpInfo {
            qp_num: 0x11,
            lid: 0,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            rkey: 0xdead,
            addr: 0x7f00_0000_0000,
            len: 4096 * 8,
        }
    }

    #[test]
    fn roundtrips_through_the_descriptor_and_the_wire() {
        let i = info();
        assert_eq!(QpInfo::from_descriptor(&i.to_descriptor()).unwrap(), i);
        let msg = crate::protocol::Message::Hello(crate::protocol::Hello {
            sender_id: "p0".into(),
            version: crate::protocol::PROTOCOL_VERSION,
            transport: "rdma".into(),
            descriptor: i.to_descriptor(),
        });
        let mut buf = Vec::new();
        crate::protocol::encode_into(&msg, &mut buf);
        let back = crate::protocol::decode(&buf).unwrap();
        let crate::protocol::Message::Hello(h) = back else {
            panic!("decoded {back:?}")
        };
        assert_eq!(QpInfo::from_descriptor(&h.descriptor).unwrap(), i);
        assert!(i.is_global());
    }

    #[test]
    fn rejects_bad_descriptors() {
        let shm = Descriptor::Shm {
            path: "/dev/shm/x".into(),
            len: 1,
        };
        assert!(matches!(
            QpInfo::from_descriptor(&shm),
            Err(TransportError::Unsupported {
                transport: "rdma",
                descriptor: "shm"
            })
        ));
        let bad = |f: &dyn Fn(&mut Descriptor)| {
            let mut d = info().to_descriptor();
            f(&mut d);
            match QpInfo::from_descriptor(&d) {
                Err(TransportError::BadDescriptor(m)) => m,
                other => panic!("expected BadDescriptor, got {other:?}"),
            }
        };
        let set =
            |d: &mut Descriptor, q: Option<u32>, g: Option<Vec<u8>>, a: Option<(u64, u64)>| {
                if let Descriptor::Rdma {
                    qp_num,
                    gid,
                    addr,
                    len,
                    ..
                } = d
                {
                    if let Some(q) = q {
                        *qp_num = q;
                    }
                    if let Some(g) = g {
                        *gid = g;
                    }
                    if let Some((x, n)) = a {
                        *addr = x;
                        *len = n;
                    }
                }
            };
        assert!(bad(&|d| set(d, None, Some(vec![1; 4]), None)).contains("gid"));
        assert!(bad(&|d| set(d, Some(0), None, None)).contains("qp_num"));
        assert!(bad(&|d| set(d, Some(MAX_QP_NUM + 1), None, None)).contains("qp_num"));
        assert!(bad(&|d| set(d, None, None, Some((u64::MAX, 2)))).contains("wraps"));
        assert!(bad(&|d| set(d, None, Some(vec![0; GID_LEN]), None)).contains("route"));
        // A LID alone (InfiniBand, local routing) is fine.
        let mut ib = info();
        ib.gid = [0; GID_LEN];
        ib.lid = 7;
        assert!(!QpInfo::from_descriptor(&ib.to_descriptor())
            .unwrap()
            .is_global());
    }

    #[test]
    fn geometry_must_match() {
        let i = info();
        i.check_geometry(4096, 8).unwrap();
        assert!(matches!(
            i.check_geometry(4096, 9),
            Err(TransportError::BadDescriptor(_))
        ));
        assert!(matches!(
            i.check_geometry(u64::MAX, 2),
            Err(TransportError::BadDescriptor(_))
        ));
    }

    #[test]
    fn psn_is_24_bit_and_depends_on_the_qp() {
        let psns: std::collections::HashSet<u32> = (1..1000).map(initial_psn).collect();
        assert!(psns.iter().all(|p| *p <= MAX_QP_NUM));
        assert!(psns.len() > 990, "psns collide too often: {}", psns.len());
        assert_eq!(initial_psn(42), initial_psn(42));
    }
}
