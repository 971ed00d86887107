//! `train.recompute: selective`: the modules it leaves out of the blocks' tapes are recomputed
//! by the same operations in the backward, so training is bit for bit the run that keeps every
//! activation (losses, gradient norms and final weights), at every layout the modules meet (tensor
//! and sequence parallelism, pipelines with ZeRO-3, the context-parallel ring, expert
//! parallelism, bf16); and the executor's measured activation peak lies between `full` and
//! `none`.

mod common;
use common::{run, MOE};

/// The run at `layout` under `recompute` (and `modules` for `selective`).
fn with(layout: &str, recompute: &str) -> pretrain::train::RunOutput {
    run(&format!("{layout},train.recompute={recompute}"))
}

fn peak(r: &pretrain::train::RunOutput) -> usize {
    r.records
        .iter()
        .map(|r| r.memory.act_peak_bytes)
        .max()
        .unwrap_or(0)
}

#[test]
fn selective_recompute_trains_bit_for_bit_as_keeping_everything() {
    let all = "train.recompute_modules=[layernorm,mlp_act,moe_act,core_attn]";
    let layouts = [
        ("parallel.dp=1".to_string(), ""),
        ("parallel.dp=1".to_string(), all),
        ("train.dtype=bf16".to_string(), all),
        (
            "parallel.tp=2,parallel.sequence_parallel=true".to_string(),
            all,
        ),
        (
            "parallel.dp=2,parallel.pp=2,parallel.zero=3".to_string(),
            "",
        ),
        ("parallel.cp=2".to_string(), all),
        (format!("{MOE},parallel.dp=2,parallel.ep=2"), all),
        (
            format!("{MOE},parallel.tp=2,parallel.sequence_parallel=true"),
            "",
        ),
    ];
    for (layout, modules) in &layouts {
        let none = with(layout, "none");
        let sel = if modules.is_empty() {
            with(layout, "selective")
        } else {
            with(&format!("{layout},{modules}"), "selective")
        };
        let name = format!("{layout} {modules}");
        for (a, b) in sel.records.iter().zip(&none.records) {
            assert_eq!(
                (a.loss.to_bits(), a.grad_norm.to_bits()),
                (b.loss.to_bits(), b.grad_norm.to_bits()),
                "{name}: step {}",
                a.step
            );
        }
        assert_eq!(sel.weights, none.weights, "{name}: final weights");
        let full = with(layout, "full");
        let (p_none, p_sel, p_full) = (peak(&none), peak(&sel), peak(&full));
        assert!(
            p_full < p_sel && p_sel < p_none,
            "{name}: activation peaks full {p_full} < selective {p_sel} < none {p_none}"
        );
    }
}
