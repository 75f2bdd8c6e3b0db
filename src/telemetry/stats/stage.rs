//! The pipeline stages whose latency is recorded per request.

use serde::Serialize;

/// A stage of a request's life in the engine (sender side unless noted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// `store()` called → AllocRequest (admission request) sent by `ctrl`.
    Pending,
    /// AllocRequest of the first batch sent → admission granted
    /// (AllocResponse received).
    AdmissionWait,
    /// Time a batch of an admitted request waits for free staging slots.
    StagingWait,
    /// Write posted to the transport → its completion polled.
    Transfer,
    /// Last completion of the request → ProxyNotif sent.
    Notify,
}

impl Stage {
    /// Number of stages.
    pub const COUNT: usize = 5;

    /// Every stage, in pipeline order.
    pub const ALL: [Stage; Stage::COUNT] = [
        Stage::Pending,
        Stage::AdmissionWait,
        Stage::StagingWait,
        Stage::Transfer,
        Stage::Notify,
    ];

    /// The stage's snake_case name, used in JSON reports and metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            Stage::Pending => "pending",
            Stage::AdmissionWait => "admission_wait",
            Stage::StagingWait => "staging_wait",
            Stage::Transfer => "transfer",
            Stage::Notify => "notify",
        }
    }

    /// Position in [`Stage::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_indices_and_serde_agree() {
        let names: Vec<_> = Stage::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(
            names,
            [
                "pending",
                "admission_wait",
                "staging_wait",
                "transfer",
                "notify"
            ]
        );
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(s.index(), i);
            assert_eq!(
                serde_json::to_string(s).unwrap(),
                format!("\"{}\"", s.name())
            );
            assert_eq!(s.to_string(), s.name());
        }
    }
}
