//! The posting half of the TCP transport.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvferry_ring::spsc::Producer;

use crate::protocol::Descriptor;
use crate::transport::{descriptor_kind, PeerIndex, Poster, RemoteBuffer, TransportError, WriteOp};

use super::engine::{Cmd, ConnectResult, Shared};
use super::wire::{decode_secret, Preamble, SECRET_LEN, VERSION};

/// Owns the submission ring's producer; talks to the engine through
/// commands for connect and disconnect.
pub(super) struct TcpPoster {
    /// `None` only while dropping (taken to close the ring before joining).
    sq: Option<Producer<WriteOp>>,
    shared: Arc<Shared>,
    waker: Arc<mio::Waker>,
    /// Address → (index, chunk_bytes, capacity, secret) of connected
    /// peers, so connecting twice is idempotent.
    by_addr: HashMap<SocketAddr, (PeerIndex, u64, u64, [u8; SECRET_LEN])>,
    next_peer: PeerIndex,
    posted: u64,
    credits: usize,
    engine: Option<JoinHandle<()>>,
    connect_timeout: Duration,
    io_timeout: Duration,
}

impl TcpPoster {
    pub(super) fn new(
        sq: Producer<WriteOp>,
        shared: Arc<Shared>,
        waker: Arc<mio::Waker>,
        credits: usize,
        engine: JoinHandle<()>,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Self {
        Self {
            sq: Some(sq),
            shared,
            waker,
            by_addr: HashMap::new(),
            next_peer: 0,
            posted: 0,
            credits,
            engine: Some(engine),
            connect_timeout,
            io_timeout,
        }
    }

    fn command(&self, cmd: Cmd) {
        self.shared.cmds.lock().push(cmd);
        // A failed wake means the engine's poll set is gone (the engine
        // exited); the command is then moot.
        let _ = self.waker.wake();
    }
}

/// Resolves a descriptor's `host:port` (an IP literal needs no lookup).
fn resolve(addr: &str) -> Result<SocketAddr, TransportError> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(a);
    }
    addr.to_socket_addrs()
        .map_err(|e| TransportError::BadDescriptor(format!("tcp address `{addr}`: {e}")))?
        .next()
        .ok_or_else(|| {
            TransportError::BadDescriptor(format!("tcp address `{addr}` resolves to nothing"))
        })
}

impl Poster for TcpPoster {
    fn connect(&mut self, remote: &RemoteBuffer) -> Result<PeerIndex, TransportError> {
        let (addr, secret) = match &remote.descriptor {
            // No secret: the receiver will refuse the connection, which
            // `connect` reports as a typed error.
            Descriptor::Tcp { addr, secret } => (
                resolve(addr)?,
                match secret {
                    None => [0; SECRET_LEN],
                    Some(hex) => decode_secret(hex).ok_or_else(|| {
                        TransportError::BadDescriptor(format!(
                            "tcp peer {addr}: secret is not {} hex digits",
                            2 * SECRET_LEN
                        ))
                    })?,
                },
            ),
            other => {
                return Err(TransportError::Unsupported {
                    transport: "tcp",
                    descriptor: descriptor_kind(other),
                })
            }
        };
        let (cb, cap) = (remote.chunk_bytes, remote.capacity_chunks);
        let data_len = cb.checked_mul(cap).filter(|&l| l > 0).ok_or_else(|| {
            TransportError::BadDescriptor(format!(
                "tcp peer {addr} announces {cap} slots of {cb} bytes"
            ))
        })?;
        if let Some(&(index, pcb, pcap, psecret)) = self.by_addr.get(&addr) {
            if (pcb, pcap, psecret) == (cb, cap, secret) {
                return Ok(index);
            }
            if (pcb, pcap) == (cb, cap) {
                // A new secret (the sender said Hello again): the old
                // connection's is revoked, so start over with a new peer.
                self.disconnect(index);
                return self.connect(remote);
            }
            return Err(TransportError::BadDescriptor(format!(
                "{addr} is already connected as peer {index} with {pcap} slots of {pcb} bytes, now announced as {cap} of {cb}"
            )));
        }
        let sq = self.sq.as_ref().ok_or(TransportError::Closed)?;
        if sq.is_closed() {
            return Err(TransportError::Closed);
        }
        let index = self.next_peer;
        self.next_peer = index
            .checked_add(1)
            .ok_or_else(|| TransportError::Config("more than u32::MAX peers".into()))?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        let preamble = Preamble {
            version: VERSION,
            chunk_bytes: cb,
            capacity_chunks: cap,
            secret,
        };
        self.command(Cmd::Connect {
            peer: index,
            addr,
            preamble,
            data_len,
            reply: tx,
        });
        // The engine answers within its own connect timeout; the margin
        // covers a busy engine. Never an unbounded wait on the ctrl thread.
        let result = rx
            .recv_timeout(self.connect_timeout + Duration::from_secs(1))
            .unwrap_or(ConnectResult::Failed(
                "the tcp engine did not answer in time".into(),
            ));
        match result {
            ConnectResult::Ready => {
                tracing::debug!(%addr, index, "tcp peer connected");
                self.by_addr.insert(addr, (index, cb, cap, secret));
                Ok(index)
            }
            ConnectResult::Rejected(reason) => {
                self.command(Cmd::Disconnect(index));
                Err(TransportError::BadDescriptor(format!(
                    "tcp data listener {addr} refused the connection: {reason}"
                )))
            }
            ConnectResult::Failed(reason) => {
                self.command(Cmd::Disconnect(index));
                Err(TransportError::Io(std::io::Error::other(format!(
                    "tcp data connection to {addr}: {reason}"
                ))))
            }
        }
    }

    fn disconnect(&mut self, peer: PeerIndex) {
        let before = self.by_addr.len();
        self.by_addr.retain(|_, (index, _, _, _)| *index != peer);
        if self.by_addr.len() != before {
            tracing::debug!(peer, "tcp peer disconnected");
            self.command(Cmd::Disconnect(peer));
        }
    }

    fn post(&mut self, ops: &[WriteOp]) -> Result<usize, TransportError> {
        let pushed = crate::transport::credits::push_within_credits(
            self.sq.as_mut(),
            &mut self.posted,
            self.credits,
            &self.shared.returned,
            ops,
        )?;
        if pushed == 0 {
            return Ok(0);
        }
        // A failed wake means the engine exited; the next post sees the
        // closed ring. The ops pushed are counted either way.
        let _ = self.waker.wake();
        Ok(pushed)
    }

    fn in_flight(&self) -> usize {
        self.posted.wrapping_sub(self.shared.returned.get()) as usize
    }

    /// A connection still opening gets its connect timeout, then each
    /// makes progress or is lost within the I/O timeout; the margin covers
    /// the engine's own exit.
    fn drop_deadline(&self) -> Duration {
        self.connect_timeout + self.io_timeout + Duration::from_secs(2)
    }

    fn credits(&self) -> usize {
        self.credits
    }
}

impl Drop for TcpPoster {
    fn drop(&mut self) {
        // Close the submission ring, then wake the engine: it sends what was
        // posted, waits for the acks (each connection bounded by the I/O
        // timeout), then exits and closes the completion ring.
        drop(self.sq.take());
        let _ = self.waker.wake();
        if let Some(engine) = self.engine.take() {
            let limit = self.drop_deadline();
            // It may be sending from registered memory: never detached.
            let _ = crate::threads::join_or_wait(engine, limit, super::ENGINE_THREAD_NAME);
        }
    }
}
