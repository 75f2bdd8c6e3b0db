//! Data planes a receiver sets up per sender during the `Hello` exchange.
//!
//! Shared memory and TCP offer one descriptor to every sender. RDMA cannot:
//! an RC queue pair is connected to exactly one peer queue pair, so the
//! receiver has to make one for each sender, towards the queue pair the
//! sender announced in its `Hello`. A [`HelloAcceptor`] does that; the
//! receiver's core calls it from `on_hello` and stays free of any
//! transport (and of the `rdma` cargo feature), so tests drive it with a
//! fake acceptor.

use std::sync::Arc;

use crate::protocol::Descriptor;
use crate::region::Region;

/// A data plane whose receiver side is set up per sender, during `Hello`.
pub trait HelloAcceptor: Send + std::fmt::Debug {
    /// The transport name a `Hello` asks for to reach this acceptor
    /// (`"rdma"`); also the name the `HelloAck` answers with.
    fn kind(&self) -> &'static str;

    /// Sets up this receiver's side towards `sender` (the `Hello`'s
    /// descriptor) and returns the descriptor for the `HelloAck`. The error
    /// text goes back to the sender in a `peer_unavailable` reply.
    fn accept(&mut self, sender: &Descriptor) -> Result<Descriptor, String>;

    /// Tears down what [`HelloAcceptor::accept`] set up for `sender` (the
    /// same descriptor), when that sender's lease expired or it said `Hello`
    /// again. Unknown descriptors are ignored.
    fn forget(&mut self, sender: &Descriptor);
}

/// Builds a receiver's [`HelloAcceptor`] over its receive buffer once the
/// buffer exists (the RDMA acceptor registers it with the NIC and keeps the
/// `Arc` for as long as the registration lives).
#[derive(Clone)]
pub struct AcceptorFactory(
    #[allow(clippy::type_complexity)]
    Arc<
        dyn Fn(Arc<Region>) -> Result<Box<dyn HelloAcceptor>, crate::transport::TransportError>
            + Send
            + Sync,
    >,
);

impl AcceptorFactory {
    /// Wraps `f`, which is called once by `Receiver::start`.
    pub fn new(
        f: impl Fn(Arc<Region>) -> Result<Box<dyn HelloAcceptor>, crate::transport::TransportError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        Self(Arc::new(f))
    }

    /// Builds the acceptor over `region`.
    pub fn build(
        &self,
        region: Arc<Region>,
    ) -> Result<Box<dyn HelloAcceptor>, crate::transport::TransportError> {
        (self.0)(region)
    }

    /// The acceptor a receiver needs to offer the data plane `transport`:
    /// `"rdma"` → `AcceptorFactory::rdma` with the device from
    /// `KVFERRY_RDMA_*` (with the `rdma` feature; without it
    /// [`TransportError::NotBuilt`](crate::transport::TransportError::NotBuilt));
    /// `"shm"` and `"tcp"` → `None` (offered to every sender alike);
    /// anything else → [`TransportError::UnknownTransport`](crate::transport::TransportError::UnknownTransport).
    pub fn for_transport(
        transport: &str,
        cfg: &crate::transport::TransportConfig,
    ) -> Result<Option<Self>, crate::transport::TransportError> {
        match transport {
            "shm" | "tcp" => Ok(None),
            #[cfg(feature = "rdma")]
            "rdma" => Ok(Some(Self::rdma(
                crate::transport::rdma::RdmaConfig::from_env(cfg)?,
            ))),
            #[cfg(not(feature = "rdma"))]
            "rdma" => {
                let _ = cfg;
                Err(crate::transport::TransportError::NotBuilt {
                    transport: "rdma",
                    feature: "the `rdma` cargo feature",
                })
            }
            other => Err(crate::transport::TransportError::UnknownTransport(
                other.to_owned(),
            )),
        }
    }

    /// The RDMA acceptor ([`RdmaReceiverSide`](crate::transport::rdma::RdmaReceiverSide))
    /// on the device of `cfg`.
    #[cfg(feature = "rdma")]
    pub fn rdma(cfg: crate::transport::rdma::RdmaConfig) -> Self {
        Self::new(move |region| {
            Ok(Box::new(crate::transport::rdma::RdmaReceiverSide::new(
                region, &cfg,
            )?))
        })
    }
}

impl std::fmt::Debug for AcceptorFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AcceptorFactory(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{TransportConfig, TransportError};

    #[test]
    fn shm_and_tcp_need_no_acceptor_and_unknown_names_are_refused() {
        let cfg = TransportConfig::default();
        assert!(AcceptorFactory::for_transport("shm", &cfg)
            .unwrap()
            .is_none());
        assert!(AcceptorFactory::for_transport("tcp", &cfg)
            .unwrap()
            .is_none());
        assert!(matches!(
            AcceptorFactory::for_transport("udp", &cfg),
            Err(TransportError::UnknownTransport(n)) if n == "udp"
        ));
        assert_eq!(
            format!(
                "{:?}",
                AcceptorFactory::new(|_| Err(TransportError::Closed))
            ),
            "AcceptorFactory(..)"
        );
    }

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn rdma_without_the_feature_says_it_is_not_built() {
        let e = AcceptorFactory::for_transport("rdma", &TransportConfig::default()).unwrap_err();
        assert!(matches!(
            e,
            TransportError::NotBuilt {
                transport: "rdma",
                ..
            }
        ));
        assert!(e.to_string().contains("`rdma` cargo feature"), "{e}");
    }

    #[cfg(feature = "rdma")]
    #[test]
    fn rdma_with_the_feature_builds_a_factory_that_needs_a_device() {
        let f = AcceptorFactory::for_transport("rdma", &TransportConfig::default())
            .unwrap()
            .expect("rdma needs an acceptor");
        let region =
            Arc::new(Region::create(&crate::region::default_region_path(), 64, 4).unwrap());
        match (f.build(region), crate::transport::rdma::probe()) {
            (Ok(a), Ok(_)) => assert_eq!(a.kind(), "rdma"),
            (Err(TransportError::NoDevice(why)), Err(_)) => assert!(!why.is_empty()),
            (Err(e), Err(no)) => panic!("no device ({no}) but not a NoDevice error: {e}"),
            (Err(e), Ok(_)) => panic!("a device exists but the acceptor failed: {e}"),
            (Ok(_), Err(e)) => panic!("no device ({e}) but the acceptor was built"),
        }
    }
}
