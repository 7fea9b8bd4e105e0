//! Declares the `loom` cfg so `--cfg loom` builds (the model-checked tests)
//! pass the `unexpected_cfgs` lint.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
}
