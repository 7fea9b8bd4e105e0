//! One module per subcommand.

pub use kvsan_audit as audit;
pub mod bench;
pub mod engine_args;
pub mod fault;
pub mod generate;
pub mod model_arg;
pub mod replay;
pub mod serve;
pub mod tokenize;
