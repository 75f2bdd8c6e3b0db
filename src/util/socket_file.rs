//! Unix socket files a daemon binds: the attach sockets, and ZMQ `ipc://`
//! endpoints (a receiver's `--listen`, a proxy's). A path is taken over only
//! from a daemon that died (a socket nobody serves), never from a live one
//! nor from a file that is not a socket, and the socket file goes when its
//! owner stops.
//!
//! libzmq (4.3) does neither by itself: before an `ipc://` bind it unlinks
//! whatever is at the path, so a second daemon given the same path took
//! the socket of a live one without an error (its peers then reached the
//! new one), and a path naming a regular file lost that file; after the
//! socket closes, the file stays. [`SocketFile::claim_endpoint`] runs before
//! every such bind.

use std::fs;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Removes a socket file nobody listens on (a previous daemon that died).
/// Anything else at `path` (a live socket, a regular file) is an error and
/// is left alone; nothing at `path` is fine.
pub(crate) fn remove_stale_socket(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(m) if !m.file_type().is_socket() => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Ok(_) => {}
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{} is served by a live daemon", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => fs::remove_file(path),
        Err(_) => Ok(()),
    }
}

/// The file a ZMQ endpoint binds: the path of an `ipc://PATH` endpoint;
/// `None` for every other transport, for libzmq's wildcard (`ipc://*`, a
/// file in a directory of its own making) and for Linux's abstract
/// namespace (`ipc://@name`, no file).
pub(crate) fn ipc_path(endpoint: &str) -> Option<&Path> {
    let path = endpoint.strip_prefix("ipc://")?;
    (!path.is_empty() && !path.starts_with('*') && !path.starts_with('@')).then(|| Path::new(path))
}

/// A path cleared for a bind ([`SocketFile::claim`]). [`Claim::bound`],
/// once the bind succeeded, makes it the owner's [`SocketFile`]; dropped
/// before that it removes nothing (a bind that failed may have lost the
/// path to a daemon that bound it meanwhile).
#[derive(Debug)]
#[must_use = "a claim owns nothing until `bound`"]
pub(crate) struct Claim(PathBuf);

impl Claim {
    /// The bind succeeded: the file is ours, removed when the returned
    /// [`SocketFile`] is dropped.
    pub(crate) fn bound(self) -> SocketFile {
        SocketFile(self.0)
    }
}

/// A socket file this process bound: removed when dropped (the owner drops
/// it after its socket closed).
#[derive(Debug)]
pub(crate) struct SocketFile(PathBuf);

impl SocketFile {
    /// Clears `path` for a bind: nothing there, or a socket nobody serves
    /// (removed). A socket that accepts a connection is
    /// [`io::ErrorKind::AddrInUse`], any other file
    /// [`io::ErrorKind::AlreadyExists`], both left as they are.
    pub(crate) fn claim(path: &Path) -> io::Result<Claim> {
        remove_stale_socket(path)?;
        Ok(Claim(path.to_owned()))
    }

    /// [`SocketFile::claim`] for the file of a ZMQ endpoint ([`ipc_path`]);
    /// `Ok(None)` for an endpoint without one.
    pub(crate) fn claim_endpoint(endpoint: &str) -> io::Result<Option<Claim>> {
        ipc_path(endpoint).map(Self::claim).transpose()
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kvferry-socket-file-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn only_a_file_backed_ipc_endpoint_has_a_path() {
        assert_eq!(
            ipc_path("ipc:///run/k.sock"),
            Some(Path::new("/run/k.sock"))
        );
        assert_eq!(ipc_path("ipc://rel.sock"), Some(Path::new("rel.sock")));
        for none in [
            "tcp://127.0.0.1:7400",
            "inproc://x",
            "ipc://*",
            "ipc://@abstract",
            "ipc://",
            "",
        ] {
            assert_eq!(ipc_path(none), None, "{none:?}");
        }
    }

    #[test]
    fn a_claim_takes_nothing_or_a_stale_socket_and_removes_it_when_dropped() {
        let dir = scratch("claim");
        let free = dir.join("free.sock");
        let claim = SocketFile::claim(&free).expect("nothing there");
        let _listener = UnixListener::bind(&free).expect("bind");
        drop(claim.bound());
        assert!(!free.exists(), "the socket file outlived its owner");

        // A claim dropped before its bind succeeded removes nothing.
        let other = dir.join("other.sock");
        let claim = SocketFile::claim(&other).expect("nothing there");
        let _theirs = UnixListener::bind(&other).expect("bind");
        drop(claim);
        assert!(other.exists(), "an unbound claim removed the file");

        // A stale socket: bound, then its listener gone.
        let stale = dir.join("stale.sock");
        drop(UnixListener::bind(&stale).expect("bind"));
        assert!(stale.exists());
        let _claim = SocketFile::claim(&stale).expect("a stale socket is taken over");
        assert!(!stale.exists(), "the stale socket was not removed");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_claim_never_takes_a_live_socket_or_another_file() {
        let dir = scratch("refuse");
        let live = dir.join("live.sock");
        let _listener = UnixListener::bind(&live).expect("bind");
        let e = SocketFile::claim(&live).expect_err("a live socket was taken");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        assert!(live.exists(), "the live socket was removed");

        let regular = dir.join("notes.txt");
        fs::write(&regular, b"keep me").expect("write");
        let endpoint = format!("ipc://{}", regular.display());
        let e = SocketFile::claim_endpoint(&endpoint).expect_err("a regular file was taken");
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(fs::read(&regular).expect("still there"), b"keep me");

        assert!(SocketFile::claim_endpoint("tcp://127.0.0.1:0")
            .expect("no file")
            .is_none());
        let _ = fs::remove_dir_all(&dir);
    }
}
