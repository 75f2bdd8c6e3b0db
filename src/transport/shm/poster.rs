//! The posting half of the shm transport.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use kvferry_ring::spsc::Producer;

use crate::protocol::Descriptor;
use crate::region::Region;
use crate::transport::{descriptor_kind, PeerIndex, Poster, RemoteBuffer, TransportError, WriteOp};

use super::peers::PeerTable;
use crate::transport::credits::Returned;

/// Owns the submission ring's producer and the peer table's write side.
pub(super) struct ShmPoster {
    /// `None` only while dropping (taken to close the ring before joining).
    pub(super) sq: Option<Producer<WriteOp>>,
    pub(super) peers: Arc<PeerTable>,
    /// Path → index of connected peers (so connecting twice is idempotent).
    pub(super) by_path: HashMap<PathBuf, (PeerIndex, u64, u64)>,
    pub(super) posted: u64,
    pub(super) returned: Arc<Returned>,
    pub(super) credits: usize,
    pub(super) engine: Option<JoinHandle<()>>,
}

impl Poster for ShmPoster {
    fn connect(&mut self, remote: &RemoteBuffer) -> Result<PeerIndex, TransportError> {
        let (path, len) = match &remote.descriptor {
            Descriptor::Shm { path, len } => (PathBuf::from(path), *len),
            other => {
                return Err(TransportError::Unsupported {
                    transport: "shm",
                    descriptor: descriptor_kind(other),
                })
            }
        };
        let geometry = (remote.chunk_bytes, remote.capacity_chunks);
        if remote.chunk_bytes.checked_mul(remote.capacity_chunks) != Some(len) {
            return Err(TransportError::BadDescriptor(format!(
                "shm descriptor announces {len} bytes, but {} slots of {} bytes are {:?}",
                remote.capacity_chunks,
                remote.chunk_bytes,
                remote.chunk_bytes.checked_mul(remote.capacity_chunks)
            )));
        }
        if let Some(&(index, cb, cap)) = self.by_path.get(&path) {
            if (cb, cap) == geometry {
                return Ok(index);
            }
            return Err(TransportError::BadDescriptor(format!(
                "{} is already connected as peer {index} with {cap} slots of {cb} bytes, now announced as {} of {}",
                path.display(),
                remote.capacity_chunks,
                remote.chunk_bytes
            )));
        }
        let region = Region::open(&path, Some(geometry))?;
        let index = self
            .peers
            .add(Arc::new(region))
            .ok_or_else(|| TransportError::Config("more than u32::MAX peers".into()))?;
        tracing::debug!(path = %path.display(), index, "shm peer connected");
        self.by_path.insert(path, (index, geometry.0, geometry.1));
        Ok(index)
    }

    fn disconnect(&mut self, peer: PeerIndex) {
        if self.peers.remove(peer) {
            self.by_path.retain(|_, (index, _, _)| *index != peer);
            tracing::debug!(peer, "shm peer disconnected");
        }
    }

    fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError> {
        crate::transport::credits::push_within_credits(
            self.sq.as_mut(),
            &mut self.posted,
            self.credits,
            &self.returned,
            ops,
        )
    }

    fn in_flight(&self) -> usize {
        self.posted.wrapping_sub(self.returned.get()) as usize
    }

    fn credits(&self) -> usize {
        self.credits
    }
}

impl Drop for ShmPoster {
    fn drop(&mut self) {
        // Close the submission ring first: the engine drains what was posted
        // (never blocking, credits guarantee room for the completions), then
        // exits and closes the completion ring.
        drop(self.sq.take());
        if let Some(engine) = self.engine.take() {
            let limit = self.drop_deadline();
            // It may be copying from registered memory: never detached.
            let _ = crate::threads::join_or_wait(engine, limit, "shm copy engine");
        }
    }
}
