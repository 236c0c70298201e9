//! The export state machine. Transitions only go forward; every worker transition is a
//! conditional update fenced by the lease generation.
//!
//! `QUEUED → RUNNING → SUCCEEDED → (EXPIRED | REVOKED)`, `RUNNING → FAILED`,
//! `QUEUED | RUNNING → CANCEL_REQUESTED → CANCELLED`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ExportState {
    Queued,
    Running,
    CancelRequested,
    Cancelled,
    Succeeded,
    Failed,
    Expired,
    Revoked,
}

impl ExportState {
    pub const ALL: [ExportState; 8] = [
        ExportState::Queued,
        ExportState::Running,
        ExportState::CancelRequested,
        ExportState::Cancelled,
        ExportState::Succeeded,
        ExportState::Failed,
        ExportState::Expired,
        ExportState::Revoked,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ExportState::Queued => "QUEUED",
            ExportState::Running => "RUNNING",
            ExportState::CancelRequested => "CANCEL_REQUESTED",
            ExportState::Cancelled => "CANCELLED",
            ExportState::Succeeded => "SUCCEEDED",
            ExportState::Failed => "FAILED",
            ExportState::Expired => "EXPIRED",
            ExportState::Revoked => "REVOKED",
        }
    }

    pub fn parse(text: &str) -> Option<ExportState> {
        ExportState::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// No worker will touch the job again.
    pub fn is_terminal(self) -> bool {
        !matches!(self, ExportState::Queued | ExportState::Running | ExportState::CancelRequested)
    }

    /// Whether a job in this state may move to `to`: the state machine above, in one place (the
    /// database enforces the same table, migration `state_transitions.sql`).
    pub fn may_become(self, to: ExportState) -> bool {
        use ExportState::*;
        self == to
            || matches!(
                (self, to),
                (Queued, Running | CancelRequested)
                    | (Running, Succeeded | Failed | CancelRequested)
                    | (CancelRequested, Cancelled)
                    | (Succeeded, Expired | Revoked)
            )
    }

    /// The job ran to publication: its rows were exported (its files may be gone since).
    pub fn was_published(self) -> bool {
        matches!(self, ExportState::Succeeded | ExportState::Expired | ExportState::Revoked)
    }
}

crate::db::text_column!(ExportState);

impl TryFrom<String> for ExportState {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        ExportState::parse(&text).ok_or_else(|| format!("unknown export state `{text}`"))
    }
}

#[cfg(test)]
mod tests {
    use super::ExportState;

    #[test]
    fn states_round_trip_through_text_and_json() {
        for state in ExportState::ALL {
            assert_eq!(ExportState::parse(state.as_str()), Some(state));
            assert_eq!(serde_json::to_value(state).unwrap(), state.as_str());
        }
        assert_eq!(ExportState::parse("queued"), None);
    }
}
