//! The planner against our own runs: for the tiny recipe at many layouts, the predicted bytes of
//! parameters, gradients and optimizer state equal every rank's measured ones exactly, and the
//! predicted peak activations equal the peak the step executor measured (distinct storages kept
//! for backward passes, see `train/pipeline.rs`), within 10% under tensor or expert parallelism.

use std::path::Path;
use std::time::Duration;

use pretrain::plan::memory;
use pretrain::train::metrics::StateBytes;
use pretrain::train::{RankCtx, Trainer};

struct Measured {
    stage: usize,
    state: StateBytes,
    act_peak: usize,
}

fn measure(recipe: &pretrain::recipe::Recipe) -> Vec<Measured> {
    let world = recipe.parallel.world_size();
    parallel::comm::local::run_local(world, Duration::from_secs(120), |rank, comm| {
        let ctx = RankCtx::open(&recipe.parallel, rank, comm, candle_core::Device::Cpu)?;
        let stage = ctx.coords.pp;
        let mut trainer = Trainer::new(recipe.clone(), ctx, false)?;
        let rec = trainer.train_step()?;
        Ok::<_, anyhow::Error>(Measured {
            stage,
            state: rec.memory.state,
            act_peak: rec.memory.act_peak_bytes,
        })
    })
    .unwrap_or_else(|e| panic!("{e}: {:#}", e.error))
}

#[test]
fn predicted_state_is_exact_and_activations_exact_but_under_tp_or_ep() {
    let layouts = [
        "parallel.dp=1",
        "train.recompute=full",
        "train.dtype=bf16",
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.pp=2",
        "parallel.pp=2,parallel.virtual_stages=2",
        "parallel.pp=2,train.recompute=full,train.dtype=bf16",
        "parallel.dp=2,parallel.zero=1",
        "parallel.dp=2,parallel.zero=2",
        "parallel.dp=2,parallel.zero=3,train.recompute=full",
        "optimizer.state_dtype=bf16",
        "parallel.dp=2,parallel.zero=1,train.dtype=bf16,optimizer.state_dtype=bf16",
        "train.recompute=selective",
        "train.recompute=selective,train.recompute_modules=[core_attn]",
        "train.recompute=selective,train.recompute_modules=[mlp_act],train.dtype=bf16",
        "parallel.tp=2,parallel.sequence_parallel=true,train.recompute=selective,train.recompute_modules=[layernorm,mlp_act,core_attn]",
        "parallel.pp=2,train.recompute=selective",
        "parallel.cp=2,train.recompute=selective,train.recompute_modules=[layernorm,core_attn]",
        "parallel.tp=2,parallel.sequence_parallel=true,parallel.pp=2,train.recompute=full",
        "parallel.cp=2",
        "parallel.cp=2,parallel.tp=2,parallel.sequence_parallel=true,train.dtype=bf16",
        // Muon: 8 bytes per hidden matrix element it owns, AdamW's for the rest.
        "optimizer.name=muon",
        "optimizer.name=muon,parallel.dp=2,parallel.zero=1,parallel.bucket_size=20000,optimizer.state_dtype=bf16",
        "optimizer.name=muon,parallel.dp=2,parallel.tp=2,parallel.zero=3,train.recompute=full",
        "optimizer.name=muon,parallel.pp=2",
        // Zero-bubble schedules: W-pending micro-batches hold their weight gradients' factors,
        // and the stages defer (zb-h1) or hold (zbv) what fits in 1F1B's peak.
        "parallel.pp=2,parallel.schedule=zb-h1",
        "parallel.pp=2,parallel.pipeline_layout=[3, 1],parallel.schedule=zb-h1",
        "parallel.pp=4,parallel.schedule=zb-h1,parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.pp=2,parallel.virtual_stages=2,parallel.schedule=zbv",
        "parallel.pp=2,parallel.virtual_stages=2,parallel.schedule=zbv,train.recompute=full",
    ];
    let moe = [
        "parallel.dp=1",
        "train.dtype=bf16",
        "parallel.pp=2,parallel.dp=2,parallel.zero=1",
        "model.mlp_only_layers=[0],train.recompute=full",
        "parallel.tp=2",
        "parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.dp=2,parallel.ep=2",
        "parallel.dp=2,parallel.ep=2,optimizer.state_dtype=bf16",
        "parallel.dp=2,parallel.ep=2,train.recompute=selective,train.recompute_modules=[layernorm,moe_act,core_attn]",
        "train.recompute=selective,train.recompute_modules=[moe_act]",
        "parallel.dp=4,parallel.ep=4,parallel.zero=1",
        "parallel.dp=2,parallel.ep=2,parallel.zero=3,train.recompute=full",
        "parallel.dp=4,parallel.ep=2,parallel.zero=1,optimizer.name=muon",
        "parallel.pp=2,parallel.dp=2,parallel.zero=1,parallel.schedule=zb-h1",
    ];
    let runs = layouts
        .iter()
        .map(|l| ("recipes/tiny.yaml", *l))
        .chain(moe.iter().map(|l| ("recipes/tiny-moe.yaml", *l)));
    for (path, layout) in runs {
        let o = vec![
            "train.steps=1,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4".to_string(),
            layout.to_string(),
        ];
        let recipe = pretrain::recipe::load(Path::new(path), &o).unwrap();
        let layout = format!("{path} {layout}");
        let predicted = memory::stages(&recipe).unwrap();
        let measured = measure(&recipe);
        let exact = recipe.parallel.tp == 1 && recipe.parallel.ep == 1;
        // Muon's state differs between shards (their shares of hidden matrices): the prediction
        // is the most loaded rank's, which some rank of each stage has.
        let mut most = vec![0u64; predicted.len()];
        for m in &measured {
            most[m.stage] = most[m.stage].max(m.state.optimizer_bytes as u64);
        }
        for (rank, m) in measured.iter().enumerate() {
            let want = &predicted[m.stage].bytes;
            let optimizer = m.state.optimizer_bytes as u64;
            let got = (
                m.state.param_bytes as u64,
                m.state.grad_bytes as u64,
                if optimizer <= want.optimizer {
                    most[m.stage]
                } else {
                    optimizer
                },
            );
            assert_eq!(
                got,
                (want.parameters, want.gradients, want.optimizer),
                "{layout} rank {rank} (stage {}): measured (parameters, gradients, most loaded \
                 rank's optimizer) bytes vs predicted",
                m.stage
            );
            let err = want.activations as f64 / m.act_peak as f64 - 1.0;
            eprintln!(
                "{layout} rank {rank} stage {}: activations predicted {} measured {} ({:+.2}%)",
                m.stage,
                want.activations,
                m.act_peak,
                100.0 * err
            );
            // Exact where every rank's tape is the model's own; within 10% under tensor
            // parallelism (ranks differ in what they keep of replicated inputs) and expert
            // parallelism (each rank keeps the tokens routed to its experts).
            let bound = if exact { 0.0 } else { 0.10 };
            assert!(
                err.abs() <= bound,
                "{layout} rank {rank}: predicted activations {} vs measured {} ({:+.2}%)",
                want.activations,
                m.act_peak,
                100.0 * err
            );
        }
    }
}

/// Megatron-LM's published throughput (Narayanan et al. 2021, Table 1; A100-80GB, sequence 2048,
/// vocabulary 51,200, full recompute): (hidden, layers, heads, tp, pp, v, GPUs, global batch,
/// micro batch, TFLOP/s per GPU). A Llama with `intermediate_size = 8h/3` (rounded to a multiple
/// of 8) has the GPT model's parameters and FLOPs.
/// One row of the table.
struct Row {
    h: usize,
    layers: usize,
    heads: usize,
    tp: usize,
    pp: usize,
    v: usize,
    gpus: usize,
    gbs: usize,
    mbs: usize,
    tflops: f64,
}

const fn row(
    h: usize,
    layers: usize,
    heads: usize,
    (tp, pp, v): (usize, usize, usize),
    gpus: usize,
    (gbs, mbs): (usize, usize),
    tflops: f64,
) -> Row {
    Row {
        h,
        layers,
        heads,
        tp,
        pp,
        v,
        gpus,
        gbs,
        mbs,
        tflops,
    }
}

const MEGATRON_2021: [Row; 6] = [
    row(2304, 24, 24, (1, 1, 1), 32, (512, 16), 137.0),
    row(3072, 30, 32, (2, 1, 1), 64, (512, 16), 138.0),
    row(4096, 36, 32, (4, 1, 1), 128, (512, 16), 142.0),
    row(6144, 40, 48, (8, 1, 1), 256, (1024, 8), 135.0),
    row(8192, 48, 64, (8, 2, 1), 512, (1536, 4), 138.0),
    row(12288, 80, 96, (8, 8, 2), 1536, (2304, 2), 148.0),
];

#[test]
fn predicts_megatron_2021_throughput_within_fifteen_percent() {
    use pretrain::plan::{plan, GpuPreset};
    let hw = GpuPreset::A100_80g.hardware();
    for Row {
        h,
        layers: l,
        heads,
        tp,
        pp,
        v,
        gpus,
        gbs,
        mbs,
        tflops: published,
    } in MEGATRON_2021
    {
        let dp = gpus / (tp * pp);
        let ffn = (8 * h / 3).div_ceil(8) * 8;
        let o = vec![format!(
            "model.hidden_size={h},model.intermediate_size={ffn},model.num_hidden_layers={l},\
             model.num_attention_heads={heads},model.num_key_value_heads={heads},model.vocab_size=51200,\
             model.max_position_embeddings=2048,model.tie_word_embeddings=true,\
             parallel.dp={dp},parallel.tp={tp},parallel.pp={pp},parallel.virtual_stages={v},\
             train.seq_len=2048,train.global_batch={gbs},train.micro_batch={mbs},train.dtype=bf16,\
             train.device=cuda,train.recompute=full"
        )];
        let r = pretrain::recipe::load(Path::new("recipes/tiny.yaml"), &o).unwrap();
        let p = plan(&r, &hw).unwrap();
        let (b, s, l, h, vocab) = (gbs as f64, 2048.0, l as f64, h as f64, 51200.0);
        // Megatron's count: forward, recompute forward and backward of every layer and the head.
        let flops = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + vocab / (16.0 * l * h));
        let predicted = flops / p.step_time_s / gpus as f64 / 1e12;
        let err = predicted / published - 1.0;
        eprintln!(
            "h {h} L {l} tp {tp} pp {pp} v {v} GPUs {gpus}: predicted {predicted:.1} TFLOP/s, published {published} ({:+.1}%); step {:.3} s = {:?}",
            100.0 * err,
            p.step_time_s,
            p.step_time
        );
        assert!(
            err.abs() <= 0.15,
            "h {h}: predicted {predicted:.1} TFLOP/s per GPU vs published {published} ({:+.1}%)",
            100.0 * err
        );
    }
}

/// The memory levers: bf16 moments take 8 bytes of optimizer state per element (planned exactly,
/// above); the search plans a layout with them only where fp32 moments do not fit, and
/// `cheapest_fit` gives the fastest fitting variant of the recipe's own layout.
#[test]
fn bf16_moments_are_a_lever_used_only_where_fp32_ones_do_not_fit() {
    use model::Recompute;
    use pretrain::plan::{candidates, cheapest_fit, plan, GpuPreset, Layout, GIB};
    use pretrain::recipe::StateDtype;
    // One data-parallel rank: no ZeRO stage to vary, only recompute and the moments.
    let o = ["parallel.dp=1,parallel.zero=0".to_string()];
    let r = pretrain::recipe::load(Path::new("recipes/1b.yaml"), &o).unwrap();
    let mut hw = GpuPreset::H100.hardware();
    let at = |recompute, state_dtype, hw: &pretrain::plan::Hardware| {
        let l = Layout {
            recompute,
            state_dtype,
            ..Layout::of(&r)
        };
        plan(&l.apply(&r), hw).unwrap()
    };
    let (fp32, bf16) = (
        at(Recompute::Full, StateDtype::Fp32, &hw),
        at(Recompute::Full, StateDtype::Bf16, &hw),
    );
    let (a, b) = (fp32.memory_bytes, bf16.memory_bytes);
    assert_eq!(3 * b.optimizer, 2 * a.optimizer);
    assert_eq!(a.total - b.total, a.optimizer - b.optimizer);
    assert!(
        fp32.layout.to_string().ends_with(" rc") && bf16.layout.to_string().ends_with(" rc m:bf16")
    );

    // Memory between the two: only bf16 moments (with recompute, or without it if that fits)
    // make the recipe's layout fit.
    hw.memory_gib = ((a.total + b.total) / 2 + fp32.headroom_bytes) as f64 / GIB;
    // A host too small to offload to: the moments' dtype is the only optimizer lever.
    let host = hw.host.memory_gib;
    hw.host.memory_gib = 1.0;
    let fit = cheapest_fit(&r, &hw).expect("bf16 moments fit");
    assert!(
        fit.fits && fit.layout.state_dtype == StateDtype::Bf16,
        "{}",
        fit.layout
    );
    let mut fits = Vec::new();
    for rc in [Recompute::None, Recompute::Full] {
        for sd in [StateDtype::Fp32, StateDtype::Bf16] {
            let p = at(rc, sd, &hw);
            if p.fits {
                fits.push(p.tokens_per_s);
            }
        }
    }
    assert_eq!(fit.tokens_per_s, fits.iter().copied().fold(0.0, f64::max));
    // With the host's memory, offload is a lever too, taken where it lets a faster layout fit
    // (here selective recompute instead of full).
    hw.host.memory_gib = host;
    let offloaded = cheapest_fit(&r, &hw).expect("a fit");
    assert!(offloaded.tokens_per_s >= fit.tokens_per_s);

    // Ranking on 8 GPUs: a bf16 candidate's fp32 twin never fits.
    let ranked = candidates(&r, &hw, 8);
    let twins = ranked
        .iter()
        .filter(|c| c.plan.layout.state_dtype == StateDtype::Bf16);
    let mut n = 0;
    for c in twins {
        let twin = Layout {
            state_dtype: StateDtype::Fp32,
            ..c.plan.layout
        };
        let mut twin = twin.apply(&r);
        twin.parallel.pipeline_layout = c.plan.pipeline_layout.clone(); // balanced stages
        assert!(!plan(&twin, &hw).unwrap().fits, "{}", c.plan.layout);
        n += 1;
    }
    assert!(n > 0 && n < ranked.len(), "{n} of {}", ranked.len());
}

/// Uneven pipeline stages: the planner balances the 1B model's 22 layers over two stages by
/// giving the stage with the head (about two layers' time) fewer layers, predicting a faster
/// step; a stage count that does not divide the layers is planned with balanced stages in the
/// `--gpus` search, and the plan's memory and time follow the layout it was given.
#[test]
fn the_planner_balances_pipeline_stages() {
    use pretrain::plan::{candidates, plan, time::balanced_layout, GpuPreset};
    let hw = GpuPreset::H100.hardware();
    let load = |set: &str| pretrain::recipe::load(Path::new("recipes/1b.yaml"), &[set.into()]);
    let r = load("parallel.pp=2,parallel.dp=2").unwrap();
    let layers = balanced_layout(&r, &hw).unwrap();
    assert_eq!(layers.iter().sum::<usize>(), 22);
    assert!(layers[0] > layers[1], "{layers:?}");
    let p = plan(&r, &hw).unwrap();
    let b = p.balanced.as_ref().expect("a balanced plan");
    assert_eq!(b.pipeline_layout.as_deref(), Some(&layers[..]));
    assert!(b.step_time_s < p.step_time_s);
    // Given as the recipe's layout, it is planned as it is: its memory and time are the
    // balanced plan's.
    let set = format!("parallel.pp=2,parallel.dp=2,parallel.pipeline_layout={layers:?}");
    let given = plan(&load(&set).unwrap(), &hw).unwrap();
    assert_eq!(given.step_time_s, b.step_time_s);
    assert_eq!(given.memory_bytes, b.memory_bytes);
    // 22 layers on 4 stages only unevenly.
    assert!(load("parallel.pp=4").is_err());
    let ranked = candidates(&r, &hw, 8);
    let uneven = ranked
        .iter()
        .find(|c| c.plan.layout.pp == 4)
        .expect("a pp 4 candidate");
    let l = uneven
        .plan
        .pipeline_layout
        .as_ref()
        .expect("balanced layers");
    assert_eq!((l.len(), l.iter().sum::<usize>()), (4, 22));
}

/// The `--gpus` search ranks the zero-bubble schedules beside 1F1B and interleaving, and the
/// time model gives them their smaller bubbles (same layout otherwise), at 1F1B's memory.
#[test]
fn the_planner_ranks_zero_bubble_schedules() {
    use parallel::pipeline::ScheduleKind;
    use pretrain::plan::{candidates, plan, GpuPreset};
    let hw = GpuPreset::H100.hardware();
    let load = |set: &str| pretrain::recipe::load(Path::new("recipes/1b.yaml"), &[set.into()]);
    // Without recompute (under `selective` a W-pending micro-batch holds what its backward
    // rebuilt, more than its tape).
    let base = "parallel.pp=2,parallel.dp=4,parallel.pipeline_layout=[12, 10],train.recompute=none";
    let at = |schedule: &str| plan(&load(&format!("{base},{schedule}")).unwrap(), &hw).unwrap();
    let (ofob, zb) = (at("parallel.schedule=1f1b"), at("parallel.schedule=zb-h1"));
    // B costs more than W here (attention's backward is all B): a third of the bubble is the
    // ideal of equal costs.
    assert!(
        zb.bubble < 0.8 * ofob.bubble,
        "{} vs {}",
        zb.bubble,
        ofob.bubble
    );
    assert!(zb.step_time_s < ofob.step_time_s);
    assert!(zb.memory_bytes.activations <= ofob.memory_bytes.activations);
    let v2 = "parallel.pp=2,parallel.dp=4,parallel.virtual_stages=2,parallel.pipeline_layout=[6, 5, 5, 6]";
    let at = |schedule: &str| plan(&load(&format!("{v2},{schedule}")).unwrap(), &hw).unwrap();
    let (inter, zbv) = (
        at("parallel.schedule=interleaved"),
        at("parallel.schedule=zbv"),
    );
    assert!(
        zbv.bubble < 0.8 * inter.bubble,
        "{} vs {}",
        zbv.bubble,
        inter.bubble
    );
    // 24 layers: two chunks per stage split evenly at pp 2 and 4.
    let ranked = candidates(&load("model.num_hidden_layers=24").unwrap(), &hw, 8);
    for kind in [ScheduleKind::ZeroBubbleH1, ScheduleKind::ZeroBubbleV] {
        assert!(
            ranked
                .iter()
                .any(|c| c.plan.layout.schedule == kind && c.plan.fits),
            "no fitting {kind} candidate"
        );
    }
}

/// Nothing the planner ranks is refused at start-up: for the 7B recipe on 1, 8 and 64 H100s and
/// H200s, each of the ten best fitting layouts passes what the trainer checks before its first
/// step — the recipe's validation, the schedule of the whole batch (built, simulated, its sends
/// and receives in order) and the activations candle's 32-bit CUDA kernels bound
/// (`device::element_problems`, the function the trainer calls). The flat buffers have no bound
/// (they are processed in spans), so a 7B fits one H200 (141 GB), and one H100 (80 GB) only with
/// its optimizer state in host memory; a micro-batch whose logits pass the bound is refused by
/// name instead of ranked.
#[test]
fn the_planners_best_7b_layouts_pass_the_trainers_start_up_checks() {
    use pretrain::plan::{candidates, GpuPreset};
    let r = pretrain::recipe::load(Path::new("recipes/7b.yaml"), &[]).unwrap();
    for preset in [GpuPreset::H100, GpuPreset::H200] {
        let hw = preset.hardware();
        for gpus in [1, 8, 64] {
            let best: Vec<_> = candidates(&r, &hw, gpus)
                .into_iter()
                .filter(|c| c.plan.fits)
                .take(10)
                .collect();
            let want = if gpus == 1 { best.len().max(1) } else { 10 };
            assert_eq!(best.len(), want, "{} × {gpus}", hw.name);
            if (preset, gpus) == (GpuPreset::H100, 1) {
                let offload = pretrain::recipe::Offload::Cpu;
                assert!(best.iter().all(|c| c.plan.layout.offload == offload));
            }
            for c in best {
                let mut rr = c.plan.layout.apply(&r);
                rr.parallel.pipeline_layout = c.plan.pipeline_layout.clone();
                let at = format!("{} × {gpus}: {}", hw.name, c.plan.layout);
                assert!(rr.problems().is_empty(), "{at}: {:?}", rr.problems());
                let schedule = memory::schedule(&rr, rr.grad_accum_steps()).unwrap();
                parallel::pipeline::validate(&schedule).unwrap_or_else(|e| panic!("{at}: {e}"));
                parallel::pipeline::check_fifo(&schedule).unwrap_or_else(|e| panic!("{at}: {e}"));
                let problems = pretrain::device::element_problems(&rr);
                assert!(problems.is_empty(), "{at}: {problems:?}");
            }
        }
    }
    // 32 × 4096 rows of 32,000 logits without tp: 4.2e9 elements in one candle kernel.
    let wide = pretrain::recipe::load(
        Path::new("recipes/7b.yaml"),
        &[
            "parallel.tp=1,parallel.sequence_parallel=false,parallel.dp=8,train.micro_batch=32"
                .to_string(),
        ],
    )
    .unwrap();
    let p = pretrain::plan::plan(&wide, &GpuPreset::H200.hardware()).unwrap();
    assert!(!p.fits, "{}", p.layout);
    assert!(
        p.refused
            .iter()
            .any(|w| w.contains("the logits of a micro-batch")
                && w.contains(&pretrain::device::CUDA_MAX_ELEMENTS.to_string())),
        "{:?}",
        p.refused
    );
}

/// Muon's orthogonalisations are spread over the data-parallel ranks whether its state is
/// replicated (ZeRO 0: each matrix on one rank, broadcast) or sharded: the planner's optimizer
/// term for the 1.1B model on H100s falls with the ranks at either stage.
#[test]
fn muons_planned_cost_divides_over_data_parallel_ranks() {
    use pretrain::plan::GpuPreset;
    let hw = GpuPreset::H100.hardware();
    let optimizer_s = |set: &str| {
        let r = pretrain::recipe::load(
            Path::new("recipes/bench-1b.yaml"),
            &[format!("optimizer.name=muon,{set}")],
        )
        .unwrap();
        pretrain::plan::plan(&r, &hw).unwrap().step_time.optimizer_s
    };
    let one = optimizer_s("parallel.dp=1,train.global_batch=8");
    for zero in [0, 1] {
        let eight = optimizer_s(&format!(
            "parallel.dp=8,parallel.zero={zero},train.global_batch=64"
        ));
        eprintln!("zero {zero}: {one:.4} s on one rank, {eight:.4} s at dp 8");
        assert!(
            eight < one / 3.0,
            "zero {zero}: {eight} s at dp 8 against {one} s alone"
        );
    }
}
