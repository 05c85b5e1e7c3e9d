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
    /// Per class: its family, and its place among the family's members.
    of: HashMap<u64, (usize, usize)>,
    /// Per family and member: its [`scale`] against the family's index profile (1 for a family
    /// of one class).
    scales: Vec<Vec<f64>>,
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
            of.insert(j.class, (f, members[f].len()));
            members[f].push(j.profile.clone());
        }
        let all: Vec<Family> = members.iter().map(|m| envelope(m)).collect();
        let scales = members
            .iter()
            .zip(&all)
            .map(|(m, f)| match f.classes {
                1 => vec![1.0],
                _ => m.iter().map(|p| scale(p, &f.profile)).collect(),
            })
            .collect();
        Families { of, scales, all }
    }

    /// The family of `class` (one of the jobs').
    pub(super) fn of(&self, class: u64) -> usize {
        self.of[&class].0
    }

    /// The family of `class` (one of the jobs') and the class's [`scale`] against the family's
    /// index profile.
    pub(super) fn member(&self, class: u64) -> (usize, f64) {
        let (f, i) = self.of[&class];
        (f, self.scales[f][i])
    }
}

/// Added to `scale x` a class index's key before a member's walk stops by it (see [`scale`]),
/// per unit of the fastest node's speed: the rounding of the member's and the envelope's memory
/// factors (sums of a few dozen terms of magnitude at most 11, each off by at most a few units
/// in the last place: below 1e-12) and of the member's shares at its points (each within 1e-15
/// of the quotient `scale` divides) are far below it.
pub(super) const SCALED_SLACK: f64 = 1e-9;

/// lambda in [0, 1]: `member`'s share of T_alone at each curve point is at most lambda x
/// `envelope`'s there, counted at most 1; 1 where no smaller one is known (then the rule it
/// serves is the unscaled one). A member of a family walks the envelope's class index; where
/// lambda < 1 its search may stop once lambda x the next node's key + [`SCALED_SLACK`] x the
/// fastest speed is below the best share found: no later node can give the member as much.
///
/// Why (in exact arithmetic; the slack covers the rounding). Write a point's share of the
/// member m_i = per_s_i / alone and of the envelope e_i, and e'_i = min(e_i, 1).
/// 1. Per memory: `memory_share` is clamp(I(q), 0, 1) with I the linear interpolation of the
///    point shares (0 below the first point, the last from it on). m_i <= lambda e'_i at every
///    point (for e'_i <= 0 because m_i <= e_i, the envelope being the members' largest, and
///    lambda <= 1), so I_m <= lambda I_e' (a convex combination) and I_e' <= min(I_e, 1)
///    (min(1, .) is concave). Hence s_m = clamp(I_m) <= clamp(lambda I_e') <= lambda
///    max(I_e', 0) <= lambda s_e, as lambda I_e' <= lambda <= 1 leaves the clamp at 1 unbound.
///    **The clamp at 1**: for lambda < 1 and x > 1, clamp(lambda x) = min(1, lambda x) may
///    exceed lambda clamp(x) = lambda (for lambda >= 1 it never does): with e'_i = e_i, an
///    envelope's share of 2 at a point is clamped to 1, a member's of 1.5 too, and
///    1 > (1.5 / 2) x 1. Counting the envelope's points at most 1 before dividing keeps every
///    scaled figure at most 1, so no clamp at 1 binds on it (a member above alone at a point
///    then gets lambda >= 1: no scaling).
/// 2. The memory factor (`memory_factor`): Trace is clamp(S - p D, 0, 1) with S the mean of
///    s over the quantiles and D the mean deficit below R; a family shares p in [0, 10] and R,
///    so D too. S_m - p D <= lambda S_e - p D <= lambda (S_e - p D) (as (1 - lambda) p D >= 0),
///    and S_e - p D <= 1, so F_m <= lambda F_e by the same clamp step as in 1. StaticMin is s
///    at the first quantile (1). Ignore gives 1 to both: lambda does not hold, and the walk
///    does not scale there.
/// 3. A set's share (`predict_with`) is clamp(A x mem, 0, 1) x max(speed, 0) with mem the
///    smallest factor of its GPUs (and 1) and A = idle + overlap - interrupted <= 1 (idle and
///    the member's held overlap o_m in [0, 1], overlap = o_m x (1 - idle), interrupted >= 0),
///    the same for the member with the envelope's factors as with its own. mem_m <= lambda
///    mem_e by 2, and A mem_e <= 1, so the member's share is at most lambda x the share of its
///    own profile with the envelope's factors (for A < 0 both are 0). **With held overlap**: A
///    <= o_m + (1 - o_m) idle <= o_e + (1 - o_e) idle, o_e being the envelope's held overlap,
///    the largest of its members' (`envelope`), as the term grows with o (1 - idle >= 0); the
///    lambda does not depend on it (the curve's points only).
/// 4. A class index's key of a node is at least the share on any of its sets of any profile
///    whose factors there are at most the envelope's and whose held overlap is at most the
///    envelope's (what families rely on already: every bound's idle term is
///    `bound::with_overlap` of the envelope's), so at least that share with the member's own
///    A; a later node's key is at most the next one's (the walk goes down), and lambda x +
///    slack grows with x.
pub(super) fn scale(member: &JobProfile, envelope: &JobProfile) -> f64 {
    let (m, e) = (&member.curve, &envelope.curve);
    let same = m.len() == e.len()
        && m.iter()
            .zip(e)
            .all(|(a, b)| a.memory_bytes == b.memory_bytes);
    if !same
        || member.deficit_penalty.to_bits() != envelope.deficit_penalty.to_bits()
        || member.required() != envelope.required()
    {
        return 1.0;
    }
    let mut lambda: f64 = 0.0;
    for (a, b) in m.iter().zip(e) {
        // The same quotient as the envelope's (`envelope`), and its point clamped at 1.
        let share = a.per_s / member.alone_per_s;
        let top = (b.per_s / envelope.alone_per_s).min(1.0);
        if top > 0.0 {
            let ratio = share / top;
            if ratio.is_nan() {
                return 1.0; // `f64::max` would pass over it
            }
            lambda = lambda.max(ratio);
        } else if super::bound::may_exceed(share, top) {
            return 1.0; // not the members' largest there (or not a number)
        }
    }
    if lambda < 1.0 {
        lambda
    } else {
        1.0 // NaN too
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
        // The largest held overlap of the members' (each as `bound::held_overlap` counts it),
        // so that the index's keys bound every member's share where interruptions are
        // modelled: the idle term o + (1 - o) idle grows with o. Nothing else of the costs is
        // read by a bound (what a job loses only lowers its share).
        costs: InterruptCosts {
            held_overlap: members
                .iter()
                .map(|m| match m.costs.held_overlap {
                    o if o.is_nan() => 1.0,
                    o => o.clamp(0.0, 1.0),
                })
                .fold(0.0, f64::max),
            ..InterruptCosts::default()
        },
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
    fn a_familys_index_profile_keeps_the_largest_held_overlap_of_its_members() {
        let base = crate::bench::class_profile(3);
        let mut jobs = Vec::new();
        for (c, o) in [0.3, 1.0, 0.0, f64::NAN].into_iter().enumerate() {
            let mut p = base.at_level(1.0 - 0.1 * c as f64);
            p.costs.held_overlap = o;
            jobs.push(job(c as u64, p));
        }
        // Without the NaN, the largest (1.0); with it, 1 (a share not a number bounds nothing
        // below all of it); and 0 for members without overlap, as before.
        for (n, want) in [(2, 1.0), (4, 1.0), (1, 0.3)] {
            let f = Families::new(&jobs[..n]);
            assert_eq!(
                f.all[f.of(0)].profile.costs.held_overlap,
                want,
                "{n} members"
            );
        }
        jobs[0] = job(0, base.clone());
        jobs[1] = job(1, base.at_level(0.5));
        let f = Families::new(&jobs[..2]);
        assert_eq!(f.all[f.of(0)].profile.costs.held_overlap, 0.0);
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
