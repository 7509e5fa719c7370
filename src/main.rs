//! The `dedupd` binary: parse flags, set up logging, dispatch.

fn main() {
    eprintln!("dedupd: commands arrive with the foundation issue");
    std::process::exit(2);
}
