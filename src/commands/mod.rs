//! One module per subcommand.

pub mod fault;
pub mod bench;
pub mod generate;
pub mod model_arg;
pub mod replay;
pub mod serve;
pub mod tokenize;
