//! The [`Sender`]'s registered memory: caller memory registered as a source
//! of [`Request::write`](super::Request::write)s, and deregistered (a method
//! group of [`Sender`]).

use std::sync::Arc;
use std::time::Instant;

use tracing::debug;

use super::{registered, MemoryRegion, RegisterError, Sender};

impl Sender {
    /// Registers `len` bytes of caller-owned host memory at `ptr` (e.g. a
    /// pinned buffer from `cudaHostAlloc`, the target of the device-to-host
    /// copy) as a source of [`Request::write`]s, which post writes straight
    /// from it: no staging copy. On shm the copy engine's copy into the
    /// receiver is the only one; on tcp the socket reads it directly; on
    /// rdma this registers a memory region over it (`ibv_reg_mr`, local
    /// read only) and the RDMA WRITEs' scatter/gather entries carry its
    /// lkey, so the NIC reads the caller's memory: no copy on the sender.
    ///
    /// Errors: [`RegisterError::Null`], [`RegisterError::Empty`],
    /// [`RegisterError::Unaligned`] (`ptr` must be page-aligned),
    /// [`RegisterError::Overflow`], [`RegisterError::TooMany`] (more than
    /// [`crate::staging::MAX_REGIONS`] at once),
    /// [`RegisterError::Transport`] if the transport cannot register it
    /// (rdma: `ibv_reg_mr` failed, e.g. because pinning the pages exceeds
    /// the locked-memory limit `RLIMIT_MEMLOCK`; the reason names the
    /// limit).
    ///
    /// # Safety
    ///
    /// `unsafe` because kvferry reads the memory from its transport threads
    /// while the caller owns it, so the caller must guarantee, for as long
    /// as the region is registered (until [`deregister`](Self::deregister)
    /// returned `Ok`, or this sender was closed or dropped):
    /// - `ptr..ptr + len` is allocated, readable host memory and stays so
    ///   (not freed, unmapped or remapped);
    /// - nobody writes a byte range named in a [`Request::write`] from that
    ///   call until its [`WriteHandle::is_done`] (ranges not in flight may be
    ///   written freely, e.g. the next layer's device-to-host copy).
    ///
    /// This is the raw-pointer contract of NIXL's and Mooncake's memory
    /// registration, because the memory a server writes from is not a Rust
    /// object (pinned allocations, a KV pool): an owning safe wrapper could
    /// not let the caller refill one part while another is in flight.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use kvferry::receiver::{Receiver, ReceiverConfig};
    /// use kvferry::sender::{RequestSpec, RequestStatus, Sender, SenderConfig};
    ///
    /// let receiver = Receiver::start(ReceiverConfig {
    ///     listen: "tcp://127.0.0.1:0".into(),
    ///     capacity_chunks: 8,
    ///     chunk_bytes: 4096,
    ///     ..Default::default()
    /// })?;
    /// let sender = Sender::new(SenderConfig {
    ///     chunk_bytes: 4096,
    ///     staging_slots: 1,
    ///     ..Default::default()
    /// })?;
    /// let deadline = Instant::now() + Duration::from_secs(10);
    ///
    /// // The caller's pinned KV memory (here an anonymous mapping: page-aligned).
    /// let mut kv = memmap2::MmapMut::map_anon(2 * 4096)?;
    /// kv[..4096].fill(7);
    /// kv[4096..].fill(8);
    /// // SAFETY: `kv` outlives the region (deregistered below) and is not
    /// // written while the write from it is in flight.
    /// let region = unsafe { sender.register(kv.as_ptr(), kv.len()) }?;
    ///
    /// let req = sender.begin(RequestSpec::new("req-1", receiver.endpoint(), 2))?;
    /// let done = req.write(
    ///     &["req-1/0", "req-1/1"],
    ///     &[(&region, 0, 4096), (&region, 4096, 4096)],
    ///     deadline,
    /// )?;
    /// assert!(done.wait(deadline)); // `kv` may be written again
    /// assert_eq!(req.wait(deadline), RequestStatus::Completed);
    /// sender.deregister(&region)?; // `kv` may be freed
    ///
    /// receiver.wait_ready("req-1", deadline)?;
    /// assert_eq!(&receiver.get("req-1/1").expect("written").bytes()[..4096], &[8u8; 4096][..]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// [`Request::write`]: super::Request::write
    /// [`WriteHandle::is_done`]: super::WriteHandle::is_done
    pub unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
    ) -> Result<MemoryRegion, RegisterError> {
        let addr = ptr as usize;
        if ptr.is_null() {
            return Err(RegisterError::Null);
        }
        if len == 0 {
            return Err(RegisterError::Empty);
        }
        let page = self::registered::page_size();
        if addr % page != 0 {
            return Err(RegisterError::Unaligned { addr, page });
        }
        if addr.checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(RegisterError::Overflow { addr, len });
        }
        let id = self
            .shared
            .staging
            .add_region(ptr, len as u64)
            .ok_or(RegisterError::TooMany {
                max: crate::staging::MAX_REGIONS,
            })?;
        if let Some(registry) = &self.registry {
            // SAFETY: the caller's contract above keeps the memory
            // allocated until `deregister` returned `Ok`, which calls the
            // registry's `deregister` first (or until this sender is
            // dropped, which drops the registry).
            if let Err(e) = unsafe { registry.register(id, ptr, len as u64) } {
                self.shared.staging.remove_region(id);
                return Err(RegisterError::Transport {
                    transport: self.shared.cfg.transport.clone(),
                    addr,
                    len,
                    reason: e.to_string(),
                });
            }
        }
        debug!(region = id, len, "registered memory");
        Ok(MemoryRegion {
            entry: Arc::new(self::registered::RegionEntry::new(id, len, &self.shared)),
        })
    }

    /// Deregisters `region`: from `Ok` on, kvferry never reads it again and
    /// the caller may free it (on rdma its memory region is deregistered:
    /// the NIC can no longer access it). [`RegisterError::Busy`] while
    /// writes from it are in flight (wait for their [`WriteHandle`]s, or
    /// use [`deregister_by`](Self::deregister_by)),
    /// [`RegisterError::NotRegistered`] if already deregistered,
    /// [`RegisterError::ForeignRegion`] for another sender's region.
    ///
    /// [`WriteHandle`]: super::WriteHandle
    pub fn deregister(&self, region: &MemoryRegion) -> Result<(), RegisterError> {
        self.deregister_within(region, None)
    }

    /// [`deregister`](Self::deregister), waiting until `deadline` for the
    /// writes in flight from `region` to complete;
    /// [`RegisterError::Busy`] if some still are at the deadline (then
    /// nothing changed).
    pub fn deregister_by(
        &self,
        region: &MemoryRegion,
        deadline: Instant,
    ) -> Result<(), RegisterError> {
        self.deregister_within(region, Some(deadline))
    }

    fn deregister_within(
        &self,
        region: &MemoryRegion,
        deadline: Option<Instant>,
    ) -> Result<(), RegisterError> {
        let e = &region.entry;
        if !e.belongs_to(&self.shared) {
            return Err(RegisterError::ForeignRegion { id: e.id });
        }
        e.retire_by(deadline)?;
        // Retired: no write can take it any more, none is in flight.
        if let Some(registry) = &self.registry {
            registry.deregister(e.id);
        }
        self.shared.staging.remove_region(e.id);
        debug!(region = e.id, "deregistered memory");
        Ok(())
    }
}
