//! Job classes of one shape, for the fast pass's class indexes: profiles on the same GPUs with
//! the same curve points in memory, the same R and deficit penalty, differing only in the share
//! of T_alone each point gives. A job's learned level (`JobProfile::at_level`) makes such a
//! profile, one per level, and so does the simulator's oracle.
//!
//! The bound a class index orders nodes by reads the curve only through the shares at those
//! points (`Curve::at_most`, `Curve::factor_bound`), and each is monotone in them, so a curve
//! whose shares are the family's highest bounds every member's share: one index (made with that
//! envelope) serves every class of the family. A member other than the envelope walks it
//! applying its own quick bound too, and stops by the envelope's bound (at least its own), so
//! it can only look further than with an index of its own, never stop sooner.

use std::collections::HashMap;
use std::sync::Arc;

use super::PendingJob;
use crate::job::{CurvePoint, InterruptCosts, JobProfile, PROFILE_VERSION};

/// A family's index is made with `profile`: the envelope where it has more than one class, else
/// its one class's own profile.
pub(super) struct Family {
    pub(super) profile: Arc<JobProfile>,
    /// Distinct classes among the pass's jobs.
    pub(super) classes: usize,
}

/// The families of a pass's jobs.
#[derive(Default)]
pub(super) struct Families {
    of: HashMap<u64, usize>,
    pub(super) all: Vec<Family>,
}

/// What a family shares; a profile the bounds do not hold for is a family of its own.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Shape {
    Points {
        gpus: u32,
        penalty: u64,
        required: u64,
        memory: Vec<u64>,
    },
    Own(u64),
}

fn shape(class: u64, p: &JobProfile) -> Shape {
    let c = &p.curve;
    let bounded = !c.is_empty()
        && c.windows(2).all(|w| w[0].memory_bytes < w[1].memory_bytes)
        && p.alone_per_s.is_finite()
        && p.alone_per_s > 0.0
        && c.iter().all(|x| x.per_s.is_finite())
        && (0.0..=10.0).contains(&p.deficit_penalty);
    if !bounded {
        return Shape::Own(class);
    }
    Shape::Points {
        gpus: p.gpus,
        penalty: p.deficit_penalty.to_bits(),
        required: p.required(),
        memory: c.iter().map(|x| x.memory_bytes).collect(),
    }
}

/// `x` and a little more: 1e-12 of it, far above the rounding of a member's own interpolation
/// between the same points (a few units in the last place).
fn above(x: f64) -> f64 {
    x + x.abs() * 1e-12
}

impl Families {
    /// The families of `jobs` (jobs of one class have one profile).
    pub(super) fn new(jobs: &[PendingJob]) -> Self {
        let mut by_shape: HashMap<Shape, usize> = HashMap::new();
        let mut members: Vec<Vec<Arc<JobProfile>>> = Vec::new();
        let mut of = HashMap::new();
        for j in jobs {
            if of.contains_key(&j.class) {
                continue;
            }
            let f = *by_shape
                .entry(shape(j.class, &j.profile))
                .or_insert_with(|| {
                    members.push(Vec::new());
                    members.len() - 1
                });
            members[f].push(j.profile.clone());
            of.insert(j.class, f);
        }
        let all = members.into_iter().map(|m| envelope(&m)).collect();
        Families { of, all }
    }

    /// The family of `class` (one of the jobs').
    pub(super) fn of(&self, class: u64) -> usize {
        self.of[&class]
    }
}

/// The family of `members` (of one shape, at least one).
fn envelope(members: &[Arc<JobProfile>]) -> Family {
    let first = &members[0];
    if members.len() == 1 {
        return Family {
            profile: first.clone(),
            classes: 1,
        };
    }
    let curve = (0..first.curve.len())
        .map(|i| {
            let share = members
                .iter()
                .map(|m| m.curve[i].per_s / m.alone_per_s)
                .fold(f64::NEG_INFINITY, f64::max);
            CurvePoint {
                memory_bytes: first.curve[i].memory_bytes,
                per_s: above(share),
            }
        })
        .collect();
    let profile = JobProfile {
        version: PROFILE_VERSION,
        name: format!("envelope of {} profiles like {}", members.len(), first.name),
        units: first.units.clone(),
        gpus: first.gpus,
        alone_per_s: 1.0,
        curve,
        required_bytes: Some(first.required()),
        deficit_penalty: first.deficit_penalty,
        costs: InterruptCosts::default(),
        measured: None,
    };
    Family {
        profile: Arc::new(profile),
        classes: members.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::place::bound::{Curve, Trace};
    use crate::predict::MemoryModel;

    fn job(class: u64, profile: JobProfile) -> PendingJob {
        PendingJob {
            id: class.to_string(),
            profile: Arc::new(profile),
            class,
            sla: 0.5,
            avoid: vec![],
            order: class,
        }
    }

    #[test]
    fn profiles_of_one_shape_share_a_family_whose_curve_bounds_each_of_theirs() {
        let mut rng = fastrand::Rng::with_seed(31);
        let mut checked = 0;
        for _ in 0..300 {
            let base = crate::place::tests::random_profile(&mut rng);
            let mut jobs = vec![job(0, base.clone())];
            // Levels, as learned or as the oracle knows them, and one of another shape.
            for c in 1..rng.u64(1..6) {
                jobs.push(job(c, base.at_level(0.5 + rng.f64())));
            }
            let mut other = base.clone();
            other.gpus += 1;
            jobs.push(job(99, other));
            let f = Families::new(&jobs);
            let bounded =
                Curve::new(&base).factor_bound(&Trace::of(&[0, 1]).unwrap(), MemoryModel::Trace);
            if bounded.is_nan() {
                // A profile the bounds do not hold for stays alone.
                assert!(jobs[1..jobs.len() - 1]
                    .iter()
                    .all(|j| f.of(j.class) != f.of(0)));
                continue;
            }
            assert!(jobs[..jobs.len() - 1]
                .iter()
                .all(|j| f.of(j.class) == f.of(0)));
            assert_ne!(f.of(99), f.of(0));
            let family = &f.all[f.of(0)];
            assert_eq!(family.classes, jobs.len() - 1);
            let env = Curve::new(&family.profile);
            for j in &jobs[..jobs.len() - 1] {
                let own = Curve::new(&j.profile);
                for _ in 0..50 {
                    let m = rng.u64(0..70 << 30);
                    assert!(env.at_most(m) >= own.at_most(m), "{m}");
                    let mut q: Vec<u64> = (0..21).map(|_| rng.u64(0..70 << 30)).collect();
                    q.sort_unstable();
                    let t = Trace::of(&q).unwrap();
                    for mm in [MemoryModel::Trace, MemoryModel::StaticMin] {
                        let exact = crate::predict::memory_factor(&j.profile, &q, mm);
                        assert!(env.factor_bound(&t, mm) >= own.factor_bound(&t, mm));
                        assert!(env.factor_bound(&t, mm) >= exact);
                        // The class index keys nodes by the envelope's exact factor.
                        let own = crate::predict::memory_factor(&family.profile, &q, mm);
                        assert!(own >= exact, "{own} < {exact}");
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 10_000, "{checked} checked");
    }

    #[test]
    fn a_family_of_one_class_is_made_with_its_own_profile() {
        let p = crate::bench::class_profile(3);
        let jobs = [job(7, p.clone()), job(7, p)];
        let f = Families::new(&jobs);
        assert_eq!(f.all.len(), 1);
        assert_eq!(f.all[0].classes, 1);
        assert!(Arc::ptr_eq(&f.all[0].profile, &jobs[0].profile));
    }
}
