//! Owned wrappers over the raw verbs objects this transport uses (device
//! context, protection domain, memory region, completion channel and queue,
//! queue pair). Each holds an `Arc` to what it was created from, so drop
//! order is always child before parent, and each frees its object on drop
//! (errors there are logged at debug level, never panicked on).
//!
//! `ibverbs`' safe API cannot register memory it did not allocate, post
//! RDMA WRITEs or use completion channels, so this uses `ibverbs-sys`.

use std::any::Any;
use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::Arc;

use ibverbs_sys as ffi;

use super::device::{no_device, pick_device};
use super::events::{is_port_event, is_qp_event, AsyncEvent};
use super::qp_state::{attrs, QpParams, QpStep};
use super::QpInfo;
use crate::protocol::GID_LEN;
use crate::transport::TransportError;

/// A verbs call failed: `what` failed with `err`.
pub(super) fn verbs_error(what: &str, err: io::Error) -> TransportError {
    TransportError::Io(io::Error::new(err.kind(), format!("{what}: {err}")))
}

/// An open device context with the state of the port in use.
pub(super) struct Context {
    ctx: *mut ffi::ibv_context,
    /// Device name (`mlx5_0`, `rxe0`).
    pub(super) name: String,
    /// Port number (1-based).
    pub(super) port: u8,
    /// The port's LID (0 on RoCE).
    pub(super) lid: u16,
    /// The GID at `gid_index`.
    pub(super) gid: [u8; GID_LEN],
    /// Index of `gid` in the port's GID table.
    pub(super) gid_index: u8,
    /// The port's active MTU (`ibv_mtu`).
    pub(super) active_mtu: u32,
}

// SAFETY: a verbs context may be used from any thread (libibverbs objects
// are thread-safe); the pointer is only freed in Drop, which runs once after
// every user (they hold Arcs) is gone.
unsafe impl Send for Context {}
// SAFETY: as above; shared use only calls thread-safe verbs.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device named `want` (or the first one), queries `port` and
    /// the GID at `gid_index`. [`TransportError::NoDevice`] if there is no
    /// device, no such device, or the port is not active.
    pub(super) fn open(
        want: Option<&str>,
        port: u8,
        gid_index: u8,
    ) -> Result<Arc<Self>, TransportError> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array (or null)
        // is freed by `List` below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = io::Error::last_os_error();
            return Err(no_device(&format!("ibv_get_device_list: {e}")));
        }
        struct List(*mut *mut ffi::ibv_device);
        impl Drop for List {
            fn drop(&mut self) {
                // SAFETY: the pointer came from ibv_get_device_list and is
                // freed exactly once; contexts opened from it stay valid.
                unsafe { ffi::ibv_free_device_list(self.0) };
            }
        }
        let list = List(list);
        let count = usize::try_from(n).unwrap_or(0);
        let mut names = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: i < n, the list holds n valid device pointers;
            // ibv_get_device_name returns a NUL-terminated string owned by
            // the device (or null), valid while the list is.
            let name = unsafe {
                let dev = *list.0.add(i);
                let p = ffi::ibv_get_device_name(dev);
                if p.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            names.push(name);
        }
        let index = pick_device(&names, want)?;
        let name = names[index].clone();
        // SAFETY: index < n; the device pointer is valid while the list is.
        let ctx = unsafe { ffi::ibv_open_device(*list.0.add(index)) };
        if ctx.is_null() {
            return Err(verbs_error(
                &format!("ibv_open_device({name})"),
                io::Error::last_os_error(),
            ));
        }
        let mut this = Self {
            ctx,
            name,
            port,
            lid: 0,
            gid: [0; GID_LEN],
            gid_index,
            active_mtu: ffi::IBV_MTU_1024,
        };
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: ctx is open; `attr` is a valid, writable ibv_port_attr (the
        // compat entry point writes a prefix of it).
        let rc = unsafe { ffi::ibv_query_port(ctx, port, &mut attr as *mut _ as *mut _) };
        if rc != 0 {
            return Err(verbs_error(
                &format!("ibv_query_port({}, port {port})", this.name),
                io::Error::from_raw_os_error(rc),
            ));
        }
        if attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(TransportError::NoDevice(format!(
                "port {port} of RDMA device {} is not active (state {})",
                this.name, attr.state
            )));
        }
        this.lid = attr.lid;
        this.active_mtu = attr.active_mtu;
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: ctx is open; `gid` is a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(ctx, port, i32::from(gid_index), &mut gid) };
        if rc != 0 {
            return Err(verbs_error(
                &format!(
                    "ibv_query_gid({}, port {port}, index {gid_index})",
                    this.name
                ),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `raw` covers the whole union; every bit pattern is valid.
        this.gid = unsafe { gid.raw };
        // Asynchronous events are read without blocking (the CQ thread
        // polls the fd next to the completion channel's).
        let fd = this.async_fd();
        // SAFETY: fd is the context's open async descriptor; F_GETFL/F_SETFL
        // take no pointers.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(verbs_error(
                "fcntl(O_NONBLOCK) on the async event fd",
                io::Error::last_os_error(),
            ));
        }
        Ok(Arc::new(this))
    }

    /// The descriptor that is readable when an asynchronous event is pending.
    pub(super) fn async_fd(&self) -> RawFd {
        // SAFETY: ctx is open (closed only in Drop).
        unsafe { (*self.ctx).async_fd }
    }

    /// Takes one pending asynchronous event, copies what identifies its
    /// element and acknowledges it; `None` when none is pending (the fd is
    /// non-blocking).
    pub(super) fn take_async_event(&self) -> Option<AsyncEvent> {
        let mut ev = std::mem::MaybeUninit::<ffi::ibv_async_event>::zeroed();
        // SAFETY: ctx is open; `ev` is a writable ibv_async_event; the fd is
        // non-blocking, so this returns -1 at once when nothing is pending.
        if unsafe { ffi::ibv_get_async_event(self.ctx, ev.as_mut_ptr()) } != 0 {
            return None;
        }
        // SAFETY: ibv_get_async_event returned 0, so it filled `ev`.
        let mut ev = unsafe { ev.assume_init() };
        let kind = ev.event_type;
        let qp_num = if is_qp_event(kind) {
            // SAFETY: for QP events `element.qp` is the QP, which stays
            // valid at least until the event is acknowledged (below).
            unsafe {
                let qp = ev.element.qp;
                (!qp.is_null()).then(|| (*qp).qp_num)
            }
        } else {
            None
        };
        let port = if is_port_event(kind) {
            // SAFETY: for port events `element.port_num` is the union's
            // active field (an int).
            u8::try_from(unsafe { ev.element.port_num }).ok()
        } else {
            None
        };
        // SAFETY: `ev` came from ibv_get_async_event and is acked once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Some(AsyncEvent { kind, qp_num, port })
    }

    /// Connection parameters for queue pairs of this context.
    pub(super) fn qp_params(&self, access: u32, retry_count: u8) -> QpParams {
        QpParams {
            port: self.port,
            gid_index: self.gid_index,
            path_mtu: self.active_mtu,
            access,
            retry_count,
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed once; all children hold an Arc to
        // this context, so they are gone.
        let rc = unsafe { ffi::ibv_close_device(self.ctx) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_close_device failed");
        }
    }
}

/// A protection domain.
pub(super) struct Pd {
    pd: *mut ffi::ibv_pd,
    pub(super) ctx: Arc<Context>,
}

// SAFETY: verbs objects are thread-safe; freed once in Drop.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// Allocates a protection domain on `ctx`.
    pub(super) fn new(ctx: Arc<Context>) -> Result<Arc<Self>, TransportError> {
        // SAFETY: ctx.ctx is an open context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(verbs_error("ibv_alloc_pd", io::Error::last_os_error()));
        }
        Ok(Arc::new(Self { pd, ctx }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once after every child (they hold Arcs).
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A memory region over memory kept alive by `_owner`.
pub(super) struct Mr {
    mr: *mut ffi::ibv_mr,
    _pd: Arc<Pd>,
    _owner: Arc<dyn Any + Send + Sync>,
    /// Start address of the registered memory.
    pub(super) addr: u64,
    /// Length in bytes.
    pub(super) len: u64,
}

// SAFETY: verbs objects are thread-safe; freed once in Drop.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr` with `access` rights.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be mapped memory that stays mapped while
    /// `owner` is alive (the region keeps `owner` until it is deregistered).
    pub(super) unsafe fn register(
        pd: Arc<Pd>,
        addr: *mut u8,
        len: u64,
        access: u32,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Result<Self, TransportError> {
        let size = usize::try_from(len)
            .map_err(|_| TransportError::Config(format!("cannot register {len} bytes")))?;
        // SAFETY: the caller guarantees the range is mapped for as long as
        // `owner` lives, and we keep `owner` until after ibv_dereg_mr.
        let mr = unsafe { ffi::ibv_reg_mr(pd.pd, addr.cast(), size, access as i32) };
        if mr.is_null() {
            return Err(verbs_error(
                &format!("ibv_reg_mr({len} bytes)"),
                io::Error::last_os_error(),
            ));
        }
        Ok(Self {
            mr,
            _pd: pd,
            _owner: owner,
            addr: addr as u64,
            len,
        })
    }

    /// Local key (for scatter/gather entries).
    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: mr is a live registration (freed only in Drop).
        unsafe { (*self.mr).lkey }
    }

    /// Remote key (for the peer's RDMA WRITEs).
    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: as in `lkey`.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once; the memory
        // (`_owner`) is dropped after this, as fields drop after Drop::drop.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_dereg_mr failed");
        }
    }
}

/// A completion channel (the fd the CQ thread sleeps on).
pub(super) struct Channel {
    ch: *mut ffi::ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: verbs objects are thread-safe; freed once in Drop.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl Channel {
    /// Creates a completion channel whose fd is non-blocking.
    pub(super) fn new(ctx: Arc<Context>) -> Result<Arc<Self>, TransportError> {
        // SAFETY: ctx.ctx is an open context.
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.ctx) };
        if ch.is_null() {
            return Err(verbs_error(
                "ibv_create_comp_channel",
                io::Error::last_os_error(),
            ));
        }
        let this = Self { ch, _ctx: ctx };
        let fd = this.fd();
        // SAFETY: fd is the channel's open descriptor; F_GETFL/F_SETFL take
        // no pointers.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(verbs_error(
                "fcntl(O_NONBLOCK) on the completion channel",
                io::Error::last_os_error(),
            ));
        }
        Ok(Arc::new(this))
    }

    /// The channel's file descriptor (readable when a CQ event is pending).
    pub(super) fn fd(&self) -> RawFd {
        // SAFETY: ch is a live channel.
        unsafe { (*self.ch).fd }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once after the CQ that uses it
        // (the CQ holds an Arc to this channel).
        let rc = unsafe { ffi::ibv_destroy_comp_channel(self.ch) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_destroy_comp_channel failed");
        }
    }
}

/// A completion queue, optionally tied to a completion channel.
pub(super) struct Cq {
    cq: *mut ffi::ibv_cq,
    channel: Option<Arc<Channel>>,
    _ctx: Arc<Context>,
}

// SAFETY: verbs objects are thread-safe; freed once in Drop.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// Creates a CQ of at least `entries` entries.
    pub(super) fn new(
        ctx: Arc<Context>,
        entries: usize,
        channel: Option<Arc<Channel>>,
    ) -> Result<Arc<Self>, TransportError> {
        let cqe = i32::try_from(entries)
            .map_err(|_| TransportError::Config(format!("CQ of {entries} entries")))?;
        let ch = channel.as_ref().map_or(ptr::null_mut(), |c| c.ch);
        // SAFETY: ctx.ctx is open; `ch` is null or a live channel of the
        // same context; no user context pointer.
        let cq = unsafe { ffi::ibv_create_cq(ctx.ctx, cqe, ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(verbs_error(
                &format!("ibv_create_cq({entries})"),
                io::Error::last_os_error(),
            ));
        }
        Ok(Arc::new(Self {
            cq,
            channel,
            _ctx: ctx,
        }))
    }

    /// Polls up to `wcs.len()` completions into `wcs`; returns how many.
    pub(super) fn poll(&self, wcs: &mut [ffi::ibv_wc]) -> Result<usize, TransportError> {
        let n = i32::try_from(wcs.len()).unwrap_or(i32::MAX);
        // SAFETY: cq is live; ibv_poll_cq is an inline wrapper around the
        // context's poll_cq op, which writes at most `n` entries to `wcs`
        // (ibv_wc is layout-compatible with the C struct in ibverbs-sys).
        let got = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(self.cq, n, wcs.as_mut_ptr().cast()),
                None => -1,
            }
        };
        usize::try_from(got)
            .map_err(|_| verbs_error("ibv_poll_cq", io::Error::other("poll failed")))
    }

    /// Asks for an event on the channel at the next completion.
    pub(super) fn arm(&self) -> Result<(), TransportError> {
        // SAFETY: cq is live; ibv_req_notify_cq is an inline wrapper around
        // the context's req_notify_cq op.
        let rc = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.req_notify_cq {
                Some(f) => f(self.cq, 0),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(verbs_error(
                "ibv_req_notify_cq",
                io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Takes and acknowledges pending channel events without blocking;
    /// returns how many there were.
    pub(super) fn drain_events(&self) -> usize {
        let Some(ch) = &self.channel else { return 0 };
        let mut n = 0;
        loop {
            let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = ptr::null_mut();
            // SAFETY: the channel fd is non-blocking, so this returns -1 at
            // once when no event is pending; out-pointers are valid.
            let rc = unsafe { ffi::ibv_get_cq_event(ch.ch, &mut cq, &mut ctx) };
            if rc != 0 {
                break;
            }
            n += 1;
            // SAFETY: `cq` is the CQ the event was for (ours: it is the only
            // CQ on this channel); every event is acknowledged once, before
            // the CQ is destroyed.
            unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        }
        n
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.drain_events();
        // SAFETY: created in `new`, destroyed once after every QP using it
        // (they hold Arcs) and after acknowledging all events.
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_destroy_cq failed");
        }
    }
}

/// An RC queue pair.
pub(super) struct Qp {
    qp: *mut ffi::ibv_qp,
    _cq: Arc<Cq>,
    _pd: Arc<Pd>,
}

// SAFETY: verbs objects are thread-safe; freed once in Drop.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

/// Gather entry and work request of one RDMA WRITE.
pub(super) struct WriteWr {
    /// Work request id (the op's sequence number on its QP).
    pub(super) wr_id: u64,
    /// Local address and length.
    pub(super) local_addr: u64,
    /// Bytes to write.
    pub(super) len: u32,
    /// Local key of the staging region.
    pub(super) lkey: u32,
    /// Remote address.
    pub(super) remote_addr: u64,
    /// Remote key.
    pub(super) rkey: u32,
    /// Ask for a completion.
    pub(super) signalled: bool,
}

impl Qp {
    /// Creates an RC queue pair in the RESET state on `cq` (send and
    /// receive), with room for `max_send_wr` outstanding writes.
    pub(super) fn new(pd: Arc<Pd>, cq: Arc<Cq>, max_send_wr: u32) -> Result<Self, TransportError> {
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: cq.cq,
            recv_cq: cq.cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: pd and cq are live objects of the same context; `init` is
        // a valid attribute struct.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(verbs_error(
                &format!("ibv_create_qp(max_send_wr {max_send_wr})"),
                io::Error::last_os_error(),
            ));
        }
        Ok(Self {
            qp,
            _cq: cq,
            _pd: pd,
        })
    }

    /// The queue pair number.
    pub(super) fn qp_num(&self) -> u32 {
        // SAFETY: qp is live.
        unsafe { (*self.qp).qp_num }
    }

    /// Runs `step` of the state machine.
    pub(super) fn modify(&self, step: &QpStep, p: &QpParams) -> Result<(), TransportError> {
        let (mut attr, mask) = attrs(step, p, self.qp_num());
        // SAFETY: qp is live; attr/mask come from `attrs`, which sets every
        // field the mask names.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, &mut attr, mask.0 as i32) };
        if rc != 0 {
            return Err(verbs_error(
                &format!("ibv_modify_qp({step:?}) of QP {:#x}", self.qp_num()),
                io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Moves the queue pair to the error state: the NIC stops executing its
    /// work requests and completes each one still outstanding with a flush
    /// error, so the completions of its writes are fenced (the NIC is done
    /// with their memory when they arrive).
    pub(super) fn fence(&self) -> Result<(), TransportError> {
        let (mut attr, mask) = attrs(
            &QpStep::Err,
            &QpParams {
                port: 1,
                gid_index: 0,
                path_mtu: 0,
                access: 0,
                retry_count: 0,
            },
            self.qp_num(),
        );
        // SAFETY: qp is live; the ERR step sets the one field its mask names.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, &mut attr, mask.0 as i32) };
        if rc != 0 {
            return Err(verbs_error(
                &format!("ibv_modify_qp(Err) of QP {:#x}", self.qp_num()),
                io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Posts `wrs` as one chain of RDMA WRITEs. On failure returns the index
    /// of the first request the NIC did not take and the error; the ones
    /// before it were posted.
    ///
    /// # Safety
    ///
    /// Each write's local range must lie in a registered region (`lkey`)
    /// that stays registered until its completion is polled, and the caller
    /// must not reuse those bytes before then.
    pub(super) unsafe fn post_writes(
        &self,
        wrs: &[WriteWr],
    ) -> Result<(), (usize, TransportError)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ffi::ibv_sge> = wrs
            .iter()
            .map(|w| ffi::ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        let mut reqs: Vec<ffi::ibv_send_wr> = Vec::with_capacity(wrs.len());
        for (i, w) in wrs.iter().enumerate() {
            let mut r = ffi::ibv_send_wr {
                wr_id: w.wr_id,
                num_sge: i32::from(w.len > 0),
                opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                send_flags: if w.signalled {
                    ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
                } else {
                    0
                },
                ..Default::default()
            };
            r.sg_list = &mut sges[i];
            r.wr.rdma.remote_addr = w.remote_addr;
            r.wr.rdma.rkey = w.rkey;
            reqs.push(r);
        }
        let base = reqs.as_mut_ptr();
        for i in 1..reqs.len() {
            // SAFETY: i - 1 and i are in bounds of `reqs`, which is not
            // resized after this, so the links stay valid.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: qp is live; `reqs`/`sges` outlive the call (the NIC copies
        // work requests at post time); local ranges are the caller's contract.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.qp, base, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc == 0 {
            return Ok(());
        }
        let index = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into `reqs` (verbs returns the failing
            // element of the chain it was given).
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        Err((
            index,
            verbs_error("ibv_post_send", io::Error::from_raw_os_error(rc)),
        ))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; CQ and PD outlive it.
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_destroy_qp failed");
        }
    }
}

/// Runs a queue pair in INIT through RTR and RTS towards `remote`.
pub(super) fn connect(qp: &Qp, params: &QpParams, remote: &QpInfo) -> Result<(), TransportError> {
    qp.modify(&QpStep::Rtr(*remote), params)?;
    qp.modify(&QpStep::Rts, params)
}
