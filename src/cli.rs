//! The `pretrain` command line: training from a recipe (as threads, or as processes started by
//! `--nproc-per-node`, torchrun or Slurm), recipe checking, tokenizer training, corpus
//! preprocessing, Hugging Face export/import, evaluation and the device self-test.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use tracing::info;

use crate::recipe::{self, DeviceKind, Dtype, Recipe};

mod bench;
mod bench_comm;
mod bench_rates;
mod check;
mod gpus;
mod train;
use check::check;
use train::train;

/// Megatron-style 3D-parallel Llama pretraining.
#[derive(Debug, Parser)]
#[command(name = "pretrain", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// Train from a recipe (the default command).
    #[command(flatten)]
    pub train: Option<RecipeArgs>,
    /// Launcher options of the default command.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Other commands.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// A recipe file and its overrides.
#[derive(Debug, Args, Clone)]
pub struct RecipeArgs {
    /// Recipe YAML file.
    #[arg(long)]
    pub recipe: PathBuf,
    /// Override recipe keys: `--set optimizer.lr=3e-4` or `--set parallel.tp=2,parallel.dp=2`; repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

impl RecipeArgs {
    /// Loads and validates the recipe.
    pub fn load(&self) -> Result<Recipe> {
        Ok(recipe::load(&self.recipe, &self.overrides)?)
    }
}

/// Arguments of `pretrain train`: the recipe and the launcher options.
#[derive(Debug, Args, Clone)]
pub struct TrainArgs {
    /// The recipe.
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Launcher options.
    #[command(flatten)]
    pub launch: LaunchArgs,
}

/// Launcher options for multi-process jobs started by this command (torchrun's names).
/// Processes started by torchrun or Slurm need none: they read `RANK`/`WORLD_SIZE`/... or
/// `SLURM_PROCID`/... from the environment.
#[derive(Debug, Args, Clone, Default)]
pub struct LaunchArgs {
    /// Train on this many devices instead of the recipe's layout: the model, sequence, global
    /// batch and optimizer stay, the layout becomes the planner's best for N devices of the kind
    /// found here (GPUs: their model and memory; on the CPU, N thread ranks). On CUDA one rank
    /// process per GPU; with --nproc-per-node, the job's devices (nproc-per-node × nnodes).
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,
    /// Start this many rank processes on this node (one per GPU on CUDA) instead of running the
    /// ranks as threads of this process.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Nodes in the job (with --nproc-per-node).
    #[arg(long, default_value_t = 1, requires = "nproc_per_node")]
    pub nnodes: usize,
    /// This node's index in the job (with --nproc-per-node).
    #[arg(long, default_value_t = 0, requires = "nproc_per_node")]
    pub node_rank: usize,
    /// Host of rank 0's rendezvous store, node 0 (default 127.0.0.1 on one node).
    #[arg(long, requires = "nproc_per_node")]
    pub master_addr: Option<String>,
    /// Port of the rendezvous store (default: a free port on one node, 29500 otherwise); with
    /// --elastic the launchers' store, and rank 0's takes a free port each round.
    #[arg(long, requires = "nproc_per_node")]
    pub master_port: Option<u16>,
    /// Restart the job on the ranks left when a rank or a node fails, and grow it back when a
    /// node's launcher returns: MIN[:MAX] ranks, from the newest checkpoint, on a layout the
    /// planner picks for them (every node's launcher takes the same flags).
    #[arg(long, requires = "nproc_per_node", value_parser = crate::launch::elastic::parse_range)]
    pub elastic: Option<(usize, Option<usize>)>,
    /// Restarts allowed with --elastic.
    #[arg(long, default_value_t = 3, requires = "elastic")]
    pub max_restarts: usize,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train from a recipe.
    Train(TrainArgs),
    /// Parse and validate a recipe, open its tokenizer and data, and print what it would run.
    Check {
        /// The recipe.
        #[command(flatten)]
        recipe: RecipeArgs,
        /// Do not open the tokenizer and datasets (for a recipe whose data lives elsewhere,
        /// e.g. on a cluster).
        #[arg(long)]
        no_data: bool,
    },
    /// Predict memory per rank and step time of the recipe's layout; with `--gpus N`, rank every
    /// valid layout for N GPUs.
    Plan(crate::plan::report::PlanArgs),
    /// Tokenizer tools.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Tokenize documents into a Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`).
    Preprocess(PreprocessArgs),
    /// Write a checkpoint as a Hugging Face `LlamaForCausalLM` directory (with a logit parity check).
    ExportHf {
        /// Checkpoint step directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Output directory.
        #[arg(long)]
        output: PathBuf,
        /// Weight dtype (default: the training dtype).
        #[arg(long, value_enum)]
        dtype: Option<Dtype>,
        /// Largest weight file in bytes before sharding.
        #[arg(long, default_value_t = crate::hf::DEFAULT_MAX_SHARD_BYTES)]
        max_shard_size: u64,
        /// Replace an earlier export in a non-empty output directory (its weight, config and
        /// tokenizer files give way once the new export has passed the parity gate).
        #[arg(long)]
        overwrite: bool,
    },
    /// Turn a Hugging Face Llama directory into a step-0 checkpoint of a recipe.
    ImportHf {
        /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
        /// The recipe; `model:` must match the directory's config.json.
        #[command(flatten)]
        recipe: RecipeArgs,
        /// Checkpoint root to write into, which must hold no checkpoints (default:
        /// `<run.dir>/hf-import`).
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Mean next-token loss of a checkpoint on a text file.
    Eval {
        /// Checkpoint step directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Text file.
        #[arg(long)]
        input: PathBuf,
        /// Recipe overrides, e.g. a layout: `--set parallel.tp=2`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Also write the first window's logits `[seq_len, vocab]` (safetensors, tensor `logits`).
        #[arg(long)]
        logits_out: Option<PathBuf>,
    },
    /// Check a device end to end: every op forward and backward against an f64 CPU reference,
    /// the optimizer kernels, bf16 training steps, the collective backend and thread-ranks
    /// sharing the device.
    Selftest {
        /// Device to check.
        #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
        device: DeviceKind,
        /// The tiny recipe (its bundled data must be present).
        #[arg(long, default_value = "recipes/tiny.yaml")]
        recipe: PathBuf,
        /// Also write the results as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Time one attention call, forward and backward, on each attention backend (TFLOP/s).
    BenchAttention(bench::AttentionArgs),
    /// What a recipe's step runs, timed on its device: every GEMM by shape, the causal
    /// attention, element-wise bandwidth; the table `pretrain plan --rates` reads.
    BenchRates(bench_rates::RatesArgs),
    /// Host time per communication call over the job's backend (NCCL, tcp processes): an
    /// all-reduce from the compute thread, one in place from a communication thread, a ring hop.
    BenchComm(bench_comm::CommArgs),
}

/// Tokenizer subcommands.
#[derive(Debug, Subcommand)]
pub enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer with an `<|endoftext|>` special token.
    Train {
        /// Text files to learn from.
        #[arg(long, num_args = 1.., required = true)]
        input: Vec<PathBuf>,
        /// Vocabulary size, special token included.
        #[arg(long)]
        vocab_size: usize,
        /// Minimum pair frequency for a merge.
        #[arg(long, default_value_t = 2)]
        min_frequency: u64,
        /// Output `tokenizer.json`.
        #[arg(long)]
        output: PathBuf,
    },
}

/// Arguments of `pretrain preprocess`.
#[derive(Debug, Args)]
pub struct PreprocessArgs {
    /// Input files or glob patterns: `.txt`, `.text` or `.jsonl`, each plain or compressed
    /// (`.gz`, `.zst`), and `.parquet`; the forms may be mixed.
    #[arg(long, num_args = 1.., required = true)]
    pub input: Vec<String>,
    /// Tokenizer (`tokenizer.json`): one trained by `pretrain tokenizer train`, or a hub
    /// tokenizer such as Llama 3's.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Output prefix: writes `PREFIX.bin` and `PREFIX.idx`.
    #[arg(long)]
    pub output_prefix: PathBuf,
    /// JSON field (`.jsonl`) or column (`.parquet`, a dotted path inside structs) holding the
    /// text.
    #[arg(long, default_value = "text")]
    pub json_key: String,
    /// Split `.txt` files into documents at this separator; `\n` and `\t` are understood
    /// (e.g. `'\n\n\n'`). Default: one document per file.
    #[arg(long)]
    pub doc_separator: Option<String>,
    /// Follow each document with the tokenizer's end-of-text token (`<|endoftext|>`, Llama 3's
    /// `<|end_of_text|>`, `</s>`); `--append-eod false` leaves documents unseparated.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub append_eod: bool,
    /// Begin each document with the tokenizer's beginning-of-text token (Llama 3's
    /// `<|begin_of_text|>`, `<s>`), as Llama 3 pretrains.
    #[arg(long)]
    pub add_bos: bool,
    /// Write shards `PREFIX_00000.bin/.idx`, `PREFIX_00001…`, starting a new one whenever a
    /// `.bin` reaches this many bytes (documents stay whole).
    #[arg(long)]
    pub shard_size: Option<u64>,
    /// Tokenizer threads (default: all cores).
    #[arg(long)]
    pub workers: Option<usize>,
}

/// Whether log lines get ANSI colours: only on a terminal, and never when `NO_COLOR` is set to a
/// non-empty value (<https://no-color.org>); files and pipes get plain text.
pub fn log_colours(is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    match (cli.train, cli.command) {
        (Some(args), None) => train(&args, &cli.launch),
        (None, Some(Command::Train(t))) => train(&t.recipe, &t.launch),
        (None, Some(Command::Check { recipe, no_data })) => check(&recipe, !no_data),
        (None, Some(Command::Plan(args))) => crate::plan::report::run(&args),
        (
            None,
            Some(Command::Tokenizer(TokenizerCommand::Train {
                input,
                vocab_size,
                min_frequency,
                output,
            })),
        ) => {
            let opts = data::TokenizerTrainOptions {
                inputs: input,
                vocab_size,
                min_frequency,
                output,
                show_progress: true,
            };
            let s = data::train_tokenizer(&opts)?;
            info!(
                "wrote {} (vocabulary {}, <|endoftext|> = {})",
                s.output.display(),
                s.vocab_size,
                s.eod_id
            );
            Ok(())
        }
        (None, Some(Command::Preprocess(a))) => {
            let opts = data::PreprocessOptions {
                inputs: a.input,
                tokenizer: a.tokenizer,
                output_prefix: a.output_prefix,
                json_key: a.json_key,
                doc_separator: a.doc_separator.as_deref().map(unescape).transpose()?,
                append_eod: a.append_eod,
                add_bos: a.add_bos,
                shard_bytes: a.shard_size,
                workers: a.workers,
                show_progress: true,
                stop: Some(crate::job::signals::pending),
            };
            // Ctrl-C and SIGTERM stop between documents, leaving no temporary files behind.
            crate::job::signals::install()?;
            match data::preprocess(&opts) {
                Ok(summary) => {
                    info!("{summary}");
                    Ok(())
                }
                Err(data::DataError::Stopped { signal }) => Err(crate::job::signals::Interrupted {
                    signal,
                    step: None,
                    checkpoint: None,
                    note: Some(format!(
                        "preprocess wrote nothing to {} (an existing dataset there is kept)",
                        opts.output_prefix.display()
                    )),
                }
                .into()),
                Err(e) => Err(e.into()),
            }
        }
        (
            None,
            Some(Command::ExportHf {
                checkpoint,
                output,
                dtype,
                max_shard_size,
                overwrite,
            }),
        ) => {
            let opts = crate::hf::ExportOptions {
                dtype,
                max_shard_bytes: max_shard_size,
                overwrite,
            };
            let s = crate::hf::export(&checkpoint, &output, &opts)?;
            info!(
                "exported {} ({} weight file(s), {:.1} MB); parity check: max relative logit difference {:.2e}",
                output.display(),
                s.files.len(),
                s.bytes as f64 / 1e6,
                s.parity
            );
            Ok(())
        }
        (
            None,
            Some(Command::ImportHf {
                model,
                recipe,
                output,
            }),
        ) => {
            let r = recipe.load()?;
            // Never the run's own checkpoint root: see `hf::import`.
            let root = output.unwrap_or_else(|| r.run.dir.join("hf-import"));
            // It writes a step directory, `latest`, and prunes: not while a run uses the root.
            let _lock = crate::train::lock::RunLock::acquire(&root, "checkpoint directory")?;
            let dir = crate::hf::import(&model, &r, &root)?;
            info!(
                "wrote {}; train from it with --set checkpoint.resume={}",
                dir.display(),
                dir.display()
            );
            Ok(())
        }
        (
            None,
            Some(Command::Eval {
                checkpoint,
                input,
                overrides,
                logits_out,
            }),
        ) => {
            let r = crate::eval::eval(&checkpoint, &input, &overrides, logits_out.as_deref())?;
            println!(
                "loss={:.8} perplexity={:.6} windows={} tokens={}",
                r.loss, r.perplexity, r.windows, r.tokens
            );
            Ok(())
        }
        (
            None,
            Some(Command::Selftest {
                device,
                recipe,
                json,
            }),
        ) => selftest(device, &recipe, json.as_deref()),
        (None, Some(Command::BenchAttention(args))) => bench::bench_attention(&args).map(drop),
        (None, Some(Command::BenchComm(args))) => bench_comm::bench_comm(&args),
        (None, Some(Command::BenchRates(args))) => bench_rates::bench_rates(&args).map(drop),
        _ => anyhow::bail!("give --recipe FILE to train, or a subcommand (see --help)"),
    }
}

fn selftest(
    device: DeviceKind,
    recipe: &std::path::Path,
    json: Option<&std::path::Path>,
) -> Result<()> {
    // The arguments first: a bad recipe or output path is found before minutes of checks.
    crate::recipe::load(recipe, &[])?;
    if let Some(path) = json {
        if path.is_dir() {
            anyhow::bail!("--json {}: a directory, not a file", path.display());
        }
    }
    let checks = crate::selftest::run(device, recipe)?;
    for c in &checks {
        println!(
            "{:4}  {:<58} error {:.2e}  (tolerance {:.0e})",
            if c.passed() { "ok" } else { "FAIL" },
            c.name,
            c.error,
            c.tolerance
        );
    }
    if let Some(path) = json {
        crate::files::write_replacing(path, serde_json::to_string_pretty(&checks)?.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed = checks.iter().filter(|c| !c.passed()).count();
    if failed > 0 {
        anyhow::bail!(
            "selftest on {device}: {failed} of {} checks failed",
            checks.len()
        );
    }
    println!("selftest on {device}: all {} checks passed", checks.len());
    Ok(())
}

/// `--doc-separator`'s text with `\n`, `\r`, `\t` and `\\` read as the characters they name;
/// an empty separator is refused (it would split nothing).
fn unescape(text: &str) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    if out.is_empty() {
        anyhow::bail!("--doc-separator: empty (leave it out to make each text file one document)");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(log_colours(true, None));
        assert!(log_colours(true, Some(OsStr::new(""))));
        assert!(!log_colours(true, Some(OsStr::new("1"))));
        assert!(!log_colours(false, None));
    }

    #[test]
    fn doc_separators_name_control_characters() {
        assert_eq!(super::unescape("\\r\\n\\r\\n").unwrap(), "\r\n\r\n");
        assert_eq!(super::unescape("\\n\\t|\\\\n").unwrap(), "\n\t|\\n");
        assert_eq!(super::unescape("a\\").unwrap(), "a\\");
        assert!(super::unescape("").is_err());
    }
}
