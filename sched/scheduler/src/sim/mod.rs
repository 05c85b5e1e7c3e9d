//! The cluster simulator (issue 28, part 6): a week of a large GPU cluster whose online load
//! replays the Azure LLM trace, with offline jobs placed by the scheduler's own pass.

pub mod trace;
