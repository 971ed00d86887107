//! The step executor's hooks: every piece of every micro-batch is announced before its forward
//! and backward, after its backward and after its gradients are accumulated; every parameter is
//! reported final exactly once, after the last accumulation that adds to it — with an interleaved
//! pipeline, a later chunk's parameters while the cool-down of earlier chunks still runs (which
//! is what lets their data-parallel buckets be reduced during it); with zb-h1, a block's
//! accumulation is its weight action's, after its backward.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use data::Batch;
use model::{Llama, LlamaConfig, Piece, Recompute};
use parallel::comm::local::{run_local, LocalWorld};
use parallel::config::{ParallelConfig, DEFAULT_BUCKET_SIZE};
use parallel::pipeline::{build, ScheduleKind};
use pretrain::optim::{layout_of, GradBuffer};
use pretrain::train::hooks::StepHooks;
use pretrain::train::pipeline::{Executor, MicroBatch};
use pretrain::train::RankCtx;

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 64,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 4,
        num_attention_heads: 2,
        num_key_value_heads: 2,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: true,
        max_position_embeddings: 8,
        init_std: 0.02,
        head_dim: None,
        rope_scaling: None,
        bos_token_id: None,
        eos_token_id: None,
        ..Default::default()
    }
}

fn batch(offset: u32) -> Batch {
    let (b, s) = (2, 8);
    let ids = |k: usize| ((k as u32 + offset).wrapping_mul(2654435761) >> 9) % 64;
    Batch {
        tokens: (0..b * s).map(ids).collect(),
        labels: (1..=b * s).map(ids).collect(),
        loss_mask: vec![1.0; b * s],
        micro_batch: b,
        seq_len: s,
        doc_starts: None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Event {
    BeforeForward(Piece, usize),
    BeforeBackward(Piece, usize),
    AfterBackward(Piece, usize),
    Accumulated(Piece, usize),
    Final(usize),
}

#[derive(Default)]
struct Recorder(Vec<Event>);

impl StepHooks for Recorder {
    fn before_forward(&mut self, piece: Piece, micro: usize) -> anyhow::Result<()> {
        self.0.push(Event::BeforeForward(piece, micro));
        Ok(())
    }
    fn before_backward(&mut self, piece: Piece, micro: usize) -> anyhow::Result<()> {
        self.0.push(Event::BeforeBackward(piece, micro));
        Ok(())
    }
    fn after_backward(&mut self, piece: Piece, micro: usize) -> anyhow::Result<()> {
        self.0.push(Event::AfterBackward(piece, micro));
        Ok(())
    }
    fn after_accumulate(&mut self, piece: Piece, micro: usize) -> anyhow::Result<()> {
        self.0.push(Event::Accumulated(piece, micro));
        Ok(())
    }
    fn param_final(&mut self, param: usize) -> anyhow::Result<()> {
        self.0.push(Event::Final(param));
        Ok(())
    }
}

/// Runs one step of `m` micro-batches on rank `rank` of the layout `cfg` and returns the hook
/// events, the rank's model and its chunks.
fn record(
    cfg: &ParallelConfig,
    rank: usize,
    comm: std::sync::Arc<dyn parallel::Comm>,
    m: usize,
    recompute: Recompute,
) -> anyhow::Result<(Vec<Event>, Llama, Vec<Vec<Piece>>)> {
    let ctx = RankCtx::open(cfg, rank, comm, candle_core::Device::Cpu)?;
    let c = config();
    let model = Llama::new(&c, ctx.placement(4), 7, DType::F32, &Device::Cpu)?;
    let schedule = build(cfg.schedule_kind(), cfg.pp, cfg.virtual_stages, m)?;
    let exec = Executor::new(&model, &ctx, &schedule, recompute, 2, 8);
    let grads = GradBuffer::new(
        layout_of(model.params(), DEFAULT_BUCKET_SIZE, 1),
        &Device::Cpu,
    )?;
    let mbs = (0..m)
        .map(|k| MicroBatch::new(&batch(100 * k as u32), 1e-2, 1.0 / m as f64, &Device::Cpu))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut rec = Recorder::default();
    exec.step(&mbs, &grads, &mut rec, Instant::now())?;
    Ok((rec.0, model, ctx.chunks(4)))
}

/// The invariants every rank's events satisfy; returns each parameter's final position.
fn check(events: &[Event], model: &Llama, chunks: &[Vec<Piece>], m: usize) -> Vec<usize> {
    // A split backward accumulates a block twice: its norms in the backward, its projections
    // in the weight action; the position kept is the last.
    let pos: HashMap<Event, usize> = events.iter().enumerate().map(|(k, &e)| (e, k)).collect();
    let once: Vec<&Event> = events
        .iter()
        .filter(|e| !matches!(e, Event::Accumulated(..)))
        .collect();
    let distinct: std::collections::HashSet<&&Event> = once.iter().collect();
    assert_eq!(distinct.len(), once.len(), "an event repeats: {events:?}");
    for p in chunks.iter().flatten().copied() {
        for micro in 0..m {
            let f = pos[&Event::BeforeForward(p, micro)];
            let b = pos[&Event::BeforeBackward(p, micro)];
            let a = pos[&Event::AfterBackward(p, micro)];
            let acc = pos[&Event::Accumulated(p, micro)];
            assert!(
                f < b && b < a && b < acc,
                "{p:?} m{micro}: {f} {b} {a} {acc}"
            );
        }
    }
    let pieces: usize = chunks.iter().map(Vec::len).sum();
    let n = model.params().len();
    assert_eq!(once.len(), 3 * pieces * m + n, "{events:?}");
    (0..n)
        .map(|i| {
            let at = pos[&Event::Final(i)];
            // Final after the last micro-batch's (first) accumulation of every piece using it
            // (a split block adds its norms then, its projections in the weight action)...
            let users: Vec<Piece> = chunks
                .iter()
                .flatten()
                .copied()
                .filter(|&p| model.piece_params(p).contains(&i))
                .collect();
            assert!(!users.is_empty(), "{}", model.params().get(i).name);
            let last = users
                .iter()
                .map(|&p| {
                    let last = Event::Accumulated(p, m - 1);
                    events.iter().position(|&e| e == last).unwrap()
                })
                .max()
                .unwrap();
            assert!(
                last < at,
                "{} final at {at} before {last}",
                model.params().get(i).name
            );
            // ...and no backward of such a piece comes later.
            for e in &events[at..] {
                if let Event::BeforeBackward(p, _) = e {
                    assert!(
                        !users.contains(p),
                        "{} final before {e:?}",
                        model.params().get(i).name
                    );
                }
            }
            at
        })
        .collect()
}

#[test]
fn one_stage_reports_every_piece_and_each_parameter_final_once() {
    for recompute in [Recompute::None, Recompute::Full] {
        let comm = LocalWorld::new(1, Duration::from_secs(10)).remove(0);
        let m = 3;
        let (events, model, chunks) =
            record(&ParallelConfig::default(), 0, comm, m, recompute).unwrap();
        assert_eq!(chunks.len(), 1);
        check(&events, &model, &chunks, m);
        // The tied embedding is used by the embedding and the head: final only after the
        // embedding's last backward, the very last piece of the step.
        let e = model
            .params()
            .index_of("model.embed_tokens.weight")
            .unwrap();
        assert_eq!(
            &events[events.len() - 3..],
            [
                Event::Accumulated(Piece::Embedding, m - 1),
                Event::AfterBackward(Piece::Embedding, m - 1),
                Event::Final(e)
            ]
        );
    }
}

#[test]
fn interleaved_pipeline_finalises_later_chunks_during_the_cool_down() {
    let cfg = ParallelConfig {
        pp: 2,
        virtual_stages: 2,
        ..ParallelConfig::default()
    };
    let m = 4;
    let out = run_local(2, Duration::from_secs(30), |rank, comm| {
        record(&cfg, rank, comm, m, Recompute::None)
    })
    .unwrap_or_else(|e| panic!("{e}: {:#}", e.error));
    for (rank, (events, model, chunks)) in out.iter().enumerate() {
        assert_eq!(chunks.len(), 2, "rank {rank}");
        let finals = check(events, model, chunks, m);
        // Chunk 1 (the later layers) finishes its backward first: its parameters are final while
        // chunk 0 still has backward passes to run.
        let last_backward = events
            .iter()
            .rposition(|e| matches!(e, Event::BeforeBackward(..)))
            .unwrap();
        for p in &chunks[1] {
            for i in model.piece_params(*p) {
                if !chunks[0]
                    .iter()
                    .any(|q| model.piece_params(*q).contains(&i))
                {
                    assert!(
                        finals[i] < last_backward,
                        "rank {rank}: {} final at {} after the last backward at {last_backward}",
                        model.params().get(i).name,
                        finals[i]
                    );
                }
            }
        }
    }
}

/// zb-h1 at pp 2: a block's projection gradients are accumulated by its weight action, after
/// the block's backward has released it and (on stage 1, which defers one) after the next
/// micro-batch's backward; its norms', the embedding's and the head's inside their backward.
#[test]
fn zero_bubble_accumulates_blocks_in_their_weight_actions() {
    let cfg = ParallelConfig {
        pp: 2,
        schedule: Some(ScheduleKind::ZeroBubbleH1),
        ..ParallelConfig::default()
    };
    let m = 3;
    let out = run_local(2, Duration::from_secs(30), |rank, comm| {
        record(&cfg, rank, comm, m, Recompute::None)
    })
    .unwrap_or_else(|e| panic!("{e}: {:#}", e.error));
    for (rank, (events, model, chunks)) in out.iter().enumerate() {
        check(events, model, chunks, m);
        let at = |e: Event| events.iter().rposition(|&x| x == e).unwrap();
        for &p in &chunks[0] {
            for micro in 0..m {
                let (done, acc) = (
                    at(Event::AfterBackward(p, micro)),
                    at(Event::Accumulated(p, micro)),
                );
                match p {
                    Piece::Block(_) => assert!(done < acc, "rank {rank} {p:?} m{micro}"),
                    _ => assert!(acc < done, "rank {rank} {p:?} m{micro}"),
                }
            }
        }
        // Stage 1 defers one weight action: micro-batch 0's blocks accumulate after micro-batch
        // 1's backward.
        if rank == 1 {
            let b = chunks[0]
                .iter()
                .find(|p| matches!(p, Piece::Block(_)))
                .unwrap();
            assert!(at(Event::Accumulated(*b, 0)) > at(Event::BeforeBackward(*b, 1)));
        }
    }
}
