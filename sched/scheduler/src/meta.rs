//! What the scheduler keeps with each offline job in the cluster engine (Slurm's job comment):
//! the SLA, the profile, where the scheduler placed it and where it must not go again.
//!
//! The engine is the only store of job state, so a scheduler restart finds everything there.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::job::{check_sla, JobError, JobProfile};

/// The prefix that marks a comment as Valve's: jobs without it are not the scheduler's.
pub const PREFIX: &str = "valve:";

/// The metadata of one job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobMeta {
    /// The throughput SLA (share of alone).
    pub sla: f64,
    /// The job's profile (`None`: the scheduler's default profile applies, if it has one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<JobProfile>,
    /// Where the scheduler placed it (set just before it is released).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placed: Option<PlacedOn>,
    /// Nodes it was evicted from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub avoid: Vec<String>,
    /// Times it was evicted.
    #[serde(default)]
    pub evictions: u32,
}

/// A placement as stored with the job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedOn {
    /// The node.
    pub node: String,
    /// GPU indices on it.
    pub gpus: Vec<u32>,
}

/// Why a job's metadata could not be read.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum MetaError {
    /// The comment is Valve's but not readable.
    #[error(
        "the job's valve metadata is not valid JSON: {0}; resubmit with `valve-scheduler submit`"
    )]
    Malformed(String),
    /// The SLA or profile is out of range.
    #[error(transparent)]
    Job(#[from] JobError),
}

impl JobMeta {
    /// The comment text for the engine.
    pub fn to_comment(&self) -> String {
        format!(
            "{PREFIX}{}",
            serde_json::to_string(self).expect("metadata serialises")
        )
    }

    /// Reads a comment: `None` if it is not Valve's, else the validated metadata.
    pub fn from_comment(comment: &str) -> Option<Result<JobMeta, MetaError>> {
        let body = comment.trim().strip_prefix(PREFIX)?;
        Some(
            serde_json::from_str::<JobMeta>(body)
                .map_err(|e| MetaError::Malformed(e.to_string()))
                .and_then(|m| m.validated()),
        )
    }

    fn validated(self) -> Result<JobMeta, MetaError> {
        check_sla(self.sla)?;
        if let Some(p) = &self.profile {
            p.validate()?;
        }
        Ok(self)
    }
}

/// A profile with the key that groups jobs of equal profiles (for the placement cache).
#[derive(Clone, Debug)]
pub struct ClassedProfile {
    /// The profile.
    pub profile: Arc<JobProfile>,
    /// Equal profiles have equal classes.
    pub class: u64,
}

impl ClassedProfile {
    /// Classes `profile` by its JSON text.
    pub fn new(profile: JobProfile) -> Self {
        let mut h = DefaultHasher::new();
        serde_json::to_string(&profile)
            .expect("profile serialises")
            .hash(&mut h);
        ClassedProfile {
            profile: Arc::new(profile),
            class: h.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::tests::profile;

    #[test]
    fn metadata_round_trips_through_a_comment() {
        let m = JobMeta {
            sla: 0.8,
            profile: Some(profile(2)),
            placed: Some(PlacedOn {
                node: "gpu003".into(),
                gpus: vec![2, 3],
            }),
            avoid: vec!["gpu001".into()],
            evictions: 1,
        };
        let c = m.to_comment();
        assert!(c.starts_with("valve:{"));
        assert_eq!(JobMeta::from_comment(&c), Some(Ok(m)));
        assert_eq!(JobMeta::from_comment("someone else's note"), None);
        assert_eq!(JobMeta::from_comment(""), None);
    }

    #[test]
    fn bad_metadata_is_named() {
        let e = JobMeta::from_comment("valve:{\"sla\":")
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        let e = JobMeta::from_comment("valve:{\"sla\":1.5}")
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("outside (0, 1]"), "{e}");
        let mut p = profile(1);
        p.curve.clear();
        let bad = JobMeta {
            sla: 0.5,
            profile: Some(p),
            placed: None,
            avoid: vec![],
            evictions: 0,
        };
        let e = JobMeta::from_comment(&bad.to_comment())
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("no points"), "{e}");
    }

    #[test]
    fn equal_profiles_share_a_class() {
        let a = ClassedProfile::new(profile(1));
        let b = ClassedProfile::new(profile(1));
        let c = ClassedProfile::new(profile(2));
        assert_eq!(a.class, b.class);
        assert_ne!(a.class, c.class);
    }
}
