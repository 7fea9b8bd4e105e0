//! One module per subcommand.

pub mod audit;
pub mod bench;
pub mod engine_args;
pub mod fault;
pub mod generate;
pub mod model_arg;
pub mod replay;
pub mod serve;
pub mod tokenize;
