//! `valve-scheduler predict`: what the model predicts for one job on one node's harvest
//! document, factor by factor.

use std::process::ExitCode;

use clap::Args;

use super::common::{read_profile, ModelArgs};
use crate::error::usage;
use valve_harvest::NodeHarvest;
use valve_scheduler::meta::ClassedProfile;
use valve_scheduler::place::NodeSlot;
use valve_scheduler::place::{place, Outcome, PendingJob};
use valve_scheduler::predict::{predict, NodeModel};

/// Predicts a job's throughput on a node: T_alone x idle x memory x alignment.
///
/// Without --gpus, the best free GPU set of the job's size is chosen as the scheduler would.
#[derive(Args, Debug)]
pub struct PredictArgs {
    /// The job's profile.
    #[arg(long)]
    profile: std::path::PathBuf,
    /// The node's harvest document (`valvectl --json profile`, or an agent's /v1/harvest).
    #[arg(long)]
    harvest: std::path::PathBuf,
    /// GPU indices to predict on (default: the best set).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<u32>,
    #[command(flatten)]
    model: ModelArgs,
}

/// Prints the prediction.
pub fn exec(a: &PredictArgs, json: bool) -> anyhow::Result<ExitCode> {
    let params = a.model.params()?;
    let profile = read_profile(&a.profile)?;
    let text = std::fs::read_to_string(&a.harvest)
        .map_err(|e| usage(format!("cannot read {}: {e}", a.harvest.display())))?;
    let doc = NodeHarvest::from_json(&text)
        .map_err(|e| usage(format!("{}: {e}", a.harvest.display())))?;
    let model = NodeModel::from_doc(&doc, &params.place.model);
    let (gpus, prediction) = if a.gpus.is_empty() {
        let job = PendingJob {
            id: "predict".into(),
            profile: ClassedProfile::new(profile.clone()).profile,
            class: 0,
            sla: 1e-9,
            avoid: vec![],
            order: 0,
        };
        let mut slot = [NodeSlot {
            free: vec![true; model.gpus.len()],
            model: model.clone(),
        }];
        let mut p = params.place;
        p.margin = 0.0;
        match place(&[job], &mut slot, &p).remove(0).outcome {
            Outcome::Placed(pl) => (pl.gpus, pl.prediction),
            Outcome::Pending(why) => {
                return Err(usage(format!(
                    "no GPU set of {} GPUs: {why:?}",
                    profile.gpus
                )))
            }
        }
    } else {
        if a.gpus.len() != profile.gpus as usize {
            return Err(usage(format!(
                "the profile runs on {} GPUs; --gpus names {}",
                profile.gpus,
                a.gpus.len()
            )));
        }
        let positions = a
            .gpus
            .iter()
            .map(|g| {
                model
                    .gpus
                    .iter()
                    .position(|x| x.index == *g)
                    .ok_or_else(|| usage(format!("node {} has no GPU {g}", doc.node)))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        (
            a.gpus.clone(),
            predict(&profile, &model, &positions, &params.place.model),
        )
    };
    if json {
        println!(
            "{}",
            serde_json::json!({"node": doc.node, "gpus": gpus, "prediction": prediction})
        );
    } else {
        println!(
            "{} GPUs {gpus:?}: {:.1} {}/s predicted = {prediction}",
            doc.node, prediction.per_s, profile.units
        );
    }
    Ok(ExitCode::SUCCESS)
}
