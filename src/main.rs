//! The `dedupd` binary: parse flags, set up logging, dispatch. Everything
//! else lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use dedupd::classify::SystemClock;
use dedupd::config::{EngineSettings, FileConfig, TuningArgs};
use dedupd::offline::{run_dedupe, DedupeOptions, Stdio};

#[derive(Parser, Debug)]
#[command(name = "dedupd", version, about = "Exactly-once deduplication of usage events for billing")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up; the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Offline mode: dedupe NDJSON with the same engine as the Kafka worker.
    Dedupe {
        /// NDJSON input file, or - for standard input.
        #[arg(long, env = "DEDUPD_INPUT")]
        input: Stdio,
        /// Accepted events as canonical NDJSON: a file, or - for standard output.
        #[arg(long, env = "DEDUPD_OUTPUT")]
        output: Stdio,
        /// Keep state here across runs (the output file is then appended to).
        #[arg(long, env = "DEDUPD_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// Write rejected records here, one JSON line each.
        #[arg(long, env = "DEDUPD_REJECTED")]
        rejected: Option<PathBuf>,
        /// Write conflicting records here, one JSON line each.
        #[arg(long, env = "DEDUPD_CONFLICTS")]
        conflicts: Option<PathBuf>,
        /// Records per batch.
        #[arg(long, env = "DEDUPD_BATCH_RECORDS", default_value_t = 1000)]
        batch_records: usize,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Checks every checksum of a state directory; exits 1 on any corruption.
    Verify {
        #[arg(long, env = "DEDUPD_STATE_DIR")]
        state_dir: PathBuf,
    },
    /// Where and when an event was seen.
    Inspect {
        #[arg(long, env = "DEDUPD_STATE_DIR")]
        state_dir: PathBuf,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        event_id: String,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Sample traffic with retries, conflicts and bad records; prints the buckets.
    Demo {
        /// Distinct events to generate.
        #[arg(long, default_value_t = 100_000)]
        events: u64,
        /// Keep the demo's files here (default: a new temporary directory).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Run the offline engine on files instead of the in-process Kafka.
        #[arg(long)]
        offline: bool,
    },
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DEDUPD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
}

fn engine_settings(tuning: &TuningArgs) -> anyhow::Result<(EngineSettings, FileConfig)> {
    let file = match &tuning.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    Ok((EngineSettings::resolve(tuning, &file)?, file))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dedupd: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Dedupe { input, output, state_dir, rejected, conflicts, batch_records, tuning } => {
            let (settings, _) = engine_settings(&tuning)?;
            let opts = DedupeOptions { input, output, state_dir, rejected, conflicts, batch_records };
            let summary = run_dedupe(&opts, &settings, &SystemClock)?;
            // The summary is the last line on stderr, machine-readable.
            eprintln!("{}", serde_json::to_string(&summary)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { state_dir } => {
            let (report, clean) = dedupd::state::verify_state_dir(&state_dir)?;
            print!("{report}");
            Ok(if clean { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Inspect { state_dir, tenant, event_id, tuning } => {
            let (settings, _) = engine_settings(&tuning)?;
            let answer = dedupd::state::inspect(&state_dir, &tenant, &event_id, settings)?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo { events, work_dir, offline: _ } => {
            let dir = match work_dir {
                Some(d) => d,
                None => std::env::temp_dir().join(format!("dedupd-demo-{}", std::process::id())),
            };
            std::fs::create_dir_all(&dir)?;
            let (counts, summary, dir) =
                dedupd::offline::run_offline_demo(events, &dir, &EngineSettings::default(), &SystemClock)?;
            println!("dedupd demo (offline engine): files in {}", dir.display());
            print!("{}", dedupd::offline::bucket_table(&counts, &summary));
            Ok(ExitCode::SUCCESS)
        }
    }
}
