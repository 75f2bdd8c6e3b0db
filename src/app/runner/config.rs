//! Configuration of `kvferry run`: defaults, a TOML file with the same keys,
//! and command-line overrides.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::protocol::Descriptor;
use crate::region::Region;
use crate::transport::RemoteBuffer;

/// An inclusive range of chunk counts, written `MIN..MAX` (or one number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ChunkRange {
    /// Fewest chunks per request.
    pub min: u32,
    /// Most chunks per request.
    pub max: u32,
}

impl std::str::FromStr for ChunkRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |x: &str| {
            x.trim()
                .parse::<u32>()
                .map_err(|e| format!("bad chunk count {x:?}: {e}"))
        };
        let (min, max) = match s.split_once("..") {
            Some((a, b)) => (parse(a)?, parse(b.trim_start_matches('='))?),
            None => {
                let n = parse(s)?;
                (n, n)
            }
        };
        if min == 0 || min > max {
            return Err(format!(
                "chunk range {s:?} must be MIN..MAX with 1 <= MIN <= MAX"
            ));
        }
        Ok(Self { min, max })
    }
}

impl TryFrom<String> for ChunkRange {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<ChunkRange> for String {
    fn from(r: ChunkRange) -> String {
        format!("{}..{}", r.min, r.max)
    }
}

impl std::fmt::Display for ChunkRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.min, self.max)
    }
}

/// Everything `kvferry run` needs. Field names are the TOML keys and, with
/// `-` for `_`, the command-line options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Prefill senders.
    pub prefillers: usize,
    /// Decode receivers.
    pub decoders: usize,
    /// Requests in the whole run.
    pub requests: usize,
    /// Chunks per request.
    pub chunks: ChunkRange,
    /// Chunks per `store` call.
    pub batch: usize,
    /// Bytes per chunk (and per slot).
    pub chunk_bytes: u64,
    /// Staging slots per prefiller.
    pub staging_slots: usize,
    /// Receive-buffer slots per decoder.
    pub capacity_chunks: usize,
    /// Requests in flight per prefiller.
    pub concurrency: usize,
    /// Fraction of requests the prefiller cancels part-way.
    pub abort_rate: f64,
    /// Fraction of writes the fault injector fails.
    pub fail_rate: f64,
    /// Seed of every random choice.
    pub seed: u64,
    /// Data plane: shm, tcp or rdma.
    pub transport: String,
    /// Seconds without any request finishing before the watchdog declares a
    /// deadlock.
    pub stall_timeout_s: f64,
    /// Pending-area bound per prefiller, bytes.
    pub max_pending_bytes: usize,
    /// `kvferry sender` only: receivers that do not answer `Hello` (LMCache
    /// receivers), each as `"ENDPOINT=PATH"` — write that receiver's chunks
    /// into the kvferry buffer file at `PATH` (shm; slot size and count
    /// read from its header). See [`static_peer`].
    pub static_buffers: Vec<String>,
    /// Chunk keys: `"kvferry"` (`req/index/total`, default) or `"lmcache"`
    /// (LMCache's `CacheEngineKey` strings, which an LMCache receiver
    /// parses and refuses otherwise).
    pub key_format: String,
    /// Prefillers hand chunks over with the copying `store` instead of
    /// filling staging in place (`Request::stage`), to compare the paths.
    pub copy_store: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            prefillers: 2,
            decoders: 1,
            requests: 2000,
            chunks: ChunkRange { min: 1, max: 32 },
            batch: 4,
            chunk_bytes: 256 * 1024,
            staging_slots: 64,
            // Smaller than the chunks of the requests in flight (2 × 4 ×
            // ~16), so admission parks requests and the ledger is exercised.
            capacity_chunks: 64,
            concurrency: 4,
            abort_rate: 0.0,
            fail_rate: 0.0,
            seed: 1,
            transport: "shm".into(),
            stall_timeout_s: 10.0,
            max_pending_bytes: 64 << 20,
            static_buffers: Vec::new(),
            key_format: "kvferry".into(),
            copy_store: false,
        }
    }
}

impl RunConfig {
    /// Reads a TOML file with the same keys (unknown keys are an error).
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The stall timeout as a duration.
    pub fn stall_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.stall_timeout_s.max(0.1))
    }

    /// Checks every value; the message names the option.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: usize, name: &str| {
            if v == 0 {
                Err(format!("--{name} must be at least 1"))
            } else {
                Ok(())
            }
        };
        pos(self.prefillers, "prefillers")?;
        pos(self.decoders, "decoders")?;
        pos(self.batch, "batch")?;
        pos(self.staging_slots, "staging-slots")?;
        pos(self.capacity_chunks, "capacity-chunks")?;
        pos(self.concurrency, "concurrency")?;
        if self.chunk_bytes < super::payload::HEADER as u64
            || self.chunk_bytes > u64::from(u32::MAX)
        {
            return Err(format!(
                "--chunk-bytes must be in {}..={} (a chunk's length is 32 bits)",
                super::payload::HEADER,
                u32::MAX
            ));
        }
        if self
            .chunk_bytes
            .checked_mul(self.capacity_chunks.max(self.staging_slots) as u64)
            .is_none_or(|b| b > 1 << 40)
        {
            return Err("--chunk-bytes × slots is larger than 1 TiB".into());
        }
        if self.batch > self.staging_slots {
            return Err(format!(
                "--batch {} is larger than --staging-slots {}: a batch takes its staging slots all at once",
                self.batch, self.staging_slots
            ));
        }
        if self.chunks.max as usize > self.capacity_chunks {
            return Err(format!(
                "--chunks max {} is larger than --capacity-chunks {}: such a request could never be admitted",
                self.chunks.max, self.capacity_chunks
            ));
        }
        for (v, name) in [
            (self.abort_rate, "abort-rate"),
            (self.fail_rate, "fail-rate"),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("--{name} must be between 0 and 1, got {v}"));
            }
        }
        if !self.stall_timeout_s.is_finite() || self.stall_timeout_s <= 0.0 {
            return Err("--stall-timeout must be a positive number of seconds".into());
        }
        if !matches!(self.key_format.as_str(), "kvferry" | "lmcache") {
            return Err(format!(
                "--key-format must be kvferry or lmcache, got {:?}",
                self.key_format
            ));
        }
        check_static_buffers(&self.static_buffers, &self.transport)?;
        match self.transport.as_str() {
            "shm" | "tcp" | "rdma" => Ok(()),
            other => Err(format!(
                "--transport must be shm, tcp or rdma, got {other:?}"
            )),
        }
    }

    /// The key of chunk `id` of `req_id` in [`RunConfig::key_format`].
    pub fn chunk_key(&self, id: &super::payload::ChunkId, req_id: &str) -> String {
        if self.key_format == "lmcache" {
            id.lmcache_key(req_id)
        } else {
            id.key(req_id)
        }
    }

    /// The receive buffers of [`RunConfig::static_buffers`], by endpoint.
    pub fn static_peers(&self) -> Result<Vec<(String, RemoteBuffer)>, String> {
        static_peers_of(&self.static_buffers, &self.transport)
    }
}

/// The receive buffers `specs` name (`ENDPOINT=PATH` each, as
/// `--static-buffer` takes them), by endpoint, for a sender writing over
/// `transport`: `kvferry sender`'s and `kvferry node`'s. Errors: a spec
/// that is not `ENDPOINT=PATH`, a transport other than shm, a file that
/// is not a kvferry buffer.
pub fn static_peers_of(
    specs: &[String],
    transport: &str,
) -> Result<Vec<(String, RemoteBuffer)>, String> {
    check_static_buffers(specs, transport)?;
    specs
        .iter()
        .map(|spec| {
            let (endpoint, path) = split_static_buffer(spec)?;
            Ok((endpoint.to_owned(), static_peer(Path::new(path))?))
        })
        .collect()
}

/// Every spec is `ENDPOINT=PATH`, and a sender with any writes over shm
/// (a static buffer is a shm buffer file).
fn check_static_buffers(specs: &[String], transport: &str) -> Result<(), String> {
    for spec in specs {
        split_static_buffer(spec)?;
    }
    if !specs.is_empty() && transport != "shm" {
        return Err(format!(
            "--static-buffer needs --transport shm (a static buffer is a shm buffer file), got {transport:?}"
        ));
    }
    Ok(())
}

/// Splits `"ENDPOINT=PATH"` (at the first `=`; ZMQ endpoints have none).
fn split_static_buffer(spec: &str) -> Result<(&str, &str), String> {
    match spec.split_once('=') {
        Some((e, p)) if !e.trim().is_empty() && !p.trim().is_empty() => Ok((e.trim(), p.trim())),
        _ => Err(format!(
            "--static-buffer {spec:?}: expected ENDPOINT=PATH, e.g. tcp://10.0.0.2:7400=/dev/shm/kvferry.buf"
        )),
    }
}

/// The static descriptor of the kvferry buffer file at `path`, for a
/// receiver that does not answer `Hello`: its geometry comes from the
/// file's header. Only a shm buffer file can be addressed this way: the
/// TCP and RDMA data planes are set up by `Hello`/`HelloAck`, and an
/// LMCache receiver's own buffer is reachable only over NIXL, which kvferry
/// does not speak (docs/protocol.md, "Interoperating with LMCache").
pub fn static_peer(path: &Path) -> Result<RemoteBuffer, String> {
    let region = Region::open(path, None).map_err(|e| {
        format!(
            "--static-buffer: {e} (a receiver that does not answer Hello is addressed through a kvferry shm buffer file on this host; kvferry has no NIXL transport to reach an LMCache receiver's own buffer)"
        )
    })?;
    Ok(RemoteBuffer {
        descriptor: Descriptor::Shm {
            path: path.to_string_lossy().into_owned(),
            len: region.data_len(),
        },
        chunk_bytes: region.chunk_bytes(),
        capacity_chunks: region.capacity_chunks(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_refuse() {
        assert_eq!(
            "1..32".parse::<ChunkRange>(),
            Ok(ChunkRange { min: 1, max: 32 })
        );
        assert_eq!(
            "4..=4".parse::<ChunkRange>(),
            Ok(ChunkRange { min: 4, max: 4 })
        );
        assert_eq!("7".parse::<ChunkRange>(), Ok(ChunkRange { min: 7, max: 7 }));
        assert!("0..3".parse::<ChunkRange>().is_err());
        assert!("5..3".parse::<ChunkRange>().is_err());
        assert!("a..3".parse::<ChunkRange>().is_err());
    }

    #[test]
    fn toml_uses_the_same_keys_and_refuses_unknown_ones() {
        let c: RunConfig =
            toml::from_str("requests = 10\nchunks = \"2..4\"\nfail_rate = 0.5\n").unwrap();
        assert_eq!(c.requests, 10);
        assert_eq!(c.chunks, ChunkRange { min: 2, max: 4 });
        assert_eq!(c.prefillers, 2, "missing keys keep their defaults");
        assert!(toml::from_str::<RunConfig>("requets = 10\n").is_err());
    }

    #[test]
    fn static_buffers_parse_resolve_and_refuse() {
        let dir = std::env::temp_dir().join(format!("kvferry-static-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("buf");
        let region = Region::create(&path, 4096, 3).unwrap();
        let c: RunConfig = toml::from_str(&format!(
            "static_buffers = [\"tcp://127.0.0.1:7400={}\"]\n",
            path.display()
        ))
        .unwrap();
        assert_eq!(c.validate(), Ok(()));
        let peers = c.static_peers().unwrap();
        assert_eq!(peers.len(), 1);
        assert_eq!(peers[0].0, "tcp://127.0.0.1:7400");
        assert_eq!(peers[0].1.chunk_bytes, 4096);
        assert_eq!(peers[0].1.capacity_chunks, 3);
        assert_eq!(
            peers[0].1.descriptor,
            Descriptor::Shm {
                path: path.to_string_lossy().into_owned(),
                len: region.data_len()
            }
        );
        for bad in ["tcp://127.0.0.1:7400", "=/dev/shm/x", "tcp://h:1= "] {
            let c = RunConfig {
                static_buffers: vec![bad.into()],
                ..RunConfig::default()
            };
            assert!(c.validate().unwrap_err().contains("ENDPOINT=PATH"), "{bad}");
        }
        let c = RunConfig {
            static_buffers: vec![format!("tcp://h:1={}", path.display())],
            transport: "tcp".into(),
            ..RunConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("--transport shm"));
        // No buffer file there: the message says what is missing.
        let c = RunConfig {
            static_buffers: vec![format!("tcp://h:1={}", dir.join("none").display())],
            ..RunConfig::default()
        };
        let e = c.static_peers().unwrap_err();
        assert!(
            e.contains("kvferry shm buffer file") && e.contains("NIXL"),
            "{e}"
        );
        drop(region);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn validation_names_the_option() {
        let mut c = RunConfig::default();
        assert_eq!(c.validate(), Ok(()));
        c.batch = 100;
        assert!(c.validate().unwrap_err().contains("--batch"));
        let mut c = RunConfig {
            chunks: ChunkRange { min: 1, max: 100 },
            ..RunConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("--chunks"));
        c = RunConfig {
            abort_rate: 2.0,
            ..RunConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("--abort-rate"));
        c = RunConfig {
            transport: "udp".into(),
            ..RunConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("--transport"));
    }
}
